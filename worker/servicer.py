"""The gRPC `Worker` service over one engine."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import grpc
import structlog

from protos import worker_pb2, worker_pb2_grpc
from worker.engine import Engine
from worker.telemetry import engine_times

log = structlog.get_logger(__name__)


def sampling_params(p: worker_pb2.SamplingParams):
    """Wire sampling parameters to vLLM's. vLLM's own validation raises ValueError."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=p.n or 1,
        max_tokens=p.max_tokens or 16,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k if p.top_k > 0 else -1 if p.top_k < 0 else 0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        logprobs=p.logprobs if p.logprobs > 0 else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        min_tokens=p.min_tokens,
        skip_special_tokens=(p.skip_special_tokens if p.HasField("skip_special_tokens")
                             else True),
        output_kind=RequestOutputKind.DELTA,
    )


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad request (its validation error is not a ValueError)."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, VLLMClientError)


def _top(lp: dict) -> worker_pb2.TokenLogprobs:
    top = worker_pb2.TokenLogprobs()
    for tid, entry in lp.items():
        top.top.add(token_id=tid, logprob=_finite(entry.logprob), token=entry.decoded_token or "")
    return top


def _chunks(out, first: bool) -> list[worker_pb2.GenerateChunk]:
    """One wire chunk per choice that moved in this engine output (several when n > 1)."""
    chunks = []
    for comp in out.outputs:
        chunk = worker_pb2.GenerateChunk(token_ids=list(comp.token_ids), text=comp.text,
                                         index=comp.index)
        if comp.logprobs:
            for tok, lp in zip(comp.token_ids, comp.logprobs, strict=False):
                chunk.logprobs.append(_finite(lp[tok].logprob))
                chunk.top_logprobs.append(_top(lp))
        if comp.finish_reason is not None:
            chunk.finish_reason = comp.finish_reason
            if isinstance(comp.stop_reason, str):
                chunk.stop_str = comp.stop_reason
            elif isinstance(comp.stop_reason, int):
                chunk.stop_token_id = comp.stop_reason
        chunks.append(chunk)
    if not chunks:  # prompt logprobs or a bare finish, without new tokens
        chunks.append(worker_pb2.GenerateChunk())
    head, last = chunks[0], chunks[-1]
    if out.prompt_logprobs:
        head.prompt_logprobs.extend(worker_pb2.TokenLogprobs() if lp is None else _top(lp)
                                    for lp in out.prompt_logprobs)
    if first:
        head.num_prompt_tokens = len(out.prompt_token_ids or [])
        head.num_cached_tokens = out.num_cached_tokens or 0
    if out.finished:
        last.finish_reason = last.finish_reason or "stop"
        last.blocks_loaded = int((out.kv_transfer_params or {}).get("pool_blocks_loaded", 0))
    return chunks


SAVE_WAIT_S = 0.5
"""After `PoolReady`, how long the engine's load waits for blocks still being saved."""
_EARLY_TTL_S = 60.0


class Held(NamedTuple):
    """What holding a Generate for its prefill (`PoolWait.hold`) came to."""
    pool_wait: tuple[int, float] | None
    """The engine's pool wait: blocks and the seconds it may wait for them."""
    seconds: float
    first_token: int | None
    """The prefill's first token (`PoolReady`): the engine's first is made it."""


def _pool_wait(request: worker_pb2.PrefillRequest | worker_pb2.GenerateRequest
               ) -> tuple[int, float] | None:
    if not request.HasField("pool_wait"):
        return None
    return request.pool_wait.blocks, request.pool_wait.wait_s


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _progress(stats: dict) -> int:
    """Grows with every lookup and transfer batch: orders two snapshots of one engine."""
    return stats.get("lookups", 0) + stats.get("save_batches", 0) + stats.get("load_batches", 0)


