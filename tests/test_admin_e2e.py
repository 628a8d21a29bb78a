"""Membership and control on the real stack: an embedded cluster (2 prefill, 1 decode), its
conductor's admin API, real engines, a real etcd and Mooncake master.

- ResizePool starts a decode worker under steady traffic, Drain lets the first one finish,
  shrinking retires the started one: no request fails.
- kill -9 of a worker: out of routing within the health-check interval, out of etcd within
  the lease TTL.
- etcd stopped under traffic: requests keep succeeding; after it returns, a new worker joins.
- Prewarm of a long prefix: the requests sharing it find it cached and their mean TTFT is
  lower than that of requests sharing a prefix nobody prewarmed.
- kill -9 of the decode worker serving a stream: the stream continues on another decode
  instance, token for token what an undisturbed run of the same request gives.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import threading
import time
from pathlib import Path

import aetcd
import grpc
import httpx
import pytest
from conftest import wait_until

from embedded import ClusterSpec, EmbeddedCluster
from protos import admin_pb2, admin_pb2_grpc

LEASE_TTL = 6.0
"""Leases of 3 s lapsed under this module's load (a resize starts an engine beside three):
every worker left and rejoined at once, failing the requests that were changing hands."""
HEALTH_S = 0.5
PREFIX = "/kvcluster/instances/"
MIGRATE_TOKENS = 1000
STALL_S = 5.0
"""The conductor's inter-token deadline here (the default derives 900 s from these tests'
lax TBT SLO)."""


@pytest.fixture(scope="module")
def ctl(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(model=model_dir, prefill=2, decode=1, http_port=0,
                       run_dir=str(tmp_path_factory.mktemp("admin-cluster")), block_size=32,
                       max_model_len=2048, dtype="float32", kv_cache_bytes=192 << 20,
                       pool_segment_bytes=256 << 20, lease_ttl=LEASE_TTL,
                       # SLOs out of the way: these tests are about membership and control,
                       # on a machine whose other tests may slow every engine down
                       conductor_args=("--health-interval-s", str(HEALTH_S),
                                       "--ttft-slo-s", "600", "--tbt-slo-s", "30",
                                       "--stall-timeout-s", str(STALL_S)))
    c = EmbeddedCluster(spec)
    c.start(timeout=300)
    try:
        wait_until(lambda: len(instances(c)) == 3, 240, interval=0.5)  # ready means one of each
        yield c
    finally:
        c.stop()


def admin(c: EmbeddedCluster, token: str | None = None):
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(c.admin_addr))
    md = (("authorization", f"Bearer {token or c.token_file.read_text().strip()}"),)

    def call(name: str, request, timeout: float = 30.0):
        return getattr(stub, name)(request, metadata=md, timeout=timeout)
    return call


def instances(c: EmbeddedCluster) -> dict[str, admin_pb2.Instance]:
    reply = admin(c)("ListInstances", admin_pb2.ListInstancesRequest())
    return {i.instance_id: i for i in reply.instances}


def complete(c: EmbeddedCluster, prompt: str | list[int], max_tokens: int = 4,
             **extra) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


class Traffic:
    """Requests one after another from `threads` threads until stopped; every status kept."""

    def __init__(self, c: EmbeddedCluster, threads: int = 2) -> None:
        self.c = c
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                         for n in range(threads)]

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                r = complete(self.c, f"thread {n} request {i}: " + "tell me more " * 20,
                             max_tokens=8, stream=i % 2 == 0)
                self.statuses.append(r.status_code)
                if r.status_code != 200 or (r.text.count("[DONE]") != 1 and i % 2 == 0):
                    self.errors.append(f"{r.status_code} {r.text[:300]}")
            except httpx.HTTPError as e:
                self.statuses.append(0)
                self.errors.append(repr(e))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def etcd_keys(c: EmbeddedCluster) -> set[str]:
    async def keys() -> set[str]:
        async with aetcd.Client("127.0.0.1", c.etcd.client_port, timeout=2) as client:
            return {kv.key.decode() for kv in await client.get_prefix(PREFIX.encode())}
    return asyncio.run(keys())


def test_wrong_token_is_refused_and_the_pool_is_unchanged(ctl):
    before = instances(ctl)
    with pytest.raises(grpc.RpcError) as e:
        admin(ctl, token="not-the-token")("ResizePool", admin_pb2.ResizePoolRequest(
            role="decode", target=3))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    time.sleep(1.0)  # a negative wait: long enough for a resize to show, had one started
    after = instances(ctl)
    assert after.keys() == before.keys() and len(ctl.workers) == 3
    assert all(i.state == "serving" for i in after.values())


def test_resize_up_drain_and_resize_down_under_traffic_lose_nothing(ctl):
    call = admin(ctl)
    with Traffic(ctl) as traffic:
        wait_until(lambda: len(traffic.statuses) >= 4, 60, interval=0.1)
        r = call("ResizePool", admin_pb2.ResizePoolRequest(role="decode", target=2, wait=True,
                                                           timeout_s=240), timeout=260)
        assert list(r.started) == ["decode-s0"] and (r.before, r.after) == (1, 2), r
        assert instances(ctl)["decode-s0"].state == "serving"
        wait_until(lambda: instances(ctl)["decode-s0"].dispatched_total > 0, 60, interval=0.1)
        d = call("Drain", admin_pb2.DrainRequest(instance_id="decode-0", wait=True,
                                                 timeout_s=120), timeout=130)
        assert d.idle and d.state == "draining" and d.in_flight == 0
        served = instances(ctl)["decode-0"].dispatched_total
        n = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= n + 4, 60, interval=0.1)
        assert instances(ctl)["decode-0"].dispatched_total == served  # nothing new there
        # back to one decode instance: the one started by the resize is drained and retired
        call("Undrain", admin_pb2.DrainRequest(instance_id="decode-0"))
        r = call("ResizePool", admin_pb2.ResizePoolRequest(role="decode", target=1))
        assert list(r.drained) == ["decode-s0"] and r.after == 1, r
        wait_until(lambda: "decode-s0" not in instances(ctl), 60, interval=0.1)
        n = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= n + 4, 60, interval=0.1)
    assert traffic.errors == [] and len(traffic.statuses) >= 12, traffic.errors[:5]
    assert f"{PREFIX}decode-s0" not in etcd_keys(ctl)


def test_kill9_leaves_routing_within_the_health_interval_and_etcd_within_the_ttl(ctl):
    assert f"{PREFIX}prefill-1" in etcd_keys(ctl)
    ctl.stop_worker("prefill-1", kill=True)
    t_out = wait_until(lambda: (i := instances(ctl).get("prefill-1")) is None
                       or i.state == "unhealthy", 10, interval=0.05)
    assert t_out <= HEALTH_S + 1.0, f"still routed {t_out:.2f}s after kill -9"
    statuses = [complete(ctl, f"after the kill {n}: " + "and then " * 30).status_code
                for n in range(6)]
    assert statuses == [200] * 6
    t_gone = wait_until(lambda: f"{PREFIX}prefill-1" not in etcd_keys(ctl), LEASE_TTL + 10,
                        interval=0.2)
    assert t_out + t_gone <= LEASE_TTL + 2.0, f"etcd entry outlived the lease: {t_gone:.1f}s"
    wait_until(lambda: "prefill-1" not in instances(ctl), 5, interval=0.1)


def test_etcd_outage_keeps_serving_and_a_new_worker_joins_after(ctl):
    ctl.etcd.stop()
    try:
        t0 = time.monotonic()
        statuses = []
        while time.monotonic() - t0 < 2 * LEASE_TTL:
            statuses.append(complete(ctl, f"etcd is down {len(statuses)}: " + "go on " * 30)
                            .status_code)
        assert statuses and set(statuses) == {200}, statuses
    finally:
        ctl.etcd.start()
    wp = ctl.start_worker("prefill")
    wait_until(lambda: (i := instances(ctl).get(wp.instance_id)) is not None
               and i.state == "serving", 240, interval=0.5)
    wait_until(lambda: {"prefill-0", "decode-0"} <= instances(ctl).keys(), 30, interval=0.1)
    assert complete(ctl, "etcd is back: " + "fine " * 30).status_code == 200


def _ttft(c: EmbeddedCluster, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached prompt tokens reported."""
    t0 = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream("POST", f"{c.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


def test_prewarm_makes_the_prefix_cached_and_lowers_mean_ttft(ctl, tokenizer):
    call = admin(ctl)
    vocab = tokenizer.vocab_size

    def prefix(seed: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(1800)]

    def tail(n: int) -> list[int]:
        return [(n * 31 + i) % (vocab - 10) + 5 for i in range(40)]

    n_requests = 4
    cold = [_ttft(ctl, prefix(1) + tail(n)) for n in range(n_requests)]
    r = call("Prewarm", admin_pb2.PrewarmRequest(token_ids=prefix(2)), timeout=120)
    assert r.blocks == 1800 // 32 and r.blocks_in_pool == r.blocks, r
    warm = [_ttft(ctl, prefix(2) + tail(n)) for n in range(n_requests)]
    prewarmed_tokens = r.blocks * 32
    assert all(cached >= prewarmed_tokens for _, cached in warm), warm
    mean_cold = statistics.mean(t for t, _ in cold)
    mean_warm = statistics.mean(t for t, _ in warm)
    print(f"prewarm: mean TTFT cold {mean_cold * 1000:.1f} ms, prewarmed "
          f"{mean_warm * 1000:.1f} ms (first cold {cold[0][0] * 1000:.1f} ms)")
    assert mean_warm < mean_cold


def _metric(c: EmbeddedCluster, name: str) -> float:
    for line in httpx.get(f"{c.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


MIGRATE_BODY = {"prompt": "Once upon a time " * 20, "max_tokens": MIGRATE_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
"""Long enough that the stream is surely still running when the client has seen a few tokens:
vLLM coalesces a fast stream's outputs when its reader lags (CI once saw the whole of a
160-token stream finish before the client read its 20th token)."""


def _two_decodes(ctl: EmbeddedCluster) -> None:
    if len([i for i in instances(ctl).values() if i.role == "decode"]) < 2:
        wp = ctl.start_worker("decode")
        wait_until(lambda: (i := instances(ctl).get(wp.instance_id)) is not None
                   and i.state == "serving", 240, interval=0.5)


def _stream(ctl: EmbeddedCluster, fault=None, after: int = 10
            ) -> tuple[list[int], str, str | None, float]:
    """MIGRATE_BODY streamed; once `after` tokens arrived, `fault(decode instance)`. The
    token ids, the text, the instance faulted, and the longest gap between chunks after it."""
    ids, text, faulted, gap = [], "", None, 0.0
    last = time.monotonic()
    with httpx.stream("POST", f"{ctl.url}/v1/completions", json=MIGRATE_BODY,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if faulted is not None:
                gap = max(gap, now - last)
            last = now
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            ids += choice.get("token_ids") or []
            text += choice["text"]
            if fault is not None and faulted is None and len(ids) >= after:
                faulted = _streaming_decode(ctl, chunk["id"])
                fault(faulted)
                last = time.monotonic()
    assert fault is None or faulted is not None
    return ids, text, faulted, gap


def test_a_stream_whose_decode_worker_is_killed_continues_elsewhere_token_for_token(ctl):
    _two_decodes(ctl)
    before = _metric(ctl, "kvcluster_stream_migrations_total")
    broken_ids, broken_text, _, _ = _stream(
        ctl, lambda iid: ctl.stop_worker(iid, kill=True))
    assert _metric(ctl, "kvcluster_stream_migrations_total") == before + 1
    clean_ids, clean_text, _, _ = _stream(ctl)
    assert len(broken_ids) == len(clean_ids) == MIGRATE_TOKENS
    assert broken_ids == clean_ids and broken_text == clean_text


def test_a_stream_whose_decode_worker_stalls_continues_elsewhere_within_the_deadline(ctl):
    """SIGSTOP (a wedged host, not a crash: the connection stays open and silent): the
    stream moves on within the conductor's inter-token deadline, token for token the same:
    at the deadline, or before it when two health checks in a row go unanswered (2 s each
    here) and the instance's calls are cancelled, whichever comes first."""
    _two_decodes(ctl)
    before = _metric(ctl, "kvcluster_stream_migrations_total")
    stopped: list[str] = []

    def stall(iid: str) -> None:
        ctl.workers[iid].process.signal_group(signal.SIGSTOP)
        stopped.append(iid)

    try:
        stalled_ids, stalled_text, _, gap = _stream(ctl, stall)
    finally:
        for iid in stopped:
            ctl.workers[iid].process.signal_group(signal.SIGCONT)
            ctl.stop_worker(iid, kill=True)
    assert _metric(ctl, "kvcluster_stream_migrations_total") == before + 1
    # the deadline's or the health checks' doing (gRPC keepalive would have failed the call
    # too, seconds later)
    log = Path(ctl.run_dir, "conductor.log").read_text(errors="replace")
    why = re.findall(rf"(decode_stalled|instance_lost_calls_cancelled)\W.*instance(?:_id)?"
                     rf"\W+{stopped[0]}\b", log)
    assert why, "neither decode_stalled nor instance_lost_calls_cancelled"
    # then the prompt and the tokens so far recomputed on the other decode
    assert 3.5 <= gap < STALL_S + 15, (gap, why)
    clean_ids, clean_text, _, _ = _stream(ctl)
    assert stalled_ids == clean_ids and stalled_text == clean_text


def _streaming_decode(c: EmbeddedCluster, request_id: str) -> str:
    """The decode worker whose own log shows `request_id`'s stream started and not ended."""
    for iid, wp in c.workers.items():
        if wp.role != "decode":
            continue
        log = wp.process.log_path.read_text(errors="replace")
        if f"request_id={request_id}" in log and "generate_end" not in "".join(
                line for line in log.splitlines() if f"request_id={request_id}" in line):
            return iid
    raise AssertionError(f"no decode worker is streaming {request_id}")
