"""Capacity under SLO: the highest arrival rate (the trace time-scaled) at which at least
`target` of the requests meet both the TTFT and the TBT SLO, found by bisection.

A probe runs the trace at one scale and stops as soon as more requests have missed than the
target allows (`Simulation.miss_budget`): an infeasible probe costs a fraction of a run.
The search brackets the capacity between a feasible scale `lo` and an infeasible one `hi`:
it starts below `upper_bound` (a rate no policy can sustain on that cluster, from the
trace's work and the cluster's executors and KV memory), halves until a probe holds, then
bisects geometrically until `hi / lo <= 1 + precision` or `max_runs` probes have run. The
capacity reported is `lo`: within `precision` of the true threshold if attainment falls
monotonically with the rate (it is a simulation of queues, so close to but not exactly so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from conductor.scheduler import loadable_blocks
from simulator.cluster import ClusterSpec
from simulator.engine import Simulation
from simulator.profile import LatencyProfile
from simulator.sweeps import POOL_POLICIES, make_policy
from simulator.trace import TraceRequest, block_hashes, time_scaled


@dataclass(frozen=True)
class Arm:
    """A routing setup to measure: a policy (conductor, `colocated` or a peer), with or
    without the KV pool, on the cluster's disaggregated shape or all of it colocated."""

    label: str
    policy: str
    pool: bool
    colocated: bool = False

    def spec(self, base: ClusterSpec) -> ClusterSpec:
        if self.colocated:
            base = replace(base, prefill=0, decode=0,
                           colocated=base.prefill + base.decode + base.colocated)
        return replace(base, use_pool=self.pool)

    @staticmethod
    def named(label: str) -> Arm:
        """`policy[+pool|-pool][@colocated]`; without a suffix the pool is on for the
        policies that use it (`sweeps.POOL_POLICIES`); `colocated` (kv_centric's pick with
        the decode on the same instance) always runs colocated."""
        name, _, where = label.partition("@")
        if where not in ("", "colocated"):
            raise ValueError(f"unknown shape {where!r} in {label!r}")
        pool = name in POOL_POLICIES
        for suffix, on in (("+pool", True), ("-pool", False)):
            if name.endswith(suffix):
                name, pool = name.removesuffix(suffix), on
        return Arm(label, name, pool, where == "colocated" or name == "colocated")


@dataclass(frozen=True)
class Probe:
    scale: float
    feasible: bool
    attainment: float
    """Over all requests; for a stopped probe, an upper bound (the misses so far)."""
    stopped: bool


@dataclass(frozen=True)
class Capacity:
    arm: str
    scale: float
    """The highest feasible time scale found (0: none)."""
    rate_rps: float
    """`scale` as requests per second of the trace's arrival span."""
    hi_scale: float
    """The lowest infeasible scale found (or the upper bound)."""
    attainment: float
    """At `scale`."""
    probes: tuple[Probe, ...]
    bound_scale: float
    saturated: bool = False
    """The search reached `max_scale` with every probe holding: the trace arrives nearly at
    once and the cluster still serves it, so `scale` is only a lower bound (a longer trace
    would be needed to find the capacity)."""


def base_rate(trace: list[TraceRequest]) -> float:
    """Requests per second of the trace at scale 1."""
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 1.0
    return len(trace) / (span or 1.0)


def miss_budget(n: int, target: float) -> int:
    """Misses allowed among `n` requests for attainment >= target."""
    return n - math.ceil(target * n - 1e-9)


def probe(trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec, arm: Arm,
          scale: float, target: float) -> Probe:
    """One run of `arm` at `scale`, stopped once it cannot reach `target`."""
    budget = miss_budget(len(trace), target)
    sim = Simulation(time_scaled(trace, scale), profile, arm.spec(spec),
                     make_policy(arm.policy), miss_budget=budget)
    sim.run()
    n = len(trace)
    return Probe(scale, not sim.aborted, (n - sim.misses) / n, sim.aborted)


def upper_bound(trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec,
                target: float) -> float:
    """A time scale above which no policy meets `target` on this cluster.

    The served requests (at least `target` of them) need at least the smallest `target`
    share of: prefill time with every prefix the trace repeats cached (on any executor, for
    policies that prefill on decode instances too), per-request decode work (each token's
    `per_seq + per_kv_token * prompt`, on decode-capable instances), and KV-token-seconds
    (the prompt held for at least `output - 1` steps of `tbt.base_s`). Each must fit in its
    executors' or KV memory's time: the arrival span plus the time a last request may take
    within its SLOs (its TTFT SLO for prefill alone)."""
    bs = profile.block_size
    seen: set[int] = set()
    prefill, decode, kv = [], [], []
    tm = profile.tbt
    for r in trace:
        h = block_hashes(r, bs)
        k = 0
        while k < len(h) and h[k] in seen:
            k += 1
        seen.update(h)
        cached = min(k, loadable_blocks(r.input_length, bs)) * bs
        prefill.append(profile.prefill.predict(r.input_length - cached, cached))
        decode.append(r.output_length * (tm.per_seq_s + tm.per_kv_token_s * r.input_length))
        kv.append(r.input_length * max(r.output_length - 1, 0) * tm.base_s)
    keep = math.ceil(target * len(trace) - 1e-9)
    w_p, w_d, w_kv = (sum(sorted(x)[:keep]) for x in (prefill, decode, kv))
    executors = spec.prefill + spec.decode + spec.colocated
    decoders = spec.decode + spec.colocated
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 1.0
    tail = spec.ttft_slo_s + max(r.output_length for r in trace) * spec.tbt_slo_s
    scale = math.inf
    for work, capacity, late in ((w_p, executors, spec.ttft_slo_s), (w_p + w_d, executors, tail),
                                 (w_d, decoders, tail),
                                 (w_kv, decoders * profile.kv_capacity_tokens, tail)):
        need = work / capacity - late if capacity else math.inf
        if need > 0:
            scale = min(scale, span / need)
    return scale


def max_scale(trace: list[TraceRequest]) -> float:
    """The scale at which the whole trace arrives within one second: searches stop there."""
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 0.0
    return max(span, 1.0)


def find_capacity(trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec,
                  arm: Arm, target: float = 0.9, precision: float = 0.02, max_runs: int = 12,
                  start: float | None = None, bound: float | None = None,
                  feasible_at: float = 0.0) -> Capacity:
    """Bisect `arm`'s capacity. `start`: the first scale to probe (default: half the bound);
    `feasible_at`: a scale already known to hold (a lower end for the bracket)."""
    if bound is None:
        bound = upper_bound(trace, profile, spec, target)
    top = max_scale(trace)
    hi = bound * (1 + 1e-9) if bound <= top else math.inf
    lo, lo_att = feasible_at, math.nan
    probes: list[Probe] = []
    x = min(start if start is not None else (bound / 2 if math.isfinite(hi) else 1.0), top)
    while len(probes) < max_runs:
        p = probe(trace, profile, spec, arm, x, target)
        probes.append(p)
        if p.feasible:
            lo, lo_att = x, p.attainment
        else:
            hi = x
        if (lo > 0 and hi / lo <= 1 + precision) or lo >= top:
            break
        if lo > 0:
            x = math.sqrt(lo * hi) if math.isfinite(hi) else min(lo * 2, top)
        else:
            x = hi / 2
    return Capacity(arm.label, lo, lo * base_rate(trace), hi, lo_att, tuple(probes), bound,
                    saturated=lo >= top)
