"""Membership that proves itself: an etcd entry shapes nothing (block size, context,
namespaces, cores) and is routed nothing until the worker at its address proved itself (the
cluster secret's proof, and its own `Stats` reporting the same registration) and agrees with
the cluster's terms (model, namespace, block size: `conductor.terms`); out-of-range fields are
refused when the entry is decoded. The real conductor app over fake workers
(tests/fake_worker.py); a worker re-asserting its own key in real etcd is in
test_membership."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
import time
import tracemalloc

import aetcd
import grpc
import httpx
import pytest
from conftest import wait_until
from fake_worker import Knobs, LocalConductor

from cluster.etcd_server import EtcdServer
from cluster.instance import InstanceInfo
from cluster.ports import free_port
from cluster.secret import ClusterSecret
from protos import admin_pb2, admin_pb2_grpc, worker_pb2

TOKEN = "admin-token-for-tests"


@pytest.fixture
def secret_file(tmp_path) -> str:
    return str(ClusterSecret.create(tmp_path / "cluster.secret"))


def _served(c: LocalConductor, n: int, prompt: str = "word ") -> None:
    for i in range(n):
        r = httpx.post(f"{c.url}/v1/completions", timeout=30,
                       json={"prompt": f"{prompt}{i} " * 60, "max_tokens": 2})
        assert r.status_code == 200, r.text


def _unshaped(c: LocalConductor) -> None:
    """The cluster's parameters are the honest workers' (block size 32, the model's own
    context as they announce none, their namespace)."""
    conductor = c.app.state.conductor
    assert conductor.pipeline.block_size() == 32
    assert conductor.tokenizer.max_model_len == conductor.tokenizer.model_max_len
    assert conductor.pool_namespaces() == {"kv-fake"}


def _info(iid: str, address: str, **fields: object) -> InstanceInfo:
    base = InstanceInfo(instance_id=iid, role="decode", address=address, model="tinymodel",
                        block_size=32, capacity_tokens=1 << 20, version="test",
                        kv_namespace="kv-fake")
    return dataclasses.replace(base, **fields)


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STRANGE = {
    "block_size": {"block_size": 64},
    "tiny_context": {"max_model_len": 16},
    "huge_cores": {"cpus": "0-8191", "threads": 8192},
    "model": {"model": "other-model"},
    "namespace": {"kv_namespace": "kv-other"},
}


@pytest.mark.parametrize("kind", sorted(STRANGE))
def test_an_impostors_registration_shapes_nothing(model_dir, secret_file, kind):
    """decode-1 serves every call but does not hold the cluster secret; whatever it
    registered, the cluster's parameters stay the honest workers' and it gets nothing."""
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        secret_file=secret_file, impostors=("decode-1",),
                        overrides={"decode-1": STRANGE[kind]},
                        conductor_args=("--disaggregate", "always")) as c:
        _served(c, 6)
        registry = c.app.state.conductor.registry
        assert registry.get("decode-1").state == "unverified"
        assert registry.get("decode-1").load.cores == frozenset()  # nothing built for it
        assert c.workers["decode-1"].counts.generates == 0
        assert c.workers["decode-0"].counts.generates == 6
        _unshaped(c)


def test_an_impostors_pool_figures_price_nothing(model_dir, secret_file):
    """The pool's measured time per block prices every request's transfers
    (`PoolStatsPoller.seconds_per_block`): an impostor's Stats claiming a second a block
    are not counted, the honest worker's are."""
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        secret_file=secret_file, impostors=("decode-1",),
                        conductor_args=("--stats-interval-s", "0.2")) as c:
        slow = worker_pb2.PoolStats(blocks_loaded=1000,
                                    load=worker_pb2.LatencyHistogram(sum_seconds=1000.0))
        fast = worker_pb2.PoolStats(blocks_loaded=100,
                                    load=worker_pb2.LatencyHistogram(sum_seconds=0.1))
        c.workers["decode-1"].knobs = Knobs(pool=slow)
        c.workers["decode-0"].knobs = Knobs(pool=fast)
        polled = c.workers["decode-1"].counts.stats
        poller = c.app.state.conductor.pool_stats
        wait_until(lambda: "decode-0" in poller.latest
                   and c.workers["decode-1"].counts.stats >= polled + 3, 10)
        assert "decode-1" not in poller.latest
        assert poller.seconds_per_block() == pytest.approx(0.001)


