"""One request through the cluster: tokenize, route, prefill, decode, stream back.

The pipeline yields typed `Delta`s; the HTTP layer turns them into OpenAI JSON or SSE.
Cancelling the iterator (a client that went away) cancels the worker RPC in flight, and the
worker aborts its engine request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field, replace
from typing import Protocol

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
from store.block_hash import block_hashes, extend_hashes

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
    retries: int = 0
    retried: list[str] = field(default_factory=list)
    """The stages retried on another instance (prefill, decode), in order."""
    fallbacks: list[str] = field(default_factory=list)
    """Fall-backs taken (prefill_on_decode)."""
    migrations: int = 0
    """Times the stream moved to another decode instance."""


class ResilienceMetrics(Protocol):
    """Where the pipeline counts the failure paths it took (`conductor.metrics.Metrics`)."""

    def retry(self, stage: str) -> None: ...
    def fallback(self, kind: str) -> None: ...
    def migration(self) -> None: ...


class Pipeline:
    def __init__(self, config: ConductorConfig, registry: Registry, tokenizer: Tokenizer) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        self.router = Router(config, registry)
        self.metrics: ResilienceMetrics | None = None

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

    def route(self, prep: Prepared, exclude: Collection[str] = ()) -> Dispatch:
        """Where the request runs (counted there from now on), or Overloaded / NoCapacity."""
        return self.router.route(prep.request_id, prep.token_ids, prep.block_hashes,
                                 prep.max_tokens, prep.block_size, prep.cache_salt,
                                 prep.ttft_slo_s, prep.tbt_slo_s, exclude)

    async def run(self, prep: Prepared, outcome: Outcome) -> AsyncIterator[Delta]:
        """Prefill on one instance, then stream the decode from another; a route with one
        instance (conditional disaggregation) skips the Prefill RPC: the decode instance
        computes the short uncached part itself.

        Failures of an instance (not of the request: a 4xx is never retried) are survived:
        a failed prefill is retried on another prefill instance, or left to the decode
        instance; a decode failing before its first token is retried elsewhere; a stream
        broken after it continues on another decode instance from the tokens already sent
        (the prompt's KV is in the pool, so the new instance computes little). Each path
        counts in `outcome` and logs a marker; every retry waits a jittered backoff."""
        outcome.prompt_tokens = len(prep.token_ids)
        deadline = time.monotonic() + self.config.request_timeout_s
        exclude: set[str] = set()
        sent: list[int] = []  # choice 0's tokens streamed so far
        current = prep
        broken: WorkerFailure | None = None  # the failure a continuation recovers from
        done = False  # choice 0 finished: a failure after that loses nothing
        last: WorkerFailure | None = None  # the latest failure: the answer if nothing else runs
        while True:
            try:
                dispatch = self.route(current, exclude)
            except ConductorError:
                if last is not None:  # nowhere else to go: the failure itself is the answer
                    raise last.error from None
                raise
            prefill, decode = dispatch.prefill, dispatch.decode
            if broken is not None:
                outcome.migrations += 1
                if self.metrics is not None:
                    self.metrics.migration()
                log.warning("stream_migrated", request_id=prep.request_id,
                            failed=broken.instance, to=decode.info.instance_id,
                            tokens_sent=len(sent), error=broken.code.name)
                broken = None
            outcome.prefill_instance = prefill.info.instance_id
            outcome.decode_instance = decode.info.instance_id
            try:
                if dispatch.route.disaggregated:
                    try:
                        await self._prefill(prefill, current, outcome, dispatch)
                    except WorkerFailure as f:
                        exclude.add(self._failed(f, dispatch))
                        last = f
                        if self._others(prefill, exclude) and outcome.retries < MAX_RETRIES:
                            await self._retry(outcome, "prefill", current.request_id, f)
                            continue
                        outcome.fallbacks.append("prefill_on_decode")
                        if self.metrics is not None:
                            self.metrics.fallback("prefill_on_decode")
                        log.warning("fallback_prefill_on_decode", request_id=prep.request_id,
                                    failed=f.instance, decode=decode.info.instance_id)
                first = True
                async for delta in self._decode(decode, current, outcome, deadline,
                                                first_call=not sent and not outcome.migrations):
                    if first:
                        dispatch.first_token()
                        first = False
                    dispatch.tokens(delta.token_ids, record=delta.index == 0)
                    if delta.index == 0:
                        sent.extend(delta.token_ids)
                        done = done or delta.finish_reason is not None
                    yield delta
                self.registry.call_succeeded(decode.info.instance_id)
                dispatch.decode_done()
                return
            except WorkerFailure as f:
                exclude.add(self._failed(f, dispatch))
                last = f
                if done and (prep.params.n or 1) == 1:
                    return
                if not sent and outcome.retries < MAX_RETRIES:
                    await self._retry(outcome, "decode", current.request_id, f)
                    continue
                if sent and outcome.migrations < MAX_MIGRATIONS and _continuable(prep):
                    current = self._continued(prep, sent, outcome.migrations + 1)
                    broken = f
                    continue
                raise f.error from None
            finally:
                dispatch.release()

    def _failed(self, f: WorkerFailure, dispatch: Dispatch) -> str:
        """A failure of the instance: count it in its breaker, withdraw what the request was
        predicted to leave there; the instance to avoid. A failure of the request itself (the
        worker refused it: a 4xx) is raised as its answer."""
        if not f.retryable:
            raise f.error from None
        dispatch.withdraw(f.instance)
        self.registry.call_failed(f.instance, fatal=f.code in _UNREACHABLE,
                                  cooldown_s=self.config.breaker_cooldown_s)
        return f.instance

    def _others(self, inst: Instance, exclude: set[str]) -> bool:
        """Another routable prefill-capable instance than `inst` is up."""
        return any(i.routable and i.instance_id not in exclude and i.role != "decode"
                   for i in self.registry.all() if i is not inst)

    async def _retry(self, outcome: Outcome, stage: str, request_id: str,
                     f: WorkerFailure) -> None:
        if self.metrics is not None:
            self.metrics.retry(stage)
        outcome.retries += 1
        outcome.retried.append(stage)
        log.warning("retry", request_id=request_id, stage=stage, failed=f.instance,
                    error=f.code.name, attempt=outcome.retries)
        await asyncio.sleep(min(BACKOFF_S * 2 ** (outcome.retries - 1), 1.0)
                            * random.uniform(0.5, 1.5))

    def _continued(self, prep: Prepared, sent: list[int], n: int) -> Prepared:
        """The rest of a broken stream as a request of its own: the prompt and the tokens
        already sent, for the tokens still owed."""
        p = worker_pb2.SamplingParams()
        p.CopyFrom(prep.params)
        p.max_tokens = prep.params.max_tokens - len(sent)
        p.min_tokens = max(prep.params.min_tokens - len(sent), 0)
        tokens = prep.token_ids + sent
        return replace(prep, request_id=f"{prep.request_id}-m{n}", token_ids=tokens,
                       max_tokens=p.max_tokens, params=p,
                       block_hashes=prep.block_hashes + tuple(extend_hashes(
                           prep.block_hashes[-1] if prep.block_hashes else None,
                           prep.token_ids[len(prep.block_hashes) * prep.block_size:] + sent,
                           prep.block_size, prep.cache_salt)))

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
        if dispatch.decode is not dispatch.prefill:  # no decode follows: nothing lands there
            dispatch.withdraw(dispatch.decode.instance_id)
        try:
            await self._prefill(dispatch.prefill, prep, outcome, dispatch)
        except WorkerFailure as f:
            raise f.error from None
        finally:
            dispatch.release()
        saved = outcome.blocks_saved
        outcome.warmed.append(dispatch.prefill.instance_id)
        for n, inst in enumerate(t for t in targets if t is not dispatch.prefill):
            one = replace(prep, request_id=f"{prep.request_id}-{n}")
            try:
                reply = await self._prefill_rpc(inst, one)
            except WorkerFailure as f:
                raise f.error from None
            saved += reply.blocks_saved
            self.router.index.store(inst.instance_id, prep.block_hashes)
            outcome.warmed.append(inst.instance_id)
        outcome.blocks_saved = saved
        return outcome

    async def _prefill_rpc(self, inst: Instance, prep: Prepared) -> worker_pb2.PrefillReply:
        try:
            reply = await inst.stub.Prefill(
                worker_pb2.PrefillRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                          cache_salt=prep.cache_salt),
                timeout=self.config.prefill_timeout_s,
            )
        except grpc.aio.AioRpcError as e:
            raise _failure(e, inst, "prefill") from None
        except grpc.aio.UsageError:  # its channel closed: it left after we chose it
            raise _left(inst, "prefill") from None
        except asyncio.CancelledError:
            if _cancelled_by_us():
                raise
            raise _left(inst, "prefill") from None
        self.registry.call_succeeded(inst.info.instance_id)
        return reply

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

    async def _decode(self, inst: Instance, prep: Prepared, outcome: Outcome, deadline: float,
                      first_call: bool = True) -> AsyncIterator[Delta]:
        """The decode stream as deltas; WorkerFailure when the instance fails it.
        `first_call`: the request's first decode (a continuation keeps the usage figures)."""
        try:
            call = inst.stub.Generate(
                worker_pb2.GenerateRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                           params=prep.params, cache_salt=prep.cache_salt),
                timeout=max(deadline - time.monotonic(), 0.001),
            )
        except grpc.aio.UsageError:  # its channel closed: it left after we chose it (its
            # lease lapsed while the prefill ran); new calls are refused, calls in flight go on
            raise _left(inst, "decode") from None
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
                    raise WorkerFailure(inst.info.instance_id, grpc.StatusCode.DEADLINE_EXCEEDED,
                                        Timeout("no first token from the decode instance in "
                                                "time", code="first_token_timeout")) from None
                if chunk is grpc.aio.EOF:
                    break
                if first:
                    if first_call:
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
                raise WorkerFailure(inst.info.instance_id, grpc.StatusCode.UNKNOWN, UpstreamFailed(
                    f"decode on {inst.info.instance_id} ended before choices "
                    f"{sorted(unfinished)} finished"))
        except grpc.aio.AioRpcError as e:
            raise _failure(e, inst, "decode") from None
        except asyncio.CancelledError:
            if _cancelled_by_us():
                raise
            raise _left(inst, "decode") from None
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


