"""`MooncakePool`: a Mooncake Store client as a `ZeroCopyPool`.

Mooncake facts this module leans on (mooncake-transfer-engine 0.3.13.post1, measured):
- `get`/`get_batch` return `b""` for a missing key, a dead master, AND for a present key that did
  not fit in the client's local buffer at that moment: empty bytes are never data.
- `put` of an existing key returns 0 and keeps the old value; `put` of `b""` returns -600.
- `put` of a memoryview with itemsize > 1 stores `len(view)` BYTES (truncates): values are cast to
  bytes-format views here before they reach Mooncake.
- `put`/`get` and their batches stage through the client's local buffer: a batch larger than
  what is free fails as a whole (put: -600) or per key (get: `b""`), also when concurrent calls
  fill it. So batches are chunked (a quarter of the buffer) and gated (`_StagingGate`).
- `get_batch([])` returns `[b""]`.
- Against a dead master a call takes ~4.3 s (returning -900 / `b""`) until the client's ping
  thread marks it unreachable (`health_check() == 2`, within 0.02-1 s of the death); against a
  hung (SIGSTOPped) master a call blocks 30 s (-901). These calls release the GIL, so they run
  here in a small thread pool under a deadline (`op_timeout_s`) behind a circuit breaker.
- Zero-copy (`ZeroCopyPool`): `batch_put_from_multi_buffers`/`batch_get_into_multi_buffers` move
  an object between registered memory (`register_buffer`) and the pool with no staging copy and
  answer per key: bytes read, 0 for a put (also of a key already there), -704 for a missing key,
  -600 when the object is larger than the ranges, -800 when smaller, -200 when the pool is full.
  Memory that was not registered fails a put (-200 here, not an error of its own).
- `setup()` and `close()` hold the GIL: `close()` for ~2 s even when healthy, `setup()` for 30 s
  against a hung master. Neither can be timed out from Python.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TypeVar

from cluster.ports import free_port
from cluster.resilience import Breaker
from store.pool.calls import Budget, InFlight, StagingGate, Workers, runs
from store.pool.config import PoolConfig, probe_master
from store.pool.outcomes import (
    Outcome,
    PoolError,
    PoolUnavailable,
    PutReport,
    classify,
    code_name,
)
from store.pool.protocol import Fences, Ranges, Value, check_items, sizes_of, split_ranges

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

T = TypeVar("T")
_ZC_CHUNK_BYTES = 64 << 20
class _Down(Exception):
    """Internal: the master is (or was just) unreachable; the caller returns misses."""


# Pools whose client was abandoned while their master was unreachable: its `close()`/destructor
# would block 10-15 s holding the GIL (it retries unmounting), so it is kept alive until process
# exit, where Mooncake's own atexit handler tears it down anyway (+~6 s at exit if the master is
# dead, over a minute if it is hung). It keeps its segment memory and keeps heartbeating.
_ABANDONED: list[MooncakePool] = []
_LIVE: weakref.WeakSet[MooncakePool] = weakref.WeakSet()
_EXIT_DRAIN_S = 5.0


@atexit.register
def _drain_calls_at_exit() -> None:
    """Mooncake's atexit teardown aborts the process (SIGSEGV / std::terminate) if a store call
    is still running in one of our threads then. Such a call (say, against a master that just
    died) usually returns within ~4.3 s: wait for it, a bounded time."""
    deadline = time.monotonic() + _EXIT_DRAIN_S
    for pool in [*_ABANDONED, *_LIVE]:
        while pool._calls.running and time.monotonic() < deadline:
            time.sleep(0.05)


_BREAKER_COOLDOWN_S = 2.0
_SLOW_MISS_S = 1.0
_PROBE_KEY = "kvcluster-probe"


class MooncakePool:
    """A Mooncake Store client (`MooncakeDistributedStore`) as a `KVPool`.

    Construction probes the master first (`probe_master`: a dead master would otherwise make
    `setup` block ~4.4 s and fail with -600, a hung one 30 s), then runs `setup` with a fresh
    free port for `local_hostname` (reusing one within the master's `client_ttl` fails with
    -600); any failure raises `PoolUnavailable`. A master that dies between probe and setup
    still costs the ~4.4 s.

    Later calls run on a small thread pool; a method stops waiting after `op_timeout_s` without
    progress and returns misses / `unavailable` (the abandoned call finishes in the background).
    A failed or timed-out call opens a breaker for 2 s, and while the client's own ping says the
    master is unreachable, or a call given up on is stuck (`InFlight`), no call is made at all.
    When the master comes back at the same address the client reconnects and remounts its
    segment by itself within ~2 s; the objects are gone (they lived in the master's metadata).
    """

    def __init__(self, config: PoolConfig, *, io_threads: int = 4) -> None:
        from mooncake.store import MooncakeDistributedStore  # heavy import, only when used

        self.config = config
        self._breaker = Breaker(_BREAKER_COOLDOWN_S)
        self._lock = threading.Lock()
        self._calls = InFlight(config.master_addr)
        # Chunks of a quarter of the local buffer, at most three quarters of it in flight.
        self._chunk_bytes = max(1, config.local_buffer_bytes // 4)
        self._gate = StagingGate(config.local_buffer_bytes * 3 // 4)

        probe_master(config)
        _LIVE.add(self)
        self._store = MooncakeDistributedStore()
        self._workers = Workers(io_threads, "kvpool-io")
        from mooncake.store import ReplicateConfig

        self._put_config = ReplicateConfig()
        if config.store_client:
            self.local_hostname = config.store_client_segment  # the local segment
            if config.prefer_local_segment and config.store_client_segment:
                self._put_config.preferred_segment = config.store_client_segment
            code = self._store.setup_dummy(0, config.local_buffer_bytes, config.store_client)
        else:
            self.local_hostname = f"{config.local_host}:{free_port(config.local_host)}"
            if config.prefer_local_segment and config.segment_bytes > 0:
                self._put_config.preferred_segment = self.local_hostname
            code = self._store.setup(  # holds the GIL: no point in a thread with a timeout
                self.local_hostname,
                config.metadata_url,
                config.segment_bytes,
                config.local_buffer_bytes,
                config.protocol,
                config.rdma_devices,
                config.master_addr,
            )
        if code == 0 and config.store_client:
            # A dummy client reports itself healthy only after its first ping (a thread).
            deadline = time.monotonic() + config.probe_timeout_s
            while self._store.health_check() != 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        if code != 0:
            self._calls.close()
            self._workers.shutdown()
            self._store.close()  # instant after a failed setup: nothing was mounted
            raise PoolUnavailable(
                f"Mooncake setup against {config.master_addr} / {config.metadata_url} as "
                f"{self.local_hostname} failed: {code} ({code_name(code)})"
            )

    # -- plumbing -------------------------------------------------------------------------------

    def _abandon(self) -> None:
        _ABANDONED.append(self)
        # Keep the client past interpreter teardown too, where module globals are cleared.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._store))
        self._workers.shutdown()

    def _trip(self, why: str) -> None:
        with self._lock:
            if self._breaker.allows():
                log.warning("KV pool %s unavailable: %s", self.config.master_addr, why)
            self._breaker.failed(fatal=True)

    def _reachable(self) -> bool:
        return (
            self._breaker.allows()
            and not self._calls.holding()
            and self._store.health_check() == 0
        )

    def _run(self, token: object, staged: int, fn: Callable[..., T], *args: Any) -> T:
        """In an I/O thread: the call, accounted before its result is visible to the caller."""
        try:
            return fn(*args)
        finally:
            self._calls.end(token)
            if staged:
                self._gate.release(staged)

    def _budget_start(self) -> Budget:
        if self._calls.closed:
            raise PoolError("the KV pool is closed")
        return Budget(self.config.op_timeout_s)

    def _call(self, budget: Budget, fn: Callable[..., T], *args: Any, staged: int = 0,
              fences: Fences | None = None, master_only: bool = False) -> T:
        """One store call staging `staged` bytes through the local buffer, or `_Down` if the
        master is known unreachable or the budget ran out (a call still running then goes to
        `fences`, and is stuck: `InFlight`). `master_only`: an RPC to the master alone, no
        transfer to or from a segment."""
        if self._calls.closed:
            raise PoolError("the KV pool is closed")
        if not self._reachable():
            raise _Down
        reserved = self._gate.reserve(staged, budget.remaining()) if staged else 0
        remaining = budget.remaining()
        stuck = False
        if reserved is not None and remaining > 0:
            token = self._calls.begin()
            if token is None:
                self._gate.release(reserved)
                raise PoolError("the KV pool is closed")
            fut = self._workers.submit(self._run, token, reserved, fn, *args)
            try:
                return fut.result(timeout=remaining)
            except FutureTimeout:
                if fut.cancel():  # never started
                    self._calls.end(token)
                    self._gate.release(reserved)
                elif self._calls.give_up(token, master_only):
                    stuck = True
                    if fences is not None:
                        fences.append(fut)
        elif reserved:
            self._gate.release(reserved)
        self._trip(f"no progress for {self.config.op_timeout_s}s (in {fn.__name__})")
        if stuck and master_only:  # after the trip: the first probe waits for its cool-down
            self._calls.watch(self._probe, self._probe_ready)
        raise _Down

    def _probe_ready(self) -> bool:
        return self._breaker.allows() and self._store.health_check() == 0

    def _probe(self) -> bool:
        """A fresh call to the master: answered? (It does while a call stuck on a lost reply
        waits for the retransmission: measured.)"""
        return all(c >= 0 for c in self._store.batch_is_exist([_PROBE_KEY]))

    # -- KVPool ---------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        budget = self._budget_start()
        if not keys:
            return []
        try:
            codes = self._call(budget, self._store.batch_is_exist, keys, master_only=True)
        except _Down:
            return [False] * len(keys)
        bad = [c for c in codes if c < 0]
        if bad and any(classify(c) is Outcome.UNAVAILABLE for c in bad):
            self._trip(f"batch_is_exist: {code_name(bad[0])}")
        return [c == 1 for c in codes]

    def put_many(self, items: Sequence[tuple[str, Value]]) -> PutReport:
        budget = self._budget_start()
        keys, views = check_items(items)
        outcomes = [Outcome.UNAVAILABLE] * len(keys)
        try:
            sizes = [v.nbytes for v in views]
            for start, end in runs(sizes, self._chunk_bytes):
                code = self._call(
                    budget,
                    self._store.put_batch,
                    keys[start:end],
                    views[start:end],
                    staged=sum(sizes[start:end]),
                )
                outcome = classify(code)
                if outcome is not Outcome.UNAVAILABLE:
                    budget.progress()
                if outcome is Outcome.OK:
                    outcomes[start:end] = [Outcome.OK] * (end - start)
                    continue
                if outcome is Outcome.UNAVAILABLE:
                    self._trip(f"put_batch: {code_name(code)}")
                    break
                if end - start == 1:
                    outcomes[start] = outcome
                    continue
                # The batch failed as a whole (full, or the local buffer was busy): find out per
                # key. Keys of the batch that did get written return 0 again.
                for i in range(start, end):
                    code = self._call(budget, self._store.put, keys[i], views[i], staged=sizes[i])
                    outcomes[i] = classify(code)
                    if outcomes[i] is Outcome.UNAVAILABLE:
                        self._trip(f"put: {code_name(code)}")
                        raise _Down
                    budget.progress()
        except _Down:
            pass
        return PutReport.of(outcomes)

    def get_many(self, keys: Sequence[str], expected_size: int | None = None) -> list[bytes | None]:
        keys = list(keys)
        budget = self._budget_start()
        out: list[bytes | None] = [None] * len(keys)
        if not keys:
            return out
        if expected_size is not None and expected_size <= 0:
            raise ValueError(f"expected_size must be > 0, got {expected_size}")
        per_item = expected_size if expected_size is not None else self._chunk_bytes // 32
        try:
            for start, end in runs([per_item] * len(keys), self._chunk_bytes):
                t0 = time.monotonic()
                values = self._call(
                    budget,
                    self._store.get_batch,
                    keys[start:end],
                    staged=per_item * (end - start),
                )
                for i, value in enumerate(values, start):
                    out[i] = self._accept(keys[i], value, expected_size)
                self._check_read(budget, out[start:end], t0)
                if expected_size is None and end - start > 1:
                    # Sizes unknown: an empty answer may be a key that did not fit the batch.
                    for i in range(start, end):
                        if out[i] is None:
                            t0 = time.monotonic()
                            value = self._call(
                                budget, self._store.get, keys[i], staged=self._chunk_bytes
                            )
                            out[i] = self._accept(keys[i], value, None)
                            self._check_read(budget, out[i : i + 1], t0)
        except _Down:
            pass
        return out

    def _check_read(self, budget: Budget, got: list[bytes | None], t0: float) -> None:
        """Data is progress. Nothing back after a long wait is how a dead master looks to a get
        (b"" after ~4.3 s, while a real miss takes well under a millisecond): stop there."""
        if any(v is not None for v in got):
            budget.progress()
        elif time.monotonic() - t0 > _SLOW_MISS_S:
            self._trip(f"reads came back empty after {time.monotonic() - t0:.1f}s")
            raise _Down

    @staticmethod
    def _accept(key: str, value: bytes, expected_size: int | None) -> bytes | None:
        if not value:
            return None
        if expected_size is not None and len(value) != expected_size:
            log.warning(
                "KV pool: %r has %d bytes, expected %d; treated as a miss",
                key,
                len(value),
                expected_size,
            )
            return None
        return value

    def remove(self, keys: Sequence[str], *, force: bool = False) -> int:
        keys = list(keys)
        budget = self._budget_start()
        if not keys:
            return 0
        try:
            codes = self._call(budget, self._store.batch_remove, keys, force, master_only=True)
        except _Down:
            return 0
        if any(classify(c) is Outcome.UNAVAILABLE for c in codes):
            self._trip("batch_remove: unavailable")
        return sum(c == 0 for c in codes)

    # -- ZeroCopyPool ---------------------------------------------------------------------------

    def alloc_shared(self, nbytes: int) -> int:
        """Dummy-client pools only: `nbytes` of zeroed shared memory (memfd) the standalone
        client maps; `register_memory` accepts exactly such an allocation (whole). Lives until
        `close()`."""
        if not self.config.store_client:
            raise PoolError("alloc_shared needs store_client (a Mooncake dummy client)")
        addr = self._store.alloc_from_mem_pool(nbytes)
        if not addr:
            raise PoolError(f"alloc_from_mem_pool({nbytes}) failed")
        return addr

    def register_memory(self, addr: int, nbytes: int) -> None:
        budget = self._budget_start()
        try:
            code = self._call(budget, self._store.register_buffer, addr, nbytes)
        except _Down as e:
            raise PoolUnavailable(f"register_buffer: {self.config.master_addr} unreachable") from e
        if code != 0:
            raise PoolError(f"register_buffer({addr:#x}, {nbytes}) failed: {code_name(code)}")

    def _placed(self, segment: str | None) -> Any:
        """The put config placing objects in `segment` (None: the default one)."""
        if segment is None:
            return self._put_config
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.preferred_segment = segment
        return config

    def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 segment: str | None = None, fences: Fences | None = None) -> PutReport:
        keys, ptrs, sizes = split_ranges(keys, ranges)
        put_config = self._placed(segment)
        budget = self._budget_start()
        outcomes = [Outcome.UNAVAILABLE] * len(keys)
        try:
            for start, end in runs(sizes_of(ranges), _ZC_CHUNK_BYTES):
                codes = self._call(budget, self._store.batch_put_from_multi_buffers,
                                   keys[start:end], ptrs[start:end], sizes[start:end],
                                   put_config, fences=fences)
                got = [classify(c) for c in codes]
                outcomes[start:end] = got
                if Outcome.UNAVAILABLE in got:
                    bad = next(c for c in codes if classify(c) is Outcome.UNAVAILABLE)
                    self._trip(f"batch_put_from_multi_buffers: {code_name(bad)}")
                    break
                budget.progress()
        except _Down:
            pass
        return PutReport.of(outcomes)

    def segment_of(self, key: str) -> str | None:
        """From the master's replica descriptors: the transport endpoint of the first memory
        replica, which is the name of the segment holding it. A dummy client (`store_client`)
        cannot ask (its real client does not serve that RPC) and needs not: everything it
        writes goes to the store client's segment, which outlives the engine."""
        if self.config.store_client:
            return self.config.store_client_segment if self.exists([key])[0] else None
        budget = self._budget_start()
        try:
            replicas = self._call(budget, self._store.get_replica_desc, key, master_only=True)
        except _Down:
            return None
        for replica in replicas:
            if replica.is_memory_replica():
                return replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
        return None

    def get_into(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 fences: Fences | None = None) -> list[bool]:
        keys, ptrs, sizes = split_ranges(keys, ranges)
        budget = self._budget_start()
        out = [False] * len(keys)
        try:
            for start, end in runs(sizes_of(ranges), _ZC_CHUNK_BYTES):
                t0 = time.monotonic()
                codes = self._call(budget, self._store.batch_get_into_multi_buffers,
                                   keys[start:end], ptrs[start:end], sizes[start:end],
                                   fences=fences)
                for i, code in enumerate(codes, start):
                    want = sum(sizes[i])
                    out[i] = code == want
                    if code >= 0 and code != want:
                        log.warning("KV pool: %r read %d bytes, expected %d; treated as a miss",
                                    keys[i], code, want)
                if any(classify(c) is Outcome.UNAVAILABLE for c in codes):
                    self._trip("batch_get_into_multi_buffers: unavailable")
                    raise _Down
                self._check_read(budget, [b"" if ok else None for ok in out[start:end]], t0)
        except _Down:
            pass
        return out

    def healthy(self) -> bool:
        return not self._calls.closed and self._reachable()

    def close(self) -> None:
        """Unmount and release. Mooncake's `close()` holds the GIL ~2 s even when healthy; with
        the master dead it takes 10-15 s, with it hung 30 s+, and with a call still in flight
        it crashed the process (SIGSEGV). So unless the master answers and no call is running,
        the client is abandoned instead: kept alive (and heartbeating) until process exit.
        Waits for calls in flight (up to `op_timeout_s`), and takes up to `probe_timeout_s` +
        2.5 s more when the master is in trouble."""
        with self._lock:
            if self._calls.closed:
                return
            self._calls.close()  # no new calls from here on
        deadline = time.monotonic() + self.config.op_timeout_s
        while self._calls.running and not self._calls.holding() and time.monotonic() < deadline:
            time.sleep(0.02)  # let calls in flight finish
        if self._calls.running:
            why = "calls in flight"
        elif not self._answers():
            why = "master not answering"
        else:
            # The client's view lags (its ping) and the breaker may still be open: give it a
            # moment before deciding that a master which answers is unreachable.
            deadline = time.monotonic() + _BREAKER_COOLDOWN_S + 0.5
            while not self._reachable() and time.monotonic() < deadline:
                time.sleep(0.05)
            why = "" if self._reachable() else "master unreachable from this client"
        if why:
            log.warning(
                "KV pool %s: %s at close; abandoning the client", self.config.master_addr, why
            )
            self._abandon()
            return
        self._workers.shutdown()
        self._store.close()

    def _answers(self) -> bool:
        try:
            probe_master(self.config)
        except PoolUnavailable:
            return False
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