async def test_kv_events_are_followed_once_an_instance_is_admitted(config_only_model):
    """A worker's KV events fill the global index (bounded, least recently stored first
    out): a stranger's are not listened to until it proved itself and agrees."""
    from conductor.config import ConductorConfig
    from conductor.registry import Registry
    from conductor.router import Router

    registry = Registry()
    router = Router(ConductorConfig(model=config_only_model, etcd="127.0.0.1:1"), registry)
    assert router.follower is not None
    registry.sync({"d0": _m("d0"), "d1": _m("d1"), "dx": _m("dx", block_size=64)})
    assert router.follower.following() == []
    for iid in ("d0", "d1", "dx"):
        registry.set_verified(iid)
    assert sorted(router.follower.following()) == ["d0", "d1"]
    assert registry.get("dx").state == "mismatched"
    await router.follower.close()
    await registry.close()


def test_registrations_without_a_worker_of_their_own_shape_nothing(model_dir):
    """No cluster secret (a loopback cluster): an entry is proved by the worker at its address
    reporting the same registration. One entry points at nothing, one at decode-0's address
    under another id; both claim another block size, a tiny context, all cores, another
    namespace."""
    strange = {"block_size": 64, "max_model_len": 16, "cpus": "0-8191", "threads": 8192,
               "kv_namespace": "kv-other"}
    strange["model"] = model_dir.rstrip("/").split("/")[-1]
    nowhere = _info("decode-x", f"127.0.0.1:{_closed_port()}", **strange)
    with LocalConductor(model_dir, roles=("prefill", "decode"), strangers=(nowhere,),
                        conductor_args=("--disaggregate", "always")) as c:
        c.put_member(_info("decode-y", c.addresses["decode-0"], **strange))
        registry = c.app.state.conductor.registry
        _served(c, 4)
        for iid in ("decode-x", "decode-y"):
            assert registry.get(iid).state == "unverified", iid
            assert registry.get(iid).load.cores == frozenset()
        assert registry.get("decode-0").state == "serving"
        assert c.workers["decode-0"].counts.generates == 4
        _unshaped(c)


MISMATCH = {
    "block_size": ({"block_size": 64}, ()),
    "configured_block_size": ({"block_size": 64}, ("--block-size", "32")),
    "model": ({"model": "other-model"}, ()),
    "namespace": ({"kv_namespace": "kv-other"}, ()),
}


