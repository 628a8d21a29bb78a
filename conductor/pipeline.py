"""One request through the cluster: tokenize, route, prefill, decode, stream back.

The pipeline yields typed `Delta`s; the HTTP layer turns them into OpenAI JSON or SSE.
Cancelling the iterator (a client that went away) cancels the worker RPC in flight, and the
worker aborts its engine request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from conductor.config import ConductorConfig
from conductor.errors import ConductorError, NoCapacity, Timeout, from_worker_status
from conductor.policy import POLICIES
from conductor.protocol import CompletionRequest
from conductor.registry import Instance, Registry
from conductor.snapshot import RouteRequest
from conductor.tokenizer import Tokenizer
from protos import worker_pb2
from store.block_hash import block_hashes

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A validated request, tokenized, with its block hashes."""

    request_id: str
    token_ids: list[int]
    max_tokens: int
    block_hashes: tuple[int, ...]
    params: worker_pb2.SamplingParams
    cache_salt: str


@dataclass
class Delta:
    """New output since the previous delta."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Outcome:
    """What the pipeline learnt about a request, filled in as it runs."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_instance: str = ""
    decode_instance: str = ""
    blocks_saved: int = 0
    blocks_in_pool: int = 0
    blocks_loaded: int = 0


class Pipeline:
    def __init__(self, config: ConductorConfig, registry: Registry, tokenizer: Tokenizer) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        self.policy = POLICIES[config.policy]

    def block_size(self) -> int:
        sizes = {i.info.block_size for i in self.registry.all()}
        if len(sizes) == 1:
            return sizes.pop()
        if self.config.block_size:
            return self.config.block_size
        if not sizes:
            raise NoCapacity("no instance is registered")
        raise NoCapacity(f"instances disagree on the block size: {sorted(sizes)}")

    def prepare(self, req: CompletionRequest) -> Prepared:
        token_ids = self.tokenizer.encode_prompt(req.prompt)
        max_tokens = self.tokenizer.clamp_max_tokens(len(token_ids), req.max_tokens)
        salt = req.cache_salt or ""
        params = worker_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            stop=req.stop_list(),
            stop_token_ids=req.stop_token_ids or [],
            logprobs=0 if req.logprobs is None else max(req.logprobs, 1),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty or 0.0,
            min_tokens=req.min_tokens,
        )
        if req.seed is not None:
            params.seed = req.seed
        return Prepared(
            request_id=req.request_id or f"cmpl-{uuid.uuid4().hex}",
            token_ids=token_ids,
            max_tokens=max_tokens,
            block_hashes=tuple(block_hashes(token_ids, self.block_size(), salt)),
            params=params,
            cache_salt=salt,
        )

    def route(self, prep: Prepared) -> tuple[Instance, Instance]:
        snapshot = self.registry.snapshot()
        choice = self.policy(snapshot, RouteRequest(len(prep.token_ids), prep.block_hashes))
        if choice is None:
            missing = [role for role, have in (("prefill", snapshot.prefill()),
                                               ("decode", snapshot.decode())) if not have]
            raise NoCapacity(f"no {' or '.join(missing) or 'suitable'}-capable instance is up; "
                             "retry later")
        p, d = self.registry.get(choice.prefill_id), self.registry.get(choice.decode_id)
        if p is None or d is None:
            raise NoCapacity("the chosen instance left the cluster")
        return p, d

    async def run(self, prep: Prepared, outcome: Outcome) -> AsyncIterator[Delta]:
        """Prefill on one instance, then stream the decode from another."""
        prefill, decode = self.route(prep)
        outcome.prompt_tokens = len(prep.token_ids)
        outcome.prefill_instance = prefill.info.instance_id
        outcome.decode_instance = decode.info.instance_id
        log.info("routed", request_id=prep.request_id, prefill=outcome.prefill_instance,
                 decode=outcome.decode_instance, prompt_tokens=outcome.prompt_tokens)
        deadline = time.monotonic() + self.config.request_timeout_s
        await self._prefill(prefill, prep, outcome)
        async for delta in self._decode(decode, prep, outcome, deadline):
            yield delta

    async def _prefill(self, inst: Instance, prep: Prepared, outcome: Outcome) -> None:
        inst.in_flight += 1
        inst.queued_prompt_tokens += len(prep.token_ids)
        t0 = time.perf_counter()
        try:
            reply = await inst.stub.Prefill(
                worker_pb2.PrefillRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                          cache_salt=prep.cache_salt),
                timeout=self.config.prefill_timeout_s,
            )
        except grpc.aio.AioRpcError as e:
            raise _worker_error(e, inst, "prefill") from None
        finally:
            inst.in_flight -= 1
            inst.queued_prompt_tokens -= len(prep.token_ids)
        outcome.blocks_saved = reply.blocks_saved
        outcome.blocks_in_pool = reply.blocks_in_pool
        log.info("prefilled", request_id=prep.request_id, instance=inst.info.instance_id,
                 blocks_saved=reply.blocks_saved, cached_tokens=reply.num_cached_tokens,
                 seconds=round(time.perf_counter() - t0, 4))

    async def _decode(self, inst: Instance, prep: Prepared, outcome: Outcome, deadline: float
                      ) -> AsyncIterator[Delta]:
        inst.in_flight += 1
        call = inst.stub.Generate(
            worker_pb2.GenerateRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                       params=prep.params, cache_salt=prep.cache_salt),
            timeout=max(deadline - time.monotonic(), 0.001),
        )
        try:
            first = True
            while True:
                wait = self.config.first_token_timeout_s if first else None
                try:
                    async with asyncio.timeout(wait):
                        chunk = await call.read()
                except TimeoutError:
                    raise Timeout("no first token from the decode instance in time",
                                  code="first_token_timeout") from None
                if chunk is grpc.aio.EOF:
                    break
                if first:
                    outcome.cached_tokens = chunk.num_cached_tokens
                    first = False
                outcome.completion_tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    outcome.blocks_loaded = chunk.blocks_loaded
                yield _delta(chunk)
        except grpc.aio.AioRpcError as e:
            raise _worker_error(e, inst, "decode") from None
        finally:
            inst.in_flight -= 1
            call.cancel()


def _delta(chunk: worker_pb2.GenerateChunk) -> Delta:
    d = Delta(text=chunk.text, token_ids=list(chunk.token_ids), logprobs=list(chunk.logprobs),
              finish_reason=chunk.finish_reason or None)
    for top in chunk.top_logprobs:
        d.tokens.append(top.top[0].token if top.top else "")
        d.top_logprobs.append({t.token: t.logprob for t in top.top})
    return d


def _worker_error(e: grpc.aio.AioRpcError, inst: Instance, stage: str) -> ConductorError:
    log.warning("worker_rpc_failed", instance=inst.info.instance_id, stage=stage,
                code=e.code().name, details=e.details())
    return from_worker_status(e.code(), f"{stage} on {inst.info.instance_id}: {e.details()}")
