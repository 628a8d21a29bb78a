"""The gRPC `Worker` service over one engine."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from protos import worker_pb2, worker_pb2_grpc
from worker.engine import Engine

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


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _progress(stats: dict) -> int:
    """Grows with every lookup and transfer batch: orders two snapshots of one engine."""
    return stats.get("lookups", 0) + stats.get("save_batches", 0) + stats.get("load_batches", 0)


def pool_stats(stats: dict) -> worker_pb2.PoolStats:
    """The connector's `pool_stats` (`PoolConnector.stats`) on the wire."""
    from store.kv_transfer import LATENCY_BOUNDS_S

    counters = {f.name: int(stats.get(f.name, 0)) for f in worker_pb2.PoolStats.DESCRIPTOR.fields
                if f.type != f.TYPE_MESSAGE}
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
        self._pool = None
        self.pool_stats: dict | None = None
        """The latest of the connector's cumulative counters finished requests carried out."""
        self.on_retire: Callable[[], None] | None = None
        """Called by `Retire`: starts the process's ordered shutdown."""

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillReply:
        rid = request.request_id
        log.info("prefill_start", request_id=rid, prompt_tokens=len(request.token_ids))
        self.prefills += 1
        try:
            res = await self.engine.prefill(rid, list(request.token_ids), request.cache_salt)
        except _client_errors() as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:
            await self._aborted(rid, "prefill")
            raise
        finally:
            self.prefills -= 1
        self._count(res.num_prompt_tokens, res.num_cached_tokens)
        self._note_pool(res.pool_stats)
        in_pool = await asyncio.to_thread(self._count_in_pool, res.block_keys, res.blocks_saved)
        log.info("prefill_done", request_id=rid, cached_tokens=res.num_cached_tokens,
                 blocks_saved=res.blocks_saved, blocks_in_pool=in_pool,
                 seconds=round(res.engine_seconds, 4))
        return worker_pb2.PrefillReply(
            num_prompt_tokens=res.num_prompt_tokens,
            num_cached_tokens=res.num_cached_tokens,
            blocks_saved=res.blocks_saved,
            blocks_in_pool=in_pool,
            engine_seconds=res.engine_seconds,
        )

    def _count_in_pool(self, keys: tuple[str, ...], saved: int) -> int:
        """How long a prefix of the prompt's blocks the pool holds (an independent check),
        once the engine's background saves of the `saved` blocks are readable (bounded wait).
        The conductor's index follows it, so a chain the pool evicted is corrected here."""
        if not keys:
            return 0
        from store.pool import MooncakePool, PoolConfig, PoolError, wait_present

        c = self.engine.config
        try:
            if self._pool is None:
                self._pool = MooncakePool(PoolConfig(master_addr=c.pool_master,
                                                     metadata_url=c.pool_metadata,
                                                     segment_bytes=0))
            return wait_present(self._pool, keys, saved)
        except PoolError as e:  # construction failed: the master is down; retried next time
            log.warning("pool_check_failed", error=str(e))
            return 0

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateChunk]:
        rid = request.request_id
        try:
            params = sampling_params(request.params)
        except _client_errors() as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("generate_start", request_id=rid, prompt_tokens=len(request.token_ids))
        self.generates += 1
        first = True
        outs = self.engine.generate(rid, list(request.token_ids), params, request.cache_salt)
        try:
            async with contextlib.aclosing(outs):
                async for out in outs:
                    if first:
                        self._count(len(request.token_ids), out.num_cached_tokens or 0)
                    if out.finished:
                        self._note_pool((out.kv_transfer_params or {}).get("pool_stats"))
                    for chunk in _chunks(out, first):
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
            pool=pool_stats(self.pool_stats) if self.pool_stats is not None else None,
        )

    async def Retire(self, request: worker_pb2.RetireRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.RetireReply:
        log.info("retire_requested", reason=request.reason)
        if self.on_retire is not None:
            asyncio.get_running_loop().call_soon(self.on_retire)
        return worker_pb2.RetireReply(instance_id=self.instance_id)

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
