"""Our vLLM KV connector: every full prompt block goes to the Mooncake Store pool, and a
request's longest prefix present in the pool is loaded back into vLLM's paged KV cache.

Loaded by vLLM through `KVTransferConfig(kv_connector="PoolConnector",
kv_connector_module_path="store.connector", kv_connector_extra_config={...})`; the extra
config is `ConnectorSettings` below. Roles: `kv_producer` saves, `kv_consumer` loads,
`kv_both` does both.

The scheduler-side half decides what to load and save (block hashes from
`store.block_hash`, the scheme the conductor's index uses too); the worker-side half moves
bytes. One pool object holds one block of every layer (layers in model order, each layer's
block slice in its logical order), so the object is independent of how the backend lays a
block out inside a layer: a block is copied whole, never split into K and V.

Data path (`BlockLayout`, `KVTransfer`): the paged KV cache is registered with the store client
once, and blocks move between it and the pool with `put_from`/`get_into` (Mooncake's
`batch_put_from_multi_buffers`/`batch_get_into_multi_buffers`): no Python-level copy. Saves run
on a background thread (`_Saver`), after a `batch_is_exist` that skips blocks already pooled,
so a shared prefix is written once cluster-wide; a finished request's blocks stay allocated
(`request_finished` answers "delay free") until its saves are done (`get_finished`). Loads are
synchronous, before the forward pass that needs them.

The pool failing never fails a request: a save that cannot be made is skipped and counted, a
load that cannot be made is reported to vLLM as invalid blocks, which vLLM then recomputes
(`kv_load_failure_policy="recompute"`), and counted. Counters: `KVTransfer.stats`, reported in
every finished request's `kv_transfer_params["pool_stats"]`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from store.block_hash import block_hashes, block_key
from store.pool import MooncakePool, PoolConfig, PoolError, ZeroCopyPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)

_RETRY_CONNECT_S = 5.0
_PREEMPT_WAIT_S = 30.0


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config` of the connector; unknown keys are errors."""

    master_addr: str
    """Mooncake master RPC address, host:port."""
    metadata_url: str
    """Mooncake metadata server, e.g. http://127.0.0.1:8080/metadata or P2PHANDSHAKE."""
    namespace: str
    """Prefix of every object key: the model and KV layout, so models never share blocks."""
    segment_bytes: int = 256 << 20
    """Memory this client contributes to the pool."""
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""
    op_timeout_s: float = 5.0
    """A pool call giving no sign of progress for this long counts as the pool being down."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        return cls(**extra)

    def pool_config(self) -> PoolConfig:
        return PoolConfig(
            master_addr=self.master_addr,
            metadata_url=self.metadata_url,
            segment_bytes=self.segment_bytes,
            local_buffer_bytes=self.local_buffer_bytes,
            protocol=self.protocol,
            rdma_devices=self.rdma_devices,
            op_timeout_s=self.op_timeout_s,
        )


class _SharedPool:
    """One pool client per process, shared by the connector instances living there. Creating
    the client is lazy and retried, so a store master that is down at start-up degrades to
    recompute; once created, the client rides out master restarts by itself (it must not be
    dropped and recreated: an abandoned Mooncake client keeps its segment until exit).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._pool: MooncakePool | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def get(self) -> MooncakePool | None:
        with self._lock:
            if self._pool is None and time.monotonic() >= self._next_try:
                try:
                    self._pool = MooncakePool(self.settings.pool_config())
                except PoolError as e:
                    self._next_try = time.monotonic() + _RETRY_CONNECT_S
                    log.warning("pool_unavailable", error=str(e), fallback="recompute")
            return self._pool


