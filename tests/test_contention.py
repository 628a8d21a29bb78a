"""Engines sharing a host slow each other's prompts: the contended factor an instance learns
from its timings, and the prices that follow it. Pure parts on factories, then the router's
timing of real dispatches on a clock the test moves."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.instance import InstanceInfo
from conductor.config import ConductorConfig
from conductor.registry import Registry
from conductor.router import Router
from conductor.scheduler.load import CONTENDED_RANGE, LoadState
from conductor.scheduler.policies.kv_centric import kv_centric
from conductor.scheduler.policies.round_robin import round_robin
from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.snapshot import (
    CONTENDED_PRIOR,
    ClusterSnapshot,
    InstanceLoad,
    RouteRequest,
    SchedulerParams,
    shares_host,
    stretched,
)
from store.block_hash import block_hashes

BS = 32
NOW = 1000.0
MODEL = PrefillTimeModel(base_s=0.0, per_token_s=1e-3, per_attn_s=0.0)  # 1 ms a token


def inst(iid: str, host: str = "h", gpus: frozenset[int] = frozenset(), **load: object
         ) -> InstanceLoad:
    return InstanceLoad(instance_id=iid, role="both", in_flight=0, queued_prompt_tokens=0,
                        block_size=BS, host=host, gpus=gpus, **load)


def snap(*instances: InstanceLoad) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(instances), NOW, SchedulerParams(prefill=MODEL,
                                                                  disaggregate="never"))


def test_work_runs_slower_only_while_the_contention_lasts():
    assert stretched(0.0, 1.0, 10.0, 2.0) == 2.0  # contended throughout
    assert stretched(0.0, 3.0, 2.0, 2.0) == pytest.approx(2.0 + 3.0 - 1.0)  # 1 s done by 2
    assert stretched(5.0, 3.0, 2.0, 2.0) == 3.0  # contention over before it starts
    assert stretched(0.0, 3.0, 2.0, 1.0) == 3.0


def test_engines_share_a_host_unless_their_accelerators_differ():
    a, b = inst("a"), inst("b")
    assert shares_host(a, b) and not shares_host(a, a)
    assert not shares_host(a, inst("c", host="g"))
    assert not shares_host(inst("x", host=""), inst("y", host=""))  # unknown: apart
    g0, g1 = inst("g0", gpus=frozenset({0})), inst("g1", gpus=frozenset({1}))
    assert not shares_host(g0, g1) and not shares_host(g0, a)
    assert shares_host(g0, inst("g01", gpus=frozenset({0, 1})))


def test_a_load_counts_the_seconds_it_had_prompts_to_compute():
    load = LoadState("a", "both", BS)
    assert load.busy_overlap(0.0, 100.0) == 0.0
    load.add_prefill("r1", 100, 100, 1.0, now=10.0)
    load.add_prefill("r2", 100, 100, 1.0, now=11.0)
    load.end_prefill("r1", now=12.0)
    assert load.busy_overlap(11.0, 13.0) == pytest.approx(2.0)  # still computing r2
    load.end_prefill("r2", now=13.0)
    load.add_prefill("r3", 100, 100, 1.0, now=20.0)
    load.end_prefill("r3", now=21.0)
    assert load.busy_overlap(12.0, 20.5) == pytest.approx(1.0 + 0.5)
    assert load.busy_overlap(13.0, 20.0) == 0.0


def test_contended_timings_make_a_factor_apart_from_the_speeds():
    """A 1,000-token prompt (1 s at speed 1) timed at 1.5 s, all of it beside another engine's
    compute: factor 1.5, the speed untouched; one contended for half its 4/3 s (1/3 s of work
    done in 2/3): 2; one contended for a fifth: neither."""
    load = LoadState("a", "both", BS)
    load.observe_prefill(1000, 0, 1.0, MODEL)
    assert (load.prefill_contended, load.contended()) == (None, 1.0)
    load.side = True
    assert load.contended() == CONTENDED_PRIOR
    load.observe_prefill(1000, 0, 1.5, MODEL, overlap=1.5)
    assert (load.prefill_speed, load.prefill_contended) == (1.0, pytest.approx(1.5))
    assert load.view().prefill_contended == pytest.approx(1.5)
    assert load.uncontended(1.5, 1.5) == pytest.approx(1.0)
    load.observe_prefill(1000, 0, 4 / 3, MODEL, overlap=2 / 3)
    assert load.prefill_contended == pytest.approx((1.5 + 2.0) / 2)
    load.observe_prefill(1000, 0, 3.0, MODEL, overlap=0.6)
    assert (load.prefill_speed, load.prefill_contended) == (1.0, pytest.approx(1.75))
    load.observe_prefill(1000, 0, 0.9, MODEL, overlap=0.9)  # faster than alone: no speed-up
    assert load.prefill_contended == pytest.approx((1.5 + 2.0 + 1.0) / 3)
    load.observe_prefill(1000, 0, 5.0, MODEL, overlap=2.5)  # more than the overlap explains
    high = (1.5 + 2.0 + 1.0 + CONTENDED_RANGE[1]) / 4
    assert load.prefill_contended == pytest.approx(high)
    load.respeed(PrefillTimeModel(base_s=0.0, per_token_s=0.5e-3, per_attn_s=0.0))
    assert load.prefill_speed == pytest.approx(2.0)  # the factor is over the speed: unchanged
    assert load.prefill_contended == pytest.approx(high)


def test_a_queue_and_a_prompt_are_priced_slower_while_a_peer_computes():
    """b is idle and twice as slow beside a's compute, which is predicted to go on for 1 s: a
    2 s prompt there does 0.5 s of work in that second and takes 2.5 s (its queue's work is
    still 2 s); c, on another host, takes 2.2 s alone and gets the prompt; with a idle, not c."""
    a = inst("a", busy_until=NOW + 1.0)
    b = inst("b", prefill_contended=2.0)
    c = inst("c", host="g", prefill_speed=1.1)
    s = snap(a, b, c)
    assert s.peers_busy_until(b) == NOW + 1.0 and s.peers_busy_until(c) == 0.0
    assert s.prefill_timing(b, 2.0, 0.0, 0.0) == (0.0, 2.0, pytest.approx(2.5))
    assert s.prefill_timing(b, 2.0, 0.5, 0.0) == (pytest.approx(1.0), 2.0, 2.0)  # queue slowed
    assert s.prefill_timing(c, 2.0, 0.0, 0.0) == (0.0, pytest.approx(2.2), pytest.approx(2.2))
    req = RouteRequest(2000, ())
    route = kv_centric(s, req)
    assert route.prefill_id == "c" and route.prefill_s == pytest.approx(2.2)
    idle = snap(dataclasses.replace(a, busy_until=0.0), b, c)
    route = kv_centric(idle, req)
    assert route.prefill_id != "c" and route.predicted_ttft_s == pytest.approx(2.0)
    fixed = kv_centric(snap(a, dataclasses.replace(b, prefill_contended=1.0), c), req)
    assert fixed.prefill_id == "b"  # timed not slowed
    untimed = dataclasses.replace(b, prefill_contended=None)
    assert kv_centric(snap(a, untimed, c), req).prefill_id == "b"  # the prior: 1
    side = dataclasses.replace(untimed, side=True)  # the prior: CONTENDED_PRIOR
    assert snap(a, side, c).prefill_timing(side, 2.0, 0.0, 0.0)[2] == pytest.approx(
        stretched(NOW, 2.0, NOW + 1.0, CONTENDED_PRIOR))
    # the same prices in the policies that choose by other means
    other = round_robin(snap(a, b), RouteRequest(2000, (), seq=1))
    assert other.prefill_id == "b" and other.prefill_s == pytest.approx(2.0)
    assert other.predicted_ttft_s > 2.5
    kept = s.replacing([dataclasses.replace(a, busy_until=NOW + 3.0)], NOW)
    assert kept.peers_busy_until(b) == NOW + 3.0  # a snapshot kept current keeps its peers


# ---------------------------------------------------------------------- the router's timings

def _member(iid: str, address: str) -> InstanceInfo:
    return InstanceInfo(instance_id=iid, role="both", address=address, model="m",
                        block_size=BS, capacity_tokens=100_000, version="t")


async def test_a_prompt_timed_beside_a_peers_compute_teaches_its_factor(config_only_model,
                                                                         monkeypatch):
    """a and b share a host, c is apart: a's prompt ran all its 1.5x beside b's, so a learns
    a factor of 1.5 (not a slower speed) and the model the time it would have taken alone;
    c's, timed meanwhile, is its speed's; a's next prompt, while b computes, is priced slower."""
    registry = Registry()
    router = Router(ConductorConfig(model=config_only_model, etcd="127.0.0.1:1", kv_events=False,
                                    disaggregate="never"), registry)
    registry.sync({"a": _member("a", "10.0.0.1:1"), "b": _member("b", "10.0.0.1:2"),
                   "c": _member("c", "10.0.0.2:1")})
    router.warm.update(("a", "b", "c"))
    clock = [100.0]
    monkeypatch.setattr("conductor.router.time",
                        type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    model = router.prefill_fit.model
    work = model.predict(2048, 0)

    def route(on: str):
        start = len(dispatched) * 4096
        tokens = list(range(start, start + 2048))
        dispatched.append(router.route(f"r{start}", tokens, tuple(block_hashes(tokens, BS)), 4,
                                       BS, exclude={"a", "b", "c"} - {on}))
        return dispatched[-1]

    dispatched: list = []
    on_a, _, _, on_c = route("a"), route("b"), route("b"), route("c")  # b busy for 2x work
    clock[0] += 1.5 * work
    on_a.first_token(0)
    on_c.first_token(0)
    a, c = registry.get("a").load, registry.get("c").load
    assert (a.prefill_speed, a.prefill_contended) == (1.0, pytest.approx(1.5))
    assert (c.prefill_speed, c.prefill_contended) == (pytest.approx(1.5), None)
    rows = list(router.prefill_fit._obs._rows)
    assert [row[1] for row in rows[-2:]] == [pytest.approx(work), pytest.approx(work)]
    model = router.prefill_fit.model
    b_until = registry.get("b").load.view().busy_until  # its second beside its first's stream
    assert b_until > clock[0]
    again = route("a")
    new_work = model.predict(2048, 0)
    assert again.route.prefill_s == pytest.approx(new_work)
    assert again.route.predicted_ttft_s == pytest.approx(
        stretched(clock[0], new_work, b_until, a.prefill_contended))  # a's factor as refitted
    assert again.route.predicted_ttft_s > new_work
    for d in dispatched:
        d.release()
    await registry.close()
