"""Our vLLM KV connector: every full prompt block goes to the Mooncake Store pool, and a
request's longest prefix present in the pool is loaded back into vLLM's paged KV cache.

Loaded by vLLM through `KVTransferConfig(kv_connector="PoolConnector",
kv_connector_module_path="store.connector", kv_connector_extra_config={...})`; the extra
config is `ConnectorSettings` below. Roles: `kv_producer` saves, `kv_consumer` loads,
`kv_both` does both.

The scheduler-side half decides what to load and save (block hashes from
`store.block_hash`, the scheme the conductor's index uses too); the worker-side half moves
bytes. One pool object holds one block of every layer (layers in model order), so the
object is independent of how the backend lays a block out inside a layer: a block is copied
whole, never split into K and V. The pool failing never fails a request: a save that
cannot be made is skipped, a load that cannot be made is reported to vLLM as invalid blocks,
which vLLM then recomputes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from store.block_hash import block_hashes, block_key
from store.pool import KVPool, MooncakePool, PoolConfig, PoolError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)

_RETRY_CONNECT_S = 5.0


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
        )


class _SharedPool:
    """One pool client per process, shared by the connector instances living there. Creating
    the client is lazy and retried, so a store master that is down at start-up degrades to
    recompute; once created, the client rides out master restarts by itself (it must not be
    dropped and recreated: an abandoned Mooncake client keeps its segment until exit).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._pool: KVPool | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def get(self) -> KVPool | None:
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


@dataclass
class _Tracked:
    """Scheduler-side view of one request."""

    keys: list[str]
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    loaded_blocks: int = 0
    load_from_block: int = 0
    """First block of the external hit: the block-aligned local hit vLLM reported."""


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
        # worker side
        self._layers: list[torch.Tensor] = []
        self._block_dim: list[int] = []
        self._invalid_blocks: set[int] = set()

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
        pool = self._pool.get()
        if pool is None:
            return 0, False
        try:
            present = pool.exists(tracked.keys[first:usable])
        except PoolError as e:
            log.warning("pool_lookup_failed", request_id=request.request_id, error=str(e))
            return 0, False
        hit = 0
        for ok in present:
            if not ok:
                break
            hit += 1
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
        meta = PoolConnectorMetadata(loads=self._pending_loads)
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

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        return False, {
            "pool_blocks_saved": tracked.saved_blocks,
            "pool_blocks_loaded": tracked.loaded_blocks,
            "pool_block_keys": tracked.keys,
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._layers = list(kv_caches.values())
        self._block_dim = [_block_dim(t, num_blocks) for t in self._layers]
        log.info(
            "kv_caches_registered",
            layers=len(self._layers),
            shape=tuple(self._layers[0].shape) if self._layers else None,
            block_dim=self._block_dim[0] if self._layers else None,
            block_bytes=self._block_nbytes(),
        )

    def _block_nbytes(self) -> int:
        return sum(
            t.select(d, 0).numel() * t.element_size()
            for t, d in zip(self._layers, self._block_dim, strict=True)
        )

    def _read_block(self, block_id: int) -> bytes:
        parts = [
            t.select(d, block_id).contiguous().view(torch.uint8).reshape(-1)
            for t, d in zip(self._layers, self._block_dim, strict=True)
        ]
        return torch.cat(parts).numpy().tobytes()

    def _write_block(self, block_id: int, data: bytes) -> None:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for t, d in zip(self._layers, self._block_dim, strict=True):
            dst = t.select(d, block_id)
            n = dst.numel() * t.element_size()
            src = flat[offset : offset + n].view(t.dtype).view(dst.shape)
            dst.copy_(src.to(t.device))
            offset += n

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: BlockTransfer) -> None:
        pool = self._pool.get()
        values: list[bytes | None] = [None] * len(load.keys)
        if pool is not None:
            try:
                values = pool.get_many(list(load.keys), expected_size=self._block_nbytes())
            except PoolError as e:
                log.warning("pool_load_failed", request_id=load.request_id, error=str(e))
        loaded = 0
        for block_id, value in zip(load.block_ids, values, strict=True):
            if value is None:
                self._invalid_blocks.add(block_id)
                continue
            self._write_block(block_id, value)
            loaded += 1
        if loaded < len(load.keys):
            log.warning("pool_load_partial", request_id=load.request_id,
                        loaded=loaded, wanted=len(load.keys), fallback="recompute")
        else:
            log.debug("pool_load", request_id=load.request_id, blocks=loaded)

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
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        if not meta.saves:
            return
        pool = self._pool.get()
        if pool is None:
            return
        for save in meta.saves:
            try:
                present = pool.exists(list(save.keys))
                items = [
                    (key, self._read_block(block_id))
                    for key, block_id, there in zip(save.keys, save.block_ids, present,
                                                    strict=True)
                    if not there
                ]
                report = pool.put_many(items) if items else None
            except PoolError as e:
                log.warning("pool_save_failed", request_id=save.request_id, error=str(e))
                return
            log.debug("pool_save", request_id=save.request_id, blocks=len(save.keys),
                      written=len(items), report=report)


def _block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a per-layer KV tensor that indexes blocks (0 on CPU, 1 for
    FlashAttention's [2, num_blocks, ...]): the first whose size is the block count."""
    for d, size in enumerate(t.shape):
        if size == num_blocks:
            return d
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV shape {tuple(t.shape)}")