MAX_RETRIES = 2
"""Retries per request (prefill elsewhere, decode before its first token elsewhere)."""
MAX_MIGRATIONS = 2
"""Times one stream may move to another decode instance."""
BACKOFF_S = 0.05
"""First retry's backoff; doubled per retry, capped at 1 s, jittered by ±50%."""

_RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})
"""Failures of the instance, not of the request (CANCELLED: its channel was closed as it
left the cluster; our own cancellations arrive as CancelledError instead)."""
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""Failures that open the instance's breaker at once."""


class WorkerFailure(Exception):
    """A worker call failed; `error` is what the client gets if nothing else works."""

    def __init__(self, instance: str, code: grpc.StatusCode, error: ConductorError) -> None:
        super().__init__(error.message)
        self.instance = instance
        self.code = code
        self.error = error
        self.retryable = code in _RETRYABLE


def _continuable(prep: Prepared) -> bool:
    """A broken stream can go on elsewhere: one choice, no prompt logprobs to resend."""
    p = prep.params
    return (p.n or 1) == 1 and not p.HasField("prompt_logprobs")


def _cancelled_by_us() -> bool:
    """A CancelledError out of a worker call is ours (the client went away) when this task is
    being cancelled; otherwise grpc.aio cancelled the call itself because the channel to an
    instance that left the cluster closed under it (no AioRpcError then)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _left(inst: Instance, stage: str) -> WorkerFailure:
    log.warning("worker_rpc_failed", instance=inst.info.instance_id, stage=stage,
                code="CANCELLED", details="channel closed: the instance left the cluster")
    return WorkerFailure(inst.info.instance_id, grpc.StatusCode.CANCELLED, UpstreamFailed(
        f"{stage} on {inst.info.instance_id}: the instance left the cluster"))


def _failure(e: grpc.aio.AioRpcError, inst: Instance, stage: str) -> WorkerFailure:
    log.warning("worker_rpc_failed", instance=inst.info.instance_id, stage=stage,
                code=e.code().name, details=e.details())
    return WorkerFailure(inst.info.instance_id, e.code(), from_worker_status(
        e.code(), f"{stage} on {inst.info.instance_id}: {e.details()}"))
