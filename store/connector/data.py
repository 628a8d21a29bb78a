"""What the connector's two halves pass each other: the scheduler side plans loads and saves
per step (`PoolConnectorMetadata`), the worker side reports what its transfers did
(`PoolWorkerMetadata`). Plain data, no vLLM state."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from store.kv_transfer import TransferStats


@dataclass(frozen=True)
class BlockTransfer:
    """Save whole blocks from the paged cache (by block id) to the pool (by key)."""

    request_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    generated: bool = False
    """Blocks holding generated tokens."""
    near: str | None = None
    """The key of a pooled block whose segment these blocks should go to."""


@dataclass(frozen=True)
class LoadJob:
    """Load a request's blocks from the pool into the paged cache, off the scheduler thread.
    Blocks not in the pool yet are waited for up to `wait_s` (a prefill elsewhere is writing
    them); a block that does not arrive, and every block after it, is recomputed."""

    request_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    wait_s: float = 0.0


@dataclass(frozen=True)
class LoadResult:
    """One finished load: how far it got, and where its time went. Reported once no read of
    it can write the request's blocks any more (`store.connector.fences`)."""

    loaded: int
    """Blocks loaded: a prefix of the job's."""
    failed: int
    """Blocks that did not arrive (or did not read back whole): recomputed by the engine."""
    wait_s: float
    """Seconds spent waiting for blocks that were not in the pool yet."""
    load_s: float
    """Seconds spent copying blocks."""


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, every step."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    """Requests finished (aborted) before their load reported: the load may stop waiting, and
    vLLM frees their blocks as it reports (and only then)."""
    preempted: set[str] = field(default_factory=set)


@dataclass
class PoolWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: the loads that finished, and the worker's cumulative
    transfer counters."""

    loads: dict[str, LoadResult] = field(default_factory=dict)
    stats: TransferStats = field(default_factory=TransferStats)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PoolWorkerMetadata)
        return PoolWorkerMetadata({**self.loads, **other.loads}, self.stats.add(other.stats))


@dataclass
class LookupStats:
    """Scheduler-side counters."""

    lookups: int = 0
    lookup_blocks_hit: int = 0
    lookup_misses: int = 0
    """Lookups that wanted blocks and found fewer than wanted (a shorter or no prefix)."""
    lookup_unavailable: int = 0
    """Lookups made without the pool (down or unreachable): computed from scratch."""