def pool_stats(stats: dict) -> worker_pb2.PoolStats:
    """The connector's `pool_stats` (`PoolConnector.stats`) on the wire."""
    from store.kv_transfer import LATENCY_BOUNDS_S

    fields = worker_pb2.PoolStats.DESCRIPTOR.fields
    counters = {f.name: (float if f.type == f.TYPE_DOUBLE else int)(stats.get(f.name, 0))
                for f in fields if f.type != f.TYPE_MESSAGE}
    out = worker_pb2.PoolStats(**counters)
    for name in ("save", "load"):
        buckets = stats.get(f"{name}_buckets") or ()
        getattr(out, name).CopyFrom(worker_pb2.LatencyHistogram(
            bounds=LATENCY_BOUNDS_S if buckets else (), counts=buckets,
            sum_seconds=stats.get(f"{name}_seconds", 0.0),
            count=stats.get(f"{name}_batches", 0)))
    return out


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, instance_id: str, role: str) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.role = role
        self.prefills = 0
        self.generates = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.aborted_total = 0
        self.pool_stats: dict | None = None
        """The latest of the connector's cumulative counters finished requests carried out."""
        self.registration = b""
        """What the worker registered in etcd (`InstanceInfo` JSON), reported by `Stats`:
        the conductor routes to it only once that equals the registration it read."""
        self.on_retire: Callable[[], None] | None = None
        """Called by `Retire`: starts the process's ordered shutdown."""
        self._held: dict[str, asyncio.Event] = {}
        """Generate requests held for their prefill (`PoolWait.hold`), by request id."""
        self._ready: dict[str, asyncio.Event] = {}
        self._early: dict[str, float] = {}
        """`PoolReady`s that came before their Generate, and when."""
        self._first: dict[str, int] = {}
        """First tokens `PoolReady` brought, by request id, until their Generate takes them."""

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillReply:
        received = time.time()
        rid = request.request_id
        log.info("prefill_start", request_id=rid, prompt_tokens=len(request.token_ids))
        self.prefills += 1
        try:
            params = sampling_params(request.params) if request.HasField("params") else None
            res = await self.engine.prefill(rid, list(request.token_ids), request.cache_salt,
                                            _pool_wait(request), params)
        except _client_errors() as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:
            await self._aborted(rid, "prefill")
            raise
        finally:
            self.prefills -= 1
        self._count(res.num_prompt_tokens, res.num_cached_tokens)
        self._note_pool(res.pool_stats)
        log.info("prefill_done", request_id=rid, cached_tokens=res.num_cached_tokens,
                 blocks_saved=res.blocks_saved, blocks_in_pool=res.blocks_in_pool,
                 seconds=round(res.engine_seconds, 4))
        reply = worker_pb2.PrefillReply(
            num_prompt_tokens=res.num_prompt_tokens,
            num_cached_tokens=res.num_cached_tokens,
            blocks_saved=res.blocks_saved,
            blocks_in_pool=res.blocks_in_pool,
            engine_seconds=res.engine_seconds,
            times=engine_times(res.output, received),
        )
        if params is not None:  # the token the decode beside it will sample first
            reply.first.CopyFrom(_chunks(res.output, True)[0])
        return reply

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateChunk]:
        received = time.time()
        rid = request.request_id
        try:
            params = sampling_params(request.params)
        except _client_errors() as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("generate_start", request_id=rid, prompt_tokens=len(request.token_ids))
        self.generates += 1
        first = True
        cached = 0
        try:
            held = await self._hold(request)
            outs = self.engine.generate(rid, list(request.token_ids), params,
                                        request.cache_salt, held.pool_wait, held.first_token)
            async with contextlib.aclosing(outs):
                async for out in outs:
                    if first:
                        cached = out.num_cached_tokens or 0
                        self._count(len(request.token_ids), cached)
                    chunks = _chunks(out, first)
                    if out.finished:
                        ktp = out.kv_transfer_params or {}
                        self._note_pool(ktp.get("pool_stats"))
                        # vLLM counts a load's promised blocks as cached even when they did
                        # not arrive (recomputed): the last chunk says what really was
                        failed = int(ktp.get("pool_blocks_load_failed", 0))
                        chunks[-1].num_cached_tokens = max(
                            cached - failed * self.engine.config.block_size, 0)
                    if first or out.finished:
                        times = engine_times(out, received)
                        times.held = held.seconds
                        chunks[-1 if out.finished else 0].times.CopyFrom(times)
                    for chunk in chunks:
                        yield chunk
                    first = False
        except _client_errors() as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away: cancelled while the engine worked, or closed while this
            # generator waited at a yield. Either way the engine request is aborted now.
            await self._aborted(rid, "generate")
            raise
        finally:
            self.generates -= 1
            log.info("generate_end", request_id=rid)

    async def _hold(self, request: worker_pb2.GenerateRequest) -> Held:
        """A request whose prefill runs elsewhere (`PoolWait.hold`) stays out of the engine
        until `PoolReady` or its `wait_s`; then the engine waits for the blocks still being
        saved for what is left of `wait_s`, at least `SAVE_WAIT_S` (none, after a timeout: it
        computes what is missing)."""
        wait = _pool_wait(request)
        if wait is None or not request.pool_wait.hold:
            return Held(wait, 0.0, None)
        blocks, wait_s = wait
        rid = request.request_id
        self._early.pop(rid, None)
        ready = self._ready.pop(rid, None) or asyncio.Event()
        self._held[rid] = ready
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(wait_s):
                await ready.wait()
        except TimeoutError:
            log.info("pool_hold_timeout", request_id=rid, waited_s=wait_s)
        finally:
            self._held.pop(rid, None)
        held = time.monotonic() - t0
        # after `PoolReady` the blocks may still be on their way (the prefill engine saves in
        # the background): the rest of the bound, and at least `SAVE_WAIT_S`, for them
        save_wait = max(SAVE_WAIT_S, wait_s - held) if ready.is_set() else 0.0
        return Held((blocks, save_wait), held, self._first.pop(rid, None))

    async def PoolReady(self, request: worker_pb2.PoolReadyRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.PoolReadyReply:
        if request.HasField("first_token"):
            self._first[request.request_id] = request.first_token
        held = self._held.get(request.request_id)
        if held is not None:
            held.set()
            return worker_pb2.PoolReadyReply(found=True)
        # ahead of its Generate (or after it gave up): remembered for a while
        now = time.monotonic()
        for rid, at in list(self._early.items()):
            if now - at > _EARLY_TTL_S:
                del self._early[rid]
                self._ready.pop(rid, None)
                self._first.pop(rid, None)
        ready = asyncio.Event()
        ready.set()
        self._ready[request.request_id] = ready
        self._early[request.request_id] = now
        return worker_pb2.PoolReadyReply(found=False)

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.AbortReply:
        await self.engine.abort(request.request_id)
        return worker_pb2.AbortReply(found=True)

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(
            instance_id=self.instance_id,
            role=self.role,
            running=self.engine.running(),
            prefills_in_flight=self.prefills,
            generates_in_flight=self.generates,
            requests_total=self.requests_total,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            aborted_total=self.aborted_total,
            waiting=int(self.engine.load.get("waiting", 0)),
            kv_usage=float(self.engine.load.get("kv_usage", 0.0)),
            pool=pool_stats(self.pool_stats) if self.pool_stats is not None else None,
            registration=self.registration,
        )

    async def Retire(self, request: worker_pb2.RetireRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.RetireReply:
        log.info("retire_requested", reason=request.reason)
        if self.on_retire is not None:
            asyncio.get_running_loop().call_soon(self.on_retire)
        return worker_pb2.RetireReply(instance_id=self.instance_id)

    async def SetStepTarget(self, request: worker_pb2.StepTargetRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.StepTargetReply:
        if not request.step_ms > 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"step_ms must be positive, got {request.step_ms}")
        now = await self.engine.set_step_target(request.step_ms)
        if now is None:
            return worker_pb2.StepTargetReply(applied=False)
        log.info("step_target_set", step_ms=now)
        return worker_pb2.StepTargetReply(applied=True, step_ms=now)

    async def KvEvents(self, request: worker_pb2.KvEventsRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        relay = self.engine.relay
        if relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are off (--kv-events)")
        async for batch in relay.stream():
            yield batch

    async def _aborted(self, request_id: str, stage: str) -> None:
        """Free the engine request now (idempotent) and count it."""
        self.aborted_total += 1
        log.info("request_aborted", request_id=request_id, stage=stage)
        await self.engine.abort(request_id)

    def _note_pool(self, stats: dict | None) -> None:
        """Keep the newest snapshot (requests finishing together may be handled out of order)."""
        if stats and (self.pool_stats is None or _progress(stats) >= _progress(self.pool_stats)):
            self.pool_stats = stats

    def _count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.cached_tokens_total += cached_tokens
