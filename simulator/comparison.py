"""The capacity comparison `make bench-sim` reports, on one cluster, trace and set of SLOs:

- every arm's capacity under SLO per profile on the cluster's own shape (its P/D split, or all
  of its instances colocated for the colocated arms);
- every router at its best split of the same instances (`planner.plan` per router, racing),
  kv_centric's plan checked against an exhaustive sweep of the splits;
- where the TTFT goes, stage by stage, for kv_centric and the best peer at both of their
  capacities (`report.stage_row`).

Each capacity or plan is one task; tasks run in `jobs` worker processes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from simulator.capacity import Arm, Capacity, find_capacity
from simulator.cluster import ClusterSpec
from simulator.engine import Simulation
from simulator.peers import PEERS
from simulator.planner import Plan, plan
from simulator.profile import load_profile
from simulator.report import stage_row
from simulator.sweeps import make_policy
from simulator.trace import TraceRequest, time_scaled

DEFAULT_ARMS = ("kv_centric", "cache_aware", "least_loaded",
                "dynamo", "llm_d", "vllm_router", "smg",
                "dynamo+pool", "llm_d+pool", "vllm_router+pool", "smg+pool",
                "colocated", "colocated+pool")
"""Ours; the peers as they ship (their engines' own caches, KV sent P to D), and the same with
the KV pool under their engines (their routing unchanged); the colocated baseline
(kv_centric's pick, decode on the same instance) without and with the pool."""


@dataclass(frozen=True)
class Options:
    target: float = 0.9
    precision: float = 0.02
    start: float | None = 1.5
    """The first time scale each capacity search probes (None: half the upper bound)."""
    jobs: int = 0
    """Worker processes (0: up to 2)."""


@dataclass(frozen=True)
class Ratios:
    """kv_centric's capacity over the best peer's and the best colocated arm's."""

    profile: str
    kv_centric_rps: float
    best_peer: str
    vs_best_peer: float
    best_colocated: str
    vs_colocated: float
    best_split_kv_centric: str = ""
    best_split_kv_centric_rps: float = 0.0
    best_split_peer: str = ""
    best_split_peer_rps: float = 0.0
    vs_best_peer_best_split: float = 0.0


@dataclass
class Results:
    capacities: dict[tuple[str, str], Capacity]
    """(profile, arm) -> its capacity on the cluster's shape"""
    plans: dict[tuple[str, str], Plan]
    """(profile, router) -> its plan of the same instances"""
    exhaustive: dict[str, Plan]
    """profile -> kv_centric's exhaustive sweep"""
    stages: list[dict]


def shape(spec: ClusterSpec, arm: Arm) -> str:
    s = arm.spec(spec)
    return f"{s.colocated}C" if s.colocated else f"{s.prefill}P+{s.decode}D"


def _capacity(trace: list[TraceRequest], profile: str, spec: ClusterSpec, label: str,
              opt: Options) -> Capacity:
    return find_capacity(trace, load_profile(profile), spec, Arm.named(label), opt.target,
                         opt.precision, start=opt.start)


def _plan(trace: list[TraceRequest], profile: str, spec: ClusterSpec, policy: str,
          opt: Options, exhaustive: bool) -> Plan:
    return plan(trace, load_profile(profile), spec.prefill + spec.decode + spec.colocated,
                spec.ttft_slo_s, spec.tbt_slo_s, policy=policy, pool=policy == "kv_centric",
                target=opt.target, precision=opt.precision, exhaustive=exhaustive)


def _stages(trace: list[TraceRequest], profile: str, spec: ClusterSpec, label: str,
            scale: float, at: str) -> dict:
    arm = Arm.named(label)
    s = arm.spec(spec)
    results = Simulation(time_scaled(trace, scale), load_profile(profile), s,
                         make_policy(arm.policy)).run()
    return stage_row(label, results, s.ttft_slo_s, s.tbt_slo_s, profile=profile, at=at,
                     scale=scale)


def run(trace: list[TraceRequest], profiles: Sequence[str], spec: ClusterSpec,
        arms: Sequence[str] = DEFAULT_ARMS, plan_profiles: Sequence[str] = (),
        exhaustive_profile: str | None = None, opt: Options = Options()) -> Results:
    """Capacities of `arms` per profile; for `plan_profiles`, every router's plan (and, for
    `exhaustive_profile`, kv_centric's exhaustive sweep); then the stage rows."""
    jobs = opt.jobs or min(2, os.cpu_count() or 1)
    with ProcessPoolExecutor(jobs) as pool:
        ex: dict[str, Future] = {}
        if exhaustive_profile:  # the longest task first
            ex[exhaustive_profile] = pool.submit(_plan, trace, exhaustive_profile, spec,
                                                 "kv_centric", opt, True)
        plans = {(p, r): pool.submit(_plan, trace, p, spec, r, opt, False)
                 for p in plan_profiles for r in ("kv_centric", *PEERS)}
        caps = {(p, a): pool.submit(_capacity, trace, p, spec, a, opt)
                for p in profiles for a in arms}
        capacities = {k: f.result() for k, f in caps.items()}
        stage_jobs = []
        for p in profiles:
            if (p, "kv_centric") not in capacities:
                continue
            r = ratios(capacities, p)
            for at, scale in (("best peer capacity", capacities[(p, r.best_peer)].scale),
                              ("kv_centric capacity", capacities[(p, "kv_centric")].scale)):
                if scale > 0:
                    stage_jobs += [pool.submit(_stages, trace, p, spec, label, scale, at)
                                   for label in ("kv_centric", r.best_peer)]
        return Results(capacities, {k: f.result() for k, f in plans.items()},
                       {k: f.result() for k, f in ex.items()},
                       [f.result() for f in stage_jobs])


def ratios(capacities: dict[tuple[str, str], Capacity], profile: str,
           plans: dict[tuple[str, str], Plan] | None = None) -> Ratios:
    mine = {arm: c for (p, arm), c in capacities.items() if p == profile}
    ours = mine["kv_centric"].rate_rps
    peers = [a for a in mine if Arm.named(a).policy in PEERS]
    coloc = [a for a in mine if Arm.named(a).policy == "colocated"]
    peer = max(peers, key=lambda a: mine[a].rate_rps)
    col = max(coloc, key=lambda a: mine[a].rate_rps)
    out = Ratios(profile, ours, peer, _ratio(ours, mine[peer].rate_rps), col,
                 _ratio(ours, mine[col].rate_rps))
    mine_plans = {r: pl for (p, r), pl in (plans or {}).items() if p == profile}
    if "kv_centric" in mine_plans and len(mine_plans) > 1:
        kv = mine_plans["kv_centric"]
        best = max((r for r in mine_plans if r != "kv_centric"),
                   key=lambda r: mine_plans[r].best_rps)
        pb = mine_plans[best]
        out = Ratios(**{**out.__dict__, "best_split_kv_centric": kv.best.label,
                        "best_split_kv_centric_rps": kv.best_rps,
                        "best_split_peer": f"{best} {pb.best.label}",
                        "best_split_peer_rps": pb.best_rps,
                        "vs_best_peer_best_split": _ratio(kv.best_rps, pb.best_rps)})
    return out


def plan_ok(quick: Plan, full: Plan, tolerance: float = 0.05) -> bool:
    """The quick plan's split reaches (by the exhaustive sweep's measure) within `tolerance`
    of the best split's capacity."""
    got = next(c for c in full.candidates if c.split == quick.best)
    return got.capacity_rps >= (1 - tolerance) * full.best_rps


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")
