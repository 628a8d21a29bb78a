"""Several conductor replicas (active-active behind a load balancer), each routing its share
of the requests with the same policy from a view that learns the other replicas' dispatches
only from the workers' load reports.

The model:
- The load balancer: request i goes to replica i mod N (`round_robin`), or to a replica drawn
  from a seeded generator (`random`).
- Every `sync_period_s`, at the same ticks for all, each worker reports its load: a report
  carries exactly what one conductor routing every request would have counted at that tick
  (the prefill queue and its predicted work, running sequences, KV in use, the predicted
  finishes) and the blocks it was asked to compute.
- A replica's view of an instance is its last report plus its own dispatches since (not yet
  acknowledged by a report). Completions, its own included, show at the next report.
- The KV index is one per replica. Confirmed bits (KV events and evictions) reach every replica
  at once, as they reach one conductor: each replica follows the same event streams. A
  replica predicts the blocks of its own dispatches at once and those of another's at the
  next report.

With `sync_period_s` 0 every replica sees every dispatch at once and the run equals one
conductor's, decision for decision. Only pure conductor policies replicate (a stateful peer
router would need one state per replica).
"""

from __future__ import annotations

import random
from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from conductor.scheduler import (
    ClusterSnapshot,
    InstanceLoad,
    KVIndex,
    Policy,
    Reject,
    Route,
    RouteRequest,
)
from simulator.cluster import ClusterSpec, Job
from simulator.engine import RequestResult, Simulation
from simulator.profile import LatencyProfile
from simulator.trace import TraceRequest

SYNC = 3
"""The event kind of a report tick (after `engine.ARRIVE, DONE, JOIN`)."""

SPREADS = ("round_robin", "random")


@dataclass
class Unacked:
    """One replica's dispatches to one instance since the last report, counted as
    `conductor.scheduler.LoadState` counts them."""

    requests: set[str] = field(default_factory=set)
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    work_s: float = 0.0
    first_at: float = 0.0
    """When the first of its prefills was dispatched."""
    prefills: int = 0
    kv_tokens: int = 0
    finishes: list[float] = field(default_factory=list)

    def add_prefill(self, rid: str, prompt: int, uncached: int, seconds: float,
                    now: float) -> None:
        if not self.prefills:
            self.first_at = now
        self.prefills += 1
        self.requests.add(rid)
        self.prompt_tokens += prompt
        self.uncached_tokens += uncached
        self.work_s += seconds

    def add_decode(self, rid: str, prompt: int, finish_at: float) -> None:
        self.requests.add(rid)
        self.kv_tokens += prompt
        insort(self.finishes, finish_at)

    def over(self, report: InstanceLoad) -> InstanceLoad:
        """The report with these dispatches added: a prefill queue the report holds ends
        their work later; an empty one starts at the first of them."""
        busy = report.busy_until
        if self.prefills:
            busy = (busy if report.queued_prompt_tokens else self.first_at) + self.work_s
        return replace(
            report, in_flight=report.in_flight + len(self.requests),
            queued_prompt_tokens=report.queued_prompt_tokens + self.prompt_tokens,
            queued_uncached_tokens=report.queued_uncached_tokens + self.uncached_tokens,
            busy_until=busy, running=report.running + len(self.finishes),
            kv_tokens=report.kv_tokens + self.kv_tokens,
            finishes=tuple(sorted(report.finishes + tuple(self.finishes))))


