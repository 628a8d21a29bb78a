"""Conductor replicas in the simulator (`simulator.replicas`): without a sync period they
decide as one conductor; with a long one they pile onto the instances each sees idle."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conductor.scheduler.decode_model import TbtModel
from conductor.scheduler.policy import POLICIES
from conductor.scheduler.prefill_model import PrefillTimeModel
from simulator.__main__ import cli
from simulator.cluster import ClusterSpec
from simulator.engine import RequestResult, Simulation
from simulator.profile import LatencyProfile
from simulator.replicas import ReplicatedSimulation
from simulator.trace import TraceRequest

# 1 ms per computed token, 10 ms per decode step, transfers of 1 ms a block
PROFILE = LatencyProfile(
    name="unit", source="test", block_size=512,
    prefill=PrefillTimeModel(base_s=0.0, per_token_s=1e-3, per_attn_s=0.0),
    tbt=TbtModel(base_s=0.01, per_seq_s=0.0, per_kv_token_s=0.0),
    transfer_s_per_block=1e-3, transfer_s_fixed=0.0, kv_capacity_tokens=20_000,
    local_cache_blocks=12)
SPEC = ClusterSpec(prefill=3, decode=2)


def shared_prefix_trace(n: int) -> list[TraceRequest]:
    """Bursts of prompts over five shared prefixes of different lengths, with own tails."""
    out = []
    for i in range(n):
        prefix = tuple(1000 * (i % 5) + k for k in range(1 + i % 5))
        tail = tuple(100_000 + 10 * i + k for k in range(1 + i % 3))
        at = 0.4 * (i // 6) + 0.001 * (i % 6)
        out.append(TraceRequest(at, 512 * (len(prefix) + len(tail)), 2 + i % 7, prefix + tail))
    return out


def decisions(results: list[RequestResult]) -> list[tuple]:
    return [(r.index, r.prefill_id, r.decode_id, r.rejected, r.cached_tokens, r.pool_tokens,
             r.ttft_s, r.finish_s) for r in results]


@pytest.mark.parametrize("spread", ["round_robin", "random"])
def test_replicas_without_a_sync_period_decide_as_one_conductor(spread):
    trace = shared_prefix_trace(90)
    one = Simulation(trace, PROFILE, SPEC, POLICIES["kv_centric"]).run()
    many = ReplicatedSimulation(trace, PROFILE, SPEC, POLICIES["kv_centric"], replicas=4,
                                sync_period_s=0.0, spread=spread).run()
    assert decisions(many) == decisions(one)
    assert len({r.prefill_id for r in one}) >= 4 and sum(r.cached_tokens for r in one) > 0
    assert sum(r.pool_tokens for r in one) > 0  # the index and the pool were both exercised


def test_a_long_sync_period_piles_replicas_onto_the_same_instances():
    trace = [TraceRequest(0.0, 2048, 4, (10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4))
             for i in range(8)]
    spec = ClusterSpec(prefill=4, decode=4)

    def per_instance(replicas: int, period: float) -> tuple[int, float]:
        res = ReplicatedSimulation(trace, PROFILE, spec, POLICIES["kv_centric"], replicas,
                                   period).run()
        return (max(Counter(r.prefill_id for r in res).values()),
                sum(r.ttft_s for r in res) / len(res))

    one, one_ttft = per_instance(1, 0.0)
    assert per_instance(1, 10.0) == (one, one_ttft)  # one replica sees all it dispatched
    piled, ttft = per_instance(4, 10.0)
    assert one == 1 and piled == 4  # each replica saw the same idle instances as the others
    assert ttft > 3 * one_ttft
    assert per_instance(4, 0.0) == (one, one_ttft)


def test_a_replica_sees_its_own_dispatches_at_once_and_the_others_at_the_next_report():
    seen = []

    def spy(snap, req):
        seen.append((sum(i.queued_prompt_tokens for i in snap.instances), req.match.longest))
        return POLICIES["kv_centric"](snap, req)

    prefix = (1, 2, 3, 4, 5, 6, 7)
    trace = [TraceRequest(at, 4096, 2, prefix + (10 + n,))
             for n, at in enumerate((0.0, 0.1, 0.15, 0.3))]
    ReplicatedSimulation(trace, PROFILE, ClusterSpec(prefill=2, decode=2), spy, replicas=2,
                         sync_period_s=0.2).run()
    # replica 0 routes the 1st and 3rd, replica 1 the 2nd and 4th; a prefill takes 4 s and
    # the first report is at 0.2 s: the 2nd sees nothing, the 3rd its own 1st only (its
    # queued prompt and its predicted prefix), the 4th all three
    assert seen == [(0, 0), (0, 0), (4096, 7), (3 * 4096, 7)]


def test_the_replicas_command_writes_a_table_a_figure_and_a_summary(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {i * 50}, "input_length": 2048, "output_length": 4, '
        f'"hash_ids": [{i % 3}, {100 + i}, {200 + i}, {300 + i}]}}\n' for i in range(40)))
    line = cli(["replicas", "--trace", str(trace), "--replicas", "1,2", "--periods",
                "step,0.5", "--out", str(tmp_path / "r")])
    rows = json.loads((tmp_path / "r/replicas.json").read_text())
    assert [(r["replicas"], r["per_step"]) for r in rows] == [
        (1, False), (1, True), (2, True), (1, False), (2, False)]
    assert rows[0]["ttft_p50_vs_one"] == 1.0 and 0 < rows[1]["sync_period_s"] < 0.1
    assert (tmp_path / "r/replicas.png").stat().st_size > 0
    assert line.startswith("sim-replicas trace=t ") and "r2_ttft_p50_vs_one=" in line
