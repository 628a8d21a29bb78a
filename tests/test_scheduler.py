"""The scheduler's pure parts on factories: the KV index, the load model, the time models, and
each routing policy's choice in constructed situations. No process, no clock: fast."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.instance import cpu_list
from conductor.config import POLICIES as CONFIG_POLICIES
from conductor.scheduler.decode_model import TbtFitter, TbtModel
from conductor.scheduler.index import POOL, KVIndex
from conductor.scheduler.load import SPEED_RANGE, SPEED_WINDOW, LoadState
from conductor.scheduler.policies.cache_aware import cache_aware
from conductor.scheduler.policies.kv_centric import kv_centric
from conductor.scheduler.policies.least_loaded import least_loaded
from conductor.scheduler.policies.random_choice import random_choice
from conductor.scheduler.policies.round_robin import round_robin
from conductor.scheduler.policy import DECODES_ALONE, DEFAULT_POLICY, POLICIES
from conductor.scheduler.prefill_model import PrefillTimeFitter, PrefillTimeModel
from conductor.scheduler.snapshot import (
    BESIDE_PRIOR,
    ClusterSnapshot,
    InstanceLoad,
    PrefixMatch,
    Reject,
    Route,
    RouteRequest,
    SchedulerParams,
    contention,
)
from store.block_hash import block_hashes

BS = 32
NOW = 1000.0


# ---------------------------------------------------------------------- factories

def inst(iid: str, role: str = "prefill", *, queue_s: float = 0.0, in_flight: int = 0,
         running: int = 0, kv_tokens: int = 0, capacity: int = 0,
         finishes: tuple[float, ...] = (), cached_blocks: int = 0, cores: str = "",
         threads: int = 0, max_seqs: int = 0) -> InstanceLoad:
    """An instance whose prefill queue drains `queue_s` after NOW; `cores` and `threads`:
    where it computes on host "h" (empty: unknown)."""
    return InstanceLoad(instance_id=iid, role=role, in_flight=in_flight, queued_prompt_tokens=0,
                        block_size=BS, busy_until=NOW + queue_s if queue_s else 0.0,
                        running=running, kv_tokens=kv_tokens, kv_capacity_tokens=capacity,
                        finishes=finishes, cached_blocks=cached_blocks,
                        host="h" if cores else "", cores=cpu_list(cores), threads=threads,
                        max_seqs=max_seqs)


def snap(*instances: InstanceLoad, **params: object) -> ClusterSnapshot:
    """Every request disaggregated unless asked otherwise: the tests of pairs see pairs."""
    params.setdefault("disaggregate", "always")
    return ClusterSnapshot(tuple(instances), NOW, SchedulerParams(**params))


def request(tokens: int, pool: int = 0, max_tokens: int = 16, seq: int = 0,
            **local: int) -> RouteRequest:
    """A prompt of `tokens` tokens; `pool` and `local` (instance id=blocks) its cached prefix."""
    hashes = tuple(range(1, tokens // BS + 1))
    return RouteRequest(tokens, hashes, PrefixMatch(pool=pool, local=local),
                        max_tokens=max_tokens, seq=seq)


def pair(route: Route | Reject | None) -> tuple[str, str]:
    assert isinstance(route, Route), route
    return route.prefill_id, route.decode_id


# ---------------------------------------------------------------------- configuration

def test_config_and_policy_table_agree_and_default_is_kv_centric():
    assert set(CONFIG_POLICIES) == set(POLICIES)
    assert DEFAULT_POLICY == "kv_centric"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_needs_a_decode_instance_and_most_a_prefill_one(name):
    policy = POLICIES[name]
    assert policy(snap(inst("p0")), request(100)) is None
    alone = policy(snap(inst("d0", "decode")), request(100))
    if name in DECODES_ALONE:
        assert pair(alone) == ("d0", "d0") and not alone.disaggregated
    else:
        assert alone is None
    route = policy(snap(inst("b0", "both")), request(100))
    assert pair(route) == ("b0", "b0") and not route.disaggregated


def test_without_a_prefill_instance_the_decodes_compute_prompts_even_when_forced_apart():
    """The prefill pool drained or unreachable: kv_centric serves on, each prompt computed on
    the decode instance that costs least, whatever `disaggregate` says."""
    s = snap(inst("d0", "decode", running=6), inst("d1", "decode"), disaggregate="always")
    assert pair(kv_centric(s, request(1024))) == ("d1", "d1")


# ---------------------------------------------------------------------- kv_centric

def test_long_local_hit_beats_a_short_queue():
    """p0 holds 30 of the 32 blocks but is busy 50 ms; p1 is idle and holds nothing."""
    s = snap(inst("p0", queue_s=0.05), inst("p1"), inst("d0", "decode"))
    route = kv_centric(s, request(1024, p0=30))
    assert pair(route) == ("p0", "d0")
    assert route.cached_blocks == 30 and route.uncached_tokens == 1024 - 30 * BS


def test_a_long_queue_outweighs_the_local_hit():
    s = snap(inst("p0", queue_s=1.0), inst("p1"), inst("d0", "decode"))
    route = kv_centric(s, request(1024, p0=30))
    assert pair(route) == ("p1", "d0")
    assert route.cached_blocks == 0


def test_the_pool_serves_an_idle_instance_the_prefix_a_busy_one_holds():
    """Global, not local, cache-awareness: p1 pulls the 30 blocks from the pool."""
    s = snap(inst("p0", queue_s=0.05), inst("p1"), inst("d0", "decode"))
    route = kv_centric(s, request(1024, pool=30, p0=30))
    assert pair(route) == ("p1", "d0")
    assert route.cached_blocks == 30


def test_predicted_ttft_adds_queue_prefill_transfer_and_decode_step():
    prm = SchedulerParams(tbt=TbtModel(0.01, 0.0, 0.0), disaggregate="always")
    s = ClusterSnapshot((inst("p0", queue_s=0.2), inst("d0", "decode")), NOW, prm)
    route = kv_centric(s, request(1024, pool=10))
    compute = prm.prefill.predict(1024 - 10 * BS, 10 * BS)
    pull_p = prm.transfer_s_fixed + 10 * prm.transfer_s_per_block
    save = prm.transfer_s_fixed + 21 * prm.transfer_s_per_block  # the blocks p computes
    pull_d = prm.transfer_s_fixed + 31 * prm.transfer_s_per_block  # all but the last block
    assert route.prefill_s == pytest.approx(compute)
    assert route.predicted_ttft_s == pytest.approx(0.2 + compute + pull_p + save + pull_d
                                                   + 0.01)


def test_ties_keep_locality():
    """Two idle instances predicted alike (the pool covers both): the one holding the prefix."""
    s = snap(inst("p0"), inst("p1"), inst("d0", "decode"))
    assert pair(kv_centric(s, request(1024, pool=30, p1=30))) == ("p1", "d0")


def test_decode_affinity_prefers_the_instance_holding_the_prefix():
    s = snap(inst("p0"), inst("d0", "decode", running=1), inst("d1", "decode", running=1))
    assert pair(kv_centric(s, request(2048, pool=60, d1=60)))[1] == "d1"
    assert pair(kv_centric(s, request(2048, pool=60)))[1] == "d0"


def test_decode_balances_by_predicted_tbt():
    s = snap(inst("p0"), inst("d0", "decode", running=20), inst("d1", "decode", running=3))
    assert pair(kv_centric(s, request(512)))[1] == "d1"


def test_tbt_violating_decode_is_skipped_for_one_within_slo():
    """d0 holds the prefix but would run at 0.4 s per token: d1, within the SLO, wins."""
    s = snap(inst("p0"), inst("d0", "decode", running=39), inst("d1", "decode", running=10),
             tbt=TbtModel(0.0, 0.01, 0.0), tbt_slo_s=0.2)
    route = kv_centric(s, request(1024, pool=31, d0=31))
    assert pair(route) == ("p0", "d1")
    assert route.predicted_tbt_s == pytest.approx(0.11)


def test_decode_without_free_kv_is_skipped():
    s = snap(inst("p0"), inst("d0", "decode", kv_tokens=9_000, capacity=10_000),
             inst("d1", "decode", running=5, kv_tokens=1_000, capacity=10_000))
    assert pair(kv_centric(s, request(1024, max_tokens=100)))[1] == "d1"


@pytest.mark.parametrize("disaggregate", ["always", "never"])
def test_every_sequence_of_a_request_takes_a_batch_slot(disaggregate):
    """A request sampling 8 choices does not fit beside 60 of an engine's 64 sequences: it
    would wait in the engine's queue, unpriced. The emptier instance takes it; with none,
    a 429 until enough finish."""
    full = dict(running=60, finishes=(NOW + 9.0,) * 60, max_seqs=64)
    s = snap(inst("p0"), inst("d0", "both", **full), inst("d1", "both", running=56,
                                                           max_seqs=64),
             disaggregate=disaggregate)
    # d0 holds the whole prompt: only its batch being full sends the request elsewhere
    four, eight = (dataclasses.replace(request(2048, d0=63), sequences=n)
                   for n in (4, 8))
    assert pair(kv_centric(s, four))[1] == "d0"
    assert pair(kv_centric(s, eight))[1] == "d1"
    s = snap(inst("p0"), inst("d0", "both", **full), disaggregate=disaggregate)
    out = kv_centric(s, eight)
    assert isinstance(out, Reject) and out.retry_after_s == pytest.approx(9.0)


def test_every_sequence_reserves_its_output_kv_and_a_share_of_the_steps():
    s = snap(inst("p0"), inst("d0", "decode", capacity=10_000),
             inst("d1", "decode", running=2, capacity=100_000),
             tbt=TbtModel(0.0, 0.01, 0.0), tbt_slo_s=1.0)
    many = dataclasses.replace(request(1024, max_tokens=1_000), sequences=16)
    route = kv_centric(s, many)
    assert pair(route)[1] == "d1"  # 1,024 + 16 x 1,000 tokens do not fit d0's 10,000
    assert route.predicted_tbt_s == pytest.approx(0.18)  # 2 running + 16


def test_no_decode_within_tbt_slo_rejects_with_retry_after():
    s = snap(inst("p0"), inst("d0", "decode", running=50, finishes=(NOW + 7.0,) * 50),
             tbt=TbtModel(0.0, 0.01, 0.0), tbt_slo_s=0.2)
    out = kv_centric(s, request(512))
    assert isinstance(out, Reject) and "TBT" in out.reason
    assert out.retry_after_s == pytest.approx(7.0)


def test_ttft_slo_violation_rejects_before_any_work():
    s = snap(inst("p0", queue_s=5.0), inst("p1", queue_s=3.0), inst("d0", "decode"),
             ttft_slo_s=1.0)
    out = kv_centric(s, request(512))
    assert isinstance(out, Reject) and "TTFT" in out.reason
    assert 2.0 <= out.retry_after_s <= 2.5  # roughly until p1's queue is short enough


def test_per_request_slo_overrides_the_default():
    s = snap(inst("p0", queue_s=3.0), inst("d0", "decode"), ttft_slo_s=1.0)
    relaxed = dataclasses.replace(request(512), ttft_slo_s=10.0)
    assert isinstance(kv_centric(s, relaxed), Route)


def test_prediction_based_rejection_counts_decodes_finishing_before_arrival():
    """d0 is over the TBT SLO now, but 30 of its requests end before this prefill does."""
    finishes = (NOW + 0.5,) * 30 + (NOW + 60.0,) * 20
    s = snap(inst("p0", queue_s=1.0), inst("d0", "decode", running=50, finishes=finishes),
             tbt=TbtModel(0.0, 0.01, 0.0), tbt_slo_s=0.3)
    route = kv_centric(s, request(512))
    assert pair(route) == ("p0", "d0")
    assert route.predicted_tbt_s == pytest.approx(0.21)


def test_an_idle_decode_instance_computes_a_prompt_itself():
    """Nothing runs on d0: computing there costs the prefill alone, moving it through the pool
    costs a save, a load and a decode step more."""
    s = snap(inst("p0"), inst("d0", "decode"), disaggregate="auto")
    route = kv_centric(s, request(1024, pool=20))
    assert pair(route) == ("d0", "d0") and route.uncached_tokens == 1024 - 20 * BS
    assert route.cost_s == pytest.approx(route.predicted_ttft_s)  # no stream to stall


def test_a_long_prefill_goes_beside_a_decode_instance_with_streams_running():
    """Eight streams decode on d0: a 2K-token prefill there would stall every one of them;
    p0 computes it on cores of its own, and the streams keep their pace."""
    s = snap(inst("p0", cores="0", threads=1), inst("d0", "decode", running=8, cores="1",
                                                    threads=1), disaggregate="auto")
    route = kv_centric(s, request(2048))
    assert pair(route) == ("p0", "d0")
    local = kv_centric(snap(*s.instances, disaggregate="never"), request(2048))
    assert local.cost_s > route.cost_s
    assert local.cost_s == pytest.approx(local.predicted_ttft_s + 8 * local.prefill_s)


def test_a_side_engine_gets_a_prompt_only_when_it_ends_it_sooner_tokens_included():
    """The side engine (on the serving processes' cores) probed a little faster than the
    engine with a core of its own: a lone prompt still goes to the dedicated engine; beside a
    single stream there, a long answer is prefilled on the side engine and streamed by the
    dedicated one (each token a TBT slower on the side engine), a short one goes to the side
    engine, and so does a prompt behind a queue of seconds, its predicted TTFT unpriced."""
    home = dataclasses.replace(inst("b0", "both", cores="1", threads=1), prefill_speed=1.0)
    side = dataclasses.replace(inst("b1", "both", cores="0", threads=1), prefill_speed=0.9,
                               side=True)
    assert contention(side, home) == 1.0 and contention(home, side) == 0.0
    busy = dataclasses.replace(home, running=1)
    assert pair(kv_centric(snap(home, side, disaggregate="auto"), request(2048))) == ("b0", "b0")
    assert pair(kv_centric(snap(busy, side, disaggregate="auto"),
                           request(2048, max_tokens=128))) == ("b1", "b0")
    assert pair(kv_centric(snap(busy, side, disaggregate="auto"), request(2048))) == ("b1", "b1")
    unmarked = dataclasses.replace(side, side=False)  # not known as one: its probe wins
    assert pair(kv_centric(snap(home, unmarked, disaggregate="auto"), request(2048))) == (
        "b1", "b1")
    queued = dataclasses.replace(home, running=2, busy_until=NOW + 3.0)
    route = kv_centric(snap(queued, side, disaggregate="auto"), request(2048))
    assert pair(route) == ("b1", "b1")
    assert route.predicted_ttft_s == pytest.approx(route.prefill_s)
    assert route.cost_s == pytest.approx(route.prefill_s + 16 * route.predicted_tbt_s)
    priced = kv_centric(snap(home, side, disaggregate="auto", side_cost=3.0), request(2048))
    assert pair(priced) == ("b0", "b0")  # an operator's price still applies


def test_an_instance_measured_slower_gets_a_prompt_only_when_it_ends_it_sooner():
    """A background prefill engine prefills at a third of the speed of the `both` engine: an
    idle `both` engine computes a prompt itself, one decoding streams hands it over, and with
    the prefill engine queued the prompt stays at home."""
    slow = dataclasses.replace(inst("p0"), prefill_speed=3.0)
    fast = dataclasses.replace(inst("b0", "both"), prefill_speed=1.0)
    assert pair(kv_centric(snap(slow, fast, disaggregate="auto"), request(2048))) == ("b0", "b0")
    busy = dataclasses.replace(fast, running=4)
    route = kv_centric(snap(slow, busy, disaggregate="auto"), request(2048))
    assert pair(route) == ("p0", "b0")
    assert route.prefill_s == pytest.approx(3 * PrefillTimeModel().predict(2048, 0))
    queued = dataclasses.replace(slow, busy_until=NOW + 10.0)
    assert pair(kv_centric(snap(queued, busy, disaggregate="auto"), request(2048))) == (
        "b0", "b0")


def test_an_instance_speed_follows_its_timings_over_the_model():
    model = PrefillTimeModel(base_s=0.0, per_token_s=1e-3, per_attn_s=0.0)  # 1 ms a token
    load = LoadState("p0", "prefill", BS)
    assert load.view().prefill_speed == 1.0
    load.observe_prefill(200, 0, 0.8, model)
    assert load.view().prefill_speed == pytest.approx(4.0)  # the first timing counts whole
    load.observe_prefill(400, 100, 0.8, model)
    assert load.view().prefill_speed == pytest.approx(3.0)  # then a mean
    load.respeed(PrefillTimeModel(base_s=0.0, per_token_s=2e-3, per_attn_s=0.0))
    assert load.view().prefill_speed == pytest.approx(1.5)  # against a refitted model
    for _ in range(SPEED_WINDOW):
        load.observe_prefill(1000, 0, 1e-6, model)  # no faster than the floor
    assert load.view().prefill_speed == pytest.approx(SPEED_RANGE[0])
    load.observe_prefill(1000, 0, 0.0, model)  # no timing: unchanged
    assert load.view().prefill_speed == pytest.approx(SPEED_RANGE[0])
    for _ in range(SPEED_WINDOW):
        load.observe_prefill(1000, 0, 2.0, model)  # the last timings only
    assert load.view().prefill_speed == pytest.approx(2.0)


def test_prefills_beside_streams_of_its_own_make_a_speed_apart():
    """A prompt beside streams decoding on the same engine shares its steps with them (and a
    step budget cuts it into more steps): timed apart from prompts alone, its speed is its
    own; until one is timed, the speed alone times `BESIDE_PRIOR` stands for it."""
    model = PrefillTimeModel(base_s=0.0, per_token_s=1e-3, per_attn_s=0.0)
    load = LoadState("b0", "both", BS)
    load.observe_prefill(1000, 0, 0.5, model)
    assert load.view().speed(False) == load.speed(False) == pytest.approx(0.5)
    assert load.view().speed(True) == load.speed(True) == pytest.approx(0.5 * BESIDE_PRIOR)
    load.observe_prefill(1000, 0, 1.5, model)
    load.observe_prefill(1000, 0, 1.6, model, beside=True)
    load.observe_prefill(1000, 0, 1.4, model, beside=True)
    view = load.view()
    assert (view.speed(False), view.speed(True)) == (pytest.approx(1.0), pytest.approx(1.5))
    assert (load.speed(False), load.speed(True)) == (pytest.approx(1.0), pytest.approx(1.5))
    load.respeed(PrefillTimeModel(base_s=0.0, per_token_s=2e-3, per_attn_s=0.0))
    assert (load.speed(False), load.speed(True)) == (pytest.approx(0.5), pytest.approx(0.75))


def test_a_prompt_beside_streams_is_priced_at_that_speed():
    """Two engines, one decoding a stream: a prompt there is predicted at its speed beside
    streams (1.8x here), not alone (1x): with the stream's wait it costs 3.6x, and the prompt
    goes to the other engine, idle and slower alone (2.5x; at 1x it would have cost 2x there);
    the idle one's speed beside streams does not count."""
    model = PrefillTimeModel()
    busy = dataclasses.replace(inst("b0", "both", cores="1", threads=1), running=1,
                               finishes=(NOW + 60.0,), prefill_speed=1.0,
                               prefill_speed_beside=1.8)
    idle = dataclasses.replace(inst("b1", "both", cores="0", threads=1), prefill_speed=2.5,
                               prefill_speed_beside=5.0)
    route = kv_centric(snap(busy, disaggregate="never"), request(2048))
    assert route.prefill_s == pytest.approx(1.8 * model.predict(2048, 0))
    route = kv_centric(snap(busy, idle, disaggregate="never"), request(2048, max_tokens=1))
    assert pair(route) == ("b1", "b1")
    assert route.prefill_s == pytest.approx(2.5 * model.predict(2048, 0))
    alone = dataclasses.replace(busy, running=0, finishes=())
    assert pair(kv_centric(snap(alone, idle, disaggregate="never"),
                           request(2048, max_tokens=1))) == ("b0", "b0")


def test_a_prefill_is_priced_beside_streams_only_while_they_are_predicted_to_run():
    """Streams predicted to end a third of the way into a prefill (at its speed beside them,
    2x) slow that third only: a 3 s prefill alone takes 1 s at half speed and the 2 s left
    at full speed, 3.5 s in all, not 6; ended before it starts, they slow none of it."""
    b0 = dataclasses.replace(inst("b0", "both"), running=2, prefill_speed=1.0,
                             prefill_speed_beside=2.0, finishes=(NOW + 0.5, NOW + 2.0))
    assert b0.prefill_seconds(3.0, NOW) == pytest.approx(3.0 + 2.0 * (1 - 1 / 2))
    assert b0.prefill_seconds(3.0, NOW + 2.0) == pytest.approx(3.0)
    assert b0.prefill_seconds(0.5, NOW) == pytest.approx(1.0)  # beside them all along
    assert dataclasses.replace(b0, finishes=()).prefill_seconds(3.0, NOW) == 3.0
    queued = dataclasses.replace(b0, busy_until=NOW + 2.0)  # they end while it waits
    route = kv_centric(snap(queued, disaggregate="never"), request(2048))
    assert route.prefill_s == pytest.approx(PrefillTimeModel().predict(2048, 0))


def test_engines_sharing_cores_gain_nothing_from_disaggregating():
    """p0 and d0 each run two threads on the same two cores: a prefill on p0 slows d0's
    streams as much as one on d0 would, so the transfer is pure cost: computed locally (d0
    timed as fast beside its streams as alone; at `BESIDE_PRIOR`, p0 computes it faster)."""
    d0 = dataclasses.replace(inst("d0", "decode", running=8, cores="0-1", threads=2),
                             finishes=(NOW + 60.0,) * 8, prefill_speed_beside=1.0)
    shared = snap(inst("p0", cores="0-1", threads=2), d0, disaggregate="auto")
    assert pair(kv_centric(shared, request(2048))) == ("d0", "d0")
    assert contention(shared.instances[0], shared.instances[1]) == 1.0
    untimed = snap(inst("p0", cores="0-1", threads=2), dataclasses.replace(
        d0, prefill_speed_beside=None), disaggregate="auto")
    assert pair(kv_centric(untimed, request(2048))) == ("p0", "d0")
    apart = snap(inst("p0", cores="0-1", threads=2),
                 inst("d0", "decode", running=8, cores="2-3", threads=2), disaggregate="auto")
    assert contention(apart.instances[0], apart.instances[1]) == 0.0
    assert pair(kv_centric(apart, request(2048))) == ("p0", "d0")


def test_disaggregate_never_and_always():
    s = (inst("p0"), inst("d0", "decode", running=8))
    assert not kv_centric(snap(*s, disaggregate="never"), request(2048)).disaggregated
    assert kv_centric(snap(*s, disaggregate="always"), request(40)).disaggregated


def test_one_engine_in_the_both_role_serves_alone_even_when_disaggregation_is_forced():
    s = snap(inst("b0", "both"), disaggregate="always")
    assert pair(kv_centric(s, request(1024))) == ("b0", "b0")


def test_local_prefill_counts_the_decode_instances_own_prefill_queue():
    s = snap(inst("p0"), inst("d0", "decode", queue_s=2.0), disaggregate="auto")
    assert kv_centric(s, request(40)).disaggregated


# ---------------------------------------------------------------------- cache_aware

def test_cache_aware_balanced_takes_the_best_match():
    s = snap(inst("p0", in_flight=2), inst("p1", in_flight=4), inst("d0", "decode"))
    assert pair(cache_aware(s, request(1024, p1=20)))[0] == "p1"


def test_cache_aware_small_match_goes_to_the_emptiest_cache():
    s = snap(inst("p0", cached_blocks=900), inst("p1", cached_blocks=100),
             inst("d0", "decode"))
    assert pair(cache_aware(s, request(1024, p0=3)))[0] == "p1"


def test_cache_aware_imbalance_falls_back_to_best_match_among_least_loaded():
    """p2 holds the prefix but is swamped; the plain least loaded (p0) would throw locality
    away: p1, nearly as idle, holds part of it and wins."""
    s = snap(inst("p0", in_flight=0), inst("p1", in_flight=3), inst("p2", in_flight=80),
             inst("d0", "decode"))
    assert pair(cache_aware(s, request(1024, p1=10, p2=30)))[0] == "p1"
    assert pair(least_loaded(s, request(1024, p1=10, p2=30)))[0] == "p0"


# ---------------------------------------------------------------------- the simple ones

def test_round_robin_cycles_with_the_request_counter():
    s = snap(inst("p0"), inst("p1"), inst("d0", "decode"))
    assert [pair(round_robin(s, request(64, seq=i)))[0] for i in range(4)] == \
        ["p0", "p1", "p0", "p1"]


def test_random_is_spread_and_replayable():
    s = snap(*(inst(f"p{i}") for i in range(4)), inst("d0", "decode"))
    picks = [pair(random_choice(s, request(64, seq=i)))[0] for i in range(400)]
    assert picks == [pair(random_choice(s, request(64, seq=i)))[0] for i in range(400)]
    assert all(60 < picks.count(f"p{i}") < 140 for i in range(4))


def test_least_loaded_fills_predictions():
    s = snap(inst("p0", in_flight=2), inst("p1"), inst("d0", "decode"))
    route = least_loaded(s, request(640, pool=10))
    assert pair(route) == ("p1", "d0")
    assert route.cached_blocks == 10 and route.predicted_ttft_s > route.prefill_s > 0


# ---------------------------------------------------------------------- KV index

def test_index_matches_the_longest_prefix_per_location():
    idx = KVIndex()
    for name in ("p0", "p1", "d0"):
        idx.add_location(name)
    h = list(range(100, 110))
    idx.store(POOL, h[:8])
    idx.store("p0", h[:3])
    idx.store("p1", h)
    idx.store("d0", h[1:])  # no first block: no prefix at all
    m = idx.match(h)
    assert m.pool == 8 and dict(m.local) == {"p0": 3, "p1": 10}
    assert idx.match([1, 2, 3]) == PrefixMatch()


def test_index_a_hole_ends_the_prefix():
    idx = KVIndex()
    idx.add_location("p0")
    idx.store("p0", [1, 2, 3, 4])
    idx.remove("p0", [3])
    assert idx.match([1, 2, 3, 4]).local == {"p0": 2}


def test_tenants_with_different_salts_share_no_blocks():
    tokens = list(range(1024))
    idx = KVIndex()
    idx.add_location("p0")
    idx.store("p0", block_hashes(tokens, BS, "tenant-a"))
    assert idx.match(block_hashes(tokens, BS, "tenant-a")).local == {"p0": 32}
    assert idx.match(block_hashes(tokens, BS, "tenant-b")) == PrefixMatch()
    assert idx.match(block_hashes(tokens, BS)) == PrefixMatch()
    s = snap(inst("p0", queue_s=0.05), inst("p1"), inst("d0", "decode"))
    same = RouteRequest(1024, (), idx.match(block_hashes(tokens, BS, "tenant-a")))
    other = RouteRequest(1024, (), idx.match(block_hashes(tokens, BS, "tenant-b")))
    assert pair(kv_centric(s, same))[0] == "p0" and pair(kv_centric(s, other))[0] == "p1"


def test_predicted_blocks_expire_unless_confirmed():
    idx = KVIndex(ttl_s=5.0)
    idx.add_location("p0")
    idx.predict("p0", (1, 2, 3), now=10.0)
    idx.predict(POOL, (1, 2, 3), now=10.0)
    idx.store(POOL, [1, 2])  # the reply confirms two blocks in the pool
    assert idx.match([1, 2, 3]) == PrefixMatch(pool=3, local={"p0": 3})
    idx.expire(14.9)
    assert idx.match([1, 2, 3]).pool == 3
    idx.expire(15.0)
    assert idx.match([1, 2, 3]) == PrefixMatch(pool=2)
    assert idx.blocks("p0") == 0 and idx.blocks(POOL) == 2


def test_index_memory_is_bounded_and_forgets_the_oldest():
    idx = KVIndex(max_blocks=1000)
    idx.add_location("p0")
    for start in range(0, 5000, 100):
        idx.store("p0", range(start, start + 100))
    assert len(idx) <= 1000 and idx.evicted >= 4000
    assert idx.blocks("p0") == len(idx)
    assert idx.match([4999]).local == {"p0": 1} and idx.match([0]) == PrefixMatch()


def test_restored_blocks_are_refreshed_against_eviction():
    idx = KVIndex(max_blocks=100)
    idx.add_location("p0")
    idx.store("p0", range(100))
    idx.store("p0", [0])  # touched again: now the most recent
    idx.store("p0", range(100, 150))
    assert idx.match([0]).local == {"p0": 1} and idx.match([1]) == PrefixMatch()


def test_a_leaving_instance_is_forgotten_and_its_slot_reused():
    idx = KVIndex()
    idx.add_location("p0")
    idx.store("p0", [1, 2])
    idx.store(POOL, [1, 2])
    idx.remove_location("p0")
    assert idx.match([1, 2]) == PrefixMatch(pool=2)
    assert idx.add_location("p9") == 1 and idx.match([1, 2]).local == {}


# ---------------------------------------------------------------------- load model

def test_prefill_queue_is_a_self_correcting_fifo():
    load = LoadState("p0", "prefill", BS)
    load.add_prefill("a", 100, 100, 1.0, now=0.0)
    load.add_prefill("b", 100, 60, 0.5, now=0.2)
    assert load.view().busy_until == pytest.approx(1.5)
    assert load.view().queued_uncached_tokens == 160
    load.end_prefill("a", now=0.6)  # finished early: b starts now
    assert load.view().busy_until == pytest.approx(1.1)
    load.end_prefill("b", now=1.0)
    v = load.view()
    assert v.busy_until == 0.0 and v.in_flight == 0 and v.queued_prompt_tokens == 0


def test_decode_load_counts_from_dispatch_and_releases():
    load = LoadState("d0", "decode", BS, kv_capacity_tokens=4096)
    load.add_decode("a", 300, finish_at=5.0)
    load.add_decode("b", 200, finish_at=3.0)
    load.decode_progress("a", 10)
    v = load.view()
    assert (v.running, v.kv_tokens, v.finishes) == (2, 510, (3.0, 5.0))
    load.end_decode("a")
    load.end_decode("a")
    assert load.view().kv_tokens == 200


def test_a_request_of_n_choices_decodes_n_sequences():
    load = LoadState("d0", "decode", BS, max_seqs=64)
    load.add_decode("a", 300, finish_at=5.0, sequences=4)
    load.add_decode("b", 200, finish_at=3.0)
    v = load.view()
    assert (v.running, v.in_flight, v.kv_tokens, v.max_seqs) == (5, 2, 500, 64)
    assert v.finishes == (3.0, 5.0, 5.0, 5.0, 5.0)
    load.end_decode("a")
    assert load.view().finishes == (3.0,) and load.running() == 1


def test_a_local_prefill_is_one_request_in_flight():
    load = LoadState("d0", "decode", BS)
    load.add_prefill("a", 40, 40, 0.01, now=0.0)
    load.add_decode("a", 40, finish_at=1.0)
    assert load.view().in_flight == 1 and load.dispatched_total == 1


def test_generated_tokens_reach_the_view_a_block_at_a_time():
    load = LoadState("d0", "decode", BS)
    seen: list[str] = []
    load.on_change = seen.append
    load.add_decode("a", 100, finish_at=5.0)
    assert load.view().kv_tokens == 100 and seen == ["d0"]
    for _ in range(BS - 1):
        load.decode_progress("a", 1)
    assert load.view().kv_tokens == 100 and seen == ["d0"]  # not yet a block's worth
    load.decode_progress("a", 1)
    assert load.view().kv_tokens == 100 + BS and seen == ["d0", "d0"]


def test_a_patched_snapshot_equals_one_frozen_whole():
    """The router keeps its snapshot current by patching the instances whose load changed;
    after any sequence of dispatches and completions it must equal a fresh one, decisions
    included."""
    import random

    rng = random.Random(7)
    loads = [LoadState(f"p{i}", "prefill", BS) for i in range(6)]
    loads += [LoadState(f"d{i}", "decode", BS, kv_capacity_tokens=50_000) for i in range(4)]
    loads.append(LoadState("b0", "both", BS, kv_capacity_tokens=50_000))
    by_id = {s.instance_id: s for s in loads}
    dirty: set[str] = set()
    for s in loads:
        s.on_change = dirty.add
    params = SchedulerParams(disaggregate="auto")
    patched = ClusterSnapshot(tuple(s.view() for s in loads), NOW, params)
    live: list[tuple[str, str, str]] = []
    for n in range(400):
        now = NOW + n * 0.01
        patched = patched.replacing([by_id[i].view() for i in dirty], now)
        dirty.clear()
        whole = ClusterSnapshot(tuple(s.view() for s in loads), now, params)
        assert patched.instances == whole.instances
        assert patched.prefill_by_queue() == whole.prefill_by_queue()
        assert patched.decode_rows() == whole.decode_rows()
        assert patched.orders() == whole.orders()
        assert patched.prefill() == whole.prefill() and patched.decode() == whole.decode()
        req = request(rng.randrange(40, 2000), pool=rng.randrange(0, 4), seq=n,
                      **{f"p{rng.randrange(6)}": rng.randrange(0, 30)})
        for name in POLICIES:
            assert POLICIES[name](patched, req) == POLICIES[name](whole, req), name
        if rng.random() < 0.6:
            p = rng.choice([s for s in loads if s.role != "decode"]).instance_id
            d = rng.choice([s for s in loads if s.role != "prefill"]).instance_id
            rid = f"r{n}"
            by_id[p].add_prefill(rid, 500, rng.randrange(1, 500), rng.uniform(0.01, 1), now)
            by_id[d].add_decode(rid, 500, now + rng.uniform(0, 5))
            live.append((rid, p, d))
        if live and rng.random() < 0.5:
            rid, p, d = live.pop(rng.randrange(len(live)))
            by_id[p].end_prefill(rid, now)
            if rng.random() < 0.7:
                by_id[d].end_decode(rid)
            else:
                by_id[d].decode_progress(rid, rng.randrange(1, 3 * BS))
                live.append((rid, d, d))


# ---------------------------------------------------------------------- time models

def test_prefill_model_refits_to_observed_timings():
    truth = PrefillTimeModel(0.02, 3e-4, 2e-8)
    fit = PrefillTimeFitter(PrefillTimeModel(0.01, 1e-4, 1e-8))
    for u, c in [(100, 0), (500, 0), (1000, 0), (200, 800), (50, 1500), (900, 100)] * 5:
        fit.observe(u, c, truth.predict(u, c))
    for u, c in [(300, 0), (700, 500)]:
        assert fit.model.predict(u, c) == pytest.approx(truth.predict(u, c), rel=0.05)


def test_an_inter_departure_time_far_from_the_prediction_is_no_timing():
    """A 30-token remainder that waited ~3 s behind another prompt's chunks, or came out of
    a batch at once, teaches the model nothing; the same seconds measured alone do."""
    truth = PrefillTimeModel(0.02, 3e-4, 2e-8)
    fit = PrefillTimeFitter(truth, every=1)
    for seconds in (3.0, 0.001):
        fit.observe(30, 3232, seconds, exact=False)
        assert fit.model == truth
    fit.observe(30, 3232, 1.5 * truth.predict(30, 3232), exact=False)  # within the band
    moved = fit.model.predict(30, 3232)
    assert moved > truth.predict(30, 3232)
    fit.observe(30, 3232, 3.0)
    assert fit.model.predict(30, 3232) > moved


def test_prefill_model_keeps_its_prior_until_observed():
    prior = PrefillTimeModel(0.01, 1e-4, 1e-8)
    fit = PrefillTimeFitter(prior)
    assert fit.model == prior
    fit.observe(0, 100, 1.0)  # nothing computed: no evidence
    assert fit.model == prior


def test_a_model_fitted_to_a_slow_moment_returns_to_its_prior_without_new_timings():
    """Rejected requests bring no timings: without forgetting, a model fitted while the machine
    was slow would make the scheduler refuse everything for good."""
    prior = PrefillTimeModel(0.01, 1e-4, 1e-8)
    fit = PrefillTimeFitter(prior)
    for u in (100, 500, 1000, 300):
        fit.observe(u, 0, 100 * prior.predict(u, 0), now=0.0)
    slow = fit.model.predict(2000, 0)
    assert slow > 20 * prior.predict(2000, 0)
    fit.refresh(2.0)  # too soon to refit
    assert fit.model.predict(2000, 0) == slow
    fit.refresh(120.0)  # two half-lives: still mostly the slow timings
    assert fit.model.predict(2000, 0) > 5 * prior.predict(2000, 0)
    fit.refresh(30 * 60.0)
    assert fit.model.predict(2000, 0) == pytest.approx(prior.predict(2000, 0), rel=0.2)


def test_timings_that_barely_exercise_a_term_do_not_move_it_by_orders_of_magnitude():
    """bench-e2e's overhead probes: 2-token prefills after a 64-token prefix, ~20 ms each (the
    step's fixed cost) made a model that predicted 19 s for a 2,252-token prompt (0.6 s)."""
    prior = PrefillTimeModel(0.01, 1e-4, 1e-8)
    fit = PrefillTimeFitter(prior)
    for i in range(40):
        fit.observe(2, 64, 0.02, now=i * 0.05)
    assert fit.model.predict(2, 64) == pytest.approx(0.02, rel=0.1)  # what it saw
    assert fit.model.per_attn_s < 2 * prior.per_attn_s
    assert fit.model.predict(2252, 0) < 4 * prior.predict(2252, 0)
    for i in range(4):  # long prompts timed: the model follows them
        fit.observe(2252, 0, 0.6, now=2.0 + i)
    assert fit.model.predict(2252, 0) == pytest.approx(0.6, rel=0.1)


def test_tbt_model_refits():
    truth = TbtModel(0.004, 0.002, 1e-6)
    fit = TbtFitter(TbtModel(0.01, 0.001, 1e-7))
    for n, kv in [(1, 200), (4, 1000), (16, 5000), (32, 9000), (8, 20000)] * 4:
        fit.observe(n, kv, truth.predict(n, kv))
    assert fit.model.predict(10, 4000) == pytest.approx(truth.predict(10, 4000), rel=0.05)


def test_extending_a_chain_equals_hashing_the_whole_sequence():
    from store.block_hash import extend_hashes

    tokens = list(range(7, 7 + 10 * BS + 5))
    whole = block_hashes(tokens, BS, "s")
    head = block_hashes(tokens[:4 * BS + 3], BS, "s")
    assert head + extend_hashes(head[-1], tokens[4 * BS:], BS) == whole
    assert extend_hashes(None, tokens, BS, "s") == whole
