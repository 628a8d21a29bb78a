"""The worker side's loader: a background thread that moves blocks from the pool into the
paged cache while the engine keeps stepping its other requests (vLLM's asynchronous load:
the request waits in WAITING_FOR_REMOTE_KVS until `take_finished` reports it).

A job may name blocks a prefill elsewhere is still writing: each round asks the pool which of
every waiting job's next blocks exist (one `batch_is_exist`), loads what arrived (a read per
job, of at most `READ_BLOCKS`), and sleeps `poll_s`; a job ends when all its blocks are
loaded, when its wait is over (what has not arrived is recomputed), when a read fails, when
the pool is down, or when it is cancelled.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import structlog

from store.connector import background
from store.connector.data import LoadJob, LoadResult
from store.connector.fences import RequestFences
from store.kv_transfer import KVTransfer
from store.pool import Fences

log = structlog.get_logger(__name__)


@dataclass
class _Active:
    job: LoadJob
    deadline: float
    started: float
    done: int = 0
    load_s: float = 0.0
    failed_at: int | None = None
    """Index of the first block that could not be read: it and the rest are recomputed."""
    cancelled: bool = False
    late: Fences = field(default_factory=list)
    """Its reads the pool gave up on that may still write its blocks."""

    def finished(self, now: float) -> bool:
        return (self.done == len(self.job.keys) or self.failed_at is not None
                or self.cancelled or now >= self.deadline)

    def result(self, now: float) -> LoadResult:
        elapsed = now - self.started
        return LoadResult(loaded=self.done, failed=len(self.job.keys) - self.done,
                          wait_s=max(elapsed - self.load_s, 0.0), load_s=self.load_s)


@dataclass
class _Finished:
    results: dict[str, LoadResult] = field(default_factory=dict)
    invalid: set[int] = field(default_factory=set)


READ_BLOCKS = 64
"""Blocks one read moves at most (a longer prefix takes several rounds): Mooncake's TCP
transport stalled past the pool's 5 s timeout on one read of six 1,800-token prompts at
once, on two cores busy with prefills."""


class Loader:
    def __init__(self, transfer: KVTransfer, poll_s: float, fences: RequestFences) -> None:
        self.transfer = transfer
        self.fences = fences
        """Where a finished job whose reads were given up on holds its request, before its
        result is taken: the worker side reports it once none of them can write."""
        self.poll_s = poll_s
        self._new: queue.SimpleQueue[LoadJob] = queue.SimpleQueue()
        self._cancel: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._finished = _Finished()
        self._stop = False
        self._thread = background.start(self._run, "kv-loader")

    def submit(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            self._new.put(job)
        if jobs:
            self._wake.set()

    def cancel(self, request_ids: set[str]) -> None:
        """Stop waiting for these requests' blocks (what is loaded stays valid)."""
        if request_ids:
            with self._lock:
                self._cancel |= request_ids
            self._wake.set()

    def take_finished(self) -> tuple[dict[str, LoadResult], set[int]]:
        """The jobs finished since the last call, and the block ids they could not load:
        together, so that vLLM learns a request's failed blocks no later than its end."""
        with self._lock:
            done, self._finished = self._finished, _Finished()
        return done.results, done.invalid

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def _run(self) -> None:
        active: dict[str, _Active] = {}
        while not self._stop:
            if not active:
                self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            while True:
                try:
                    job = self._new.get_nowait()
                except queue.Empty:
                    break
                active[job.request_id] = _Active(job, now + job.wait_s, now)
            with self._lock:
                cancel, self._cancel = self._cancel, set()
            for rid in cancel:
                if rid in active:
                    active[rid].cancelled = True
            try:
                self._round(active)
            except Exception:  # a bug must not strand requests in WAITING_FOR_REMOTE_KVS
                log.exception("kv_load_crashed", requests=sorted(active))
                for a in active.values():
                    a.failed_at = a.done
            self._retire(active)
            if active:
                self._wake.wait(self.poll_s)

    def _round(self, active: dict[str, _Active]) -> None:
        """One exists check for every job still waiting, then reads of what arrived."""
        todo = [a for a in active.values() if not a.cancelled and a.failed_at is None]
        if not todo:
            return
        if not self.transfer.healthy():  # waiting for a pool that is down is pointless
            for a in todo:
                a.failed_at = a.done
            return
        keys = [k for a in todo for k in a.job.keys[a.done:]]
        present = self.transfer.exists(keys)
        reads: list[tuple[_Active, int]] = []
        at = 0
        for a in todo:
            left = len(a.job.keys) - a.done
            n = next((i for i, ok in enumerate(present[at:at + left]) if not ok), left)
            at += left
            if n:
                reads.append((a, n))
        for a, n in reads:  # reads per job: a slow or failed read stays that job's
            end = a.done + n
            while a.done < end and a.failed_at is None:
                step = min(end - a.done, READ_BLOCKS)
                t0 = time.monotonic()
                ok = self.transfer.load(a.job.keys[a.done:a.done + step],
                                        a.job.block_ids[a.done:a.done + step], fences=a.late)
                a.load_s += time.monotonic() - t0
                good = next((i for i, g in enumerate(ok) if not g), step)
                a.done += good
                if good < step:
                    a.failed_at = a.done

    def _retire(self, active: dict[str, _Active]) -> None:
        now = time.monotonic()
        done = {rid: a for rid, a in active.items() if a.finished(now)}
        if not done:
            return
        with self._lock:
            for rid, a in done.items():
                del active[rid]
                self.fences.hold([rid], a.late)
                self._finished.results[rid] = a.result(now)
                self._finished.invalid.update(a.job.block_ids[a.done:])
                if a.done < len(a.job.keys) and not a.cancelled:
                    log.info("pool_load_partial", request_id=rid, loaded=a.done,
                             wanted=len(a.job.keys), waited_s=round(now - a.started, 4),
                             fenced=bool(a.late), fallback="recompute")
