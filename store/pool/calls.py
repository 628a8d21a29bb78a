"""How a blocking Mooncake call is run: on a few daemon threads (`Workers`), within the bytes
the client's staging buffer has free (`StagingGate`), and under a deadline renewed by progress
(`Budget`); `runs` cuts a batch into pieces of bounded size."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def runs(sizes: Sequence[int], limit: int) -> Iterable[tuple[int, int]]:
    """[start, end) runs of `sizes` whose total is at most `limit` (a bigger item alone)."""
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > limit:
            yield start, i
            start, acc = i, 0
        acc += size
    if start < len(sizes):
        yield start, len(sizes)


_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class Workers:
    """A few daemon threads running store calls. Unlike `ThreadPoolExecutor` workers they are
    not joined at interpreter exit, where a call stuck on a hung master would hold exit 30 s."""

    def __init__(self, n: int, name: str) -> None:
        self._n = n
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Let the threads end once the queue drains (a stuck call ends its thread later)."""
        for _ in range(self._n):
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiting caller
                fut.set_exception(e)


class StagingGate:
    """Bytes of the client's local buffer promised to calls in flight. `put_batch`/`get_batch`
    allocate from that one buffer and fail (-600 / `b""`) when concurrent calls exhaust it, so
    each call first reserves what it will stage and releases it when it actually returns."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._cond = threading.Condition()

    def reserve(self, nbytes: int, timeout: float) -> int | None:
        """The bytes reserved (capped at capacity: an oversized call waits to run alone), or None
        on timeout."""
        nbytes = min(nbytes, self.capacity)
        with self._cond:
            fits = self._cond.wait_for(
                lambda: self._used + nbytes <= self.capacity, max(0.0, timeout)
            )
            if not fits:
                return None
            self._used += nbytes
            return nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()


class Budget:
    """How long one pool method may still wait on Mooncake; renewed by every sign of progress."""

    __slots__ = ("timeout", "until")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.until = time.monotonic() + timeout

    def progress(self) -> None:
        self.until = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return self.until - time.monotonic()