@pytest.mark.parametrize("kind", sorted(MISMATCH))
def test_a_proven_instance_that_disagrees_is_not_routed_and_listed_mismatched(
        model_dir, kind, capfd):
    """decode-2 proves itself (its Stats report its registration) but registered another
    block size, model or namespace than the cluster's: it is listed `mismatched` with the
    reason, logged once, routed nothing, and shapes nothing."""
    override, args = MISMATCH[kind]
    port = free_port()
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode", "decode"),
                        overrides={"decode-2": override},
                        conductor_args=("--disaggregate", "always", "--admin-port", str(port),
                                        "--admin-token", TOKEN, *args)) as c:
        registry = c.app.state.conductor.registry
        wait_until(lambda: registry.get("decode-2").state == "mismatched", 5)
        _served(c, 9)
        assert c.workers["decode-2"].counts.generates == 0
        assert c.workers["decode-0"].counts.generates + c.workers["decode-1"].counts.generates \
            == 9
        _unshaped(c)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            listed = admin_pb2_grpc.AdminStub(ch).ListInstances(
                admin_pb2.ListInstancesRequest(),
                metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        states = {i.instance_id: (i.state, i.mismatch) for i in listed.instances}
        state, why = states["decode-2"]
        assert state == "mismatched" and kind.removeprefix("configured_") in why.replace(
            " ", "_"), why
        assert {s for iid, (s, _) in states.items() if iid != "decode-2"} == {"serving"}
    logged = [line for line in capfd.readouterr().out.splitlines()
              if "instance_mismatched" in line and "instance_id=decode-2" in line]
    assert len(logged) == 1, logged


def test_an_overwritten_registration_is_not_believed_until_its_worker_says_so(model_dir):
    """Someone puts decode-0's key again with a tiny context (same id, same address): the
    worker at that address reports what it registered, which differs, so decode-0 is out of
    routing and its claimed context shapes nothing; put back, it serves again."""
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        conductor_args=("--disaggregate", "always")) as c:
        registry = c.app.state.conductor.registry
        honest = c.workers["decode-0"].info
        assert honest is not None
        c.put_member(dataclasses.replace(honest, max_model_len=16, block_size=64))
        wait_until(lambda: registry.get("decode-0").state == "unverified", 5)
        before = c.workers["decode-0"].counts.generates
        _served(c, 4)
        assert c.workers["decode-0"].counts.generates == before
        _unshaped(c)
        c.put_member(honest)
        wait_until(lambda: registry.get("decode-0").state == "serving", 5)
        _unshaped(c)


def test_in_etcd_strangers_change_nothing_and_an_overwritten_entry_comes_back(
        model_dir, tmp_path):
    """Real etcd: the fake workers register on leases of 3 s and the conductor watches. A
    stranger adds an entry pointing at decode-0 (another block size, a tiny context) and
    rewrites decode-1's with a tiny context: requests go on being served within the honest
    terms throughout, and decode-1's worker puts its entry back within the TTL, after which
    it serves again."""
    ttl = 3
    server = EtcdServer(data_dir=tmp_path / "etcd").start()
    try:
        with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                            etcd=server.endpoint, lease_ttl=ttl,
                            conductor_args=("--disaggregate", "always")) as c:
            registry = c.app.state.conductor.registry
            honest = c.workers["decode-1"].info
            assert honest is not None
            stranger = _info("decode-x", c.addresses["decode-0"], model=c.served_name,
                             block_size=64, max_model_len=16)
            forged = dataclasses.replace(honest, max_model_len=16)

            async def put() -> None:
                async with aetcd.Client("127.0.0.1", server.client_port, timeout=2) as client:
                    await client.put(f"{c.prefix}decode-x".encode(), stranger.to_json())
                    await client.put(f"{c.prefix}decode-1".encode(), forged.to_json())

            asyncio.run(put())
            t0 = time.monotonic()
            wait_until(lambda: registry.get("decode-x") is not None, 5)
            _served(c, 3)
            _unshaped(c)
            wait_until(lambda: (i := registry.get("decode-1")) is not None
                       and i.info == honest and i.state == "serving", ttl + 2)
            back = time.monotonic() - t0
            _served(c, 3)
            _unshaped(c)
            assert registry.get("decode-x").state == "unverified"
    finally:
        server.close()
    assert back < ttl + 1, f"decode-1 served again after {back:.1f} s"


# ------------------------------------------------------------------ the terms, pure


def _m(iid: str, **fields: object) -> InstanceInfo:
    return _info(iid, "127.0.0.1:1", **fields)


def test_the_terms_are_those_most_proven_instances_hold_ties_keep_the_current():
    from conductor.terms import Expected, Terms, agree

    a, b, c = _m("a"), _m("b"), _m("c", block_size=64)
    terms, out = agree(Expected(), [c, a, b], Terms())
    assert (terms.block_size, terms.kv_namespace, out) == (32, "kv-fake", {"c": out["c"]})
    assert "block size 64" in out["c"]
    terms, out = agree(Expected(), [c], Terms())  # alone, c's terms are the cluster's
    assert terms.block_size == 64 and out == {}
    terms, out = agree(Expected(), [c, a], terms)  # a tie keeps them
    assert terms.block_size == 64 and set(out) == {"a"}
    terms, out = agree(Expected(), [c, a, b], terms)  # outnumbered: they change
    assert terms.block_size == 32 and set(out) == {"c"}
    terms, _ = agree(Expected(), [], terms)
    assert terms == Terms()


