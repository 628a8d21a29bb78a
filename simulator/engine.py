"""The event loop: requests arrive, the conductor's policy routes them from a snapshot built
exactly as the live conductor builds it, and the cluster runs them.

Per request: dispatch (load counted at once, as `conductor.router.Dispatch` does)
-> prefill on P (after P's queue; its local prefix or the pool's, whichever is longer, pulled
at the transfer cost) -> the KV moves to D (the blocks D's cache lacks) -> D admits it to its
batch when the KV fits -> one token per decode step; the first token's time is the TTFT.

The conductor's view is its real `KVIndex`, fed as the workers feed it: predicted bits at
dispatch, confirmed on prefill and decode completion, removed on every eviction. Its time
models are the profile's (a perfectly fitted conductor).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from conductor.scheduler import (
    POOL,
    ClusterSnapshot,
    KVIndex,
    LoadState,
    Policy,
    Reject,
    Route,
    RouteRequest,
    SchedulerParams,
    loadable_blocks,
)
from simulator.cluster import ClusterSpec, Instance, Job
from simulator.peers.base import EngineMetrics
from simulator.pool import BlockCache
from simulator.profile import LatencyProfile
from simulator.trace import TraceRequest, block_hashes

ARRIVE, DONE, JOIN = 0, 1, 2
"""Event kinds; events at equal times run in the order they were scheduled."""


@dataclass(frozen=True)
class RequestResult:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    rejected: bool = False
    ttft_s: float = float("nan")
    tbt_s: float = float("nan")
    """Mean time between tokens after the first (0 for a single-token output)."""
    finish_s: float = float("nan")
    cached_tokens: int = 0
    """Prompt tokens the prefill engine did not compute (its own cache or the pool's)."""
    pool_tokens: int = 0
    prefill_id: str = ""
    decode_id: str = ""
    stages: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    """Its TTFT by stage, seconds (`STAGES`): queued for its prefill, prefill (pull and
    compute), KV transfer to the decode instance (0 when it prefilled there), waiting there
    for KV room, then the step that makes its first token (and the wait for it)."""


STAGES = ("prefill_queue", "prefill", "kv_transfer", "decode_admit", "first_step")


class Simulation:
    def __init__(self, trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec,
                 policy: Policy, on_arrival: Callable[[], None] | None = None,
                 miss_budget: int | None = None) -> None:
        """`policy` may be a conductor policy or a stateful peer router: if it has `bind`,
        `prefilled` or `finished` (`simulator.peers.base.PeerRouter`), it is given the engines'
        metrics and told of prefill ends and completions. `miss_budget`: stop the run once more
        requests than this have missed an SLO (`aborted` is then set; the results are partial)."""
        self.trace, self.profile, self.spec, self.policy = trace, profile, spec, policy
        self.on_arrival = on_arrival
        self.miss_budget = miss_budget
        self.misses = 0
        self.aborted = False
        bind = getattr(policy, "bind", None)
        if bind is not None:
            bind(self.engine_metrics)
        self._prefilled = getattr(policy, "prefilled", None)
        self._finished = getattr(policy, "finished", None)
        self.params = SchedulerParams(
            ttft_slo_s=spec.ttft_slo_s, tbt_slo_s=spec.tbt_slo_s, prefill=profile.prefill,
            tbt=profile.tbt, transfer_s_per_block=profile.transfer_s_per_block,
            transfer_s_fixed=profile.transfer_s_fixed)
        self.index = KVIndex(max_blocks=4_000_000)
        self.pool = BlockCache(spec.pool_blocks, spec.eviction, self._evicted(POOL))
        self.instances: list[Instance] = []
        for iid, role in spec.roles():
            self.index.add_location(iid)
            cap = profile.kv_capacity_tokens
            load = LoadState(iid, role, profile.block_size, cap if role != "prefill" else 0)
            cache = BlockCache(profile.local_cache_blocks, spec.eviction, self._evicted(iid))
            self.instances.append(Instance(iid, role, load, cache, cap))
        self.by_id = {i.iid: i for i in self.instances}
        self._snap: ClusterSnapshot | None = None
        self._dirty: set[str] = set()
        for inst in self.instances:
            inst.load.on_change = self._dirty.add
        self.results: list[RequestResult] = []
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0

    def _evicted(self, name: str) -> Callable[[int], None]:
        return lambda h: self.index.remove(name, (h,))

    # ------------------------------------------------------------------ loop

    def schedule(self, at: float, kind: int, what: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, self._seq, kind, what))

    def run(self) -> list[RequestResult]:
        for i, r in enumerate(self.trace):
            self.schedule(r.arrival_s, ARRIVE, i)
        while self.events and not self.aborted:
            self.now, _, kind, what = heapq.heappop(self.events)
            self.handle(kind, what)
        return sorted(self.results, key=lambda r: r.index)

    def handle(self, kind: int, what: object) -> None:
        if kind == ARRIVE:
            self.arrive(what)  # type: ignore[arg-type]
        elif kind == DONE:
            self.done(what)  # type: ignore[arg-type]
        else:
            self.join(what)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ routing

    def snapshot(self) -> ClusterSnapshot:
        """As the conductor's registry keeps it: the previous one patched with the instances
        whose load or indexed blocks changed since."""
        idx, dirty = self.index, self._dirty
        dirty.update(idx.take_changed())
        if self._snap is None:
            self._snap = ClusterSnapshot(tuple(i.load.view(idx.blocks(i.iid))
                                               for i in self.instances), self.now, self.params)
        else:
            by_id = self.by_id
            self._snap = self._snap.replacing(
                [by_id[iid].load.view(idx.blocks(iid)) for iid in dirty], self.now)
        dirty.clear()
        return self._snap

    def arrive(self, i: int) -> None:
        if self.on_arrival is not None:
            self.on_arrival()
        r, now = self.trace[i], self.now
        hashes = block_hashes(r, self.profile.block_size)
        decision = self.route(i, hashes)
        if decision is None or isinstance(decision, Reject):
            self.results.append(RequestResult(i, r.arrival_s, r.input_length, r.output_length,
                                              rejected=True))
            self.missed()
            return
        p, d = self.by_id[decision.prefill_id], self.by_id[decision.decode_id]
        job = Job(f"r{i}", i, r, hashes, decision, p, d)
        p.load.add_prefill(job.rid, r.input_length, decision.uncached_tokens,
                           decision.prefill_s, now)
        d.load.add_decode(job.rid, r.input_length, self.finish_at(job))
        self.expect(job)
        p.queue.append(job)
        self.kick(p)

    def route(self, i: int, hashes: tuple[int, ...]) -> Route | Reject | None:
        """The policy's decision for request `i`, from the conductor's view now."""
        r = self.trace[i]
        self.index.expire(self.now)
        req = RouteRequest(r.input_length, hashes, self.index.match(hashes), r.output_length,
                           i + 1)
        return self.policy(self.snapshot(), req)

    def finish_at(self, job: Job) -> float:
        """When the conductor predicts, at dispatch (now), the job's last token."""
        return self.now + job.route.predicted_ttft_s \
            + job.req.output_length * job.route.predicted_tbt_s

    def expected(self, job: Job) -> list[str]:
        """Where a dispatched job's blocks will be: the index's predicted locations."""
        names = [job.prefill.iid]
        if self.spec.use_pool:
            names.append(POOL)
        if job.route.disaggregated:
            names.append(job.decode.iid)
        return names

    def expect(self, job: Job) -> None:
        """Predict the dispatched job's blocks in the index."""
        for name in self.expected(job):
            self.index.predict(name, job.hashes, self.now)

    # ------------------------------------------------------------------ executors

    def kick(self, inst: Instance) -> None:
        """Start the instance's next work if it is idle: a queued prefill, else a step."""
        if inst.busy:
            return
        if inst.queue:
            job = inst.queue.popleft()
            seconds = self.start_prefill(inst, job)
            inst.running_prefill = job
        elif inst.batch:
            inst.stepping = list(inst.batch)
            seconds = self.profile.tbt.predict(len(inst.batch), inst.kv_tokens)
            inst.steps += 1
            inst.step_s += seconds
        else:
            return
        inst.busy_s += seconds
        self.schedule(self.now + seconds, DONE, inst)

    def start_prefill(self, inst: Instance, job: Job) -> float:
        """Seconds of the prefill: pull what the pool has beyond the local cache, compute the
        rest. Hits are taken now, when it starts (a queued twin may have filled the cache)."""
        prof, r, h = self.profile, job.req, job.hashes
        bs = prof.block_size
        loadable = loadable_blocks(r.input_length, bs)
        local = min(inst.cache.match(h), loadable)
        pool = min(self.pool.match(h), loadable) if self.spec.use_pool else 0
        cached = max(local, pool)
        inst.cache.touch(h[:local])
        if pool > local:
            self.pool.touch(h[:pool])
        job.prefill_at = self.now
        job.cached_tokens, job.pool_tokens = cached * bs, max(pool - local, 0) * bs
        pull = prof.transfer_s_fixed + (pool - local) * prof.transfer_s_per_block \
            if pool > local else 0.0
        return pull + prof.prefill.predict(r.input_length - cached * bs, cached * bs)

    def done(self, inst: Instance) -> None:
        job = inst.running_prefill
        if job is not None:
            inst.running_prefill = None
            self.end_prefill(inst, job)
        else:
            self.end_step(inst)
        self.kick(inst)

    def end_prefill(self, inst: Instance, job: Job) -> None:
        h = job.hashes
        inst.cache.insert(h)
        self.index.store(inst.iid, h)
        if self.spec.use_pool:
            self.pool.insert(h)
            self.index.store(POOL, h)
        inst.load.end_prefill(job.rid, self.now)
        job.prefilled_at = self.now
        if self._prefilled is not None:
            self._prefilled(job.index + 1)
        d = job.decode
        if d is inst:
            self.join(job)
            return
        lack = len(h) - min(d.cache.match(h), len(h))
        prof = self.profile
        d.arriving += 1
        self.schedule(self.now + prof.transfer_s_fixed + lack * prof.transfer_s_per_block,
                      JOIN, job)

    def join(self, job: Job) -> None:
        """The request's KV is on its decode instance: run it when it fits."""
        d = job.decode
        job.joined_at = self.now
        if d is not job.prefill:
            d.arriving -= 1
        if d.waiting or not d.fits(job):
            d.waiting.append(job)
        else:
            self.admit(d, job)
        self.kick(d)

    def admit(self, d: Instance, job: Job) -> None:
        job.admitted_at = self.now
        d.batch.append(job)
        d.kv_tokens += job.req.input_length
        d.kv_reserved += job.req.input_length + job.req.output_length

    def end_step(self, inst: Instance) -> None:
        now = self.now
        stepping, inst.stepping = inst.stepping or [], None
        inst.kv_tokens += len(stepping)
        finished = []
        for job in stepping:
            job.generated += 1
            if job.generated == 1:
                job.first_token_at = now
                if now - job.req.arrival_s > self.spec.ttft_slo_s:
                    self.missed(job)
            job.last_token_at = now
            inst.load.decode_progress(job.rid, 1)
            if job.generated >= job.req.output_length:
                finished.append(job)
        for job in finished:
            self.finish(inst, job)
        while inst.waiting and inst.fits(inst.waiting[0]):
            self.admit(inst, inst.waiting.popleft())

    def finish(self, d: Instance, job: Job) -> None:
        r = job.req
        d.batch.remove(job)
        d.kv_tokens -= r.input_length + job.generated
        d.kv_reserved -= r.input_length + r.output_length
        d.cache.insert(job.hashes)
        self.index.store(d.iid, job.hashes)
        d.load.end_decode(job.rid)
        if self._finished is not None:
            self._finished(job.index + 1)
        steps = job.generated - 1
        tbt = (job.last_token_at - job.first_token_at) / steps if steps else 0.0
        if tbt > self.spec.tbt_slo_s:
            self.missed(job)
        self.results.append(RequestResult(
            job.index, r.arrival_s, r.input_length, r.output_length,
            ttft_s=job.first_token_at - r.arrival_s, tbt_s=tbt,
            finish_s=self.now, cached_tokens=job.cached_tokens, pool_tokens=job.pool_tokens,
            prefill_id=job.prefill.iid, decode_id=d.iid,
            stages=(job.prefill_at - r.arrival_s, job.prefilled_at - job.prefill_at,
                    job.joined_at - job.prefilled_at, job.admitted_at - job.joined_at,
                    job.first_token_at - job.admitted_at)))

    def missed(self, job: Job | None = None) -> None:
        """Count a request that misses an SLO (once); past the budget, the run stops."""
        if job is not None:
            if job.missed:
                return
            job.missed = True
        self.misses += 1
        if self.miss_budget is not None and self.misses > self.miss_budget:
            self.aborted = True

    # ------------------------------------------------------------------ metrics

    def engine_metrics(self) -> dict[str, EngineMetrics]:
        """Every engine's metrics as a router would scrape them now."""
        bs = self.profile.block_size
        out = {}
        for i in self.instances:
            prompt = i.running_prefill.req.input_length if i.running_prefill else 0
            cap = i.kv_capacity_tokens
            out[i.iid] = EngineMetrics(
                waiting=len(i.queue) + len(i.waiting) + i.arriving,
                running=(i.running_prefill is not None) + len(i.batch),
                kv_usage=min((i.kv_tokens + prompt) / cap, 1.0) if cap else 0.0,
                cache_blocks=cap // bs)
        return out