class ReplicatedSimulation(Simulation):
    """The cluster run by `replicas` conductors as the module describes; request i is routed
    by replica `replica_of[i]`."""

    def __init__(self, trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec,
                 policy: Policy, replicas: int = 1, sync_period_s: float = 0.0,
                 spread: str = "round_robin", seed: int = 1,
                 on_arrival: Callable[[], None] | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1: {replicas}")
        if sync_period_s < 0:
            raise ValueError(f"sync_period_s must be >= 0: {sync_period_s}")
        if spread not in SPREADS:
            raise ValueError(f"spread must be one of {SPREADS}: {spread!r}")
        if any(hasattr(policy, a) for a in ("bind", "prefilled", "finished")):
            raise ValueError("only a pure conductor policy replicates")
        super().__init__(trace, profile, spec, policy, on_arrival)
        self.replicas, self.period = replicas, sync_period_s
        draw = random.Random(seed)
        self.replica_of = [i % replicas if spread == "round_robin" else draw.randrange(replicas)
                           for i in range(len(trace))]
        self.indexes = [KVIndex(max_blocks=self.index.max_blocks) for _ in range(replicas)]
        for idx in self.indexes:
            for name in self.index.locations():
                idx.add_location(name)
        self.index = _Confirmed(self.indexes)  # type: ignore[assignment]
        self.reports = {i.iid: i.load.view() for i in self.instances}
        self.unacked: list[dict[str, Unacked]] = [{} for _ in range(replicas)]
        self.unheard: list[list[tuple[list[str], tuple[int, ...]]]] = [
            [] for _ in range(replicas)]
        """Per replica, the predictions of the others' dispatches it has not had reported."""

    def run(self) -> list[RequestResult]:
        if self.period > 0:
            self.schedule(self.period, SYNC, None)
        return super().run()

    def handle(self, kind: int, what: object) -> None:
        if kind == SYNC:
            self.sync()
        else:
            super().handle(kind, what)

    def sync(self) -> None:
        """A report tick: every replica's view of every instance is what one conductor would
        count now, and the others' predicted blocks are in its index."""
        self.reports = {i.iid: i.load.view() for i in self.instances}
        for k in range(self.replicas):
            self.unacked[k].clear()
            idx = self.indexes[k]
            for names, hashes in self.unheard[k]:
                for name in names:
                    idx.predict(name, hashes, self.now)
            self.unheard[k].clear()
        if self.events:
            self.schedule(self.now + self.period, SYNC, None)

    # ------------------------------------------------------------------ one replica's view

    def route(self, i: int, hashes: tuple[int, ...]) -> Route | Reject | None:
        r, now = self.trace[i], self.now
        for idx in self.indexes:
            idx.expire(now)
        idx = self.indexes[self.replica_of[i]]
        req = RouteRequest(r.input_length, hashes, idx.match(hashes), r.output_length, i + 1)
        return self.policy(self.view(self.replica_of[i]), req)

    def view(self, k: int) -> ClusterSnapshot:
        """Replica k's snapshot: the last reports and its own dispatches since; with no
        period, the load as one conductor counts it."""
        idx, mine = self.indexes[k], self.unacked[k]
        if self.period == 0:
            loads = tuple(i.load.view(idx.blocks(i.iid)) for i in self.instances)
        else:
            loads = tuple(self._seen(self.reports[i.iid], mine.get(i.iid), idx.blocks(i.iid))
                          for i in self.instances)
        return ClusterSnapshot(loads, self.now, self.params)

    @staticmethod
    def _seen(report: InstanceLoad, mine: Unacked | None, blocks: int) -> InstanceLoad:
        load = mine.over(report) if mine is not None else report
        return load if load.cached_blocks == blocks else replace(load, cached_blocks=blocks)

    def expect(self, job: Job) -> None:
        k, now = self.replica_of[job.index], self.now
        names = self.expected(job)
        for n, idx in enumerate(self.indexes):
            if n == k or self.period == 0:
                for name in names:
                    idx.predict(name, job.hashes, now)
            else:
                self.unheard[n].append((names, job.hashes))
        if self.period > 0:
            rt, r = job.route, job.req
            mine = self.unacked[k]
            mine.setdefault(job.prefill.iid, Unacked()).add_prefill(
                job.rid, r.input_length, rt.uncached_tokens, rt.prefill_s, now)
            mine.setdefault(job.decode.iid, Unacked()).add_decode(
                job.rid, r.input_length, self.finish_at(job))

    def mean_step_s(self) -> float:
        """The mean decode step of the run so far (0: none ran)."""
        steps = sum(i.steps for i in self.instances)
        return sum(i.step_s for i in self.instances) / steps if steps else 0.0


class _Confirmed:
    """The engine's confirmed index updates, to every replica's index at once."""

    def __init__(self, indexes: list[KVIndex]) -> None:
        self.indexes = indexes

    def store(self, name: str, hashes: tuple[int, ...]) -> None:
        for idx in self.indexes:
            idx.store(name, hashes)

    def remove(self, name: str, hashes: tuple[int, ...]) -> None:
        for idx in self.indexes:
            idx.remove(name, hashes)
