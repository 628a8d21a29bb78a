"""The scheduler's stateful seams without engines: the router's dispatch-time accounting and
early rejection over a real registry, the conductor's KV event follower, and the worker's
relay that re-keys vLLM's KV events into the conductor's block hashes."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
from conftest import wait_until

from cluster.instance import InstanceInfo
from conductor.config import ConductorConfig
from conductor.errors import NoCapacity, Overloaded
from conductor.registry import Registry
from conductor.router import Router, kv_block_bytes
from conductor.scheduler.events import KvEventFollower
from conductor.scheduler.index import POOL, KVIndex
from protos import worker_pb2
from store.block_hash import block_hashes, from_wire, to_wire

BS = 32


@pytest.fixture
def model_dir(config_only_model: str) -> str:
    return config_only_model


def _member(iid: str, role: str, port: int) -> InstanceInfo:
    return InstanceInfo(instance_id=iid, role=role, address=f"127.0.0.1:{port}", model="m",
                        block_size=BS, capacity_tokens=100_000, version="t")


def _joined(registry: Registry, members: dict[str, InstanceInfo]) -> None:
    """`members` join the registry and prove themselves (what `conductor.health` does)."""
    registry.sync(members)
    for iid in members:
        registry.set_verified(iid)


async def _router(model_dir: str, **config: object) -> tuple[Router, Registry]:
    """A router over two prefill and one decode instance; it disaggregates every request (the
    accounting under test is the P/D path's) unless told otherwise."""
    config.setdefault("disaggregate", "always")
    registry = Registry()
    router = Router(ConductorConfig(model=model_dir, etcd="127.0.0.1:1", kv_events=False,
                                    **config), registry)
    _joined(registry, {"p0": _member("p0", "prefill", 1), "p1": _member("p1", "prefill", 2),
                   "d0": _member("d0", "decode", 3)})
    return router, registry


async def test_a_broken_instance_serves_again_after_its_cooldown_without_traffic(model_dir):
    """make test-hosts saw decode-c listed "broken" for 120 s after its link came back: its
    breaker half-opened only when a request was routed, and none was."""
    _, registry = await _router(model_dir)
    registry.call_failed("d0", fatal=True, cooldown_s=0.05)
    assert registry.get("d0").state == "broken"
    assert "d0" not in {v.instance_id for v in registry.views()}
    wait_until(lambda: any(i.instance_id == "d0" and i.state == "serving"
                           for i in registry.all()),
               timeout=5, what="d0 still broken after its cool-down")
    assert "d0" in {v.instance_id for v in registry.views()}
    assert registry.get("d0").state == "serving"


async def test_a_half_open_instance_takes_one_request_until_it_answers(model_dir):
    """After its cool-down a broken instance is tried with one request, not all of them: the
    others go elsewhere (here: nowhere else can decode, so 503) until the probe's first
    token closes the breaker."""
    router, registry = await _router(model_dir)
    tokens = list(range(100))
    hashes = tuple(block_hashes(tokens, BS))
    registry.call_failed("d0", fatal=True, cooldown_s=0.05)
    wait_until(lambda: registry.all() and registry.get("d0").breaker.admits(), timeout=5)
    probe = router.route("a", tokens, hashes, 16, BS)
    assert probe.decode.instance_id == "d0" and registry.get("d0").state == "probing"
    with pytest.raises(NoCapacity):
        router.route("b", tokens, hashes, 16, BS)
    probe.release()  # ended without a verdict (its client left): the next request probes
    again = router.route("c", tokens, hashes, 16, BS)
    registry.call_succeeded("d0")  # its first token
    assert registry.get("d0").state == "serving"
    router.route("d", tokens, hashes, 16, BS).release()
    router.route("e", tokens, hashes, 16, BS).release()
    again.release()


def test_block_bytes_follow_the_model_geometry(model_dir):
    assert kv_block_bytes(model_dir, BS) == 2 * 4 * 2 * 64 * 4 * BS


async def test_dispatch_counts_load_at_once_and_releases_it_once(model_dir):
    router, registry = await _router(model_dir)
    tokens = list(range(1000))
    hashes = tuple(block_hashes(tokens, BS))
    first = router.route("a", tokens, hashes, 16, BS)
    p, d = first.prefill.load, first.decode.load
    assert p.prefills_in_flight() == 1 and d.running() == 1 and d.kv_tokens == 1000
    # the next identical request sees the first one's queue and its predicted blocks
    second = router.route("b", tokens, hashes, 16, BS)
    assert second.prefill.instance_id != first.prefill.instance_id or second.route.cached_blocks
    assert router.index.match(hashes).pool == 0  # not before the prefill is done
    first.prefill_done(1000, 0, len(hashes), 0.2)
    assert router.index.match(hashes).pool == len(hashes)
    first.first_token()
    first.tokens([5, 6, 7])
    first.decode_done()
    first.release()
    assert p.prefills_in_flight() == (1 if second.prefill.load is p else 0)
    second.release()
    second.release()
    assert all(i.load.in_flight() == 0 and i.load.kv_tokens == 0 for i in registry.all())
    assert router.counters.routed == 2
    await registry.close()


async def test_a_prefix_still_being_computed_is_no_pool_hit_elsewhere(model_dir):
    """bench-e2e run 7: a second prompt of a prefix another engine was still computing was
    priced as a pool hit on an idle engine, which then computed the prefix all over again (the
    pool had nothing yet). The blocks count in the pool once the prefill is done, and on the
    decode instance once it has its first token; in the prefilling engine's cache at once."""
    router, registry = await _router(model_dir, disaggregate="auto")
    tokens = list(range(1000))
    hashes = tuple(block_hashes(tokens, BS))
    first = router.route("a", tokens, hashes, 16, BS)
    match = router.index.match(hashes)
    assert match.pool == 0 and match.local == {first.prefill.instance_id: len(hashes)}
    second = router.route("b", tokens + [1] * 40, hashes + (7,), 16, BS)
    if second.prefill.instance_id != first.prefill.instance_id:
        assert second.route.cached_blocks == 0  # computed, and priced so
    first.prefill_done(1000, 0, len(hashes), 0.2)
    assert router.index.match(hashes).pool == len(hashes)
    first.first_token()
    assert router.index.match(hashes).local[first.decode.instance_id] == len(hashes)
    for d in (first, second):
        d.release()
    await registry.close()


async def test_the_tbt_model_learns_the_steady_gaps_not_the_hand_over(model_dir, monkeypatch):
    """The first gap of a disaggregated stream is the hand-over from the prefill (seconds when
    the pool stalls): a TBT sample made of it made the router reject requests on an idle
    cluster (found by the SIGSTOP-master test)."""
    router, registry = await _router(model_dir)
    clock = [100.0]
    monkeypatch.setattr("conductor.router.time",
                        type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    prompt = list(range(100))
    dispatch = router.route("a", prompt, tuple(block_hashes(prompt, BS)), 16, BS)
    seen: list[float] = []
    monkeypatch.setattr(router.tbt_fit, "observe", lambda b, k, tbt, now=None: seen.append(tbt))
    dispatch.first_token()
    dispatch.tokens([1])  # the prefill's token
    clock[0] += 5.0  # the hand-over: the decode waited for the pool
    dispatch.tokens([2])
    for t in range(3, 11):
        clock[0] += 0.01
        dispatch.tokens([t])
    dispatch.decode_done()
    assert seen == [pytest.approx(0.01)]
    await registry.close()


async def test_decode_done_indexes_the_generated_blocks_for_the_next_turn(model_dir):
    router, registry = await _router(model_dir)
    prompt = list(range(100))
    hashes = tuple(block_hashes(prompt, BS))
    dispatch = router.route("a", prompt, hashes, 64, BS)
    output = list(range(500, 540))
    dispatch.first_token()
    dispatch.tokens(output)
    dispatch.decode_done()
    turn2 = block_hashes(prompt + output + [7] * 30, BS)
    assert router.index.match(turn2).local[dispatch.decode.instance_id] == (100 + 40) // BS
    await registry.close()


async def test_a_prefill_reply_corrects_what_the_index_believes_of_the_pool(model_dir):
    """The pool evicted the tail of a chain the index holds: the next prefill of that chain
    reports how long a prefix the pool really holds, and the index follows."""
    router, registry = await _router(model_dir)
    tokens = list(range(320))
    hashes = tuple(block_hashes(tokens, BS))
    router.index.store(POOL, hashes)
    dispatch = router.route("a", tokens, hashes, 4, BS)
    assert dispatch.route.cached_blocks == len(hashes) - 1  # all loadable blocks, per the index
    dispatch.prefill_done(320, 3 * BS, 3, 0.1)
    assert router.index.match(hashes).pool == 3
    dispatch.release()
    await registry.close()


async def test_an_engines_first_prefill_is_not_timed_its_second_is(model_dir):
    """A fresh engine's first prefill pays its warm-up (2 s for 66 tokens was seen here): timed,
    it made the model predict minutes for a 2K-token prompt, and every request was refused."""
    router, registry = await _router(model_dir)
    before = router.prefill_fit.model
    for i, seconds in enumerate((2.0, 0.05)):
        tokens = list(range(i * 1000, i * 1000 + 66))
        dispatch = router.route(f"r{i}", tokens, tuple(block_hashes(tokens, BS)), 4, BS,
                                exclude={"p1"})
        dispatch.prefill_done(66, 0, 2, seconds)
        dispatch.release()
        assert router.prefill_fit.observations == i
    assert router.prefill_fit.model != before
    assert router.prefill_fit.model.predict(66, 0) < 0.5
    await registry.close()


async def test_the_snapshot_follows_dispatches_and_drains(model_dir):
    router, registry = await _router(model_dir)
    tokens = list(range(1000))
    hashes = tuple(block_hashes(tokens, BS))
    first = router.route("a", tokens, hashes, 16, BS)
    snap = router.snapshot(0.0, BS)
    p = snap.prefill_instance(first.prefill.instance_id)
    assert p is not None and p.in_flight == 1 and p.busy_until > 0
    first.release()
    assert router.snapshot(0.0, BS).prefill_instance(first.prefill.instance_id).in_flight == 0
    registry.set_draining("p0", True)
    assert [i.instance_id for i in router.snapshot(0.0, BS).prefill()] == ["p1"]
    assert all(router.route(f"r{n}", tokens, hashes, 16, BS).prefill.instance_id != "p0"
               for n in range(3))
    registry.set_draining("p0", False)
    assert {i.instance_id for i in router.snapshot(0.0, BS).prefill()} == {"p0", "p1"}
    await registry.close()


async def test_overload_raises_429_with_retry_after_and_counts_nothing(model_dir):
    router, registry = await _router(model_dir, ttft_slo_s=0.5)
    admitted = []
    with pytest.raises(Overloaded) as e:
        for i in range(50):  # distinct prompts: no request helps the next one's cache
            tokens = list(range(i * 1500, (i + 1) * 1500))
            admitted.append(router.route(f"r{i}", tokens, tuple(block_hashes(tokens, BS)), 16,
                                         BS))
    assert e.value.retry_after >= 1 and "SLO" in e.value.message
    assert admitted and router.counters.rejected == 1
    assert sum(i.load.prefills_in_flight() for i in registry.all()) == len(admitted)
    assert sum(i.load.running() for i in registry.all()) == len(admitted)
    await registry.close()


async def test_no_decode_instance_is_503(model_dir):
    registry = Registry()
    router = Router(ConductorConfig(model=model_dir, etcd="127.0.0.1:1", kv_events=False),
                    registry)
    _joined(registry, {"p0": _member("p0", "prefill", 1)})
    with pytest.raises(NoCapacity, match="decode"):
        router.route("a", [1, 2, 3], (), 4, BS)
    await registry.close()


async def test_a_leaving_instance_leaves_the_index(model_dir):
    router, registry = await _router(model_dir)
    router.index.store("p0", [1, 2, 3])
    _joined(registry, {"p1": _member("p1", "prefill", 2), "d0": _member("d0", "decode", 3)})
    assert "p0" not in router.index.locations() and router.index.match([1, 2, 3]).local == {}
    await registry.close()


# ---------------------------------------------------------------------- event follower

def test_follower_applies_reset_evictions_then_stores():
    index = KVIndex()
    index.add_location("p0")
    index.store("p0", [9, 10])
    follower = KvEventFollower(index)
    follower.apply("p0", worker_pb2.KvEventBatch(reset=True, stored=to_wire([1, 2, 3])))
    assert index.match([9]).local == {} and index.match([1, 2, 3]).local == {"p0": 3}
    follower.apply("p0", worker_pb2.KvEventBatch(removed=to_wire([3]), stored=to_wire([4])))
    assert index.match([1, 2, 3]).local == {"p0": 2} and index.match([4]).local == {"p0": 1}
    assert index.blocks(POOL) == 0


# ---------------------------------------------------------------------- worker relay

def _stored(hashes: list, parent, tokens: list[int], salt: str | None = None):
    from vllm.distributed.kv_events import BlockStored

    extra = [(salt,) if salt and i == 0 and parent is None else None for i in range(len(hashes))]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=extra)


async def test_relay_rekeys_vllm_events_into_the_conductors_hashes():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    from worker.kv_events import KvEventRelay

    relay = KvEventRelay(BS)
    try:
        tokens = list(range(1000, 1000 + 4 * BS))
        ours = block_hashes(tokens, BS, "tenant")
        stream = relay.stream()
        assert (await anext(stream)).reset
        relay._apply([_stored([b"a", b"b"], None, tokens[:2 * BS], "tenant"),
                      _stored([b"c", b"d"], b"b", tokens[2 * BS:])])
        batch = await anext(stream)
        assert from_wire(batch.stored) == ours and not batch.reset
        relay._apply([BlockRemoved(block_hashes=[b"d"], medium="GPU"),
                      _stored([b"x"], b"unknown", tokens[:BS])])  # parent never seen: skipped
        batch = await anext(stream)
        assert from_wire(batch.removed) == ours[3:] and not batch.stored
        assert relay.untranslatable == 1
        late = relay.stream()  # a new subscriber starts from everything cached now
        assert set(from_wire((await anext(late)).stored)) == set(ours[:3])
        relay._apply([AllBlocksCleared()])
        assert (await anext(stream)).reset and relay.blocks() == 0
        await asyncio.wait_for(late.aclose(), 1)
    finally:
        relay.stop()


async def test_a_workers_probe_sets_its_speed_and_its_timings_refine_it(model_dir):
    """p0 announced a probe 4x the model's prediction: its prefills are priced 4x from the
    first request, so p1 gets the long prompts; p1's timings (2x) make its speed, and the
    shared model learns what is left of them (nothing, here)."""

    from dataclasses import replace

    from cluster.instance import PROBE_TOKENS

    registry = Registry()
    router = Router(ConductorConfig(model=model_dir, etcd="127.0.0.1:1", kv_events=False,
                                    disaggregate="always"), registry)
    model = router.prefill_fit.model
    _joined(registry, {"p0": replace(_member("p0", "prefill", 1),
                                 prefill_probe_s=4 * model.predict(PROBE_TOKENS, 0)),
                   "p1": _member("p1", "prefill", 2), "d0": _member("d0", "decode", 3)})
    p0, p1 = registry.get("p0").load, registry.get("p1").load
    assert (p0.prefill_speed, p1.prefill_speed) == (pytest.approx(4.0), 1.0)
    router.warm.update(("p0", "p1"))
    seconds = 2 * model.predict(2048, 0)
    for n, rid in enumerate(("a", "b")):
        tokens = list(range(n * 5000, n * 5000 + 2048))
        now_model = router.prefill_fit.model  # refitted after each timing
        d = router.route(rid, tokens, tuple(block_hashes(tokens, BS)), 16, BS)
        assert d.prefill.instance_id == "p1" and d.route.prefill_s == pytest.approx(
            p1.prefill_speed * now_model.predict(2048, 0))
        d.prefill_done(2048, 0, 64, seconds)
        d.release()
        assert p1.prefill_speed == pytest.approx(2.0)
        assert router.prefill_fit._obs._rows[-1][1] == pytest.approx(seconds / 2)
    assert router.prefill_fit.model.predict(2048, 0) == pytest.approx(model.predict(2048, 0))


def _one_engine(model_dir: str, monkeypatch) -> tuple[Router, Registry, list[float]]:
    """A router over one warm `both` instance, b0, on a clock the test moves (`clock[0]`)."""
    registry = Registry()
    router = Router(ConductorConfig(model=model_dir, etcd="127.0.0.1:1", kv_events=False),
                    registry)
    _joined(registry, {"b0": _member("b0", "both", 1)})
    router.warm.add("b0")
    clock = [100.0]
    monkeypatch.setattr("conductor.router.time",
                        type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    return router, registry, clock


async def test_a_prompt_computed_where_it_decodes_is_timed_for_the_prefill_model(
        model_dir, monkeypatch):
    """make run's shape computes most prompts on the instance that decodes them: untimed, the
    shared model stayed at its prior (bench-e2e run 11: 0.26 s predicted for a cold 2,250-token
    prompt that takes ~1.1 s). Timed from dispatch to first token when alone, with the
    engine's own count of what it did not compute; the instance's speed takes its share."""
    router, registry, clock = _one_engine(model_dir, monkeypatch)
    prior = router.prefill_fit.model
    for n in range(4):
        tokens = list(range(n * 5000, n * 5000 + 2048))
        d = router.route(f"r{n}", tokens, tuple(block_hashes(tokens, BS)), 4, BS)
        assert not d.route.disaggregated
        clock[0] += 4 * prior.predict(1024, 1024)
        d.first_token(num_cached_tokens=1024)  # the engine found half of it cached
        d.release()
    rows = router.prefill_fit._obs._rows
    assert len(rows) == 4 and rows[0][0][1] == 1024.0  # its uncached tokens, as reported
    tokens = list(range(50_000, 52_048))  # alone at dispatch; a short one rides along after it
    long = router.route("long", tokens, tuple(block_hashes(tokens, BS)), 4, BS)
    short = router.route("short", tokens[:40], tuple(block_hashes(tokens[:40], BS)), 4, BS)
    assert short.decode is long.decode
    clock[0] += 1.5
    short.first_token(num_cached_tokens=0)  # it finished first, a moment before
    long.first_token(num_cached_tokens=0)
    timed = registry.get("b0").load._timings[False][-1]
    assert timed[:2] == (2048, 0) and timed[2] == pytest.approx(1.5)  # from its dispatch
    for d in (long, short):
        d.release()
    speed = registry.get("b0").load.prefill_speed
    assert speed > 1.0
    assert router.prefill_fit.model.predict(1024, 1024) * speed == pytest.approx(
        4 * prior.predict(1024, 1024), rel=0.25)
    await registry.close()


async def test_a_prompt_beside_streams_of_its_own_is_timed_for_that_speed(model_dir, monkeypatch):
    """A prompt dispatched while a stream decodes on its engine shares that engine's steps:
    its timing makes the instance's speed beside streams, not its speed alone, and the shared
    model learns it divided by that speed (bench-e2e run 12: a cold prompt on the side engine
    beside one stream of its own took ~1.5x one alone, priced as alone)."""
    router, registry, clock = _one_engine(model_dir, monkeypatch)
    load = registry.get("b0").load
    stream = router.route("s", list(range(64)), tuple(block_hashes(list(range(64)), BS)), 99, BS)
    clock[0] += 0.05
    stream.first_token(num_cached_tokens=0)  # too short to time a speed: it streams on
    assert load._timings[True] == load._timings[False] == deque()
    tokens = list(range(5000, 7048))
    d = router.route("long", tokens, tuple(block_hashes(tokens, BS)), 4, BS)
    predicted = router.prefill_fit.model.predict(2048, 0)
    clock[0] += 3 * predicted
    d.first_token(num_cached_tokens=0)
    d.release()
    assert not load._timings[False] and load._timings[True][-1][2] == pytest.approx(
        3 * predicted)
    router.snapshot(clock[0], BS)  # speeds against the model as refitted
    assert load.speed(True) * router.prefill_fit.model.predict(2048, 0) == pytest.approx(
        3 * predicted, rel=0.05)
    assert load.speed(False) == 1.0  # alone: unchanged
    stream.release()
    await registry.close()
