"""The control state that conductor replicas share through a real etcd (tests/fake_worker.py
workers, `LocalConductor` replicas sharing one membership prefix): a change through one
replica's admin API holds on every replica and across a replica's restart, with the fitted
models it had learned; a corrupted record changes nothing; with etcd down serving goes on and
changes are refused."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import httpx
import pytest
import structlog
from conftest import wait_until
from fake_worker import LocalConductor

from cluster.etcd_server import EtcdServer
from cluster.membership import Registration
from cluster.ports import free_port
from conductor.control_records import ModelControl, encode
from conductorctl.cli import main as ctl

KEYS = "key-a a\nkey-b b\n"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.close()


class Cluster:
    """Conductor replicas over one etcd: the first owns the fake workers, the others
    (`replica()`) serve them too."""

    def __init__(self, model_dir: str, etcd: EtcdServer, tmp: Path) -> None:
        self.model_dir, self.etcd, self.tmp = model_dir, etcd, tmp
        (tmp / "keys").write_text(KEYS)
        self.token = tmp / "admin.token"
        self.token.write_text("t0ken")
        self.prefix = ""
        self.addrs: dict[LocalConductor, str] = {}

    def replica(self, roles: tuple[str, ...] = ()) -> LocalConductor:
        port = free_port()
        c = LocalConductor(self.model_dir, roles=roles, etcd=self.etcd.endpoint,
                           prefix=self.prefix, conductor_args=(
                               "--admin-port", str(port), "--admin-token-file", str(self.token),
                               "--api-keys-file", str(self.tmp / "keys"),
                               "--control-models-s", "0.2", "--policy", "round_robin"))
        self.prefix = c.prefix
        self.addrs[c] = f"127.0.0.1:{port}"
        return c

    def ctl(self, replica: LocalConductor, *args: str) -> int:
        return ctl(["--addr", self.addrs[replica], "--token-file", str(self.token), *args])

    @property
    def control_prefix(self) -> str:
        return self.prefix.removesuffix("instances/") + "control/"


def _once(fn):
    done: list[bool] = []

    def call() -> None:
        if not done:
            done.append(True)
            fn()
    return call


def _serves_all(c: LocalConductor, ids: set[str]) -> bool:
    return c.call(lambda: all((i := c.conductor.registry.get(iid)) is not None and i.verified
                              for iid in ids))


def _post(c: LocalConductor, key: str = "key-b", tokens: int = 40) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/completions", timeout=30,
                      headers={"authorization": f"Bearer {key}"},
                      json={"prompt": "word " * tokens, "max_tokens": 2})


def _state(c: LocalConductor) -> dict:
    """What the replica routes by now."""
    def read() -> dict:
        cond = c.conductor
        r, reg, t = cond.pipeline.router, cond.registry, cond.tenants
        return {"draining": sorted(i.instance_id for i in reg.all() if i.draining),
                "slo": (r.ttft_slo_s, r.tbt_slo_s), "policy": (r.policy_name, r.disaggregate),
                "a": t.limits("a")}
    return c.call(read)


def _models(c: LocalConductor) -> tuple:
    """Its fitted models, and the timings they were fitted from."""
    r = c.conductor.pipeline.router
    return c.call(lambda: (r.prefill_fit.model, r.tbt_fit.model,
                           set(r.prefill_fit.rows()), set(r.tbt_fit.rows())))


def _routed_to_decode_1(cluster_owner: LocalConductor, replicas: list[LocalConductor],
                        n: int = 6) -> int:
    before = cluster_owner.workers["decode-1"].counts.generates
    for c in replicas:
        for _ in range(n):
            assert _post(c).status_code == 200
    return cluster_owner.workers["decode-1"].counts.generates - before


def test_a_change_through_one_replica_holds_on_all_of_them_and_across_its_restart(
        model_dir, etcd, tmp_path, capsys):
    """Issue 50's acceptance: drain an instance and change the SLO (and a tenant's limits,
    the policy) through replica 1; both replicas route accordingly; replica 1 stops and
    starts again: the state holds on both, and its fitted models are the ones it learned."""
    cluster = Cluster(model_dir, etcd, tmp_path)
    with contextlib.ExitStack() as stack:
        owner = stack.enter_context(cluster.replica(("prefill", "decode", "decode")))
        r1 = cluster.replica().__enter__()
        stopped = stack.callback(_once(lambda: r1.__exit__(None, None, None)))
        r2 = stack.enter_context(cluster.replica())
        ids = {"prefill-0", "decode-0", "decode-1"}
        for c in (r1, r2):
            wait_until(lambda c=c: _serves_all(c, ids), 20, "a replica did not see the workers")
        assert _routed_to_decode_1(owner, [r1, r2], 8) > 0  # both decode instances serve
        before = _state(r2)

        assert cluster.ctl(r1, "drain", "decode-1") == 0
        assert cluster.ctl(r1, "slo", "--ttft-ms", "7000", "--tbt-ms", "250") == 0
        assert cluster.ctl(r1, "tenant", "a", "--tokens-per-s", "1") == 0
        assert cluster.ctl(r1, "policy", "--policy", "least_loaded") == 0
        want = {"draining": ["decode-1"], "slo": (7.0, 0.25), "policy": ("least_loaded", "auto"),
                "a": dataclasses.replace(before["a"], tokens_per_s=1.0)}
        assert _state(r1) == want  # in force on replica 1 as its calls returned
        for c in (r2, owner):
            wait_until(lambda c=c: _state(c) == want, 5, "a replica did not follow the change")
        assert _routed_to_decode_1(owner, [r1, r2]) == 0
        assert _post(r2, "key-a", 50).status_code == 200  # a full bucket of 10 tokens ...
        r = _post(r2, "key-a", 50)  # ... then its debt
        assert r.status_code == 429 and r.headers["x-kvcluster-reason"] == "tenant_token_rate"

        # replica 1 learns timings; replica 2 follows its models as they are written
        def learn() -> None:
            router = r1.conductor.pipeline.router
            now = time.monotonic()
            for n in (600, 1200, 2400, 3000, 4000):
                router.prefill_fit.observe(n, 0, n * 4e-4, now=now)
            for k in (1, 2, 4, 8):
                router.tbt_fit.observe(k, k * 1000, 0.02 + 0.004 * k, now=now)

        r1.call(learn)

        def stored(c: LocalConductor) -> tuple:
            """The models as last written (by any replica), as the replica saw them."""
            control = c.conductor.control
            return c.call(lambda: tuple(control.record(f"models/{k}") for k in ("prefill",
                                                                                 "tbt")))

        def shared() -> bool:  # both replicas hold the record's timings, and its models
            written, mine = stored(r1), _models(r1)
            return all(isinstance(m, ModelControl) for m in written) and _models(r2) == mine \
                and (set(written[0].rows), set(written[1].rows)) == mine[2:]

        wait_until(shared, 10, "the models were not shared")
        learned, written = _models(r1), stored(r1)
        assert (tuple(written[0].coefficients), tuple(written[1].coefficients)) == (
            learned[0].coefficients(), learned[1].coefficients())
        assert learned[0] != r1.conductor.pipeline.router.prefill_fit.prior
        assert len(learned[2]) >= 5 and len(learned[3]) >= 4  # all those timings, at least

        async def nothing() -> None:
            pass

        r1.conductor.control.write_models = nothing  # no last write, as if killed
        stopped()  # replica 1 goes away ...
        r1b = stack.enter_context(cluster.replica())  # ... and comes back
        assert _models(r1b) == learned  # priced with what was learned, before any request
        wait_until(lambda: _serves_all(r1b, ids), 20, "the restarted replica did not serve")
        assert _state(r1b) == want and _state(r2) == want
        assert _routed_to_decode_1(owner, [r1b, r2]) == 0

        # a drain names the instance: its worker re-registering (a restart) stays drained
        reg = owner.registrations["decode-1"]
        info = dataclasses.replace(reg.info, started_at=time.time() + 1)

        async def restart_worker() -> None:
            await reg.stop()
            owner.workers["decode-1"].info = info  # what it reports of itself
            owner.registrations["decode-1"] = new = Registration(
                etcd.endpoint, info, prefix=cluster.prefix, ttl=3)
            await new.start(timeout=10)

        asyncio.run_coroutine_threadsafe(restart_worker(), owner._loop).result(30)
        for c in (r1b, r2):
            wait_until(lambda c=c: c.call(
                lambda: (i := c.conductor.registry.get("decode-1")) is not None
                and i.info == info and i.verified), 20, "the worker did not come back")
            assert _state(c)["draining"] == ["decode-1"]

        assert cluster.ctl(r2, "undrain", "decode-1") == 0
        assert cluster.ctl(r2, "policy", "--policy", "round_robin") == 0
        for c in (r1b, owner):
            wait_until(lambda c=c: _state(c)["draining"] == [] and _state(c)["policy"] == (
                "round_robin", "auto"), 5, "changes through replica 2 not followed")
        assert _routed_to_decode_1(owner, [r1b], 8) > 0
    capsys.readouterr()


def test_a_corrupted_or_half_written_record_is_ignored_and_changes_nothing(
        model_dir, etcd, tmp_path):
    cluster = Cluster(model_dir, etcd, tmp_path)
    with cluster.replica(("prefill", "decode", "decode")) as c:
        assert cluster.ctl(c, "drain", "decode-1") == 0
        assert cluster.ctl(c, "slo", "--ttft-ms", "7000") == 0
        want = _state(c)
        assert want["draining"] == ["decode-1"] and want["slo"][0] == 7.0
        prefix = cluster.control_prefix
        undrained = json.dumps({"schema": 1, "kind": "instance", "instance_id": "decode-1",
                                "draining": False, "role": ""})
        damage = {"instances/decode-1": undrained[:-9],  # half-written
                  "slo": json.dumps({"schema": 2, "kind": "slo", "ttft_slo_s": 0.001,
                                     "tbt_slo_s": 0.001}),  # a newer schema
                  "tenants/a": json.dumps({"schema": 1, "kind": "tenant", "tenant": "a",
                                           "limits": {"max_concurrency": 1}}),  # fields missing
                  "policy": b"\xff\xfe"}
        foreign = ModelControl("prefill", "another-model", time.time(), (1.0, 1.0, 1.0),
                               (((1.0, 100.0, 5e3), 9.0, time.time()),))
        models = _models(c)

        async def put(items: dict) -> None:
            async with aetcd.Client("127.0.0.1", etcd.client_port, timeout=2) as client:
                for key, value in items.items():
                    raw = value if isinstance(value, bytes) else value.encode()
                    await client.put((prefix + key).encode(), raw)

        with structlog.testing.capture_logs() as logs:
            asyncio.run(put({**damage, "models/prefill": encode(foreign)}))
            wait_until(lambda: sum(e["event"] in ("control_record_invalid", "control_model_"
                                                  "foreign") for e in logs) >= 5,
                       5, "the records were not seen")
            assert _state(c) == want and _models(c) == models
            assert _routed_to_decode_1(c, [c]) == 0
            assert {e["key"] for e in logs if e["event"] == "control_record_invalid"} == set(
                damage)
            # the follower goes on: a whole record is applied
            asyncio.run(put({"instances/decode-1": undrained}))
            wait_until(lambda: _state(c)["draining"] == [], 5, "a valid record not applied")
        # a change through the admin API replaces a corrupted record
        assert cluster.ctl(c, "slo", "--tbt-ms", "200") == 0
        assert _state(c)["slo"] == (7.0, 0.2)


def test_with_etcd_down_serving_goes_on_and_changes_are_unavailable(
        model_dir, tmp_path, capsys):
    with EtcdServer(data_dir=tmp_path / "etcd") as etcd:
        cluster = Cluster(model_dir, etcd, tmp_path)
        with cluster.replica(("prefill", "decode", "decode")) as c:
            assert cluster.ctl(c, "drain", "decode-1") == 0
            want = _state(c)
            etcd.kill()
            capsys.readouterr()
            assert cluster.ctl(c, "undrain", "decode-1") == 1
            assert cluster.ctl(c, "slo", "--ttft-ms", "1") == 1
            assert cluster.ctl(c, "tenant", "a", "--max-concurrency", "1") == 1
            err = capsys.readouterr().err
            assert err.count("conductorctl: UNAVAILABLE: the control state cannot be changed") \
                == 3, err
            assert _state(c) == want
            assert _routed_to_decode_1(c, [c]) == 0  # serving, with the last state
            etcd.restart()
            wait_until(lambda: c.call(lambda: c.conductor.control.synced), 15,
                       "the control state did not resync")
            assert cluster.ctl(c, "undrain", "decode-1") == 0
            assert _state(c)["draining"] == []


def test_a_new_embedded_cluster_starts_from_its_configuration(model_dir, tmp_path):
    """The launcher deletes the control state an earlier cluster left in its run directory's
    etcd: SLOs, drains and fitted models of another session do not carry into this one."""
    from embedded.launcher import ClusterSpec, EmbeddedCluster

    with EtcdServer(data_dir=tmp_path / "etcd") as etcd:
        async def put() -> None:
            async with aetcd.Client("127.0.0.1", etcd.client_port, timeout=2) as client:
                await client.put(b"/kvcluster/control/slo", b"{}")
                await client.put(b"/kvcluster/control/instances/decode-0", b"{}")
                await client.put(b"/kvcluster/instances/decode-0", b"{}")

        asyncio.run(put())
        spec = ClusterSpec(model=model_dir, http_port=0, run_dir=str(tmp_path / "run"))
        cluster = EmbeddedCluster(spec)
        cluster.etcd = etcd
        cluster._fresh_control_state()
        assert etcd.delete_prefix("/kvcluster/control/") == 0  # gone already
        assert etcd.delete_prefix("/kvcluster/instances/") == 1  # membership untouched


# ---------------------------------------------------------------- the state's own rules


def _state_in_memory(model_dir: str, tmp_path: Path, limits: str = "", **kw):
    from conductor.config import ConductorConfig
    from conductor.control_state import ControlState
    from conductor.control_store import MemoryControlStore
    from conductor.registry import Registry
    from conductor.router import Router
    from conductor.tenants import Tenants

    path = tmp_path / "limits.toml"
    path.write_text(limits)
    config = ConductorConfig(model=model_dir, etcd="127.0.0.1:1", kv_events=False,
                             tenant_limits_file=str(path))
    registry = Registry()
    router = Router(config, registry)
    store = MemoryControlStore()
    return ControlState(config, store, registry, router, Tenants(config.tenant_limits),
                        **kw), store


async def test_a_change_applies_by_revision_never_undone_by_an_older_one(model_dir, tmp_path):
    from conductor.control_records import SloControl

    state, store = _state_in_memory(model_dir, tmp_path)
    await state.start()
    await state.set_slo(5.0, None)
    rev = state._entries["slo"].revision
    state._event("slo", encode(SloControl(9.0, 0.5)), rev + 2)  # another replica, later
    state._event("slo", encode(SloControl(1.0, 0.1)), rev + 1)  # an echo arriving late
    assert (state.router.ttft_slo_s, state.router.tbt_slo_s) == (9.0, 0.5)
    state._snapshot({}, rev + 3)  # a re-snapshot: deleted meanwhile, the configured SLOs
    assert (state.router.ttft_slo_s, state.router.tbt_slo_s) == (30.0, 0.3)
    await state.close()


async def test_records_of_instances_gone_are_kept_up_to_a_bound_oldest_dropped(
        model_dir, tmp_path):
    state, store = _state_in_memory(model_dir, tmp_path, max_instance_records=2)
    await state.start()
    for iid in ("gone-0", "gone-1", "gone-2"):
        await state.set_instances({iid: {"draining": True}})
    assert sorted(state.instance_records()) == ["gone-1", "gone-2"]
    assert sorted(k for k in store._data if k.startswith("instances/")) == [
        "instances/gone-1", "instances/gone-2"]
    await state.set_instances({"gone-1": {"draining": False}})  # undrained: no record
    assert sorted(store._data) == ["instances/gone-2"]
    await state.close()


async def test_a_tenant_reset_holds_over_the_limits_file_and_unavailable_changes_nothing(
        model_dir, tmp_path):
    from conductor.errors import ControlUnavailable
    from conductor.tenants import Limits

    state, store = _state_in_memory(model_dir, tmp_path,
                                    '[tenants.a]\nmax_concurrency = 3\n')
    await state.start()
    tenants = state.tenants
    assert tenants.limits("a").max_concurrency == 3
    await state.set_tenant("a", {"tokens_per_s": 5.0}, reset=False)
    assert tenants.limits("a") == Limits(max_concurrency=3, tokens_per_s=5.0)
    await state.set_tenant("a", {}, reset=True)  # none of its own, whatever the file says
    assert tenants.limits("a") == Limits() and "a" not in tenants.configured()
    assert "tenants/a" in store._data  # stored: a restarted replica reads the file again
    with pytest.raises(ValueError):
        await state.set_tenant("a", {"priority": "urgent"}, reset=False)
    store.down = True
    with pytest.raises(ControlUnavailable):
        await state.set_tenant("a", {"max_concurrency": 1}, reset=False)
    with pytest.raises(ControlUnavailable):
        await state.set_instances({"decode-0": {"draining": True}})
    assert tenants.limits("a") == Limits() and state.instance_records() == {}
    store.down = False
    await state.close()
