"""The admin API over fake workers (tests/fake_worker.py): token, instances, drain, pool
resizing in a deployed cluster (drain and role switching), SLOs, prewarm and index figures.

The same API over real engines and processes (starting workers, kill -9, etcd outage,
prewarm's effect on TTFT) is in tests/test_admin_e2e.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from conftest import wait_until
from fake_worker import Knobs, LocalConductor

from cluster.ports import free_port
from protos import admin_pb2, admin_pb2_grpc

TOKEN = "s3cret-token"


class Admin:
    """A client of the admin API with the token (or another one)."""

    def __init__(self, addr: str, token: str | None = TOKEN) -> None:
        self.channel = grpc.insecure_channel(addr)
        self.stub = admin_pb2_grpc.AdminStub(self.channel)
        self.md = (("authorization", f"Bearer {token}"),) if token is not None else ()

    def __getattr__(self, name: str):
        rpc = getattr(self.stub, name)
        return lambda request, timeout=10.0: rpc(request, metadata=self.md, timeout=timeout)

    def states(self) -> dict[str, tuple[str, str]]:
        reply = self.ListInstances(admin_pb2.ListInstancesRequest())
        return {i.instance_id: (i.role, i.state) for i in reply.instances}


def conductor(model_dir: str, roles: tuple[str, ...], knobs: Knobs | None = None,
              ) -> tuple[LocalConductor, str]:
    port = free_port()
    c = LocalConductor(model_dir, roles=roles, knobs=knobs, conductor_args=(
        "--admin-port", str(port), "--admin-token", TOKEN, "--disaggregate", "always"))
    return c, f"127.0.0.1:{port}"


def complete(url: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": "word " * 100, "max_tokens": 2, **extra})


def test_wrong_or_missing_token_is_refused_and_changes_nothing(model_dir):
    c, addr = conductor(model_dir, ("prefill", "prefill", "decode"))
    with c:
        before = Admin(addr).states()
        for token in ("wrong", "", None):
            bad = Admin(addr, token)
            for call, req in (("ResizePool", admin_pb2.ResizePoolRequest(role="prefill",
                                                                          target=0)),
                              ("Drain", admin_pb2.DrainRequest(instance_id="prefill-0")),
                              ("SetSLO", admin_pb2.SetSLORequest(ttft_ms=1)),
                              ("ListInstances", admin_pb2.ListInstancesRequest())):
                with pytest.raises(grpc.RpcError) as e:
                    getattr(bad, call)(req)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (call, token)
        assert Admin(addr).states() == before
        assert all(state == "serving" for _, state in before.values())
        assert complete(c.url).status_code == 200  # the SLO did not change either


def test_instances_drain_waits_for_in_flight_then_undrain(model_dir):
    gate = threading.Event()
    c, addr = conductor(model_dir, ("prefill", "decode"), Knobs(prefill_gate=gate))
    with c:
        admin = Admin(addr)
        listed = admin.ListInstances(admin_pb2.ListInstancesRequest()).instances
        assert {(i.instance_id, i.role, i.state, i.advertised_role) for i in listed} == {
            ("prefill-0", "prefill", "serving", "prefill"),
            ("decode-0", "decode", "serving", "decode")}
        results = []
        t = threading.Thread(target=lambda: results.append(complete(c.url)))
        t.start()
        wait_until(lambda: c.worker("prefill").counts.running == 1)  # in its prefill now
        reply = admin.Drain(admin_pb2.DrainRequest(instance_id="prefill-0"))
        assert reply.state == "draining" and reply.in_flight == 1 and not reply.idle
        gate.set()  # the prefill may finish now
        t0 = time.monotonic()
        reply = admin.Drain(admin_pb2.DrainRequest(instance_id="prefill-0", wait=True))
        assert reply.idle and reply.in_flight == 0 and time.monotonic() - t0 < 5
        t.join(10)
        assert results[0].status_code == 200  # the drained instance finished its request
        r = complete(c.url)  # it takes no new one: the decode instance computes the prompt
        assert r.status_code == 200 and r.json()["kv_transfer"]["prefill_instance"] == "decode-0"
        assert admin.Undrain(admin_pb2.DrainRequest(instance_id="prefill-0")).state == "serving"
        assert complete(c.url).status_code == 200
        with pytest.raises(grpc.RpcError) as e:
            admin.Drain(admin_pb2.DrainRequest(instance_id="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_deployed_resize_switches_both_instances_drains_surplus_and_says_what_it_cannot(
        model_dir):
    c, addr = conductor(model_dir, ("prefill", "prefill", "both", "decode"))
    with c:
        admin = Admin(addr)
        # prefill is served by prefill-0, prefill-1 and both-0: shrink it to 1
        r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="prefill", target=1))
        assert (r.before, r.after) == (3, 1)
        assert list(r.switched) == ["both-0"] and len(r.drained) == 1
        states = admin.states()
        assert states["both-0"] == ("decode", "serving")
        assert states[r.drained[0]] == ("prefill", "draining")
        # growing prefill: the drained one comes back first, then both-0 switches back
        r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="prefill", target=3))
        assert (r.before, r.after) == (1, 3) and not r.unmet
        assert len(r.undrained) == 1 and list(r.switched) == ["both-0"]
        assert admin.states()["both-0"] == ("prefill", "serving")
        # no process can be started in a deployed cluster: said, not pretended
        r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="prefill", target=5))
        assert r.after == 3 and "2 prefill instance(s) short" in r.unmet and not r.started
        assert complete(c.url).status_code == 200
        # drained surplus instances stay as standbys (nothing can restart them here)
        r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="prefill", target=1))
        assert list(r.switched) == ["both-0"] and len(r.drained) == 1
        wait_until(lambda: admin.states()[r.drained[0]] == ("prefill", "draining"))
        assert not any(w.counts.retired for w in c.workers.values())
        with pytest.raises(grpc.RpcError) as e:
            admin.ResizePool(admin_pb2.ResizePoolRequest(role="router", target=1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_set_slo_applies_to_the_next_requests(model_dir):
    c, addr = conductor(model_dir, ("prefill", "decode"))
    with c:
        admin = Admin(addr)
        assert complete(c.url).status_code == 200
        r = admin.SetSLO(admin_pb2.SetSLORequest(ttft_ms=1e-6))
        assert r.ttft_ms == pytest.approx(1e-6) and r.tbt_ms == pytest.approx(300)
        rejected = complete(c.url)
        assert rejected.status_code == 429 and int(rejected.headers["retry-after"]) >= 1
        admin.SetSLO(admin_pb2.SetSLORequest(ttft_ms=30_000))
        assert complete(c.url).status_code == 200
        with pytest.raises(grpc.RpcError) as e:
            admin.SetSLO(admin_pb2.SetSLORequest(ttft_ms=5, model="other-model"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_engines_step_target_follows_the_tbt_slo_to_every_instance(model_dir):
    """Each instance is sent half the TBT SLO as it joins, again when the SLO changes (not when
    only the TTFT SLO does), and retried while it does not answer; an engine without a step
    budget is told once."""
    knobs = Knobs(step_target_unavailable=2)
    c, addr = conductor(model_dir, ("prefill", "decode", "decode"), knobs)
    with c:
        admin = Admin(addr)
        targets = c.app.state.conductor.step_targets
        decodes = [c.workers["decode-0"], c.workers["decode-1"]]
        # every worker refuses its first two calls, then takes the third
        wait_until(lambda: len(targets.applied) == 3, timeout=20, what="every instance told")
        assert set(targets.applied.values()) == {150.0}  # half the default 300 ms
        assert [w.counts.step_targets for w in decodes] == [[150.0] * 3] * 2
        admin.SetSLO(admin_pb2.SetSLORequest(ttft_ms=2_000))  # no TBT change: nothing sent
        admin.SetSLO(admin_pb2.SetSLORequest(tbt_ms=80))
        wait_until(lambda: set(targets.applied.values()) == {40.0}, timeout=10,
                   what="the new target everywhere")
        assert [w.counts.step_targets for w in decodes] == [[150.0] * 3 + [40.0]] * 2
    knobs = Knobs(step_budget=False)
    c, addr = conductor(model_dir, ("decode",), knobs)
    with c:
        worker = c.worker("decode")
        wait_until(lambda: worker.counts.step_targets == [150.0], timeout=10,
                   what="the instance told")
        assert c.app.state.conductor.step_targets.applied == {}


def test_prewarm_prefills_once_plus_chosen_instances_and_index_stats_count_it(model_dir):
    c, addr = conductor(model_dir, ("prefill", "decode"))
    with c:
        admin = Admin(addr)
        r = admin.Prewarm(admin_pb2.PrewarmRequest(prompt="word " * 300,
                                                   instances=["decode-0"]))
        assert r.prompt_tokens >= 300 and r.blocks == r.prompt_tokens // 32
        assert list(r.warmed) == ["prefill-0", "decode-0"]
        assert c.worker("prefill").counts.prefills == 1
        assert c.worker("decode").counts.prefills == 1
        assert c.worker("decode").counts.generates == 0
        stats = admin.IndexStats(admin_pb2.IndexStatsRequest())
        locs = {loc.location: loc.blocks for loc in stats.locations}
        assert stats.blocks >= r.blocks and locs["decode-0"] == r.blocks
        assert stats.memory_bytes > 0 and stats.routed == 1
        with pytest.raises(grpc.RpcError) as e:
            admin.Prewarm(admin_pb2.PrewarmRequest())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            admin.Prewarm(admin_pb2.PrewarmRequest(token_ids=[1, 2, 3], instances=["x"]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_admin_api_on_a_public_address_needs_a_token(model_dir, capsys):
    from conductor.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", model_dir, "--etcd", "127.0.0.1:1", "--admin-port", "1234",
                    "--admin-host", "0.0.0.0"])
    assert "needs an admin token" in capsys.readouterr().err
