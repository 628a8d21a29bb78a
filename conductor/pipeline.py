"""One request through the cluster: route, prefill beside decode, stream back.

A disaggregated route starts the Prefill RPC and the decode's Generate stream together: the
decode engine loads the prompt's blocks as the prefill writes them into the pool (waiting for
them off its scheduler thread, bounded; what does not arrive is recomputed). A route with one
instance skips the Prefill RPC: that instance computes what the pool cannot give it. Either
way the worker is told what the pool holds (`PoolWait`), so no engine asks the pool on its
scheduler thread. On a held disaggregated route the prefill's first token is streamed as
soon as the prefill replies (`conductor.first_token`). Failures go to `conductor.resilience`.

The pipeline yields typed `Delta`s; the HTTP layer turns them into OpenAI JSON or SSE.
Cancelling the iterator (a client that went away) cancels the worker RPCs in flight, and the
workers abort their engine requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace

import grpc
import structlog

from cluster.resilience import RetryBudget
from conductor.calls import close_call_later, settle
from conductor.config import ConductorConfig
from conductor.deltas import Delta, from_chunk
from conductor.errors import ConductorError, InvalidRequest, NoCapacity, Timeout, UpstreamFailed
from conductor.first_token import (
    FirstTokenMismatch,
    early_chunk,
    prefill_params,
    strip_first,
    usable,
)
from conductor.flow import FlowControl, Ticket
from conductor.registry import Instance, Registry
from conductor.resilience import (
    UNREACHABLE,
    Diverged,
    Next,
    PrefillFailure,
    Recovery,
    ResilienceMetrics,
    WorkerFailure,
    cancelled_by_us,
    left,
    lost,
    rpc_failure,
    stalled,
)
from conductor.router import Dispatch, Router
from conductor.timeline import Timeline
from conductor.tokenizer import Tokenizer
from protos import worker_pb2
from store.block_hash import block_hashes

log = structlog.get_logger(__name__)

POOL_READY_TIMEOUT_S = 5.0


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
    first_token_from: str = "decode"
    """Which engine's first token the client got: "prefill" (`conductor.first_token`) or
    "decode"."""
    timeline: Timeline = field(default_factory=Timeline)
    """Where the request's time went (`conductor.timeline`)."""


