"""Flow control's logic (conductor/flow.py, conductor/tenants.py) without a server: tenant
limits, priority classes and the batch queue, with gates instead of sleeps."""

from __future__ import annotations

import asyncio

import pytest

from conductor.errors import InvalidRequest, Overloaded
from conductor.flow import FlowControl
from conductor.tenants import DEFAULT, Limits, Tenants, TokenBucket, load_limits


def flow(**limits: Limits) -> FlowControl:
    return FlowControl(Tenants(limits), batch_max_wait_s=5.0, batch_queue_max=2)


def test_a_tenant_over_its_concurrency_is_refused_with_the_reason():
    f = flow(a=Limits(max_concurrency=2))
    t1, _ = f.admit("a", "interactive", 10), f.admit("a", "interactive", 10)
    with pytest.raises(Overloaded) as e:
        f.admit("a", "interactive", 10)
    assert e.value.code == "tenant_concurrency" and e.value.retry_after >= 1
    f.admit("b", "interactive", 10)  # another tenant is not held by a's limit
    f.release(t1, 10)
    f.release(t1, 10)  # idempotent
    f.admit("a", "interactive", 10)


def test_a_tenant_over_its_token_rate_waits_as_long_as_the_deficit_takes():
    f = flow(a=Limits(tokens_per_s=100))  # a bucket of 1,000
    t = f.admit("a", "interactive", 900, now=0.0)
    with pytest.raises(Overloaded) as e:
        f.admit("a", "interactive", 300, now=0.0)
    assert e.value.code == "tenant_token_rate" and e.value.retry_after == pytest.approx(2.0)
    f.release(t, 400)  # used 400 of 900: 500 come back
    f.admit("a", "interactive", 300, now=0.0)


def test_a_request_larger_than_the_bucket_runs_when_it_is_full():
    b = TokenBucket(10, now=0.0)  # holds 100
    assert b.take(500, now=0.0) == 0.0 and b.level == -400
    assert b.take(1, now=10.0) > 0  # the debt is paid back over time
    assert b.take(1, now=60.0) == 0.0


def test_the_default_limits_apply_to_tenants_without_their_own():
    f = flow(**{DEFAULT: Limits(max_concurrency=1)})
    f.admit("x", "interactive", 1)
    with pytest.raises(Overloaded):
        f.admit("x", "interactive", 1)
    f.admit("y", "interactive", 1)


def test_a_request_may_lower_its_class_never_raise_it():
    f = flow(b=Limits(priority="batch"))
    assert f.priority("a", None) == "interactive"
    assert f.priority("a", "batch") == "batch"
    assert f.priority("b", None) == "batch" and f.priority("b", "interactive") == "batch"
    with pytest.raises(InvalidRequest):
        f.priority("a", "urgent")


