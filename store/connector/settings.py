"""The connector's settings (`kv_connector_extra_config`), its process-wide pool client, and
the hook that puts vLLM's KV cache in the pool's shared memory (`store_client`)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from store.connector.background import unpinned
from store.pool import MooncakePool, PoolConfig, PoolError

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
    load_poll_s: float = 0.002
    """How often a load waiting for blocks a prefill is still writing looks for them."""
    checksum: bool = False
    """Every block's object carries its digest, verified on load (`store.checksum`); the
    namespace must say so (`kv_namespace(checksum=True)`)."""
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


class SharedPool:
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
                    with unpinned():  # its transfer threads must not share a pinned core
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
def kv_cache_in_shared_memory(pool: MooncakePool) -> Iterator[None]:
    import vllm.v1.worker.utils as worker_utils

    saved = worker_utils.torch
    worker_utils.torch = _SharedZerosTorch(pool)  # type: ignore[assignment]
    try:
        yield
    finally:
        worker_utils.torch = saved


_POOLS: dict[ConnectorSettings, SharedPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(settings: ConnectorSettings) -> SharedPool:
    with _POOLS_LOCK:
        return _POOLS.setdefault(settings, SharedPool(settings))
