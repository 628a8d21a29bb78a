"""`InMemoryPool`: a thread-safe dict as a `ZeroCopyPool`, for tests and single-process use."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from store.pool.outcomes import Outcome, PoolError, PutReport
from store.pool.protocol import Fences, Ranges, Value, check_items, split_ranges

if TYPE_CHECKING:
    from typing import Self


class InMemoryPool:
    """A thread-safe dict as a `KVPool`, for unit tests.

    `capacity_bytes` makes writes beyond it `full` (no eviction, so tests are deterministic).
    Knobs: `fail_puts = True` makes every write `full`; `down = True` emulates a dead master
    (exists all False, gets miss, writes `unavailable`, removes nothing, not healthy);
    `late` (an Event) makes `get_into`/`put_from` calls the pool's timeout abandoned: they
    answer at once as failed (`unavailable`) and do their copies only once `late` is set,
    reported through `fences`; `stall` (an Event) makes them slow calls the pool still waits
    for: they do their copies and answer once it is set. Read leases are not emulated:
    `remove` always removes.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.fail_puts = False
        self.down = False
        self.late: threading.Event | None = None
        self.stall: threading.Event | None = None
        self._data: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the KV pool is closed")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [False if self.down else k in self._data for k in keys]

    def put_many(self, items: Sequence[tuple[str, Value]]) -> PutReport:
        self._check_open()
        keys, views = check_items(items)
        outcomes: list[Outcome] = []
        with self._lock:
            for key, view in zip(keys, views, strict=True):
                if self.down:
                    outcomes.append(Outcome.UNAVAILABLE)
                elif key in self._data:
                    outcomes.append(Outcome.OK)  # first write wins, as in Mooncake
                elif self.fail_puts or (
                    self.capacity_bytes is not None
                    and self._used + view.nbytes > self.capacity_bytes
                ):
                    outcomes.append(Outcome.POOL_FULL)
                else:
                    self._data[key] = view.tobytes()
                    self._used += view.nbytes
                    outcomes.append(Outcome.OK)
        return PutReport.of(outcomes)

    def get_many(self, keys: Sequence[str], expected_size: int | None = None) -> list[bytes | None]:
        self._check_open()
        if expected_size is not None and expected_size <= 0:
            raise ValueError(f"expected_size must be > 0, got {expected_size}")
        with self._lock:
            if self.down:
                return [None] * len(keys)
            values = [self._data.get(k) for k in keys]
        return [
            None if v is None or (expected_size is not None and len(v) != expected_size) else v
            for v in values
        ]

    def remove(self, keys: Sequence[str], *, force: bool = False) -> int:
        self._check_open()
        removed = 0
        with self._lock:
            if self.down:
                return 0
            for k in keys:
                value = self._data.pop(k, None)
                if value is not None:
                    self._used -= len(value)
                    removed += 1
        return removed

    def register_memory(self, addr: int, nbytes: int) -> None:
        self._check_open()

    def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 segment: str | None = None, fences: Fences | None = None) -> PutReport:
        if self._abandoned(fences, self._put_now, keys, ranges):
            return PutReport.of([Outcome.UNAVAILABLE] * len(keys))
        self._stalled()
        return self._put_now(keys, ranges)

    def _put_now(self, keys: Sequence[str], ranges: Sequence[Ranges]) -> PutReport:
        keys, ptrs, sizes = split_ranges(keys, ranges)
        values = [b"".join(ctypes.string_at(a, n) for a, n in zip(p, z, strict=True))
                  for p, z in zip(ptrs, sizes, strict=True)]
        return self.put_many(list(zip(keys, values, strict=True)))

    def _abandoned(self, fences: Fences | None, call: Callable[..., Any],
                   *args: Any) -> bool:
        """With `late` set up: `call` runs once it is set, as a fence; True."""
        late = self.late
        if late is None:
            return False
        fut: Future = Future()

        def run() -> None:
            late.wait()
            try:
                call(*args)
            finally:
                fut.set_result(None)

        threading.Thread(target=run, daemon=True, name="late-call").start()
        if fences is not None:
            fences.append(fut)
        return True

    def _stalled(self) -> None:
        stall = self.stall
        if stall is not None:
            stall.wait()

    def segment_of(self, key: str) -> str | None:
        """One segment, "memory", for whatever it holds."""
        return "memory" if self.exists([key])[0] else None

    def get_into(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 fences: Fences | None = None) -> list[bool]:
        if self._abandoned(fences, self._get_now, keys, ranges):
            return [False] * len(keys)
        self._stalled()
        return self._get_now(keys, ranges)

    def _get_now(self, keys: Sequence[str], ranges: Sequence[Ranges]) -> list[bool]:
        keys, ptrs, sizes = split_ranges(keys, ranges)
        out = []
        for key, p, z in zip(keys, ptrs, sizes, strict=True):
            (value,) = self.get_many([key], expected_size=sum(z))
            if value is not None:
                offset = 0
                for a, n in zip(p, z, strict=True):
                    ctypes.memmove(a, value[offset : offset + n], n)
                    offset += n
            out.append(value is not None)
        return out

    def healthy(self) -> bool:
        return not self._closed and not self.down

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
