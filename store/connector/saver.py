"""The worker side's saver: a background thread writing planned blocks to the pool, so the
forward pass never waits for it."""

from __future__ import annotations

import queue
import threading

import structlog

from store.connector import background
from store.connector.data import BlockTransfer
from store.connector.fences import RequestFences
from store.kv_transfer import KVTransfer
from store.pool import Fences

log = structlog.get_logger(__name__)


class Saver:
    """The background thread that saves blocks. Jobs queued together are written as one batch
    (a shared prefix queued twice is written once). `pending(req)` is how many of a request's
    jobs are not finished; its blocks must stay allocated until it is 0 and `fences` does not
    hold it."""

    def __init__(self, transfer: KVTransfer, fences: RequestFences) -> None:
        self.transfer = transfer
        self.fences = fences
        """Where a batch whose pool call was given up on holds its requests."""
        self._queue: queue.SimpleQueue[list[BlockTransfer] | None] = queue.SimpleQueue()
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread = background.start(self._run, "kv-saver")

    def submit(self, jobs: list[BlockTransfer]) -> None:
        if not jobs:
            return
        with self._cond:
            for job in jobs:
                self._pending[job.request_id] = self._pending.get(job.request_id, 0) + 1
        self._queue.put(jobs)

    def pending(self, request_id: str) -> int:
        with self._cond:
            return self._pending.get(request_id, 0)

    def wait_idle(self, request_ids: set[str] | None, timeout: float) -> bool:
        """Until the given requests' (None: all) saves are done, or the timeout."""
        def done() -> bool:
            if request_ids is None:
                return not self._pending
            return not any(r in self._pending for r in request_ids)
        with self._cond:
            return self._cond.wait_for(done, timeout)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            jobs = list(batch)
            stop = False
            while True:  # everything queued meanwhile joins this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.extend(more)
            seen: set[str] = set()
            groups: dict[tuple[bool, str | None], dict[str, int]] = {}
            for job in jobs:  # one save per placement
                group = groups.setdefault((job.generated, job.near), {})
                for key, block_id in zip(job.keys, job.block_ids, strict=True):
                    if key not in seen:
                        seen.add(key)
                        group[key] = block_id
            dupes = sum(len(j.keys) for j in jobs) - len(seen)
            late: Fences = []
            try:
                for (generated, near), blocks in groups.items():
                    if blocks:
                        self.transfer.save(list(blocks), list(blocks.values()), near=near,
                                           generated=generated, fences=late)
                self.transfer.count_deduplicated(dupes)
            except Exception:  # a bug must not kill the thread and pin blocks forever
                log.exception("kv_save_crashed", blocks=len(seen))
            self.fences.hold((job.request_id for job in jobs), late)
            with self._cond:
                for job in jobs:
                    left = self._pending[job.request_id] - 1
                    if left:
                        self._pending[job.request_id] = left
                    else:
                        del self._pending[job.request_id]
                self._cond.notify_all()
            if stop:
                return
