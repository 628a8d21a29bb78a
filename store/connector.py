"""Our vLLM KV connector: every full block of a request (its prompt's, then those its generated
tokens fill) goes to the Mooncake Store pool, and a request's longest prefix present in the
pool is loaded back into vLLM's paged KV cache.

Loaded by vLLM through `KVTransferConfig(kv_connector="PoolConnector",
kv_connector_module_path="store.connector", kv_connector_extra_config={...})`; the extra
config is `ConnectorSettings` below. Roles: `kv_producer` saves, `kv_consumer` loads,
`kv_both` does both.

The scheduler-side half decides what to load and save (block hashes from
`store.block_hash`, the scheme the conductor's index uses too); the worker-side half moves
bytes. One pool object holds one block of every layer (layers in model order, each layer's
block slice in its logical order), so the object is independent of how the backend lays a
block out inside a layer: a block is copied whole, never split into K and V.

Data path (`store.kv_transfer`): the paged KV cache is registered with the store client
once, and blocks move between it and the pool with `put_from`/`get_into` (Mooncake's
`batch_put_from_multi_buffers`/`batch_get_into_multi_buffers`): no Python-level copy. Saves run
on a background thread (`_Saver`), after a `batch_is_exist` that skips blocks already pooled,
so a shared prefix is written once cluster-wide; a finished request's blocks stay allocated
(`request_finished` answers "delay free") until its saves are done (`get_finished`). Loads are
synchronous, before the forward pass that needs them.

Generated blocks (`save_generated`, issue 8) are what a stream that migrates after its decode
instance died needs: the continuation's prompt is the prompt plus the tokens sent, whose chained
hashes are those of the blocks the dead instance filled, so the new instance loads them and
recomputes only the last partial block. A block is planned in the step whose forward pass
writes its last token and handed to the saver after that pass (`wait_for_save`), like a prompt
block; its hash chains on from the prompt's over `Request.all_token_ids`.
Where they live: prompt blocks go to the writer's own segment (`prefer_local_segment`), but a
generated block there would die with exactly the instance whose death it is for. Generated
blocks go to the segment holding the request's last full prompt block instead (asked of the
master, `ZeroCopyPool.segment_of`): in the disaggregated flow that is the prefill instance
that wrote the prompt, and the continuation needs the prompt's blocks and the generated ones
together, so the chain depends on one segment, not the dead decoder's. A prompt computed here
(its blocks in our own segment) keeps its generated blocks here too: with us gone the prompt
is gone as well (so does a prompt shorter than a block, which has no block to follow). No
configuration, no extra process, the same on loopback and across nodes; when that segment is
full or gone, Mooncake places the blocks anywhere.

The pool failing never fails a request: a save that cannot be made is skipped and counted, a
load that cannot be made is reported to vLLM as invalid blocks, which vLLM then recomputes
(`kv_load_failure_policy="recompute"`), and counted. Counters: `KVTransfer.stats` (generated
blocks written: `blocks_saved_generated`), reported in every finished request's
`kv_transfer_params["pool_stats"]` (the worker serves the newest in its `Stats` RPC, the
conductor exposes them on /metrics: `conductor/pool_stats.py`).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
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

from store.block_hash import block_key, extend_hashes
from store.kv_transfer import BlockLayout, KVTransfer, TransferStats, block_dim
from store.pool import MooncakePool, PoolConfig, PoolError

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
    prefer_local_segment: bool = True
    """Saves land in this engine's own segment while it has room: a local copy, and the one
    network crossing is the reader's (`PoolConfig.prefer_local_segment`)."""
    load_staging_blocks: int = 0
    """> 0: loads go through a staging buffer of that many blocks (`KVTransfer`): one range per
    object on the wire, then a copy into the cache. 0 (default): straight into the cache."""
    local_host: str = "127.0.0.1"
    """The address other nodes reach this engine's segment at (the worker's advertised host)."""
    store_client: str = ""
    """host:port of this host's standalone `mooncake_client` (`store.master.StoreClientService`):
    the engine becomes a Mooncake dummy client of it, vLLM's KV cache is allocated in shared
    memory that client maps (`get_mem_pool_context`), and saves/loads are memcpys inside it
    instead of TCP transfers (`PoolConfig.store_client`). `segment_bytes` does not apply."""
    store_client_segment: str = ""
    """That client's segment name (`StoreClientService.segment_name`), where saves go."""
    save_generated: bool = True
    """A saving engine also saves the blocks its generated tokens fill, next to the prompt's
    blocks (see the module docstring)."""

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
            prefer_local_segment=self.prefer_local_segment,
            local_host=self.local_host,
            store_client=self.store_client,
            store_client_segment=self.store_client_segment,
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


class _SharedZerosTorch:
    """`torch` for `vllm.v1.worker.utils` while the KV cache is allocated: `zeros` of a 1-D CPU
    int8 buffer comes from the pool's shared memory (memfd pages are zero already)."""

    def __init__(self, pool: MooncakePool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, *size: Any, dtype: Any = None, device: Any = None, **kw: Any) -> torch.Tensor:
        n = size[0] if len(size) == 1 and isinstance(size[0], int) else None
        if (n is None or kw or dtype is not torch.int8
                or torch.device(device or "cpu").type != "cpu"):
            return torch.zeros(*size, dtype=dtype, device=device, **kw)
        addr = self._pool.alloc_shared(n)
        log.info("kv_cache_in_shared_memory", nbytes=n)
        return torch.frombuffer((ctypes.c_int8 * n).from_address(addr), dtype=torch.int8)