def test_configured_terms_are_never_outvoted():
    from conductor.terms import Expected, Terms, agree

    expected = Expected(models=frozenset({"tinymodel"}), block_size=64)
    a, b, c = _m("a"), _m("b", model="other"), _m("c", block_size=64)
    terms, out = agree(expected, [a, b, c], Terms())
    assert set(out) == {"a", "b"} and "model 'other'" in out["b"]
    assert terms.block_size == 64 and terms.kv_namespace == "kv-fake"
    terms, out = agree(expected, [a], Terms())
    assert terms.block_size == 64 and set(out) == {"a"}


def test_the_context_is_the_smallest_known_of_the_agreeing_instances():
    from conductor.terms import Expected, Terms, agree

    insts = [_m("a", max_model_len=4096), _m("b", max_model_len=0), _m("c", max_model_len=2048),
             _m("d", max_model_len=16, kv_namespace="kv-other")]
    terms, out = agree(Expected(), insts, Terms())
    assert terms.max_model_len == 2048 and set(out) == {"d"}


# ------------------------------------------------------------------ the door


def _encoded(**fields: object) -> bytes:
    obj = json.loads(_m("a").to_json())
    obj.update(fields)
    return json.dumps(obj).encode()


REFUSED = [
    {"cpus": "0-1000000"},
    {"gpus": "0-100000"},
    {"cpus": "0-4294967295"},
    {"cpus": "0," * 5000 + "1"},
    {"cpus": "\u0663"},  # an Arabic-Indic digit: int() takes it, a CPU list has none
    {"block_size": 1 << 20},
    {"capacity_tokens": 1 << 60},
    {"max_model_len": 1 << 40},
    {"threads": 1 << 20},
    {"instance_id": "x" * 1000},
    {"instance_id": "a b"},
    {"model": "m" * 10000},
    {"version": "v" * 10000},
    {"kv_namespace": "k" * 10000},
    {"address": "127.0.0.1:99999"},
    {"address": "127.0.0.1:0"},
    {"address": "bad host:80"},
    {"address": "http://h:80"},
    {"address": "h\n:80"},
    {"address": "h" * 300 + ":80"},
    {"prefill_probe_s": math.inf},
    {"prefill_probe_s": 1e9},
    {"started_at": math.nan},
]


@pytest.mark.parametrize("fields", REFUSED, ids=lambda f: next(iter(f)))
def test_out_of_range_fields_are_refused_at_the_door(fields):
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            InstanceInfo.from_json(_encoded(**fields))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing {fields} took {peak} bytes"


def test_real_deployments_fit_the_door_comfortably():
    big_gpu = dict(cpus="0-223", gpus="0-7", threads=224, block_size=128,
                   capacity_tokens=40_000_000, max_model_len=10_000_000,
                   address="gpu-node-17.cluster.example.com:50051",
                   instance_id="decode-gpu-node-17-0", model="meta-llama/Llama-3.1-405B-Instruct",
                   version="0.1.0+cu128", prefill_probe_s=12.5)
    big_cpu = dict(cpus="0-191,384-575", threads=384, address="[fd00::17]:50051",
                   block_size=1024, max_model_len=131072)
    for fields in (big_gpu, big_cpu, {"address": "10.1.2.3:65535"},
                   {"cpus": ",".join(str(i) for i in range(0, 1024, 2))}):
        info = InstanceInfo.from_json(_encoded(**fields))
        assert InstanceInfo.from_json(info.to_json()) == info