def test_limits_from_a_file_are_validated(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('[tenants."*"]\nmax_concurrency = 4\n[tenants.acme]\ntokens_per_s = 5e3\n'
                    'priority = "batch"\n')
    limits = load_limits(str(path))
    assert limits[DEFAULT].max_concurrency == 4 and limits["acme"].priority == "batch"
    path.write_text("[tenants.acme]\nmax_concurency = 4\n")
    with pytest.raises(ValueError, match="acme"):
        load_limits(str(path))
    with pytest.raises(ValueError):
        Limits(priority="urgent")


class Cluster:
    """An `attempt` that places a request only while `room` allows."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.placed: list[str] = []

    def attempt(self, name: str):
        def go() -> str:
            if self.room <= 0:
                raise Overloaded("full")
            self.room -= 1
            self.placed.append(name)
            return name
        return go

    def undo(self, name: str) -> None:
        self.placed.remove(name)
        self.room += 1


async def test_interactive_never_waits_and_batch_waits_for_room_in_deadline_order():
    f = flow()
    c = Cluster(room=0)
    with pytest.raises(Overloaded):  # interactive: refused at once, never queued
        await f.place(f.admit("a", "interactive", 1), c.attempt("i"), c.undo)
    first = asyncio.ensure_future(f.place(f.admit("a", "batch", 1), c.attempt("b1"), c.undo))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(f.place(f.admit("a", "batch", 1), c.attempt("b2"), c.undo))
    await asyncio.sleep(0)
    assert f.queued == 2 and not first.done()
    with pytest.raises(Overloaded) as e:  # the queue holds 2
        await f.place(f.admit("a", "batch", 1), c.attempt("b3"), c.undo)
    assert e.value.code == "batch_queue_full"
    c.room = 1
    f.freed()
    assert await first == "b1" and not second.done()
    c.room = 1
    f.freed()
    assert await second == "b2" and f.queued == 0


async def test_a_batch_request_waits_no_longer_than_its_deadline():
    f = FlowControl(Tenants(), batch_max_wait_s=0.05, batch_queue_max=8)
    c = Cluster(room=0)
    with pytest.raises(Overloaded) as e:
        await f.place(f.admit("a", "batch", 1), c.attempt("b"), c.undo)
    assert e.value.code == "batch_queue_timeout" and f.queued == 0
    c.room = 1
    f.freed()
    assert c.placed == []  # nothing placed for a request that gave up


async def test_a_batch_request_placed_as_its_client_leaves_is_taken_back():
    f = flow()
    c = Cluster(room=0)
    task = asyncio.ensure_future(f.place(f.admit("a", "batch", 1), c.attempt("b"), c.undo))
    await asyncio.sleep(0)
    c.room = 1
    f.freed()  # placed, and in the same loop turn its client goes away
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.placed == [] and c.room == 1


# ---------------------------------------------------------------- through the endpoint

def _tenant_conductor(model_dir: str, tmp_path, limits: str, *args: str, **kw):
    from fake_worker import LocalConductor

    keys = tmp_path / "keys"
    keys.write_text("key-a a\nkey-b b\n")
    path = tmp_path / "limits.toml"
    path.write_text(limits)
    return LocalConductor(model_dir, conductor_args=(
        "--api-keys-file", str(keys), "--tenant-limits-file", str(path), *args), **kw)


def _post(url: str, key: str, headers: dict | None = None, **body):
    import httpx

    return httpx.post(f"{url}/v1/completions", timeout=30, headers={
        "authorization": f"Bearer {key}", **(headers or {})},
        json={"prompt": "hello", "max_tokens": 2, **body})


def test_a_tenant_at_its_limit_gets_429_with_its_reason_while_another_is_served(
        model_dir, tmp_path):
    import threading

    import httpx

    gate = threading.Event()
    from fake_worker import Knobs

    with _tenant_conductor(model_dir, tmp_path, "[tenants.a]\nmax_concurrency = 1\n",
                           knobs=Knobs(decode_gate=gate)) as c:
        held = threading.Thread(target=_post, args=(c.url, "key-a"))
        held.start()
        try:
            from conftest import wait_until
            wait_until(lambda: c.worker("decode").counts.generates >= 1, 10)
            r = _post(c.url, "key-a")
            assert r.status_code == 429, r.text
            assert r.headers["x-kvcluster-reason"] == "tenant_concurrency"
            assert int(r.headers["retry-after"]) >= 1
            other = threading.Thread(target=lambda: results.append(_post(c.url, "key-b")))
            results: list = []
            other.start()
            wait_until(lambda: c.worker("decode").counts.generates >= 2, 10,
                       "tenant b was held by tenant a's limit")
        finally:
            gate.set()
            held.join(30)
        other.join(30)
        assert results[0].status_code == 200
        metrics = httpx.get(f"{c.url}/metrics").text
        assert ('kvcluster_tenant_requests_total{outcome="tenant_concurrency",'
                'priority="interactive",tenant="a"} 1.0') in metrics


def test_a_batch_request_without_room_waits_then_is_shed_and_interactive_is_not(
        model_dir, tmp_path):
    """Batch requests are routed under a share of the SLOs; here no route meets that share,
    so a batch request waits for room until its deadline, then 429; an interactive request
    of the same tenant is served at once."""
    import time

    with _tenant_conductor(model_dir, tmp_path, "", "--batch-slo-share", "1e-9",
                           "--batch-max-wait-s", "0.5") as c:
        t0 = time.monotonic()
        r = _post(c.url, "key-a", headers={"x-kvcluster-priority": "batch"},
                  prompt="word " * 100)
        assert r.status_code == 429 and r.headers["x-kvcluster-reason"] == \
            "batch_queue_timeout", r.text
        assert time.monotonic() - t0 >= 0.5
        assert _post(c.url, "key-a", prompt="word " * 100).status_code == 200
        assert _post(c.url, "key-a", headers={"x-kvcluster-priority": "urgent"}
                     ).status_code == 400


def test_tenant_limits_change_at_run_time_through_the_admin_api(model_dir, tmp_path):
    import socket

    from conductorctl.cli import main as ctl

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "admin.token"
    token.write_text("t0ken")
    with _tenant_conductor(model_dir, tmp_path, "", "--admin-port", str(port),
                           "--admin-token-file", str(token)) as c:
        addr = ["--addr", f"127.0.0.1:{port}", "--token-file", str(token)]
        assert _post(c.url, "key-a").status_code == 200
        assert ctl([*addr, "tenant", "a", "--max-concurrency", "0", "--tokens-per-s", "1"]) == 0
        assert _post(c.url, "key-a", prompt="word " * 50).status_code == 200  # a full bucket
        r = _post(c.url, "key-a", prompt="word " * 50)  # its debt: 10 tokens a second
        assert r.status_code == 429 and r.headers["x-kvcluster-reason"] == "tenant_token_rate"
        assert int(r.headers["retry-after"]) >= 2
        assert _post(c.url, "key-b").status_code == 200  # b keeps the default: no limit
        assert ctl([*addr, "tenant", "a", "--reset"]) == 0
        assert _post(c.url, "key-a").status_code == 200
        with pytest.raises(SystemExit):
            ctl([*addr, "tenant", "a", "--priority", "urgent"])
        assert ctl([*addr, "tenants"]) == 0


def test_a_client_cannot_loosen_the_operators_slo_unless_its_tenant_may(model_dir, tmp_path):
    """The operator's TTFT SLO is out of any prompt's reach: asking for an hour in the body
    does not switch load shedding off, except for a tenant the operator lets loosen it."""
    loose = {"ttft_slo_ms": 3_600_000, "tbt_slo_ms": 3_600_000}
    with _tenant_conductor(model_dir, tmp_path, "[tenants.b]\nmay_loosen_slo = true\n",
                           "--ttft-slo-s", "0.000001") as c:
        plain, asked = _post(c.url, "key-a"), _post(c.url, "key-a", **loose)
        allowed = _post(c.url, "key-b", **loose)
    assert plain.status_code == 429 and asked.status_code == 429, asked.text
    assert allowed.status_code == 200, allowed.text
