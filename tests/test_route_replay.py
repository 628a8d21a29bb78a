"""kv_centric's pruned searches choose what pricing every instance chose: decisions recorded
from the simulator on Mooncake's synthetic trace, driven by the reference copy of the policy
(tests/sched_reference/kv_centric.py), replayed through the product policy; and the same
snapshots with speeds, side engines, shared hosts and stale queues mixed in, through both."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from conductor.scheduler.policies.kv_centric import kv_centric
from conductor.scheduler.snapshot import ClusterSnapshot, RouteRequest
from simulator.cluster import ClusterSpec
from simulator.engine import Simulation
from simulator.profile import load_profile
from simulator.trace import load_trace, time_scaled
from tests.sched_reference.kv_centric import kv_centric as reference

ROOT = Path(__file__).resolve().parent.parent
TRACE = next((p for p in (ROOT.parent / "shared/traces/mooncake_synthetic_trace.jsonl",
                          ROOT.parent.parent / "shared/traces/mooncake_synthetic_trace.jsonl")
              if p.exists()), None)
RUNS = [  # (shape, arrival rate factor, requests): loaded, overloaded, colocated
    (ClusterSpec(prefill=4, decode=4), 1.0, 4000),
    (ClusterSpec(prefill=8, decode=6, tbt_slo_s=0.06), 3.0, 4000),
    (ClusterSpec(prefill=2, decode=2, colocated=4, pool_blocks=20_000), 2.0, 2500),
]
MIN_DECISIONS = 10_000


class Recorder:
    """A policy that decides with the reference and keeps every (snapshot, request, choice)."""

    def __init__(self) -> None:
        self.seen: list[tuple[ClusterSnapshot, RouteRequest, object]] = []

    def __call__(self, snap: ClusterSnapshot, req: RouteRequest) -> object:
        decision = reference(snap, req)
        self.seen.append((snap, req, decision))
        return decision


@pytest.fixture(scope="module")
def recorded() -> list[tuple[ClusterSnapshot, RouteRequest, object]]:
    if TRACE is None:
        pytest.skip("the synthetic trace (shared/traces) is not here")
    trace = load_trace(TRACE)
    profile = load_profile("paper_llama2_70b")
    out = []
    for spec, rate, limit in RUNS:
        rec = Recorder()
        Simulation(time_scaled(trace[:limit], rate), profile, spec, rec).run()
        out += rec.seen
    return out


def test_recorded_decisions_replay_to_the_same_routes(recorded):
    assert len(recorded) >= MIN_DECISIONS
    kinds = {"route": 0, "local": 0, "reject": 0}
    for snap, req, old in recorded:
        assert kv_centric(snap, req) == old, (snap, req)
        kind = "reject" if not hasattr(old, "prefill_id") else \
            "local" if old.prefill_id == old.decode_id else "route"
        kinds[kind] += 1
    assert all(kinds.values()), kinds  # every kind of answer was replayed


def test_mixed_snapshots_choose_as_the_reference(recorded):
    """Every fourth recorded decision again, on its snapshot made uneven: measured speeds,
    side engines, engines sharing a host's cores, queues drained but not yet reported, a
    predicted finish already past, a side cost apart from 1, each policy mode."""
    rng = random.Random(51)
    compared = 0
    for snap, req, _ in recorded[::4]:
        mixed = _mixed(rng, snap)
        assert kv_centric(mixed, req) == reference(mixed, req), (mixed, req)
        compared += 1
    assert compared >= MIN_DECISIONS // 4


def _mixed(rng: random.Random, snap: ClusterSnapshot) -> ClusterSnapshot:
    now = snap.now
    loads = []
    for i in snap.instances:
        change: dict[str, object] = {}
        if rng.random() < 0.5:
            change["prefill_speed"] = rng.choice((0.5, 0.8, 1.0, 1.0, 1.3, 2.0))
        if rng.random() < 0.3:
            change["prefill_speed_beside"] = rng.choice((0.9, 1.4, 2.5))
        if rng.random() < 0.15:
            change["side"] = True
        if rng.random() < 0.3:
            change.update(host=rng.choice(("a", "b")), cores=frozenset({0, 1}), threads=1)
        if rng.random() < 0.15 and not i.busy_until:
            change["busy_until"] = now - rng.uniform(0.0, 1.0)  # drained, not reported
        if rng.random() < 0.15 and i.finishes:
            change["finishes"] = (now - 0.5, *i.finishes[1:])
        loads.append(dataclasses.replace(i, **change) if change else i)
    params = dataclasses.replace(
        snap.params, side_cost=rng.choice((1.0, 1.0, 0.8, 1.5)),
        disaggregate=rng.choice(("auto", "auto", "always", "never")),
        near_min_rel=rng.choice((0.05, 0.0, 0.3)), near_min_abs_s=rng.choice((0.005, 0.0, 0.1)))
    return ClusterSnapshot(tuple(loads), now, params)