@contextmanager
def _kv_cache_in_shared_memory(pool: MooncakePool) -> Iterator[None]:
    import vllm.v1.worker.utils as worker_utils

    saved = worker_utils.torch
    worker_utils.torch = _SharedZerosTorch(pool)  # type: ignore[assignment]
    try:
        yield
    finally:
        worker_utils.torch = saved


_POOLS: dict[ConnectorSettings, _SharedPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(settings: ConnectorSettings) -> _SharedPool:
    with _POOLS_LOCK:
        return _POOLS.setdefault(settings, _SharedPool(settings))


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
            seen: set[str] = set()
            groups: dict[tuple[bool, str | None], dict[str, int]] = {}
            for job in jobs:  # one save per placement
                group = groups.setdefault((job.generated, job.near), {})
                for key, block_id in zip(job.keys, job.block_ids, strict=True):
                    if key not in seen:
                        seen.add(key)
                        group[key] = block_id
            dupes = sum(len(j.keys) for j in jobs) - len(seen)
            try:
                for (generated, near), blocks in groups.items():
                    if blocks:
                        self.transfer.save(list(blocks), list(blocks.values()), near=near,
                                           generated=generated)
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
    generated: bool = False
    """Blocks holding generated tokens (saves only)."""
    near: str | None = None
    """Saves only: the key of a pooled block whose segment these blocks should go to."""


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

    request: Request
    hashes: list[int]
    """Chained hashes of the request's full blocks known so far: the prompt's, then those
    its generated tokens filled (when saving them)."""
    keys: list[str]
    prompt_blocks: int
    """Full blocks of the prompt: `keys[:prompt_blocks]`."""
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    saved_generated: int = 0
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
            hashes = extend_hashes(None, request.prompt_token_ids or [], self._block_size,
                                   request.cache_salt)
            keys = [block_key(self._settings.namespace, h) for h in hashes]
            tracked = self._tracked[request.request_id] = _Tracked(
                request=request, hashes=hashes, keys=keys, prompt_blocks=len(keys))
        return tracked

    def _extend(self, tracked: _Tracked, done_tokens: int) -> None:
        """Hash the blocks generated tokens filled, up to `done_tokens` and the token ids known
        (with async scheduling the last sampled token may not be in `all_token_ids` yet)."""
        tokens = tracked.request.all_token_ids
        full = min(done_tokens, len(tokens)) // self._block_size
        have = len(tracked.hashes)
        if full <= have:
            return
        new = extend_hashes(tracked.hashes[-1] if tracked.hashes else None,
                            tokens[have * self._block_size : full * self._block_size],
                            self._block_size, tracked.request.cache_salt)
        tracked.hashes.extend(new)
        tracked.keys.extend(block_key(self._settings.namespace, h) for h in new)

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
        """Save the full blocks whose every token is computed by the end of this step: the
        prompt's, then (`save_generated`) those generated tokens filled, near the prompt."""
        if self._settings.save_generated:
            self._extend(tracked, done_tokens)
        upto = min(done_tokens // self._block_size, len(tracked.keys), len(tracked.block_ids))
        lo = tracked.saved_blocks
        if upto <= lo:
            return
        split = min(max(lo, tracked.prompt_blocks), upto)
        if split > lo:
            meta.saves.append(BlockTransfer(request_id=req_id,
                                            keys=tuple(tracked.keys[lo:split]),
                                            block_ids=tuple(tracked.block_ids[lo:split])))
        if upto > split:
            near = tracked.keys[tracked.prompt_blocks - 1] if tracked.prompt_blocks else None
            meta.saves.append(BlockTransfer(request_id=req_id,
                                            keys=tuple(tracked.keys[split:upto]),
                                            block_ids=tuple(tracked.block_ids[split:upto]),
                                            generated=True, near=near))
            tracked.saved_generated += upto - split
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
            "pool_blocks_saved_generated": tracked.saved_generated,
            "pool_blocks_loaded": tracked.loaded_blocks - tracked.load_failed,
            "pool_blocks_load_failed": tracked.load_failed,
            "pool_block_keys": tracked.keys[: tracked.prompt_blocks],
            "pool_stats": self.stats(),
        }

    # ------------------------------------------------------------------ worker side

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """With `store_client`: vLLM allocates the KV cache (one CPU int8 buffer,
        `vllm.v1.worker.utils.allocate_kv_cache`) in shared memory of the store client, the only
        memory a Mooncake dummy client can register. Without a pool: vLLM's own allocation (and
        the cache cannot be registered: every load falls back to recompute)."""
        if not self._settings.store_client:
            return None
        pool = self._pool.get()
        if pool is None:
            return None
        return _kv_cache_in_shared_memory(pool)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = BlockLayout.of(list(kv_caches.values()), self._kv_cache_config.num_blocks)
        self._transfer = KVTransfer(layout, self._pool.get,
                                    staging_blocks=self._settings.load_staging_blocks)
        self._transfer.connect()  # join the pool and register the cache now, not mid-request
        if self._saves:
            self._saver = _Saver(self._transfer)
        first = next(iter(kv_caches.values()))
        log.info("kv_caches_registered", layers=len(kv_caches), shape=tuple(first.shape),
                 block_dim=block_dim(first, layout.num_blocks), device=layout.device,
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
