"""Requests whose blocks a pool call may still read or write after the pool stopped waiting
for it (its timeout: `store.pool.ZeroCopyPool.get_into`'s `fences`). Their blocks stay
allocated until every such call is done, so that a late transfer never lands in (or reads)
memory vLLM gave to another request. The worker side reports a fenced request finished only
then; each call releases its requests from the thread that ran it.

A late load writes the pool's bytes for the same keys (the same tokens under the same
namespace) into blocks the request is recomputing: the KV it would have loaded. But vLLM
frees a request's blocks as soon as its load reports (`finished_recving`) when the request
was aborted, and when it kept no valid block (no local prefix hit and the first block failed:
`Scheduler._update_waiting_for_remote_kv` frees them "for a local cache hit on retry"). Such
a load is reported only once its calls are done
(`store.connector.worker.WorkerSide.get_finished`). Reported at once, a late write could
land in blocks vLLM had since given to another prompt and prefix-cached: that prompt would
be answered wrong from its first token by every later request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import structlog

from store.pool import Fences

log = structlog.get_logger(__name__)


class RequestFences:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open: dict[str, int] = {}
        """Request id -> calls not done yet."""

    def hold(self, request_ids: Iterable[str], fences: Fences) -> None:
        """Keep `request_ids` held until every call in `fences` is done."""
        rids = sorted(set(request_ids))
        if not fences or not rids:
            return
        with self._cond:
            for rid in rids:
                self._open[rid] = self._open.get(rid, 0) + len(fences)
        log.warning("pool_call_abandoned_blocks_held", requests=rids, calls=len(fences))
        t0 = time.monotonic()
        for fence in fences:
            fence.add_done_callback(lambda _: self._release(rids, t0))

    def _release(self, rids: list[str], t0: float) -> None:
        freed = []
        with self._cond:
            for rid in rids:
                left = self._open[rid] - 1
                if left:
                    self._open[rid] = left
                else:
                    del self._open[rid]
                    freed.append(rid)
            self._cond.notify_all()
        if freed:  # how long a given-up call held them: what a request withheld for it waited
            log.info("pool_call_abandoned_blocks_released", requests=freed,
                     held_s=round(time.monotonic() - t0, 3))

    def held(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._open

    def wait(self, request_ids: set[str], timeout: float) -> bool:
        """Until none of `request_ids` is held, or the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not request_ids & self._open.keys(), timeout)
