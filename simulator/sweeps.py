"""Runs and sweeps: one policy over a trace, load (time scale), pool capacity, prefix reuse,
conductor replicas."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from conductor.scheduler import (
    POLICIES,
    ClusterSnapshot,
    Policy,
    Reject,
    Route,
    RouteRequest,
    loadable_blocks,
)
from simulator.cluster import ClusterSpec
from simulator.engine import RequestResult, Simulation
from simulator.peers import PEERS
from simulator.peers import make as make_peer
from simulator.pool import BlockCache
from simulator.profile import LatencyProfile
from simulator.replicas import ReplicatedSimulation
from simulator.report import metrics_rows, summarize
from simulator.trace import TraceRequest, block_hashes, thinned_reuse, time_scaled

POOL_POLICIES = ("kv_centric",)
"""Policies that use the KV pool; the others see only the engines' own caches, as in the
paper's routing study (random, load-balancing, local cache-aware vs. global KV-centric)."""


def colocated(snap: ClusterSnapshot, req: RouteRequest) -> Route | Reject | None:
    """The colocated baseline on instances that both prefill and decode: kv_centric's prefill
    choice (best predicted TTFT with the local caches), and the decode on that same instance.
    Our adapter: no conductor policy pins p == d for any prompt length."""
    r = POLICIES["kv_centric"](snap, req)
    if not isinstance(r, Route) or not r.disaggregated:
        return r
    return replace(r, decode_id=r.prefill_id)


def make_policy(name: str) -> Policy:
    """A conductor policy, `colocated`, or a fresh peer router (`simulator.peers`) by name."""
    if name == "colocated":
        return colocated
    if name in PEERS:
        return make_peer(name)
    return POLICIES[name]


def run_policy(trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec,
               name: str, tick: Callable[[], None] | None = None,
               pool: bool | None = None) -> list[RequestResult]:
    """One run of a named policy (or `colocated`, or a peer); the pool is on for
    POOL_POLICIES unless `pool` says otherwise."""
    use = name in POOL_POLICIES if pool is None else pool
    spec = replace(spec, use_pool=spec.use_pool and use)
    return Simulation(trace, profile, spec, make_policy(name), tick).run()


def capacity_hit_ratio(trace: list[TraceRequest], block_size: int, capacity: int | None,
                       eviction: str) -> float:
    """Hit ratio of a pool alone that every prefill reads and writes, in arrival order:
    loadable prefix tokens held / prompt tokens (no cluster, no timing)."""
    cache = BlockCache(capacity, eviction)
    hit = total = 0
    for r in trace:
        h = block_hashes(r, block_size)
        k = min(cache.match(h), loadable_blocks(r.input_length, block_size))
        cache.touch(h[:k])
        cache.insert(h)
        hit += k * block_size
        total += r.input_length
    return hit / total if total else 0.0


def capacity_sweep(trace: list[TraceRequest], block_size: int, capacities: Sequence[int | None],
                   evictions: Sequence[str] = ("lru", "lfu")) -> list[dict]:
    return [{"eviction": ev, "capacity_blocks": cap if cap is not None else "unlimited",
             "hit_ratio": capacity_hit_ratio(trace, block_size, cap, ev)}
            for ev in evictions for cap in capacities]


def load_runs(trace: list[TraceRequest], scales: Sequence[float]
              ) -> list[tuple[float, list[TraceRequest]]]:
    return [(s, time_scaled(trace, s)) for s in scales]


def reuse_traces(trace: list[TraceRequest], keeps: Sequence[float]
                 ) -> list[tuple[float, list[TraceRequest]]]:
    return [(k, thinned_reuse(trace, k)) for k in keeps]


def replica_sweep(trace: list[TraceRequest], profile: LatencyProfile, spec: ClusterSpec,
                  counts: Sequence[int], periods: Sequence[float | None],
                  policy: str = "kv_centric", spread: str = "round_robin",
                  tick: Callable[[], None] | None = None) -> list[dict]:
    """One conductor (one replica, no sync period), then every replica count x sync period;
    a period of None is one report per decode step, the first run's mean step. Every row
    carries its TTFT p50/p90 and hit ratio over the first row's (`*_vs_one`)."""
    use = replace(spec, use_pool=spec.use_pool and policy in POOL_POLICIES)
    rows: list[dict] = []
    step = 0.0
    for n, period in [(1, 0.0)] + [(n, p) for p in periods for n in counts]:
        sim = ReplicatedSimulation(trace, profile, use, make_policy(policy), n,
                                   step if period is None else period, spread,
                                   on_arrival=tick)
        m = summarize(policy, sim.run(), spec.ttft_slo_s, spec.tbt_slo_s)
        step = step or sim.mean_step_s()
        row = metrics_rows([m], replicas=n, sync_period_s=sim.period,
                           per_step=period is None, spread=spread)[0]
        one = rows[0] if rows else row
        for key in ("ttft_p50_s", "ttft_p90_s", "hit_ratio"):
            row[f"{key.removesuffix('_s')}_vs_one"] = row[key] / one[key]
        rows.append(row)
    return rows
