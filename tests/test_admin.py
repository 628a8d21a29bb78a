"""The admin API over fake workers (tests/fake_worker.py): token, instances, drain, pool
resizing in a deployed cluster (drain and role switching), SLOs, prewarm and index figures.

The same API over real engines and processes (starting workers, kill -9, etcd outage,
prewarm's effect on TTFT) is in tests/test_admin_e2e.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import httpx
import pytest
from conftest import wait_until
from fake_worker import Knobs, LocalConductor

from cluster.capacity import RESERVE_BYTES, Machine, engine_bytes
from cluster.ports import free_port
from cluster.workers import WorkerSpec
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


def test_deployed_resize_of_both_switches_undrains_and_drains(model_dir):
    c, addr = conductor(model_dir, ("both", "both", "prefill", "decode"))
    with c:
        admin = Admin(addr)
        r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=1))
        assert (r.before, r.after) == (2, 1) and len(r.drained) == 1 and not r.switched
        drained = r.drained[0]
        kept = ({"both-0", "both-1"} - {drained}).pop()
        assert admin.states()[drained] == ("both", "draining")
        # an instance registered as both and routed as decode joins the pool when it grows
        admin.ResizePool(admin_pb2.ResizePoolRequest(role="prefill", target=1))
        assert admin.states()[kept] == ("decode", "serving")
        r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=3))
        assert list(r.undrained) == [drained] and list(r.switched) == [kept]
        assert (r.before, r.after) == (0, 2)
        assert "1 both instance(s) short" in r.unmet and "KVCLUSTER_WORKER_ROLE=both" in r.unmet
        assert complete(c.url).status_code == 200


class FakeProcess:
    """What the provisioner keeps of a worker it started: this one never joins."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.pid = 0

    def alive(self) -> bool:
        return not self.stopped.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped.set()


class StartRecorder(WorkerSpec):
    """Embedded mode without processes: `start` records the worker and hands back a fake."""

    def start(self, role: str, instance_id: str, port: int = 0, placement=None):
        STARTS.append((role, instance_id))
        assert GATE.wait(10), "the gate stayed shut"
        proc = FakeProcess()
        PROCESSES[instance_id] = proc
        return proc, 1


STARTS: list[tuple[str, str]] = []
PROCESSES: dict[str, FakeProcess] = {}
GATE = threading.Event()
"""Shut: a start waits (in its thread) until it opens."""


@pytest.fixture
def embedded(model_dir):
    """A conductor over fake `both` workers whose provisioner starts fake processes on a
    machine of 2 cores and 64 GiB free (tests may change `provisioner.machine`)."""
    STARTS.clear()
    PROCESSES.clear()
    GATE.set()
    c, addr = conductor(model_dir, ("both", "both"))
    with c:
        provisioner = c.app.state.conductor.provisioner
        provisioner.spec = StartRecorder(model=model_dir, etcd="", pool_master="",
                                         pool_metadata="", run_dir="")
        provisioner.machine = lambda: Machine(cores=2, available_bytes=64 << 30)
        yield c, Admin(addr), provisioner


class Aborted(Exception):
    pass


class Context:
    """A servicer context that raises what it is told to abort with."""

    async def abort(self, code, details):
        raise Aborted(code, details)


def test_the_same_resize_twice_at_once_or_retried_starts_one_worker(embedded):
    c, admin, provisioner = embedded
    servicer = c.app.state.conductor.admin.servicer
    request = admin_pb2.ResizePoolRequest(role="both", target=3)

    async def open_gate():  # runs once both calls went as far as they can: the first is
        GATE.set()          # in its start, the second waits for it (or starts one too)

    async def twice():
        GATE.clear()
        return await asyncio.gather(servicer.ResizePool(request, Context()),
                                    servicer.ResizePool(request, Context()), open_gate())

    first, second, _ = asyncio.run_coroutine_threadsafe(twice(), c._loop).result(10)
    assert STARTS == [("both", "both-s0")]
    assert list(first.started) == ["both-s0"] and not second.started
    assert list(second.starting) == ["both-s0"]
    # a client's retry over the wire: counted as there, nothing more started
    r = admin.ResizePool(request)
    assert not r.started and list(r.starting) == ["both-s0"] and (r.before, r.after) == (2, 2)
    assert STARTS == [("both", "both-s0")]
    # one that died before it joined is not counted: the next call replaces it
    PROCESSES["both-s0"].stop()
    r = admin.ResizePool(request)
    assert list(r.started) == ["both-s1"] and not r.starting
    # shrinking stops the one still starting rather than a serving instance
    r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=2))
    assert list(r.cancelled) == ["both-s1"] and not r.drained
    wait_until(lambda: PROCESSES["both-s1"].stopped.is_set(), what="cancelled worker stopped")
    assert admin.states() == {"both-0": ("both", "serving"), "both-1": ("both", "serving")}


def test_a_target_the_machine_cannot_hold_is_refused_before_anything_changes(embedded):
    c, admin, provisioner = embedded
    admin.Drain(admin_pb2.DrainRequest(instance_id="both-1"))
    before = admin.states()
    # the engines per core: 2 registered, 4 on 2 cores
    with pytest.raises(grpc.RpcError) as e:
        admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=5))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "at most 4 engines (2 per core on 2 cores" in e.value.details()
    # memory: room for one engine loading, not two
    one = engine_bytes(provisioner.spec)
    provisioner.machine = lambda: Machine(cores=8, available_bytes=RESERVE_BYTES + one + 1)
    with pytest.raises(grpc.RpcError) as e:
        admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=4))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not enough memory" in e.value.details()
    assert STARTS == [] and admin.states() == before  # both-1 not undrained either
    # the operator's cap
    provisioner.max_engines = 2
    with pytest.raises(grpc.RpcError) as e:
        admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=3))
    assert "at most 2 engines (--max-engines)" in e.value.details()
    # what fits goes through
    provisioner.max_engines = 0
    r = admin.ResizePool(admin_pb2.ResizePoolRequest(role="both", target=3))
    assert list(r.undrained) == ["both-1"] and list(r.started) == ["both-s0"]
