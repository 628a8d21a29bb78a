"""One request through the cluster: tokenize, route, prefill, decode, stream back.

The pipeline yields typed `Delta`s; the HTTP layer turns them into OpenAI JSON or SSE.
Cancelling the iterator (a client that went away) cancels the worker RPC in flight, and the
worker aborts its engine request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc
import structlog

from conductor.config import ConductorConfig
from conductor.errors import (
    ConductorError,
    InvalidRequest,
    NoCapacity,
    Timeout,
    UpstreamFailed,
    from_worker_status,
)
from conductor.registry import Instance, Registry
from conductor.scheduler.router import Dispatch, Router
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
    block_size: int
    """The block size the hashes were cut with; routing uses the same one."""
    block_hashes: tuple[int, ...]
    params: worker_pb2.SamplingParams
    cache_salt: str
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    """This request's SLOs; None: the conductor's."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprobs: the chosen (or prompt) token's, and the top candidates'."""

    token_id: int
    token: str
    logprob: float | None
    """None for the first prompt token, which has no logprob."""
    top: tuple[tuple[str, float], ...]
    """The chosen token first, then the top-k, as the engine ranked them."""


@dataclass(slots=True)
class Delta:
    """New output of one choice (`index` < n) since its previous delta."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string or token id that ended the choice (None: EOS, length, ...)."""
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """When asked (echo with logprobs): one per prompt token, the first None."""


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
    warmed: list[str] = field(default_factory=list)
    """Prewarm: the instances that prefilled the prompt."""


class Pipeline:
    def __init__(self, config: ConductorConfig, registry: Registry, tokenizer: Tokenizer) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        self.router = Router(config, registry)

    def block_size(self) -> int:
        sizes = {i.info.block_size for i in self.registry.all()}
        if len(sizes) == 1:
            return sizes.pop()
        if self.config.block_size:
            return self.config.block_size
        if not sizes:
            raise NoCapacity("no instance is registered")
        raise NoCapacity(f"instances disagree on the block size: {sorted(sizes)}")

    def prepare(self, request_id: str, token_ids: list[int],
                params: worker_pb2.SamplingParams, cache_salt: str = "",
                ttft_slo_s: float | None = None, tbt_slo_s: float | None = None) -> Prepared:
        """A request the HTTP layer validated, tokenized and parameterised, with its hashes."""
        block_size = self.block_size()
        return Prepared(
            request_id=request_id,
            token_ids=token_ids,
            max_tokens=params.max_tokens,
            block_size=block_size,
            block_hashes=tuple(block_hashes(token_ids, block_size, cache_salt)),
            params=params,
            cache_salt=cache_salt,
            ttft_slo_s=ttft_slo_s,
            tbt_slo_s=tbt_slo_s,
        )

    def route(self, prep: Prepared) -> Dispatch:
        """Where the request runs (counted there from now on), or Overloaded / NoCapacity."""
        return self.router.route(prep.request_id, prep.token_ids, prep.block_hashes,
                                 prep.max_tokens, prep.block_size, prep.cache_salt,
                                 prep.ttft_slo_s, prep.tbt_slo_s)

    async def run(self, prep: Prepared, outcome: Outcome) -> AsyncIterator[Delta]:
        """Prefill on one instance, then stream the decode from another; a route with one
        instance (conditional disaggregation) skips the Prefill RPC: the decode instance
        computes the short uncached part itself."""
        dispatch = self.route(prep)
        prefill, decode = dispatch.prefill, dispatch.decode
        outcome.prompt_tokens = len(prep.token_ids)
        outcome.prefill_instance = prefill.info.instance_id
        outcome.decode_instance = decode.info.instance_id
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            if dispatch.route.disaggregated:
                await self._prefill(prefill, prep, outcome, dispatch)
            first = True
            async for delta in self._decode(decode, prep, outcome, deadline):
                if first:
                    dispatch.first_token()
                    first = False
                dispatch.tokens(delta.token_ids, record=delta.index == 0)
                yield delta
            dispatch.decode_done()
        finally:
            dispatch.release()

    async def prewarm(self, prep: Prepared, instances: list[str]) -> Outcome:
        """Prefill `prep` where the policy would (its blocks go to the pool), then on each of
        `instances` too (into their engine caches): no decode, nothing streamed. The outcome
        holds the blocks written and present; `warmed` the instances that ran it."""
        outcome = Outcome(prompt_tokens=len(prep.token_ids))
        targets = []
        for iid in instances:
            inst = self.registry.get(iid)
            if inst is None:
                raise InvalidRequest(f"no instance {iid!r}", param="instances")
            targets.append(inst)
        dispatch = self.route(prep)
        try:
            await self._prefill(dispatch.prefill, prep, outcome, dispatch)
        finally:
            dispatch.release()
        saved = outcome.blocks_saved
        outcome.warmed.append(dispatch.prefill.instance_id)
        for n, inst in enumerate(t for t in targets if t is not dispatch.prefill):
            one = replace(prep, request_id=f"{prep.request_id}-{n}")
            reply = await self._prefill_rpc(inst, one)
            saved += reply.blocks_saved
            self.router.index.store(inst.instance_id, prep.block_hashes)
            outcome.warmed.append(inst.instance_id)
        outcome.blocks_saved = saved
        return outcome

    async def _prefill_rpc(self, inst: Instance, prep: Prepared) -> worker_pb2.PrefillReply:
        try:
            return await inst.stub.Prefill(
                worker_pb2.PrefillRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                          cache_salt=prep.cache_salt),
                timeout=self.config.prefill_timeout_s,
            )
        except grpc.aio.AioRpcError as e:
            raise _worker_error(e, inst, "prefill") from None

    async def _prefill(self, inst: Instance, prep: Prepared, outcome: Outcome,
                       dispatch: Dispatch) -> None:
        t0 = time.perf_counter()
        reply = await self._prefill_rpc(inst, prep)
        dispatch.prefill_done(reply.num_prompt_tokens, reply.num_cached_tokens,
                              reply.blocks_in_pool, reply.engine_seconds)
        outcome.blocks_saved = reply.blocks_saved
        outcome.blocks_in_pool = reply.blocks_in_pool
        log.info("prefilled", request_id=prep.request_id, instance=inst.info.instance_id,
                 blocks_saved=reply.blocks_saved, cached_tokens=reply.num_cached_tokens,
                 seconds=round(time.perf_counter() - t0, 4))

    async def _decode(self, inst: Instance, prep: Prepared, outcome: Outcome, deadline: float
                      ) -> AsyncIterator[Delta]:
        call = inst.stub.Generate(
            worker_pb2.GenerateRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                       params=prep.params, cache_salt=prep.cache_salt),
            timeout=max(deadline - time.monotonic(), 0.001),
        )
        unfinished = set(range(prep.params.n or 1))
        held: list[worker_pb2.TokenLogprobs] = []  # prompt logprobs of steps without output
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
                    unfinished.discard(chunk.index)
                    outcome.blocks_loaded = max(outcome.blocks_loaded, chunk.blocks_loaded)
                elif not chunk.token_ids:
                    held += chunk.prompt_logprobs
                    continue
                yield _delta(chunk, held)
                held = []
            if unfinished:
                raise UpstreamFailed(f"decode on {inst.info.instance_id} ended before choices "
                                     f"{sorted(unfinished)} finished")
        except grpc.aio.AioRpcError as e:
            raise _worker_error(e, inst, "decode") from None
        finally:
            call.cancel()


