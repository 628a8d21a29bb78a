"""A prefix-block cache of bounded capacity: the KV pool and each engine's local cache.

Blocks are chained hashes, so a prompt's usable hit is the longest run of held blocks from
its first. A chain is touched tail first, so under LRU its head is the most recent and a
chain loses its tail before its head (the cache stays prefix-closed, as vLLM's does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

EVICTIONS = ("lru", "lfu")


class BlockCache:
    def __init__(self, capacity: int | None = None, eviction: str = "lru",
                 on_evict: Callable[[int], None] | None = None) -> None:
        """`capacity` in blocks (None: unlimited); `eviction`: lru | lfu (least frequently
        used, ties broken by recency; evicts down to 95% of capacity at once); `on_evict` is
        told each block dropped."""
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}: {eviction!r}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0: {capacity}")
        self.capacity = capacity
        self.eviction = eviction
        self.on_evict = on_evict
        self._blocks: OrderedDict[int, int] = OrderedDict()
        """block -> uses, least recently used first"""
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def match(self, hashes: Sequence[int]) -> int:
        """Length of the longest held prefix of `hashes`, in blocks."""
        k = 0
        for h in hashes:
            if h not in self._blocks:
                break
            k += 1
        return k

    def touch(self, hashes: Sequence[int]) -> None:
        """Mark held blocks of a chain as used now (a hit)."""
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks[h] += 1
                blocks.move_to_end(h)

    def insert(self, hashes: Sequence[int]) -> None:
        """Hold a chain (now the most recently used), evicting to stay within capacity."""
        if self.capacity == 0:
            return
        blocks = self._blocks
        for h in reversed(hashes):
            blocks[h] = blocks.get(h, 0) + 1
            blocks.move_to_end(h)
        self._shrink(protect=len(hashes))

    def _shrink(self, protect: int) -> None:
        cap = self.capacity
        if cap is None or len(self._blocks) <= cap:
            return
        if self.eviction == "lru":
            while len(self._blocks) > cap:
                self._drop(next(iter(self._blocks)))
            return
        # lfu: the least used among the older blocks (the chain just stored is kept); down to
        # a 95% watermark at once, so the O(n) sort is paid once per cap/20 insertions
        excess = len(self._blocks) - cap + cap // 20
        old = list(self._blocks.items())[: max(len(self._blocks) - protect, excess)]
        old.sort(key=lambda kv: kv[1])  # stable: ties keep recency order
        for h, _ in old[:excess]:
            self._drop(h)

    def _drop(self, h: int) -> None:
        del self._blocks[h]
        self.evicted += 1
        if self.on_evict is not None:
            self.on_evict(h)
