"""Requests whose blocks a pool call may still read or write after the pool stopped waiting
for it (its timeout: `store.pool.ZeroCopyPool.get_into`'s `fences`), until every such call has
returned, however long that takes: a late transfer must never land in (or read) memory vLLM
gave to another request. Each call releases its requests from the thread that ran it, and
`released` learns how long each request was held.

The worker side keeps a held request's blocks from vLLM meanwhile
(`store.connector.worker.WorkerSide`): it reports neither its load (vLLM frees a request's
blocks as its load reports when it was aborted meanwhile, or kept no valid block) nor the end
of its saves (a finished request's blocks go as those report), and before a step that may
reuse a preempted request's blocks it waits for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import structlog

from store.pool import Fences

log = structlog.get_logger(__name__)


class RequestFences:
    def __init__(self, released: Callable[[float], None] | None = None) -> None:
        self.released = released
        """Called once per request let go, with the seconds it was held."""
        self._cond = threading.Condition()
        self._open: dict[str, int] = {}
        """Request id -> calls not done yet."""
        self._since: dict[str, float] = {}

    def hold(self, request_ids: Iterable[str], fences: Fences) -> None:
        """Keep `request_ids` held until every call in `fences` is done."""
        rids = sorted(set(request_ids))
        if not fences or not rids:
            return
        now = time.monotonic()
        with self._cond:
            for rid in rids:
                self._open[rid] = self._open.get(rid, 0) + len(fences)
                self._since.setdefault(rid, now)
        log.warning("pool_call_abandoned_blocks_held", requests=rids, calls=len(fences))
        for fence in fences:
            fence.add_done_callback(lambda _: self._release(rids))

    def _release(self, rids: list[str]) -> None:
        now = time.monotonic()
        freed: dict[str, float] = {}
        with self._cond:
            for rid in rids:
                left = self._open[rid] - 1
                if left:
                    self._open[rid] = left
                else:
                    del self._open[rid]
                    freed[rid] = now - self._since.pop(rid)
            self._cond.notify_all()
        if not freed:
            return
        log.info("pool_call_abandoned_blocks_released", requests=sorted(freed),
                 held_s=round(max(freed.values()), 3))
        if self.released is not None:
            for seconds in freed.values():
                self.released(seconds)

    def held(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._open

    def wait(self, request_ids: set[str], timeout: float | None = None) -> bool:
        """Until none of `request_ids` is held (None: however long that takes), or the
        timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not request_ids & self._open.keys(), timeout)
