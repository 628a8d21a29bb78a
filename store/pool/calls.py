"""How a blocking Mooncake call is run: on a few daemon threads (`Workers`), within the bytes
the client's staging buffer has free (`StagingGate`), under a deadline renewed by progress
(`Budget`), and accounted until it returns, also when its caller gave up on it (`InFlight`);
`runs` cuts a batch into pieces of bounded size."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


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


class InFlight:
    """Store calls submitted and not yet returned (`running`), and those among them whose caller
    stopped waiting (`stuck`). A stuck call holds its pool unavailable until it returns: the
    master may be hung, and more calls would only pile up behind it. Except when the call
    needed only the master and a fresh call to the master has answered since (`watch`): then
    it is stuck on its own connection, typically a reply lost in a network outage that waits
    for its sender's TCP retransmission, seconds after the network is back (docs/design.md,
    "Failures"), and it stops holding the pool. It stays in `running`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.running: set[object] = set()
        self.stuck: dict[object, bool] = {}
        """token -> whether the call needed only the master."""
        self.closed = False
        self._watching = False
        self._probing = 0

    def begin(self) -> object | None:
        """A token for a call about to run; None once `close`d."""
        token = object()
        with self._lock:
            if self.closed:
                return None
            self.running.add(token)
        return token

    def end(self, token: object) -> None:
        with self._lock:
            self.running.discard(token)
            self.stuck.pop(token, None)

    def close(self) -> None:
        """No call begins from here on (the caller then waits for `running` to drain)."""
        with self._lock:
            self.closed = True

    def give_up(self, token: object, master_only: bool) -> bool:
        """The caller stopped waiting: True when the call is still running (now stuck)."""
        with self._lock:
            if token not in self.running:
                return False
            self.stuck[token] = master_only
            return True

    def holding(self) -> bool:
        """Some stuck call holds the pool unavailable."""
        return bool(self.stuck)

    def watch(self, probe: Callable[[], bool], ready: Callable[[], bool]) -> None:
        """While calls that needed only the master are stuck: when `ready()` (the master looks
        reachable otherwise), `probe()` (a fresh call to it) on a thread of its own, at most
        one every `PROBE_SPACING_S` and `PROBES_MAX` at once (a probe can be stuck too); one
        that answers True releases the calls stuck when it began."""
        with self._lock:
            if self._watching:
                return
            self._watching = True
        threading.Thread(target=self._watch, args=(probe, ready), daemon=True,
                         name="kvpool-watch").start()

    PROBE_INTERVAL_S = 0.25
    PROBE_SPACING_S = 1.0
    PROBES_MAX = 3

    def _watch(self, probe: Callable[[], bool], ready: Callable[[], bool]) -> None:
        last = -self.PROBE_SPACING_S
        while True:
            with self._lock:  # with `give_up`'s add: a call stuck after this starts a new watch
                before = [t for t, master_only in self.stuck.items() if master_only]
                if not before or self.closed:
                    self._watching = False
                    return
                room = self._probing < self.PROBES_MAX
            now = time.monotonic()
            if room and now - last >= self.PROBE_SPACING_S and ready():
                last = now
                self._probe(probe, before)
            time.sleep(self.PROBE_INTERVAL_S)

    def _probe(self, probe: Callable[[], bool], before: list[object]) -> None:
        token = self.begin()
        if token is None:
            return
        with self._lock:
            self._probing += 1

        def run() -> None:
            try:
                answered = bool(probe())
            except Exception:
                answered = False
            finally:
                self.end(token)
                with self._lock:
                    self._probing -= 1
            if answered:
                with self._lock:
                    released = sum(self.stuck.pop(t, None) is not None for t in before)
                if released:
                    log.warning("KV pool %s answers again: %d call(s) to it still stuck on "
                                "their own connection no longer hold it unavailable",
                                self.name, released)

        threading.Thread(target=run, daemon=True, name="kvpool-probe").start()
