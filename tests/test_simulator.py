"""The simulator's own mechanics on tiny hand-made traces with known answers."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from conductor.scheduler.decode_model import TbtModel
from conductor.scheduler.policy import POLICIES
from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.snapshot import Route
from simulator.cluster import ClusterSpec
from simulator.engine import Simulation
from simulator.pool import BlockCache
from simulator.profile import LatencyProfile, load_profile
from simulator.report import percentile, summarize
from simulator.sweeps import capacity_hit_ratio
from simulator.trace import TraceRequest, block_hashes, ideal_hit_ratio, time_scaled

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