class Pipeline:
    def __init__(self, config: ConductorConfig, registry: Registry, tokenizer: Tokenizer) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        self.router = Router(config, registry)
        self.metrics: ResilienceMetrics | None = None
        self.retry_budget = RetryBudget(config.retry_budget)
        self.flow: FlowControl | None = None
        """Queues batch requests for room (`conductor.flow`); None: every request is routed
        at once."""

    def block_size(self) -> int:
        """The cluster's block size (`Registry.terms`: configured, or the admitted
        instances')."""
        block_size = self.registry.terms.block_size
        if not block_size:
            raise NoCapacity("no instance is registered and verified")
        return block_size

    def prepare(self, request_id: str, token_ids: list[int],
                params: worker_pb2.SamplingParams, cache_salt: str = "",
                ttft_slo_s: float | None = None, tbt_slo_s: float | None = None,
                loosen_slos: bool = False, priority: str = "interactive") -> Prepared:
        """A request the HTTP layer validated, tokenized and parameterised, with its hashes
        and the SLOs it runs under: its own only where tighter than the operator's, unless
        `loosen_slos` (`Router.slos`); a `batch` request's at most `batch_slo_share` of
        them (it takes the headroom interactive ones leave, `conductor.flow`)."""
        block_size = self.block_size()
        ttft_slo_s, tbt_slo_s = self.router.slos(
            ttft_slo_s, tbt_slo_s, loosen_slos,
            self.config.batch_slo_share if priority == "batch" else 1.0)
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
                                 prep.ttft_slo_s, prep.tbt_slo_s, exclude,
                                 prep.params.n or 1)

    # ------------------------------------------------------------------ one request

    async def run(self, prep: Prepared, outcome: Outcome, ticket: Ticket | None = None
                  ) -> AsyncIterator[Delta]:
        """Route (a batch `ticket` waiting for room: `conductor.flow`), prefill beside decode,
        stream; survive what `conductor.resilience` can."""
        outcome.prompt_tokens = len(prep.token_ids)
        deadline = time.monotonic() + self.config.request_timeout_s
        self.retry_budget.request()
        rec = Recovery(prep, outcome, self.metrics, self.retry_budget)
        alone: Instance | None = None  # after a prefill failure: this instance computes it all
        first = True
        while True:
            if first and ticket is not None and self.flow is not None:
                dispatch = await self.flow.place(ticket, lambda: self._dispatch(rec, None),
                                                 Dispatch.release)
            else:
                dispatch = self._dispatch(rec, alone)
            first = False
            try:
                async for delta in self._serve(dispatch, rec, deadline):
                    yield delta
                return
            except WorkerFailure as f:
                step = rec.decide(f, self._other_prefill(dispatch.prefill, rec.exclude))
                if step is Next.DONE:
                    return
                alone = dispatch.decode if step is Next.FALLBACK else None
                if step is Next.RETRY:
                    await rec.backoff()
            finally:
                dispatch.release()

    def _dispatch(self, rec: Recovery, alone: Instance | None) -> Dispatch:
        assert rec.current is not None
        prep = rec.current
        try:
            if alone is not None:
                dispatch = self.router.pin(prep.request_id, prep.token_ids, prep.block_hashes,
                                           prep.max_tokens, prep.block_size, prep.cache_salt,
                                           alone, prep.params.n or 1)
            else:
                dispatch = self.route(prep, rec.exclude)
        except ConductorError as e:
            rec.no_route(e)
            raise
        rec.routed(dispatch.decode.instance_id)
        o = rec.outcome
        o.prefill_instance = dispatch.prefill.instance_id
        o.decode_instance = dispatch.decode.instance_id
        o.timeline.mark("routed")
        o.timeline.attrs.update(prefill=o.prefill_instance, decode=o.decode_instance,
                                disaggregated=dispatch.route.disaggregated)
        return dispatch

    async def _serve(self, dispatch: Dispatch, rec: Recovery, deadline: float
                     ) -> AsyncIterator[Delta]:
        """The prefill (when the route has one) as a task beside the decode stream."""
        assert rec.current is not None
        prep, outcome = rec.current, rec.outcome
        prefill: asyncio.Task | None = None
        first_token: asyncio.Future | None = None
        if dispatch.route.disaggregated:
            # a decode engine already caching the prompt's blocks is not held for the prefill
            hold = not dispatch.decode_has_prompt
            params = prefill_params(prep.params) if hold else None  # `conductor.first_token`
            if params is not None:
                first_token = asyncio.get_running_loop().create_future()
            prefill = asyncio.create_task(self._prefill(dispatch, prep, outcome, rec, ready=hold,
                                                        params=params, first=first_token))
            wait = worker_pb2.PoolWait(blocks=len(prep.token_ids) // prep.block_size,
                                       wait_s=self._wait_s(dispatch), hold=hold)
        else:
            wait = worker_pb2.PoolWait(blocks=dispatch.pool_blocks)
        try:
            first = True
            async for delta in self._decode(dispatch.decode, prep, outcome, deadline, wait,
                                            prefill, first_call=not rec.sent
                                            and not outcome.migrations,
                                            first=first_token, sent=dispatch.announce):
                if first:
                    dispatch.first_token(outcome.cached_tokens)
                    self.registry.call_succeeded(dispatch.decode.instance_id)  # a probe's verdict
                    first = False
                dispatch.tokens(delta.token_ids, record=delta.index == 0)
                rec.streamed(delta)
                yield delta
            self.registry.call_succeeded(dispatch.decode.instance_id)
            dispatch.decode_done()
        except WorkerFailure as f:
            # neither a prefill's failure nor a divergence is the decode's fault, nor is the
            # request's own failure repeated
            if not isinstance(f, PrefillFailure | Diverged) and not rec.repeats(f):
                self._count_failure(f, dispatch)
            raise
        finally:
            if prefill is not None:
                await settle(prefill)

    def _wait_s(self, dispatch: Dispatch) -> float:
        predicted = dispatch.route.predicted_ttft_s
        return min(2 * predicted + self.config.pool_wait_margin_s, self.config.prefill_timeout_s)

    def _count_failure(self, f: WorkerFailure, dispatch: Dispatch) -> None:
        """An instance failed (not the request): its breaker counts it, and what the request
        was predicted to leave there is withdrawn."""
        if not f.retryable:
            return
        dispatch.withdraw(f.instance)
        self.registry.call_failed(f.instance, fatal=f.code in UNREACHABLE,
                                  cooldown_s=self.config.breaker_cooldown_s)

    def _other_prefill(self, inst: Instance, exclude: set[str]) -> bool:
        """Another routable prefill-capable instance than `inst` is up."""
        return any(i.routable and i.instance_id not in exclude and i.role != "decode"
                   for i in self.registry.all() if i is not inst)

    # ------------------------------------------------------------------ the calls

    async def _prefill_rpc(self, inst: Instance, prep: Prepared, pool_blocks: int = 0,
                           params: worker_pb2.SamplingParams | None = None
                           ) -> worker_pb2.PrefillReply:
        iid = inst.info.instance_id
        call = None
        try:
            call = inst.stub.Prefill(
                worker_pb2.PrefillRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                          cache_salt=prep.cache_salt,
                                          pool_wait=worker_pb2.PoolWait(blocks=pool_blocks),
                                          params=params),
                timeout=self.config.prefill_timeout_s,
            )
            inst.calls.add(call)
            reply = await call
        except grpc.aio.AioRpcError as e:
            raise rpc_failure(e, iid, "prefill") from None
        except grpc.aio.UsageError:  # its channel closed: it left after we chose it
            raise left(iid, "prefill") from None
        except asyncio.CancelledError:
            if cancelled_by_us():
                raise
            raise (lost(iid, "prefill", inst.why) if inst.lost else left(iid, "prefill")) from None
        finally:
            inst.calls.discard(call)
        self.registry.call_succeeded(iid)
        return reply

    async def _prefill(self, dispatch: Dispatch, prep: Prepared, outcome: Outcome,
                       rec: Recovery | None = None, ready: bool = False,
                       params: worker_pb2.SamplingParams | None = None,
                       first: asyncio.Future | None = None) -> None:
        """The Prefill RPC of a disaggregated route; a failure counts against its instance
        (unless it repeats the request's previous one, `rec`).
        `ready`: then tell the decode instance, which holds the request until then.
        `params`: the prefill samples the first token with them, and `first` gets its chunk
        (None if the reply has none) as soon as the reply is in."""
        tl = outcome.timeline
        tl.mark("prefill_sent")
        try:
            reply = await self._prefill_rpc(dispatch.prefill, prep, dispatch.pool_blocks,
                                            params)
        except WorkerFailure as f:
            if rec is None or not rec.repeats(f):
                self._count_failure(f, dispatch)
            raise
        tl.mark("prefill_done")
        if first is not None and not first.done():
            first.set_result(reply.first if reply.HasField("first") else None)
        tl.engine("prefill", reply.times)
        dispatch.prefill_done(reply.num_prompt_tokens, reply.num_cached_tokens,
                              reply.blocks_in_pool, reply.engine_seconds)
        outcome.blocks_saved = reply.blocks_saved
        outcome.blocks_in_pool = reply.blocks_in_pool
        log.info("prefilled", request_id=prep.request_id, instance=dispatch.prefill.instance_id,
                 blocks_saved=reply.blocks_saved, cached_tokens=reply.num_cached_tokens,
                 seconds=round(reply.engine_seconds, 4))
        if ready:
            token = reply.first.token_ids[0] if params and usable(reply.first) else None
            await self._pool_ready(dispatch.decode, prep.request_id, token)

    async def _pool_ready(self, inst: Instance, request_id: str,
                          first_token: int | None = None) -> None:
        """Release the decode held for this prefill, its first token made `first_token`; if
        the call fails, the decode instance releases it itself after its wait (and computes
        what did not arrive; a first token of its own is then caught by `strip_first`)."""
        try:
            await inst.stub.PoolReady(worker_pb2.PoolReadyRequest(request_id=request_id,
                                                                  first_token=first_token),
                                      timeout=POOL_READY_TIMEOUT_S)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.warning("pool_ready_failed", request_id=request_id,
                        instance=inst.info.instance_id, error=repr(e))

    async def _decode(self, inst: Instance, prep: Prepared, outcome: Outcome, deadline: float,
                      wait: worker_pb2.PoolWait, prefill: asyncio.Task | None,
                      first_call: bool = True, first: asyncio.Future | None = None,
                      sent: Callable[[], None] = lambda: None) -> AsyncIterator[Delta]:
        """The decode stream as deltas; WorkerFailure when the instance fails it, and
        PrefillFailure when `prefill` (running beside it) fails before its first chunk.
        `first_call`: the request's first decode (a continuation keeps the usage figures).
        `first`: the prefill's first token, streamed if it comes before the decode's own
        (`conductor.first_token`). `sent`: called once the call is under way (after the
        loop turn that sends it)."""
        iid = inst.info.instance_id
        tl = outcome.timeline
        tl.mark("decode_sent")
        try:
            call = inst.stub.Generate(
                worker_pb2.GenerateRequest(request_id=prep.request_id, token_ids=prep.token_ids,
                                           params=prep.params, cache_salt=prep.cache_salt,
                                           pool_wait=wait),
                timeout=max(deadline - time.monotonic(), 0.001),
            )
        except grpc.aio.UsageError:  # its channel closed: it left after we chose it (its
            # lease lapsed while the prefill ran); new calls are refused, calls in flight go on
            sent()
            raise left(iid, "decode") from None
        # grpc.aio sends from a task of its own, scheduled just now: this runs after it
        asyncio.get_running_loop().call_soon(sent)
        unfinished = set(range(prep.params.n or 1))
        stall_s = self.config.stall_s(prep.tbt_slo_s)
        ended = False
        held: list[worker_pb2.TokenLogprobs] = []  # prompt logprobs of steps without output
        inst.calls.add(call)  # cancelled if the instance is lost (`Registry.set_unhealthy`)
        read = asyncio.ensure_future(call.read())
        try:
            chunk, early = await self._first_chunk(read, prefill, iid, first)
            if early:  # the prefill's token, streamed now and dropped from the decode's
                sent = chunk
                outcome.completion_tokens += 1
                outcome.first_token_from = "prefill"
                yield from_chunk(sent, [])
                chunk, _ = await self._first_chunk(read, None, iid)
                try:
                    chunk = strip_first(chunk, sent)
                except FirstTokenMismatch as e:
                    log.warning("first_token_mismatch", request_id=prep.request_id,
                                error=str(e))
                    raise Diverged(iid, str(e)) from None
            tl.mark("first_chunk")
            opening = True
            while chunk is not grpc.aio.EOF:
                timed = chunk.HasField("times")
                if timed:
                    tl.engine("decode", chunk.times)
                # the first chunk says what the engine did not compute, the worker's last one
                # (with its times) corrects it for blocks whose load failed
                if first_call and (opening or (timed and chunk.finish_reason)):
                    outcome.cached_tokens = chunk.num_cached_tokens
                opening = False
                outcome.completion_tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    unfinished.discard(chunk.index)
                    outcome.blocks_loaded = max(outcome.blocks_loaded, chunk.blocks_loaded)
                if chunk.token_ids or chunk.finish_reason:
                    yield from_chunk(chunk, held)
                    held = []
                else:
                    held += chunk.prompt_logprobs
                if not unfinished and timed:  # the worker's last chunk: the answer is whole
                    ended = True
                    break
                try:
                    async with asyncio.timeout(stall_s):
                        chunk = await call.read()
                except TimeoutError:
                    raise stalled(iid, stall_s) from None
            if unfinished:
                raise WorkerFailure(iid, grpc.StatusCode.UNKNOWN, UpstreamFailed(
                    f"decode on {iid} ended before choices {sorted(unfinished)} finished"))
        except grpc.aio.AioRpcError as e:
            raise rpc_failure(e, iid, "decode") from None
        except asyncio.CancelledError:
            if cancelled_by_us():
                raise
            raise (lost(iid, "decode", inst.why) if inst.lost else left(iid, "decode")) from None
        finally:
            inst.calls.discard(call)
            if not read.done():
                read.cancel()
            if ended:
                close_call_later(call)
            else:
                call.cancel()

    async def _first_chunk(self, read: asyncio.Future, prefill: asyncio.Task | None,
                           iid: str, first: asyncio.Future | None = None
                           ) -> tuple[worker_pb2.GenerateChunk, bool]:
        """The decode's first chunk (`read`: the stream's pending read) within
        `first_token_timeout_s`, or, if `first` brings the prefill's first token before it,
        that token as the chunk to stream now (then True, and `read` is left pending);
        PrefillFailure as soon as the prefill beside it fails first (the decode would wait for
        its blocks in vain)."""
        try:
            async with asyncio.timeout(self.config.first_token_timeout_s):
                while True:
                    waits = {read}
                    if prefill is not None and not prefill.done():
                        waits.add(prefill)
                    if first is not None and not first.done():
                        waits.add(first)
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if read.done():
                        return read.result(), False
                    if first is not None and first.done():
                        got, first = first.result(), None
                        if got is not None and usable(got):
                            return early_chunk(got), True
                        continue
                    assert prefill is not None
                    failure = prefill.exception()
                    if isinstance(failure, WorkerFailure):
                        raise PrefillFailure.of(failure)
                    if failure is not None:
                        raise failure
        except TimeoutError:
            raise WorkerFailure(iid, grpc.StatusCode.DEADLINE_EXCEEDED, Timeout(
                "no first token from the decode instance in time",
                code="first_token_timeout")) from None

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
        dispatch.announce()  # (no decode follows: nothing is predicted on the decode instance)
        try:
            await self._prefill(dispatch, prep, outcome)
        except WorkerFailure as f:
            raise f.error from None
        finally:
            dispatch.release()
        saved = outcome.blocks_saved
        outcome.warmed.append(dispatch.prefill.instance_id)
        for n, inst in enumerate(t for t in targets if t is not dispatch.prefill):
            one = replace(prep, request_id=f"{prep.request_id}-{n}")
            try:
                reply = await self._prefill_rpc(inst, one, dispatch.pool_blocks)
            except WorkerFailure as f:
                raise f.error from None
            saved += reply.blocks_saved
            self.router.index.store(inst.instance_id, prep.block_hashes)
            outcome.warmed.append(inst.instance_id)
        outcome.blocks_saved = saved
        return outcome
