"""The scheduler on the real stack: two prefill and one decode vLLM engine, the Mooncake pool,
etcd, and the conductor with the default `kv_centric` policy (tests/conftest.py model).

What the conductor decided and predicted is read from its JSON log ("routed", "rejected",
"prefilled" with the engine's reported cache hit); what the engines did, from theirs.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from conftest import BLOCK_SIZE, DTYPE, LEASE_TTL, MAX_MODEL_LEN, wait_until

from embedded import ClusterSpec, EmbeddedCluster
from protos import worker_pb2
from store.block_hash import block_hashes, from_wire

pytestmark = pytest.mark.engine

TTFT_SLO_S = 3.0
"""Tight for this machine: a 1,500-token prefill takes about 0.5-1 s here."""
BURST = 12
REJECT_WITHIN_S = TTFT_SLO_S
"""A 429 reaches the client sooner than an admitted request could get its first token (on a
2-core machine whose conductor shares a core with the test and other jobs), and no engine
ever sees the request."""
TTFT_TOLERANCE = (1.5, 1.5)
"""Admitted requests: TTFT measured from the routing decision (the conductor's "routed" log
time to the client's receipt of the 1-token completion) <= the burst's predicted drain time
(the largest prediction among the admitted) * (1 + 1.5) + 1.5 s. vLLM batches the queued
prefills into shared steps, so a burst's admitted requests finish together, at about the
drain time the FIFO queue model gives the last of them: the first ones later than their own
prediction (2.96 s measured against 0.47 s predicted for the first of a burst whose last was
predicted 2.29 s, once), which a prediction made at admission cannot foresee. Generous beyond
that because the model is fitted online on a 2-core machine whose cores the engines share with
other jobs. Time spent in the HTTP layer before the decision is the conductor's own latency,
not the prediction's."""


def _vocab_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def sched_cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(model=model_dir, prefill=2, decode=1, http_port=0,
                       run_dir=str(tmp_path_factory.mktemp("sched-cluster")),
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype=DTYPE,
                       kv_cache_bytes=128 << 20, pool_segment_bytes=256 << 20,
                       lease_ttl=LEASE_TTL, policy="kv_centric",
                       # two like prefill instances: start-up probes taken side by side on
                       # two cores differ up to 2x, and a faster-priced instance can rightly
                       # take a prompt beside a queue, which these tests do not check
                       worker_env=(("KVCLUSTER_WORKER_PREFILL_PROBE", "false"),),
                       conductor_args=("--ttft-slo-s", str(TTFT_SLO_S),
                                       "--disaggregate", "always"))
    c = EmbeddedCluster(spec)
    with pytest.MonkeyPatch.context() as mp:  # read by the children at start only
        mp.setenv("KVCLUSTER_LOG_JSON", "1")
        c.start(timeout=400)
    try:
        wait_until(lambda: {e["instance_id"] for e in _log(c, "conductor", "instance_joined")}
                   >= set(c.workers), 240, "every worker joined", 0.1, c._check_alive)
        yield c
    finally:
        c.stop()


def _log(c: EmbeddedCluster, process: str, event: str) -> list[dict]:
    out = []
    for line in Path(c.run_dir, f"{process}.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            rec = json.loads(line)
            if rec.get("event") == event:
                out.append(rec)
    return out


def _client_id(rec: dict) -> str:
    """The id the test gave the request (the conductor's own id extends it)."""
    return rec.get("client_request_id") or rec.get("request_id", "")


def _one(c: EmbeddedCluster, process: str, event: str, request_id: str) -> dict:
    recs = [r for r in _log(c, process, event) if _client_id(r).endswith(request_id)]
    assert len(recs) == 1, (event, request_id, recs)
    return recs[0]


def _complete(c: EmbeddedCluster, tokens: list[int], request_id: str, max_tokens: int = 1,
              client: httpx.Client | None = None, **extra: object) -> tuple[httpx.Response, float]:
    """The response and the wall-clock time it arrived at (seconds since the epoch)."""
    r = (client or httpx).post(f"{c.url}/v1/completions", timeout=120, json={
        "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
        "request_id": request_id, **extra})
    return r, time.time()


def _at(record: dict) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def _engine_cache(c: EmbeddedCluster, instance_id: str) -> set[int]:
    """What an engine caches, as its KvEvents stream's opening reset tells a subscriber."""
    address = c.workers[instance_id].address
    with c.worker_channel(address) as ch:
        call = c.worker_stub(address, ch).KvEvents(worker_pb2.KvEventsRequest(), timeout=10)
        first = next(call)
        call.cancel()
    assert first.reset
    return set(from_wire(first.stored))


def test_shared_prefix_goes_where_it_is_cached_and_only_the_rest_is_computed(sched_cluster):
    c = sched_cluster
    rng = random.Random(4)
    other = _vocab_tokens(rng, 1800)
    prefix = _vocab_tokens(rng, 20 * BLOCK_SIZE)
    # Keep one prefill instance busy with an unrelated prompt, so that the prefix lands on
    # the instance a cache-blind tie-break would not pick next time.
    busy = threading.Thread(target=_complete, args=(c, other, "other"))
    busy.start()
    wait_until(lambda: any(_client_id(r).endswith("other")
                           for r in _log(c, "conductor", "routed")), 60, "other routed", 0.1)
    r, _ = _complete(c, prefix, "first")
    busy.join(timeout=120)
    assert r.status_code == 200, r.text
    holder = r.json()["kv_transfer"]["prefill_instance"]
    busy_one = _one(c, "conductor", "routed", "other")["prefill"]
    assert holder != busy_one and holder.startswith("prefill-")

    # The engines' KV events, re-keyed by the workers, name the prefix's blocks in the
    # conductor's hash scheme: the holder caches them, the other prefill instance does not.
    hashes = block_hashes(prefix, BLOCK_SIZE)
    wait_until(lambda: set(hashes) <= _engine_cache(c, holder), 10, "holder's KV events", 0.1)
    assert not set(hashes) & _engine_cache(c, busy_one)

    second = prefix + _vocab_tokens(rng, 3 * BLOCK_SIZE)
    r, _ = _complete(c, second, "second")
    assert r.status_code == 200, r.text
    kv = r.json()["kv_transfer"]
    assert kv["prefill_instance"] == holder
    assert _one(c, "conductor", "routed", "second")["cached_blocks"] == 20
    # the engine computed only the new tokens: its own report, relayed in PrefillReply
    assert _one(c, "conductor", "prefilled", "second")["cached_tokens"] == 20 * BLOCK_SIZE

    # The next turn (20 more tokens) returns to the holder, which computes only those.
    third = second + _vocab_tokens(rng, 20)
    r, _ = _complete(c, third, "third")
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer"]["prefill_instance"] == holder
    assert _one(c, "conductor", "routed", "third")["cached_blocks"] == len(second) // BLOCK_SIZE


def test_overload_is_rejected_early_and_admitted_requests_meet_their_prediction(sched_cluster):
    """One prefill instance, SLOs tight, a burst: the excess gets 429 + Retry-After before any
    engine sees it; what is admitted starts within its predicted TTFT (tolerance above)."""
    c = sched_cluster
    gone = sorted(i for i in c.workers if i.startswith("prefill-"))[-1]
    c.stop_worker(gone)
    wait_until(lambda: any(e["instance_id"] == gone for e in _log(c, "conductor", "instance_left")),
               LEASE_TTL + 10, f"{gone} left", 0.1)
    rng = random.Random(5)
    # warm-ups exist to be timed: their own SLO admits them whatever the model says now (a
    # model fitted while the machine was slow refused them once, and refusals teach nothing)
    lax = {"ttft_slo_ms": 600_000, "tbt_slo_ms": 60_000}
    for i in range(2):  # timings on the remaining instance refit the prefill model: solo...
        r, _ = _complete(c, _vocab_tokens(rng, 1500), f"warm-{i}", **lax)
        assert r.status_code == 200, r.text
    with ThreadPoolExecutor(4) as ex:  # ...and back to back
        warm = list(ex.map(lambda i: _complete(c, _vocab_tokens(random.Random(i), 1500),
                                               f"warm-group-{i}", **lax), range(4)))
    assert {r.status_code for r, _ in warm} <= {200, 429}

    # This machine's speed drifts several-fold with other jobs: size the burst's prompts by
    # the model's latest view (its TTFT for a 1,500-token prompt on an idle instance) so that
    # about five of them fit in the SLO and the rest do not.
    idle_ttft = min(r["predicted_ttft_s"] for r in _log(c, "conductor", "routed")
                    if "warm-group" in r["request_id"])
    length = int(min(max(1500 * TTFT_SLO_S / 5 / idle_ttft, 128), 1800))
    # when the machine is fast even 1,800-token prompts are cheap: then the burst asks for a
    # tighter TTFT (the per-request SLO field), so that again about five fit
    slo_s = min(TTFT_SLO_S, 5 * idle_ttft * length / 1500)
    burst = BURST
    prompts = [_vocab_tokens(rng, length) for _ in range(burst)]
    limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(burst) as ex:
        sent = time.time()
        results = list(ex.map(lambda i: _complete(c, prompts[i], f"burst-{i}", client=client,
                                                  ttft_slo_ms=slo_s * 1000), range(burst)))

    admitted = [(i, done) for i, (r, done) in enumerate(results) if r.status_code == 200]
    rejected = [(i, r, done) for i, (r, done) in enumerate(results) if r.status_code == 429]
    assert len(admitted) + len(rejected) == burst, [r.status_code for r, _ in results]
    assert admitted and rejected, (len(admitted), len(rejected))

    worker_log = "".join(Path(c.run_dir, f"{w}.log").read_text() for w in c.workers)
    for i, r, done in rejected:
        err = r.json()["error"]
        assert err["type"] == "RateLimitError" and err["code"] == 429 and "SLO" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert done - sent <= REJECT_WITHIN_S, (i, done - sent)
        # rejected before any work: no engine saw it (ids are "cmpl-<ours>[-<suffix>]")
        assert f"cmpl-burst-{i}\"" not in worker_log and f"cmpl-burst-{i}-" not in worker_log

    rel, slack = TTFT_TOLERANCE
    report = []
    for i, done in admitted:
        routed = _one(c, "conductor", "routed", f"burst-{i}")
        predicted, measured = routed["predicted_ttft_s"], done - _at(routed)
        report.append((i, round(predicted, 2), round(measured, 2), round(done - sent, 2)))
        assert predicted <= slo_s
    print("\nadmitted (request, predicted TTFT, measured from decision, from send):", report,
          "\nrejected after:", [round(done - sent, 2) for _, _, done in rejected])
    drain = max(predicted for _, predicted, _, _ in report)
    for i, predicted, measured, _ in report:
        assert measured <= drain * (1 + rel) + slack, (i, predicted, drain, measured)
