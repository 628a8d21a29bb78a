"""Flow control: which requests are routed, in what order, before the scheduler prices them.

- A request that arrived whole and parsed is admitted by its tenant's limits
  (`conductor.tenants`): its concurrency, then its token rate. Over either: 429 with
  Retry-After and the reason (`tenant_concurrency`, `tenant_token_rate`).
- Its priority class is its tenant's, or a lower one its `x-kvcluster-priority` header asks
  for.
- `interactive` requests are routed at once; the scheduler may still refuse them (429).
- `batch` requests are routed under SLOs a share (`batch_slo_share`) of the operator's, so they
  take only the headroom interactive traffic leaves. One the scheduler refuses waits in a
  bounded queue ordered by deadline (arrival + `batch_max_wait_s`), tried again in that order
  whenever capacity frees (a request ends or its prefill completes); at its deadline, or with
  the queue full, it is refused (429: `batch_queue_timeout`, `batch_queue_full`). Interactive
  requests never wait in it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from conductor.errors import InvalidRequest, Overloaded
from conductor.tenants import PRIORITIES, Tenants, TenantState

log = structlog.get_logger(__name__)

PRIORITY_HEADER = "x-kvcluster-priority"
T = TypeVar("T")


@dataclass
class Ticket:
    """A request admitted by its tenant's limits, until `FlowControl.release`."""

    tenant: str
    priority: str
    cost: int
    """Tokens taken from the tenant's bucket: its prompt and the output it may produce."""
    state: TenantState
    arrived: float = field(default_factory=time.monotonic)
    released: bool = False

    @property
    def batch(self) -> bool:
        return self.priority == "batch"


@dataclass(order=True)
class _Waiter:
    deadline: float
    seq: int
    attempt: Callable[[], Any] = field(compare=False)
    done: asyncio.Future = field(compare=False)


class FlowControl:
    def __init__(self, tenants: Tenants, batch_max_wait_s: float, batch_queue_max: int,
                 metrics: Any = None) -> None:
        self.tenants = tenants
        self.batch_max_wait_s = batch_max_wait_s
        self.batch_queue_max = batch_queue_max
        self.metrics = metrics
        """A `conductor.metrics.Metrics` (None in tests of the logic)."""
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._waking = False

    # ---------------------------------------------------------------- admission

    def priority(self, tenant: str, header: str | None) -> str:
        """The class a request runs in: its tenant's, or a lower one its header asks for."""
        top = self.tenants.limits(tenant).priority
        if header is None:
            return top
        asked = header.strip().lower()
        if asked not in PRIORITIES:
            raise InvalidRequest(f"{PRIORITY_HEADER} must be one of {list(PRIORITIES)}, got "
                                 f"{header[:40]!r}", param=PRIORITY_HEADER)
        return max(top, asked, key=PRIORITIES.index)

    def admit(self, tenant: str, priority: str, cost: int, now: float | None = None) -> Ticket:
        """Admit a request by its tenant's limits, or raise Overloaded (429) saying which."""
        now = time.monotonic() if now is None else now
        state = self.tenants.state(tenant)
        limits = state.limits
        if limits.max_concurrency and state.in_flight >= limits.max_concurrency:
            self._refused(state, tenant, priority, "tenant_concurrency")
            raise Overloaded(f"tenant at its limit of {limits.max_concurrency} requests in "
                             "flight; retry when one ends", code="tenant_concurrency",
                             retry_after=1.0)
        if state.bucket is not None:
            wait = state.bucket.take(cost, now)
            if wait:
                self._refused(state, tenant, priority, "tenant_token_rate")
                raise Overloaded(f"tenant over its rate of {limits.tokens_per_s:g} tokens/s "
                                 f"(this request counts {cost})", code="tenant_token_rate",
                                 retry_after=wait)
        state.in_flight += 1
        state.admitted += 1
        if self.metrics is not None:
            self.metrics.tenant_admitted(tenant, priority, state.in_flight)
        return Ticket(tenant, priority, cost, state, now)

    def _refused(self, state: TenantState, tenant: str, priority: str, reason: str) -> None:
        state.rejected += 1
        if self.metrics is not None:
            self.metrics.tenant_rejected(tenant, priority, reason)

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """The request ended having used `used_tokens` of its cost: the rest goes back."""
        if ticket.released:
            return
        ticket.released = True
        state = ticket.state
        state.in_flight -= 1
        if state.bucket is not None and used_tokens < ticket.cost:
            state.bucket.give(ticket.cost - used_tokens)
        if self.metrics is not None:
            self.metrics.tenant_released(ticket.tenant, state.in_flight, used_tokens)

    # ---------------------------------------------------------------- the batch queue

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def place(self, ticket: Ticket, attempt: Callable[[], T],
                    undo: Callable[[T], object]) -> T:
        """`attempt()` (a routing) now, or, for a batch request the scheduler refused
        (Overloaded), again whenever capacity frees, in deadline order, until its deadline.
        `undo` takes back an attempt's result that came too late (its caller was cancelled)."""
        if not ticket.batch:
            return attempt()
        if not self._queue:  # nobody waits before it
            try:
                return attempt()
            except Overloaded:
                pass
        if len(self._queue) >= self.batch_queue_max:
            self._shed(ticket, "batch_queue_full")
            raise Overloaded(f"the batch queue is full ({self.batch_queue_max} waiting); "
                             "retry later", code="batch_queue_full", retry_after=1.0)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(ticket.arrived + self.batch_max_wait_s, next(self._seq), attempt, done)
        heapq.heappush(self._queue, waiter)
        self._depth()
        try:
            async with asyncio.timeout(max(waiter.deadline - time.monotonic(), 0.0)):
                result = await asyncio.shield(done)
        except TimeoutError:
            if not done.done() or done.exception() is not None:
                done.cancel()
                self._shed(ticket, "batch_queue_timeout")
                raise Overloaded(f"no room for this batch request within "
                                 f"{self.batch_max_wait_s:g} s; retry later",
                                 code="batch_queue_timeout", retry_after=1.0) from None
            result = done.result()  # placed at its deadline: it runs
        except asyncio.CancelledError:  # its client left
            if done.done() and not done.cancelled() and done.exception() is None:
                undo(done.result())
            done.cancel()
            raise
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
                heapq.heapify(self._queue)
                self._depth()
        if self.metrics is not None:
            self.metrics.batch_waited(time.monotonic() - ticket.arrived)
        return result

    def freed(self) -> None:
        """Capacity was freed: route the waiting batch requests, earliest deadline first,
        until one still does not fit."""
        if self._waking or not self._queue:
            return
        self._waking = True
        try:
            while self._queue:
                waiter = self._queue[0]
                if waiter.done.done():  # timed out, being removed
                    heapq.heappop(self._queue)
                    continue
                try:
                    result = waiter.attempt()
                except Overloaded:
                    break
                except Exception as e:  # any other answer is the request's own
                    heapq.heappop(self._queue)
                    waiter.done.set_exception(e)
                    continue
                heapq.heappop(self._queue)
                waiter.done.set_result(result)
            self._depth()
        finally:
            self._waking = False

    def _shed(self, ticket: Ticket, reason: str) -> None:
        log.info("batch_shed", tenant=ticket.tenant, reason=reason)
        self._refused(ticket.state, ticket.tenant, ticket.priority, reason)

    def _depth(self) -> None:
        if self.metrics is not None:
            self.metrics.batch_queue_depth(len(self._queue))