def _delta(chunk: worker_pb2.GenerateChunk, held: list[worker_pb2.TokenLogprobs]) -> Delta:
    d = Delta(index=chunk.index, text=chunk.text, token_ids=list(chunk.token_ids),
              finish_reason=chunk.finish_reason or None)
    which = chunk.WhichOneof("stop_reason")
    if which is not None:
        d.stop_reason = getattr(chunk, which)
    if chunk.top_logprobs:
        d.logprobs = [_logprob(t, top) for t, top in zip(chunk.token_ids, chunk.top_logprobs,
                                                         strict=False)]
    if held or chunk.prompt_logprobs:
        d.prompt_logprobs = [_logprob(None, top) if top.top else None
                             for top in (*held, *chunk.prompt_logprobs)]
    return d


def _logprob(token_id: int | None, top: worker_pb2.TokenLogprobs) -> TokenLogprob:
    """The wire's list holds the chosen token first (for a prompt position: the prompt's)."""
    entries = top.top
    if not entries:
        return TokenLogprob(token_id or 0, "", None, ())
    own = entries[0]
    if token_id is not None and own.token_id != token_id:
        own = next((e for e in entries if e.token_id == token_id), own)
    return TokenLogprob(own.token_id, own.token, own.logprob,
                        tuple((e.token, e.logprob) for e in entries))


def _worker_error(e: grpc.aio.AioRpcError, inst: Instance, stage: str) -> ConductorError:
    log.warning("worker_rpc_failed", instance=inst.info.instance_id, stage=stage,
                code=e.code().name, details=e.details())
    return from_worker_status(e.code(), f"{stage} on {inst.info.instance_id}: {e.details()}")
