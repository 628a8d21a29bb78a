"""The pool's contract: `KVPool` (key -> bytes) and `ZeroCopyPool` (objects moved straight
between registered memory and the pool), with the argument checks both implementations share."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from store.pool.outcomes import PutReport

Value = bytes | bytearray | memoryview


@runtime_checkable
class KVPool(Protocol):
    """A shared key -> bytes pool. Reads never return partial or empty data: `None` is a miss."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is in the pool now (False when unreachable)."""
        ...

    def put_many(self, items: Sequence[tuple[str, Value]]) -> PutReport:
        """Write all items; never raises for pool-full or unavailable (see the report)."""
        ...

    def get_many(self, keys: Sequence[str], expected_size: int | None = None) -> list[bytes | None]:
        """Per key, its bytes or None (missing, unreachable, or not `expected_size` long)."""
        ...

    def remove(self, keys: Sequence[str], *, force: bool = False) -> int:
        """Remove keys; returns how many were removed. Without `force`, objects under a read
        lease (recent exists/get) stay."""
        ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


Fences = list[Future]
"""Calls given up on that may still touch the caller's memory (`ZeroCopyPool.get_into`)."""

Ranges = Sequence[tuple[int, int]]
"""Where one object lives in this process's memory: (address, nbytes) pieces, concatenated in
order. The memory must be registered (`register_memory`) and stay valid during the call."""


@runtime_checkable
class ZeroCopyPool(KVPool, Protocol):
    """A pool that moves objects straight between registered memory and the pool, without
    staging copies: each object is the concatenation of its `Ranges`."""

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Make [addr, addr+nbytes) usable by `put_from`/`get_into`; `PoolError` on failure."""
        ...

    def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 segment: str | None = None, fences: Fences | None = None) -> PutReport:
        """Write each key from its ranges; never raises for pool-full or unavailable.
        `segment`: place the objects in that segment (a name `segment_of` returned) while it
        has room, instead of the pool's default placement. `fences`: see `get_into`."""
        ...

    def segment_of(self, key: str) -> str | None:
        """The segment holding `key` (its first in-memory copy); None when missing or the pool
        cannot be asked."""
        ...

    def get_into(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 fences: Fences | None = None) -> list[bool]:
        """Read each key into its ranges: True where the whole object, of exactly the ranges'
        total size, arrived. False (missing, wrong size, unreachable) leaves that key's ranges
        in an unspecified state: the caller must not use them.

        A call the pool stopped waiting for (its timeout) may still run and read or write
        the ranges later: it is appended to `fences`, and the ranges must not be freed or
        reused for anything else until it is `done()`."""
        ...


def _as_byte_view(value: Value) -> memoryview:
    view = memoryview(value)
    if not view.c_contiguous:
        raise ValueError("pool values must be C-contiguous buffers")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def check_items(items: Sequence[tuple[str, Value]]) -> tuple[list[str], list[memoryview]]:
    keys: list[str] = []
    views: list[memoryview] = []
    for key, value in items:
        if not isinstance(key, str) or not key:
            raise ValueError(f"pool keys must be non-empty str, got {key!r}")
        view = _as_byte_view(value)
        if view.nbytes == 0:
            raise ValueError(f"empty value for key {key!r}: the pool cannot store (or return) b''")
        keys.append(key)
        views.append(view)
    return keys, views



def split_ranges(
    keys: Sequence[str], ranges: Sequence[Ranges]
) -> tuple[list[str], list[list[int]], list[list[int]]]:
    if len(keys) != len(ranges):
        raise ValueError(f"{len(keys)} keys but {len(ranges)} range lists")
    ptrs: list[list[int]] = []
    sizes: list[list[int]] = []
    for key, rs in zip(keys, ranges, strict=True):
        if not isinstance(key, str) or not key:
            raise ValueError(f"pool keys must be non-empty str, got {key!r}")
        if not rs or any(n <= 0 for _, n in rs):
            raise ValueError(f"ranges of {key!r} must be non-empty with positive sizes")
        ptrs.append([a for a, _ in rs])
        sizes.append([n for _, n in rs])
    return list(keys), ptrs, sizes


def sizes_of(ranges: Sequence[Ranges]) -> list[int]:
    """Each object's total size."""
    return [sum(n for _, n in rs) for rs in ranges]
