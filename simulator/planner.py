"""The planner: for N instances, which prefill/decode split (or all colocated) serves a trace
at the highest rate within the SLOs, and the capacity each candidate reaches.

`plan` is a pure function of a trace and a `LatencyProfile`; the profile is the conductor's
own models (`LatencyProfile.from_models`: prefill time, TBT, transfer time per block, KV and
cache sizes), so the live conductor can call it on what it has fitted.

Pruning (racing): candidates are taken in the order of a closed-form estimate (prefill rate
from the trace's cacheable work, decode rate from the KV memory and the TBT SLO). The first
gets a full bisection (`capacity.find_capacity`). Every later one first runs once at the best
capacity so far times `1 + precision`: if that probe fails, the candidate cannot beat the best
by more than the precision and is left there (one run, usually cut short by its miss budget);
if it holds, its bisection continues from that probe and it may become the best. So only the
candidates that win a race pay for a bisection; `exhaustive=True` bisects every candidate.
Assuming attainment falls with the rate, the split recommended is within `precision` of the
best the exhaustive search finds (plus both searches' own `precision`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from simulator.capacity import (
    Arm,
    base_rate,
    find_capacity,
    max_scale,
    probe,
    upper_bound,
)
from simulator.cluster import ClusterSpec
from simulator.profile import LatencyProfile
from simulator.trace import TraceRequest, ideal_hit_ratio


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int
    colocated: int = 0

    @property
    def label(self) -> str:
        return f"{self.colocated}C" if self.colocated else f"{self.prefill}P+{self.decode}D"

    def spec(self, ttft_slo_s: float, tbt_slo_s: float) -> ClusterSpec:
        return ClusterSpec(prefill=self.prefill, decode=self.decode, colocated=self.colocated,
                           ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s)


@dataclass(frozen=True)
class Candidate:
    split: Split
    estimate_rps: float
    """The closed-form estimate the candidates were ordered by."""
    capacity_rps: float
    """The highest rate found to hold (0: none probed held)."""
    below_rps: float
    """A rate found not to hold (inf: none): the capacity is under it."""
    runs: int
    pruned: bool
    """Left after losing its race (one probe), not bisected."""
    saturated: bool = False
    """It served the whole trace arriving at once (`Capacity.saturated`): a lower bound."""


@dataclass(frozen=True)
class Plan:
    best: Split
    best_rps: float
    candidates: tuple[Candidate, ...]
    runs: int
    cpu_s: float


def splits(instances: int, colocated: bool = True) -> list[Split]:
    """Every prefill/decode split of `instances` (each role at least one), and all colocated."""
    out = [Split(p, instances - p) for p in range(1, instances)]
    return out + [Split(0, 0, instances)] if colocated else out


@dataclass(frozen=True)
class Workload:
    """What the closed-form estimate needs of a trace."""

    mean_in: float
    mean_out: float
    cached: float
    """Mean prompt tokens the trace's own reuse can serve from a cache."""

    @staticmethod
    def of(trace: list[TraceRequest], block_size: int) -> Workload:
        n = len(trace)
        mean_in = sum(r.input_length for r in trace) / n
        return Workload(mean_in, sum(r.output_length for r in trace) / n,
                        mean_in * ideal_hit_ratio(trace, block_size))


def estimate_rps(work: Workload, profile: LatencyProfile, split: Split,
                 tbt_slo_s: float) -> float:
    """A rough sustainable rate: the lesser of the prefill rate (the mean prompt with the
    trace's own reuse cached) and the decode rate (the batch the KV memory and the TBT SLO
    allow, over a request's decode time); colocated instances share their time between the
    two."""
    t_prefill = profile.prefill.predict(int(work.mean_in - work.cached), int(work.cached))
    tm = profile.tbt
    per_seq = tm.per_seq_s + tm.per_kv_token_s * (work.mean_in + work.mean_out / 2)
    batch = max(min(profile.kv_capacity_tokens / (work.mean_in + work.mean_out),
                    (tbt_slo_s - tm.base_s) / per_seq if per_seq else math.inf), 1.0)
    t_decode = work.mean_out * (tm.base_s + per_seq * batch)
    if split.colocated:
        return split.colocated / (t_prefill + t_decode / batch)
    return min(split.prefill / t_prefill, split.decode * batch / t_decode)


def arm_for(split: Split, policy: str, pool: bool) -> Arm:
    """The routing a candidate runs: `policy` on a split; on all-colocated instances, the
    policy's own single-pool mode (for kv_centric: its pick with the decode on the same
    instance, `sweeps.colocated`)."""
    suffix = "+pool" if pool else ""
    if split.colocated:
        name = "colocated" if policy == "kv_centric" else policy
        return Arm(f"{name}{suffix}@colocated", name, pool, True)
    return Arm(policy + suffix, policy, pool)


def plan(trace: list[TraceRequest], profile: LatencyProfile, instances: int,
         ttft_slo_s: float, tbt_slo_s: float, policy: str = "kv_centric", pool: bool = True,
         colocated: bool = True, target: float = 0.9, precision: float = 0.02,
         max_runs: int = 12, exhaustive: bool = False) -> Plan:
    """The best split of `instances` for `trace` under the SLOs (see the module docstring)."""
    cpu0 = time.process_time()
    rate = base_rate(trace)
    work = Workload.of(trace, profile.block_size)
    order = sorted(((estimate_rps(work, profile, s, tbt_slo_s), s)
                    for s in splits(instances, colocated)), key=lambda e: -e[0])
    best_scale, runs = 0.0, 0
    out: list[Candidate] = []
    for est, split in order:
        spec = split.spec(ttft_slo_s, tbt_slo_s)
        arm = arm_for(split, policy, pool)
        bound = upper_bound(trace, profile, spec, target)
        if best_scale == 0.0 or exhaustive:
            start = min(est / rate if best_scale == 0.0 else best_scale, bound / 2)
            cap = find_capacity(trace, profile, spec, arm, target, precision, max_runs,
                                start=start, bound=bound)
            n = len(cap.probes)
        else:
            x = min(best_scale * (1 + precision), max_scale(trace))
            first = probe(trace, profile, spec, arm, x, target)
            if not first.feasible:
                runs += 1
                out.append(Candidate(split, est, 0.0, x * rate, 1, True))
                continue
            cap = find_capacity(trace, profile, spec, arm, target, precision, max_runs - 1,
                                start=x * (1 + 4 * precision), bound=bound, feasible_at=x)
            n = 1 + len(cap.probes)
        runs += n
        out.append(Candidate(split, est, cap.rate_rps, cap.hi_scale * rate, n, False,
                             cap.saturated))
        best_scale = max(best_scale, cap.scale)
    best = max(out, key=lambda c: c.capacity_rps)
    return Plan(best.split, best.capacity_rps, tuple(out), runs, time.process_time() - cpu0)