_POOLS: dict[ConnectorSettings, _SharedPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(settings: ConnectorSettings) -> _SharedPool:
    with _POOLS_LOCK:
        return _POOLS.setdefault(settings, _SharedPool(settings))


# ---------------------------------------------------------------------------------- data path


@dataclass(frozen=True)
class BlockLayout:
    """Where every block of a paged KV cache lives in memory, for any backend's layout.

    Per layer, the dimension that indexes blocks is found by size (`_block_dim`); block `b` of
    a layer starts `b * stride` bytes after block 0, and block 0's slice is cut into the fewest
    contiguous pieces (one on CPU, where the block dim is first; K and V apart for
    FlashAttention's [2, num_blocks, ...]). A block's object is the concatenation of those
    pieces over all layers, in layer order, i.e. `torch.cat([t.select(d, b).flatten()...])`.
    """

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int], ...], ...]
    """Per layer, (offset from the block's start, nbytes) of each contiguous piece."""
    regions: tuple[tuple[int, int], ...]
    """(address, nbytes) of the memory to register: the layers' storages, merged."""
    num_blocks: int
    device: str

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], num_blocks: int) -> BlockLayout:
        if not layers:
            raise ValueError("no KV cache layers")
        bases, strides, pieces, spans = [], [], [], []
        for t in layers:
            d = _block_dim(t, num_blocks)
            es = t.element_size()
            block0 = t.select(d, 0)
            base = block0.data_ptr()
            bases.append(base)
            strides.append(t.stride(d) * es)
            pieces.append(tuple((a - base, n) for a, n in _contiguous_pieces(block0)))
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.nbytes()))
        return cls(tuple(bases), tuple(strides), tuple(pieces), _merge(spans), num_blocks,
                   layers[0].device.type)

    @property
    def block_nbytes(self) -> int:
        return sum(n for layer in self.pieces for _, n in layer)

    def ranges(self, block_id: int) -> list[tuple[int, int]]:
        """(address, nbytes) pieces of one block's object, in object order."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of [0, {self.num_blocks})")
        return [
            (base + block_id * stride + off, n)
            for base, stride, layer in zip(self.bases, self.strides, self.pieces, strict=True)
            for off, n in layer
        ]


def _contiguous_pieces(t: torch.Tensor) -> list[tuple[int, int]]:
    """(address, nbytes) runs covering `t` in logical order; adjacent runs merged."""
    if t.is_contiguous():
        runs = [(t.data_ptr(), t.numel() * t.element_size())]
    else:
        runs = [r for i in range(t.shape[0]) for r in _contiguous_pieces(t[i])]
    merged: list[tuple[int, int]] = []
    for a, n in runs:
        if merged and merged[-1][0] + merged[-1][1] == a:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((a, n))
    return merged


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, n in sorted(spans):
        if out and a <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], a + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((a, n))
    return tuple(out)


@dataclass
class TransferStats:
    """Cumulative counters of one process's KV transfers (blocks, bytes, seconds)."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_deduplicated: int = 0
    """Blocks a save found already in the pool (written by anyone, any time) and skipped."""
    save_skipped_full: int = 0
    save_failed: int = 0
    """Blocks not saved for any other reason: pool unavailable, errors."""
    save_batches: int = 0
    save_seconds: float = 0.0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_failed: int = 0
    """Blocks whose load failed after the lookup promised them: vLLM recomputes them."""
    load_batches: int = 0
    load_seconds: float = 0.0

    def add(self, other: TransferStats) -> TransferStats:
        return TransferStats(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


@dataclass(frozen=True)
class SaveResult:
    written: int
    deduplicated: int
    full: int
    failed: int


class KVTransfer:
    """Moves whole blocks between a registered paged KV cache and a `ZeroCopyPool`: the one
    data path of the connector (and of `benchmarks.bench_kv`). Thread-safe; never raises for
    pool trouble (results say what happened, `stats` counts it)."""

    def __init__(self, layout: BlockLayout, pool: Callable[[], ZeroCopyPool | None]) -> None:
        self.layout = layout
        self._pool_source = pool
        self._registered: ZeroCopyPool | None = None
        self._lock = threading.Lock()
        self.stats = TransferStats()

    def _pool(self) -> ZeroCopyPool | None:
        pool = self._pool_source()
        if pool is None:
            return None
        with self._lock:
            if self._registered is not pool:
                try:
                    for addr, nbytes in self.layout.regions:
                        pool.register_memory(addr, nbytes)
                except PoolError as e:
                    log.warning("kv_register_failed", error=str(e), fallback="recompute")
                    return None
                self._registered = pool
        return pool

    def connect(self) -> bool:
        """Join the pool and register the cache, if the pool can be reached now."""
        return self._pool() is not None

    def save(self, keys: Sequence[str], block_ids: Sequence[int]) -> SaveResult:
        """Write the blocks the pool does not hold yet."""
        t0 = time.perf_counter()
        pool = self._pool()
        n = len(keys)
        if pool is None:
            return self._count_save(SaveResult(0, 0, 0, n), 0, t0)
        present = pool.exists(list(keys)) if n else []
        todo = [i for i in range(n) if not present[i]]
        if not todo:
            return self._count_save(SaveResult(0, n, 0, 0), 0, t0)
        report = pool.put_from([keys[i] for i in todo],
                               [self.layout.ranges(block_ids[i]) for i in todo])
        result = SaveResult(report.written, n - len(todo), report.full,
                            report.failed + report.unavailable)
        return self._count_save(result, report.written * self.layout.block_nbytes, t0)

    def _count_save(self, r: SaveResult, nbytes: int, t0: float) -> SaveResult:
        with self._lock:
            s = self.stats
            s.blocks_written += r.written
            s.bytes_written += nbytes
            s.blocks_deduplicated += r.deduplicated
            s.save_skipped_full += r.full
            s.save_failed += r.failed
            s.save_batches += 1
            s.save_seconds += time.perf_counter() - t0
        return r

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        """Read blocks into the cache; False where a block did not arrive whole (its memory
        then holds garbage and must be recomputed)."""
        t0 = time.perf_counter()
        pool = self._pool()
        if pool is None or not keys:
            ok = [False] * len(keys)
        else:
            ok = pool.get_into(list(keys), [self.layout.ranges(b) for b in block_ids])
        loaded = sum(ok)
        with self._lock:
            s = self.stats
            s.blocks_loaded += loaded
            s.bytes_loaded += loaded * self.layout.block_nbytes
            s.load_failed += len(ok) - loaded
            s.load_batches += 1
            s.load_seconds += time.perf_counter() - t0
        return ok

    def count_deduplicated(self, blocks: int) -> None:
        """Blocks a caller skipped because another save of the same batch covers them."""
        with self._lock:
            self.stats.blocks_deduplicated += blocks

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(**asdict(self.stats))


class _Saver:
    """The background thread that saves blocks. Jobs queued together are written as one batch
    (a shared prefix queued twice is written once). `pending(req)` is how many of a request's
    jobs are not finished; its blocks must stay allocated until it is 0."""

    def __init__(self, transfer: KVTransfer) -> None:
        self.transfer = transfer
        self._queue: queue.SimpleQueue[list[BlockTransfer] | None] = queue.SimpleQueue()
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-saver", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[BlockTransfer]) -> None:
        if not jobs:
            return
        with self._cond:
            for job in jobs:
                self._pending[job.request_id] = self._pending.get(job.request_id, 0) + 1
        self._queue.put(jobs)

    def pending(self, request_id: str) -> int:
        with self._cond:
            return self._pending.get(request_id, 0)

    def wait_idle(self, request_ids: set[str] | None, timeout: float) -> bool:
        """Until the given requests' (None: all) saves are done, or the timeout."""
        def done() -> bool:
            if request_ids is None:
                return not self._pending
            return not any(r in self._pending for r in request_ids)
        with self._cond:
            return self._cond.wait_for(done, timeout)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            jobs = list(batch)
            stop = False
            while True:  # everything queued meanwhile joins this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.extend(more)
            seen: dict[str, int] = {}
            for job in jobs:
                for key, block_id in zip(job.keys, job.block_ids, strict=True):
                    seen.setdefault(key, block_id)
            dupes = sum(len(j.keys) for j in jobs) - len(seen)
            try:
                self.transfer.save(list(seen), list(seen.values()))
                self.transfer.count_deduplicated(dupes)
            except Exception:  # a bug must not kill the thread and pin blocks forever
                log.exception("kv_save_crashed", blocks=len(seen))
            with self._cond:
                for job in jobs:
                    left = self._pending[job.request_id] - 1
                    if left:
                        self._pending[job.request_id] = left
                    else:
                        del self._pending[job.request_id]
                self._cond.notify_all()
            if stop:
                return


# ---------------------------------------------------------------------------------- connector


@dataclass(frozen=True)
class BlockTransfer:
    """Move whole blocks between the pool (by key) and the paged cache (by block id)."""

    request_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class PoolWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: blocks whose load failed per request, and the
    worker's cumulative transfer counters."""

    load_failed: dict[str, int] = field(default_factory=dict)
    stats: TransferStats = field(default_factory=TransferStats)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PoolWorkerMetadata)
        failed = dict(self.load_failed)
        for req, n in other.load_failed.items():
            failed[req] = failed.get(req, 0) + n
        return PoolWorkerMetadata(failed, self.stats.add(other.stats))


