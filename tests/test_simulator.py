"""The simulator's own mechanics on tiny hand-made traces with known answers."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from pathlib import Path

import pytest

from conductor.scheduler.decode_model import TbtModel
from conductor.scheduler.policy import POLICIES
from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    InstanceLoad,
    PrefixMatch,
    Route,
    RouteRequest,
)
from simulator import comparison
from simulator.__main__ import cli
from simulator.capacity import Arm, Capacity, find_capacity, upper_bound
from simulator.cluster import ClusterSpec
from simulator.engine import Simulation
from simulator.peers import PEERS, DynamoRouter, EngineMetrics, LlmdRouter, SmgRouter, VllmRouter
from simulator.peers import make as make_peer
from simulator.peers.base import ApproxTree
from simulator.planner import plan
from simulator.pool import BlockCache
from simulator.profile import LatencyProfile, load_profile
from simulator.report import percentile, summarize
from simulator.sweeps import capacity_hit_ratio
from simulator.trace import (
    TraceRequest,
    block_hashes,
    ideal_hit_ratio,
    load_trace,
    time_scaled,
)

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = next((p for p in (ROOT.parent / "shared/traces/mooncake_synthetic_trace.jsonl",
                              ROOT.parent.parent / "shared/traces/mooncake_synthetic_trace.jsonl")
                  if p.exists()), ROOT / "missing.jsonl")

# 1 ms per computed token, 10 ms per decode step, free transfers: every time is exact
PROFILE = LatencyProfile(
    name="unit", source="test", block_size=512,
    prefill=PrefillTimeModel(base_s=0.0, per_token_s=1e-3, per_attn_s=0.0),
    tbt=TbtModel(base_s=0.01, per_seq_s=0.0, per_kv_token_s=0.0),
    transfer_s_per_block=0.0, transfer_s_fixed=0.0, kv_capacity_tokens=1_000_000,
    local_cache_blocks=1000)
ONE_BY_ONE = ClusterSpec(prefill=1, decode=1)


def req(at: float, n: int, out: int, *hashes: int) -> TraceRequest:
    return TraceRequest(at, n, out, hashes)


def simulate(trace, spec=ONE_BY_ONE, profile=PROFILE, policy="least_loaded"):
    return Simulation(trace, profile, spec, POLICIES[policy]).run()


def test_one_request_timeline():
    (r,) = simulate([req(0.0, 1024, 3, 1, 2)])
    assert r.ttft_s == pytest.approx(1.024 + 0.01)  # prefill 1024 ms, then one step
    assert r.tbt_s == pytest.approx(0.01)
    assert r.finish_s == pytest.approx(1.054)
    assert (r.prefill_id, r.decode_id, r.cached_tokens) == ("p0", "d0", 0)
    assert r.stages == pytest.approx((0.0, 1.024, 0.0, 0.0, 0.01))


def test_stages_add_up_to_the_ttft():
    prof = replace(PROFILE, transfer_s_per_block=0.1, transfer_s_fixed=0.05,
                   kv_capacity_tokens=1100)
    a, b = simulate([req(0.0, 1024, 200, 1, 2), req(0.0, 1024, 1, 3, 4)], profile=prof)
    # b queues behind a's prefill, moves 2 blocks, then waits for a to leave the KV cache
    assert b.stages == pytest.approx((1.024, 1.024, 0.25, a.finish_s - 2.298, 0.01))
    assert sum(b.stages) == pytest.approx(b.ttft_s)


def test_prefills_queue_fifo_and_join_the_running_batch_at_a_step_boundary():
    a, b = simulate([req(0.0, 1024, 3, 1, 2), req(0.1, 512, 2, 3)])
    assert a.finish_s == pytest.approx(1.054)
    # b's prefill waits for a's (1.024), ends 1.536; d0 idle again, so its step ends 1.546
    assert b.ttft_s == pytest.approx(1.546 - 0.1)
    assert b.finish_s == pytest.approx(1.556)


def test_a_request_joining_mid_step_waits_for_the_next_step():
    a, b = simulate([req(0.0, 512, 100, 1), req(0.0, 512, 1, 2)])
    # a joins at 0.512 and steps every 10 ms; b joins at 1.024, inside the step 1.022-1.032
    assert b.ttft_s == pytest.approx(1.042)
    assert a.tbt_s == pytest.approx(0.01)


def test_cache_hit_skips_all_but_the_last_block():
    a, b = simulate([req(0.0, 1536, 1, 1, 2, 3), req(10.0, 2048, 1, 1, 2, 3, 4)])
    assert a.cached_tokens == 0
    assert b.cached_tokens == 1536  # 3 of 4 blocks: the last block is always computed
    assert b.ttft_s == pytest.approx(0.512 + 0.01)
    m = summarize("x", [a, b], 30.0, 0.1)
    assert m.hit_ratio == pytest.approx(1536 / (1536 + 2048))
    assert m.requests == 2 and m.rejected == 0 and m.slo_attainment == 1.0


def test_decode_admission_waits_for_kv_room():
    prof = replace(PROFILE, kv_capacity_tokens=1100)
    a, b = simulate([req(0.0, 1024, 200, 1, 2), req(0.0, 1024, 1, 3, 4)], profile=prof)
    assert a.finish_s == pytest.approx(1.024 + 2.0)
    assert b.ttft_s == pytest.approx(a.finish_s + 0.01)  # admitted when a left


def test_transfer_time_is_paid_per_missing_block():
    prof = replace(PROFILE, transfer_s_per_block=0.1, transfer_s_fixed=0.05)
    (r,) = simulate([req(0.0, 1024, 1, 1, 2)], profile=prof)
    assert r.ttft_s == pytest.approx(1.024 + 0.05 + 2 * 0.1 + 0.01)


def test_pool_serves_a_prefix_prefilled_elsewhere():
    def p0_then_p1(snap, rq):
        return Route("p0" if rq.seq == 1 else "p1", "d0")

    spec = ClusterSpec(prefill=2, decode=1)
    trace = [req(0.0, 1536, 1, 1, 2, 3), req(5.0, 1536, 1, 1, 2, 3)]
    for use_pool, hit in ((False, 0), (True, 1024)):
        _, b = Simulation(trace, PROFILE, replace(spec, use_pool=use_pool), p0_then_p1).run()
        assert (b.prefill_id, b.cached_tokens, b.pool_tokens) == ("p1", hit, hit)


def test_rejections_are_counted_and_miss_the_slo():
    spec = replace(ONE_BY_ONE, ttft_slo_s=0.001)
    res = simulate([req(0.0, 1024, 3, 1, 2), req(1.0, 512, 2, 3)], spec=spec,
                   policy="kv_centric")
    m = summarize("kv_centric", res, 0.001, 0.1)
    assert m.rejected == 2 and m.slo_attainment == 0.0 and m.goodput_rps == 0.0


def test_lru_evicts_a_chain_tail_first():
    dropped = []
    c = BlockCache(2, "lru", dropped.append)
    c.insert([1, 2])
    c.insert([3])
    assert dropped == [2] and c.match([1, 2]) == 1 and 3 in c


def test_lfu_keeps_the_frequently_used_block():
    c = BlockCache(2, "lfu")
    c.insert([1])
    for _ in range(3):
        c.touch([1])
    c.insert([2])
    c.insert([3])
    assert 1 in c and 2 not in c and 3 in c


def test_capacity_hit_ratio_and_ideal_ratio():
    trace = [req(0.0, 1024, 1, 1, 2), req(1.0, 1536, 1, 1, 2, 3)]
    assert capacity_hit_ratio(trace, 512, None, "lru") == pytest.approx(1024 / 2560)
    assert capacity_hit_ratio(trace, 512, 0, "lru") == 0.0
    assert ideal_hit_ratio(trace) == pytest.approx(1024 / 2560)


def test_block_mapping_and_time_scale():
    r = req(2.0, 600, 1, 7, 9)
    assert block_hashes(r, 256) == (14, 15, 18)
    assert block_hashes(r, 512) == (7, 9)
    assert time_scaled([r], 2.0)[0].arrival_s == 1.0
    with pytest.raises(ValueError):
        block_hashes(r, 384)


def test_percentile_and_shipped_profiles_load():
    assert percentile(list(range(1, 11)), 90) == 9
    assert load_profile("paper_llama2_70b").block_size == 512


def test_load_and_kv_are_released_after_a_run():
    trace = [req(0.01 * i, 512 * (1 + i % 3), 1 + i % 5, i % 4, 100 + i) for i in range(40)]
    sim = Simulation(trace, PROFILE, ClusterSpec(prefill=2, decode=2), POLICIES["kv_centric"])
    res = sim.run()
    assert len(res) == 40 and [r.index for r in res] == list(range(40))
    for inst in sim.instances:
        assert inst.load.in_flight() == 0 and inst.load.kv_tokens == 0
        assert (inst.kv_tokens, inst.kv_reserved, inst.batch, inst.queue) == (0, 0, [], deque())


def test_evictions_reach_the_conductors_index():
    prof = replace(PROFILE, local_cache_blocks=2)
    sim = Simulation([req(0.0, 1024, 1, 1, 2), req(5.0, 1024, 1, 3, 4)], prof, ONE_BY_ONE,
                     POLICIES["least_loaded"])
    sim.run()
    sim.index.expire(1e9)  # only confirmed bits remain
    assert sim.index.match((1, 2)).local.get("p0", 0) == 0
    assert sim.index.match((3, 4)).local["p0"] == 2


def test_the_cpu_profile_replays_with_its_own_block_size():
    prof = load_profile("cpu_tiny")
    res = simulate([req(0.0, 600, 2, 1, 2), req(30.0, 600, 2, 1, 2)], profile=prof)
    assert res[1].cached_tokens == 18 * 32  # 19 blocks of 32; all but the last one
    assert res[0].cached_tokens == 0


# ---------------------------------------------------------------------- peers

def _snap(prefill=2, decode=2, both=0):
    def inst(iid, role):
        return InstanceLoad(iid, role, 0, 0, 512, kv_capacity_tokens=10_000)
    return ClusterSnapshot(tuple([inst(f"p{i}", "prefill") for i in range(prefill)]
                                 + [inst(f"d{i}", "decode") for i in range(decode)]
                                 + [inst(f"c{i}", "both") for i in range(both)]))


def _req(seq, hashes, local=None, n=None):
    n = n if n is not None else 512 * len(hashes)
    return RouteRequest(n, tuple(hashes), PrefixMatch(0, local or {}), 4, seq)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_every_peer_serves_a_trace_and_releases_its_counters(name):
    trace = [req(0.05 * i, 512 * (1 + i % 3), 1 + i % 5, i % 4, 100 + i) for i in range(40)]
    for spec in (ClusterSpec(prefill=2, decode=2), ClusterSpec(prefill=0, decode=0, colocated=3)):
        router = make_peer(name)
        res = Simulation(trace, PROFILE, spec, router).run()
        assert len(res) == 40 and not any(r.rejected for r in res)
        counter = getattr(router, "load", None)
        if counter is not None:
            assert set(counter.load.values()) <= {0}
        if name == "dynamo":
            assert set(router.blocks.values()) <= {0} and set(router.prefill_tokens.values()) <= {0}
        if spec.colocated:
            assert all(r.prefill_id == r.decode_id for r in res)


def test_dynamo_trades_overlap_against_queued_prefill_blocks():
    router = DynamoRouter()
    snap = _snap()
    # p1 holds 3 of 4 blocks: cost (0 + 4 - 3) + 4 against p0's (0 + 4) + 4
    first = router(snap, _req(1, (1, 2, 3, 4), {"p1": 3}))
    assert first.prefill_id == "p1"  # the decode instances tie: drawn
    # now p1 has 1 uncached block queued and 4 active: (1 + 4 - 3) + 8 = 10 > p0's 8
    r = router(snap, _req(2, (1, 2, 3, 4), {"p1": 3}))
    assert r.prefill_id == "p0"
    assert {r.decode_id, first.decode_id} == {"d0", "d1"}  # decode: the fewest active blocks
    router.prefilled(1)
    router.finished(1)
    r = router(snap, _req(3, (1, 2, 3, 4), {"p1": 3}))
    assert r.prefill_id == "p1"


def test_llm_d_scores_prefix_queue_and_kv_and_decides_locally_when_cached():
    router = LlmdRouter()
    metrics = {"p0": EngineMetrics(0, 0, 0.0, 100), "p1": EngineMetrics(0, 0, 0.0, 100),
               "d0": EngineMetrics(0, 1, 0.5, 100), "d1": EngineMetrics(3, 1, 0.1, 100)}
    router.bind(lambda: metrics)
    snap = _snap()
    # d0: queue 1*2 + kv 0.5*2 = 3; d1: queue 0 + kv 0.9*2 = 1.8
    r = router(snap, _req(1, (1, 2, 3, 4)))
    assert r.decode_id == "d0" and r.disaggregated
    # the same prompt again: d0 holds all 4 blocks (3 prefix points), nothing uncached: local
    r = router(snap, _req(2, (1, 2, 3, 4)))
    assert (r.prefill_id, r.decode_id) == ("d0", "d0")


def test_vllm_router_cache_aware_follows_its_tree_until_loads_are_imbalanced():
    router = VllmRouter(balance_abs=2, balance_rel=1.5)
    snap = _snap()
    a = router(snap, _req(1, (1, 2, 3)))
    assert (a.prefill_id, a.decode_id) == ("p0", "d0")  # no match: the least loaded, first
    b = router(snap, _req(2, (1, 2, 9)))  # 2/3 matched > 0.3: the tenant that holds it
    assert b.prefill_id == "p0"
    assert router(snap, _req(3, (7, 8))).prefill_id == "p1"  # miss: least loaded
    for seq in range(4, 6):
        router(snap, _req(seq, (1, 2, 3)))
    # p0 now holds 4 requests, p1 one: 4 - 1 > 2 and 4 > 1.5: imbalanced, least loaded wins
    assert router(snap, _req(6, (1, 2, 3))).prefill_id == "p1"
    router.prefilled(1)
    assert router.load.of("p0") == 3 and router.load.of("d0") >= 1


def test_smg_spills_a_matched_worker_past_its_gate():
    router = SmgRouter(balance_abs=1, balance_rel=1.5)
    snap = _snap(prefill=3, decode=1)
    assert router(snap, _req(1, (1, 2))).prefill_id == "p0"
    assert router(snap, _req(2, (1, 2))).prefill_id == "p0"  # load 1 <= mean 1/3 + 1
    # p0 holds 2 against a mean of 2/3: 2 > 1.0 and 2 > 1.67: spills to the least loaded
    assert router(snap, _req(3, (1, 2))).prefill_id == "p1"
    router.finished(1)
    router.finished(2)
    assert router(snap, _req(4, (1, 2))).prefill_id in ("p0", "p1")  # both hold it, idle


def test_approximate_trees_evict_per_tenant_or_shared():
    own = ApproxTree(2, shared=False)
    own.insert((1, 2, 3), "a")
    own.insert((1, 2), "b")
    assert own.match((1, 2, 3), ["a", "b"]) == {"a": 2, "b": 2}
    shared = ApproxTree(3, shared=True)
    shared.insert((1, 2), "a")
    shared.insert((1, 2), "b")  # still 2 distinct blocks
    shared.insert((5, 6), "a")  # 4 distinct: the least recent entries go until 3 remain
    assert len(shared) == 3
    assert shared.match((5, 6), ["a"]) == {"a": 2}


# ---------------------------------------------------------------------- capacity, planner

def _queue_trace(n=20, tokens=1000):
    return [req(float(i), tokens, 1, 1000 + i) for i in range(n)]


def test_a_run_stops_once_its_miss_budget_is_spent():
    trace = time_scaled(_queue_trace(), 3.0)
    spec = replace(ONE_BY_ONE, ttft_slo_s=5.0)
    sim = Simulation(trace, PROFILE, spec, POLICIES["least_loaded"], miss_budget=2)
    sim.run()
    assert sim.aborted and sim.misses == 3
    full = Simulation(trace, PROFILE, spec, POLICIES["least_loaded"]).run()
    assert sum(r.ttft_s > 5.0 for r in full) > 3


def test_capacity_bisection_finds_the_queueing_threshold():
    # 1 s prefills on one instance, then one 10 ms step, one arrival per 1/s seconds: request
    # k's TTFT is k * (1 - 1/s) + 1.01; 18 of 20 meet 5 s while 17 * (1 - 1/s) + 1.01 <= 5
    trace, spec = _queue_trace(), replace(ONE_BY_ONE, ttft_slo_s=5.0)
    exact = 1 / (1 - 3.99 / 17)
    bound = upper_bound(trace, PROFILE, spec, 0.9)
    assert bound >= exact
    cap = find_capacity(trace, PROFILE, spec, Arm.named("least_loaded"), precision=0.01)
    assert exact / 1.011 <= cap.scale <= exact and cap.hi_scale > exact
    assert cap.rate_rps == pytest.approx(cap.scale * 20 / 19)


def test_arm_names():
    assert Arm.named("kv_centric") == Arm("kv_centric", "kv_centric", True)
    assert Arm.named("smg+pool").pool and not Arm.named("smg").pool
    assert Arm.named("colocated").colocated and Arm.named("dynamo@colocated").colocated
    spec = Arm.named("dynamo@colocated").spec(ClusterSpec(prefill=8, decode=4))
    assert (spec.prefill, spec.decode, spec.colocated, spec.use_pool) == (0, 0, 12, False)


def test_the_plan_is_within_5_percent_of_the_exhaustive_best():
    trace = load_trace(SYNTHETIC, limit=250) if SYNTHETIC.exists() else None
    if trace is None:
        pytest.skip("the synthetic trace is not here")
    prof = load_profile("paper_llama2_70b")
    args = dict(trace=trace, profile=prof, instances=4, ttft_slo_s=30.0, tbt_slo_s=0.1,
                precision=0.02, max_runs=10)
    full = plan(**args, exhaustive=True)
    quick = plan(**args)
    assert all(not c.pruned for c in full.candidates)
    assert quick.runs < full.runs
    got = next(c for c in full.candidates if c.split == quick.best)
    assert got.capacity_rps >= 0.95 * full.best_rps


def test_a_profile_from_fitted_models_plans():
    prof = LatencyProfile.from_models(PROFILE.prefill, PROFILE.tbt, 0.0, 512, 1_000_000, 1000)
    trace = _queue_trace(20, 500)
    p = plan(trace, prof, 3, 5.0, 0.1, precision=0.05, max_runs=6)
    assert p.best_rps > 0 and {c.split.label for c in p.candidates} == {"1P+2D", "2P+1D", "3C"}
    assert load_profile("h100_llama31_8b").kv_capacity_tokens == 426_788


def test_the_plan_command_prints_every_candidate_and_a_summary(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {i * 400}, "input_length": 2048, "output_length": 4, '
        f'"hash_ids": [{i % 3}, {100 + i}, {200 + i}, {300 + i}]}}\n' for i in range(30)))
    line = cli(["plan", "--trace", str(trace), "--instances", "3", "--ttft-slo", "10",
                "--tbt-slo", "0.1", "--precision", "0.1", "--out", str(tmp_path / "p.json")])
    table = capsys.readouterr().out
    assert all(label in table for label in ("1P+2D", "2P+1D", "3C"))
    assert line.startswith("plan trace=t instances=3 best=") and "cpu_s=" in line
    assert (tmp_path / "p.json").exists()


def test_ratios_take_the_best_peer_arm_and_the_best_colocated_arm():
    def cap(arm, scale):
        return Capacity(arm, scale, scale * 2, scale * 1.02, 0.9, (), 10.0)

    caps = {("p", a): cap(a, s) for a, s in (("kv_centric", 3.0), ("smg", 1.0),
                                              ("dynamo+pool", 1.5), ("cache_aware", 2.9),
                                              ("colocated", 2.0), ("colocated+pool", 2.4))}
    r = comparison.ratios(caps, "p")
    assert (r.best_peer, r.best_colocated) == ("dynamo+pool", "colocated+pool")
    assert r.vs_best_peer == pytest.approx(2.0) and r.vs_colocated == pytest.approx(1.25)