@dataclass
class _Tracked:
    """Scheduler-side view of one request."""

    keys: list[str]
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    loaded_blocks: int = 0
    load_failed: int = 0
    load_from_block: int = 0
    """First block of the external hit: the block-aligned local hit vLLM reported."""


@dataclass
class LookupStats:
    """Scheduler-side counters."""

    lookups: int = 0
    lookup_blocks_hit: int = 0
    lookup_misses: int = 0
    """Lookups that wanted blocks and found fewer than wanted (a shorter or no prefix)."""
    lookup_unavailable: int = 0
    """Lookups made without the pool (down or unreachable): computed from scratch."""


class PoolConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._settings = ConnectorSettings.from_extra(dict(ktc.kv_connector_extra_config))
        self._pool = shared_pool(self._settings)
        self._block_size = vllm_config.cache_config.block_size
        self._saves = bool(ktc.is_kv_producer)
        self._loads = bool(ktc.is_kv_consumer)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._lookup = LookupStats()
        self._worker_stats = TransferStats()
        # worker side
        self._transfer: KVTransfer | None = None
        self._saver: _Saver | None = None
        self._saving: set[str] = set()
        """Requests with saves submitted and not yet reported finished."""
        self._finishing: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._load_failed: dict[str, int] = {}

    # ------------------------------------------------------------------ scheduler side

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            hashes = block_hashes(request.prompt_token_ids or [], self._block_size,
                                  request.cache_salt)
            keys = [block_key(self._settings.namespace, h) for h in hashes]
            tracked = self._tracked[request.request_id] = _Tracked(keys=keys)
        return tracked

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        if not self._loads:
            return 0, False
        # vLLM must compute at least the prompt's last token: never load the block holding it.
        usable = (request.num_prompt_tokens - 1) // self._block_size
        first = num_computed_tokens // self._block_size
        tracked.load_from_block = first
        if usable <= first:
            return 0, False
        self._lookup.lookups += 1
        pool = self._pool.get()
        if pool is None or not pool.healthy():
            self._lookup.lookup_unavailable += 1
            return 0, False
        try:
            present = pool.exists(tracked.keys[first:usable])
        except PoolError as e:
            log.warning("pool_lookup_failed", request_id=request.request_id, error=str(e))
            self._lookup.lookup_unavailable += 1
            return 0, False
        hit = 0
        for ok in present:
            if not ok:
                break
            hit += 1
        self._lookup.lookup_blocks_hit += hit
        if hit < usable - first:
            self._lookup.lookup_misses += 1
        return hit * self._block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._track(request)
        block_ids = list(blocks.get_block_ids()[0])
        tracked.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        first = tracked.load_from_block
        count = num_external_tokens // self._block_size
        tracked.loaded_blocks = count
        self._pending_loads.append(
            BlockTransfer(
                request_id=request.request_id,
                keys=tuple(tracked.keys[first : first + count]),
                block_ids=tuple(block_ids[first : first + count]),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PoolConnectorMetadata(loads=self._pending_loads,
                                     preempted=set(scheduler_output.preempted_req_ids or ()))
        self._pending_loads = []
        if not self._saves:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._plan_save(meta, new.req_id, tracked, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_save(meta, req_id, tracked, done)
        return meta

    def _plan_save(
        self, meta: PoolConnectorMetadata, req_id: str, tracked: _Tracked, done_tokens: int
    ) -> None:
        """Save the prompt's full blocks whose every token is computed by the end of this step."""
        upto = min(done_tokens // self._block_size, len(tracked.keys), len(tracked.block_ids))
        if upto <= tracked.saved_blocks:
            return
        lo = tracked.saved_blocks
        meta.saves.append(
            BlockTransfer(
                request_id=req_id,
                keys=tuple(tracked.keys[lo:upto]),
                block_ids=tuple(tracked.block_ids[lo:upto]),
            )
        )
        tracked.saved_blocks = upto

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, PoolWorkerMetadata):
            return
        self._worker_stats = meta.stats
        for req_id, n in meta.load_failed.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.load_failed += n

    def stats(self) -> dict[str, int | float]:
        """Scheduler lookups plus the worker's transfer counters (as of its last step)."""
        return {**asdict(self._lookup), **asdict(self._worker_stats)}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delays freeing the blocks of a request with saves planned: the worker reports it in
        `get_finished` once they are written (or given up)."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        delay = self._saves and tracked.saved_blocks > 0
        return delay, {
            "pool_blocks_saved": tracked.saved_blocks,
            "pool_blocks_loaded": tracked.loaded_blocks - tracked.load_failed,
            "pool_blocks_load_failed": tracked.load_failed,
            "pool_block_keys": tracked.keys,
            "pool_stats": self.stats(),
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = BlockLayout.of(list(kv_caches.values()), self._kv_cache_config.num_blocks)
        self._transfer = KVTransfer(layout, self._pool.get)
        self._transfer.connect()  # join the pool and register the cache now, not mid-request
        if self._saves:
            self._saver = _Saver(self._transfer)
        first = next(iter(kv_caches.values()))
        log.info("kv_caches_registered", layers=len(kv_caches), shape=tuple(first.shape),
                 block_dim=_block_dim(first, layout.num_blocks), device=layout.device,
                 block_bytes=layout.block_nbytes, pieces_per_block=len(layout.ranges(0)))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: BlockTransfer) -> None:
        assert self._transfer is not None
        ok = self._transfer.load(load.keys, load.block_ids)
        failed = [b for b, good in zip(load.block_ids, ok, strict=True) if not good]
        if failed:
            self._invalid_blocks.update(failed)
            self._load_failed[load.request_id] = (
                self._load_failed.get(load.request_id, 0) + len(failed))
            log.warning("pool_load_partial", request_id=load.request_id,
                        loaded=len(ok) - len(failed), wanted=len(ok), fallback="recompute")

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        """Hands this step's saves to the saver thread and returns: the forward pass never
        waits for the pool."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        # Every request with saves planned is one the scheduler delays: it must be reported.
        self._saving.update(s.request_id for s in meta.saves)
        if not meta.saves or self._saver is None:
            return
        if self._transfer is not None and self._transfer.layout.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the blocks must be computed
        self._saver.submit(list(meta.saves))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted request's blocks are freed at once: finish its saves first."""
        assert isinstance(kv_connector_metadata, PoolConnectorMetadata)
        busy = kv_connector_metadata.preempted & self._saving
        if busy and self._saver is not None:
            if not self._saver.wait_idle(busy, _PREEMPT_WAIT_S):
                log.error("kv_save_preempt_wait_timeout", requests=sorted(busy))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finishing |= finished_req_ids & self._saving
        if not self._finishing:
            return None, None
        saver = self._saver
        done = {r for r in self._finishing if saver is None or not saver.pending(r)}
        self._finishing -= done
        self._saving -= done
        return done or None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._transfer is None:
            return None
        failed, self._load_failed = self._load_failed, {}
        return PoolWorkerMetadata(failed, self._transfer.snapshot())

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.wait_idle(None, self._settings.op_timeout_s)
            self._saver.stop()


def _block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a per-layer KV tensor that indexes blocks (0 on CPU, 1 for
    FlashAttention's [2, num_blocks, ...]): the first whose size is the block count."""
    for d, size in enumerate(t.shape):
        if size == num_blocks:
            return d
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV shape {tuple(t.shape)}")
