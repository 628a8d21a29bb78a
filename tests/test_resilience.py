"""Failure paths of the conductor over fake workers whose faults are injected per instance:
each path must run (its metric moves) and the client must get the whole answer, or a clean
error when nothing can be done. Kills of real processes are in tests/test_admin_e2e.py and
`make chaos`; the pool's own fall-backs (recompute) in tests/test_connector.py."""

from __future__ import annotations

import json
import re
import threading

import grpc
import httpx
import pytest
from conftest import wait_until
from fake_worker import Knobs, LocalConductor
from grpc_health.v1 import health_pb2

from cluster.health import STALLED


def metric(url: str, name: str, **labels: str) -> float:
    """A counter's value in the conductor's /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}(\{{{re.escape(want)}\}})? ([0-9.e+]+)$" if want else \
        rf"^{name} ([0-9.e+]+)$"
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.groups()[-1])
    return 0.0


def complete(url: str, prompt: list[int], max_tokens: int = 6, stream: bool = False
             ) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": max_tokens, "stream": stream})


def streamed_text(r: httpx.Response) -> tuple[str, list[dict]]:
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks


PROMPT = list(range(100, 164))


def expected(prompt: list[int], n: int) -> str:
    return "".join(f"t{prompt[-1] + 1 + k} " for k in range(n))


def test_a_failed_prefill_is_retried_on_another_prefill_instance(model_dir):
    with LocalConductor(model_dir, roles=("prefill", "prefill", "decode"),
                        knobs=Knobs(continue_sequence=True),
                        conductor_args=("--disaggregate", "always")) as c:
        bad = c.workers["prefill-0"]
        bad.knobs = Knobs(continue_sequence=True, prefill_status=grpc.StatusCode.UNAVAILABLE)
        for n in range(4):
            r = complete(c.url, PROMPT + [n])
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(
                PROMPT + [n], 6)
        assert c.workers["prefill-1"].counts.prefills == 4
        # prefill-0 failed once, then its breaker kept it out of routing
        assert bad.counts.prefills == 1
        assert metric(c.url, "kvcluster_retries_total", stage="prefill") == 1


def test_with_no_other_prefill_instance_the_decode_instance_prefills(model_dir):
    with LocalConductor(model_dir, knobs=Knobs(continue_sequence=True),
                        conductor_args=("--disaggregate", "always")) as c:
        c.worker("prefill").knobs = Knobs(continue_sequence=True,
                                          prefill_status=grpc.StatusCode.DEADLINE_EXCEEDED)
        r = complete(c.url, PROMPT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(PROMPT, 6)
        assert metric(c.url, "kvcluster_fallbacks_total", kind="prefill_on_decode") == 1


def _first_stream_fails(c: LocalConductor, after_chunks: int, **knobs) -> None:
    """The first Generate, on whichever decode instance it lands, fails after that many
    chunks with UNAVAILABLE (as a killed worker's stream does); the rest work."""
    budget = [1]
    for w in c.workers.values():
        w.knobs = Knobs(continue_sequence=True, fail_after_chunks=after_chunks,
                        decode_status=grpc.StatusCode.UNAVAILABLE, fail_budget=budget,
                        **knobs)


def test_a_decode_failing_before_its_first_token_is_retried_elsewhere(model_dir):
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode")) as c:
        _first_stream_fails(c, 0)
        text, _ = streamed_text(complete(c.url, PROMPT, stream=True))
        assert text == expected(PROMPT, 6)
        assert [w.counts.generates for w in c.workers.values()] in ([0, 1, 1], [0, 1, 1])
        assert metric(c.url, "kvcluster_retries_total", stage="decode") == 1
        assert metric(c.url, "kvcluster_stream_migrations_total") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_broken_mid_way_continues_on_another_decode_instance(model_dir, stream):
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode")) as c:
        _first_stream_fails(c, 3, token_delay_s=0.01)
        r = complete(c.url, PROMPT, max_tokens=10, stream=stream)
        assert r.status_code == 200
        if stream:
            text, chunks = streamed_text(r)
            assert len({ch["id"] for ch in chunks}) == 1  # one response, not two spliced
        else:
            body = r.json()
            text = body["choices"][0]["text"]
            assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 10,
                                     "total_tokens": len(PROMPT) + 10,
                                     **({"prompt_tokens_details": body["usage"].get(
                                         "prompt_tokens_details")}
                                        if "prompt_tokens_details" in body["usage"] else {})}
        assert text == expected(PROMPT, 10)  # nothing lost, nothing repeated
        assert metric(c.url, "kvcluster_stream_migrations_total") == 1
        # the continuation asked only for the tokens still owed, after the ones sent
        cont = [w for w in c.workers.values() if w.counts.generates and w.counts.request_ids
                and w.counts.request_ids[-1].endswith("-m1")]
        assert len(cont) == 1 and cont[0].counts.last_params.max_tokens == 7


def test_an_unrecoverable_stream_ends_with_an_error_event_and_done(model_dir):
    with LocalConductor(model_dir, knobs=Knobs(continue_sequence=True, fail_after_chunks=2,
                                               decode_status=grpc.StatusCode.UNAVAILABLE)) as c:
        r = complete(c.url, PROMPT, max_tokens=8, stream=True)
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert metric(c.url, "kvcluster_stream_migrations_total") == 0  # nowhere to go


def test_a_client_error_from_the_worker_is_not_retried(model_dir):
    with LocalConductor(model_dir, roles=("prefill", "prefill", "decode"),
                        knobs=Knobs(prefill_status=grpc.StatusCode.INVALID_ARGUMENT),
                        conductor_args=("--disaggregate", "always")) as c:
        r = complete(c.url, PROMPT)
        assert r.status_code == 400
        assert sum(w.counts.prefills for w in c.workers.values()) == 1
        assert metric(c.url, "kvcluster_retries_total", stage="prefill") == 0


def test_a_request_failing_alike_on_two_instances_is_its_own_failure(model_dir):
    """The same engine error from two instances is the request's, not theirs: it is not tried
    on a third, and only the first instance's breaker counts it."""
    with LocalConductor(model_dir, roles=("decode", "decode", "decode"),
                        knobs=Knobs(fail_after_chunks=0)) as c:
        r = complete(c.url, PROMPT)
        assert r.status_code == 502 and "injected engine error" in r.text
        assert sum(w.counts.generates for w in c.workers.values()) == 2
        registry = c.app.state.conductor.registry
        assert sorted(registry.get(i).breaker.failures for i in c.workers) == [0, 0, 1]
        assert metric(c.url, "kvcluster_retries_total", stage="decode") == 1


def test_retries_stop_at_their_share_of_the_traffic(model_dir):
    """A retry budget: once retries pass their share of recent requests (beyond a small
    floor), a failure is the answer instead of another instance's time."""
    budget = [100]  # every decode fails, but differently each time (not the request's own)
    with LocalConductor(model_dir, roles=("decode", "decode", "decode"),
                        knobs=Knobs(fail_after_chunks=0, fail_budget=budget,
                                    decode_status=grpc.StatusCode.UNAVAILABLE),
                        conductor_args=("--retry-budget", "0.1",
                                        "--breaker-cooldown-s", "0.001")) as c:
        answers = [complete(c.url, PROMPT + [n]).status_code for n in range(12)]
        assert set(answers) <= {502, 503}
        retries = metric(c.url, "kvcluster_retries_total", stage="decode")
        refused = metric(c.url, "kvcluster_retries_refused_total")
        assert refused >= 1, answers
        # the floor of 3, then a tenth of the 12 requests: the 5th retry was the last
        assert retries <= 5 and retries + refused >= 12, (retries, refused)


@pytest.mark.parametrize("stream", [False, True])
def test_nothing_healthy_is_a_fast_503(model_dir, stream):
    with LocalConductor(model_dir, roles=("prefill", "decode"),
                        knobs=Knobs(prefill_status=grpc.StatusCode.UNAVAILABLE,
                                    fail_after_chunks=0,
                                    decode_status=grpc.StatusCode.UNAVAILABLE),
                        conductor_args=("--disaggregate", "always")) as c:
        r = complete(c.url, PROMPT, stream=stream)
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["code"] == r.status_code


def test_beyond_max_in_flight_new_requests_get_a_fast_429_and_nothing_leaks(model_dir):
    import threading
    import time

    gate = threading.Event()
    with LocalConductor(model_dir, knobs=Knobs(prefill_gate=gate),
                        conductor_args=("--max-in-flight", "1",
                                        "--disaggregate", "always")) as c:
        first: list[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(complete(c.url, PROMPT)))
        t.start()
        wait_until(lambda: c.worker("prefill").counts.running == 1)  # the first holds the slot
        t0 = time.monotonic()
        r = complete(c.url, PROMPT)
        assert r.status_code == 429 and time.monotonic() - t0 < 0.5
        assert r.headers["retry-after"] == "1"
        gate.set()
        t.join(10)
        assert first[0].status_code == 200
        for stream in (False, True, False):  # the count came back down each time
            assert complete(c.url, PROMPT, stream=stream).status_code == 200


def test_a_call_cancelled_by_its_channel_closing_is_an_instance_failure(model_dir):
    """grpc.aio cancels the calls of a channel that closes (the instance left membership):
    that is no client going away, so the request is retried elsewhere, not dropped as a 499."""
    import asyncio
    import threading
    import time

    gate = threading.Event()  # the first decode holds its stream open until the channel closes
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        knobs=Knobs(continue_sequence=True, decode_gate=gate)) as c:
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(
            complete(c.url, PROMPT, max_tokens=4, stream=True)))
        t.start()
        registry = c.app.state.conductor.registry
        deadline = time.monotonic() + 10
        while not any(w.counts.running for n, w in c.workers.items() if n.startswith("decode")):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = next(n for n, w in c.workers.items() if n.startswith("decode") and w.counts.running)
        asyncio.run_coroutine_threadsafe(registry.get(busy).channel.close(grace=None),
                                         c._loop).result(5)
        gate.set()
        t.join(20)
        text, _ = streamed_text(result[0])
        assert text == expected(PROMPT, 4)
        moved = (metric(c.url, "kvcluster_retries_total", stage="decode")
                 + metric(c.url, "kvcluster_stream_migrations_total"))
        assert moved == 1


def test_a_decode_instance_that_left_during_the_prefill_still_answers(model_dir):
    """Its lease lapsed while the request's prefill ran beside its decode, which waits for the
    prefill's blocks: the registry closes its channel with a grace period, so the decode in
    flight goes on and answers; nothing is retried."""
    import asyncio
    import threading
    import time

    gate = threading.Event()  # the prefill runs until the decode's instance has left
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        knobs=Knobs(continue_sequence=True, prefill_gate=gate),
                        conductor_args=("--disaggregate", "always")) as c:
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(complete(c.url, PROMPT, max_tokens=4)))
        t.start()
        registry = c.app.state.conductor.registry
        deadline = time.monotonic() + 10
        while not (chosen := [i for i in registry.all()
                              if i.role == "decode" and i.load.in_flight()]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting = c.workers[chosen[0].instance_id]
        prefill = c.worker("prefill").counts
        # the decode started beside the prefill (the two RPCs arrive in either order), and
        # the prefill still runs (held by the gate)
        while not (waiting.counts.generates and prefill.running):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert prefill.prefills == 1 and prefill.running == 1
        asyncio.run_coroutine_threadsafe(chosen[0].channel.close(grace=30), c._loop).result(5)
        gate.set()
        t.join(20)
        assert result[0].status_code == 200, result[0].text
        assert result[0].json()["choices"][0]["text"] == expected(PROMPT, 4)
        assert metric(c.url, "kvcluster_retries_total", stage="decode") == 0


def _gated_decodes(c, chunks: int) -> dict[str, threading.Event]:
    """Every decode worker streams slowly and stops after `chunks` chunks until its gate."""
    gates = {}
    for iid, w in c.workers.items():
        if iid.startswith("decode"):
            gates[iid] = threading.Event()
            w.knobs = Knobs(continue_sequence=True, token_delay_s=0.01,
                            decode_gate=gates[iid], gate_after_chunks=chunks)
    return gates


def test_a_decode_instance_that_stops_answering_has_its_streams_moved_before_the_deadline(
        model_dir):
    """A wedged worker (its health checks unanswered twice) has its calls cancelled: the
    stream moves on in seconds, not after the 120 s stall deadline it would wait for."""
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        conductor_args=("--health-interval-s", "0.2",
                                        "--stall-timeout-s", "120")) as c:
        gates = _gated_decodes(c, 3)
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(
            complete(c.url, PROMPT, max_tokens=10, stream=True)))
        t.start()
        try:
            wait_until(lambda: any(c.workers[i].counts.generates for i in gates), 10,
                       interval=0.01)
            wedged = next(i for i in gates if c.workers[i].counts.generates)
            c.workers[wedged].health_silent = True
            for i, gate in gates.items():
                if i != wedged:
                    gate.set()
            t.join(timeout=25)
            assert not t.is_alive(), "the stream waited for the stall deadline"
        finally:
            for gate in gates.values():
                gate.set()
            t.join(timeout=10)
        text, _ = streamed_text(out[0])
        assert text == expected(PROMPT, 10)
        assert c.workers[wedged].counts.aborted == 1  # its call was cancelled
        assert metric(c.url, "kvcluster_stream_migrations_total") == 1


def _stalled_one(c: LocalConductor, started, gates: dict[str, threading.Event]) -> str:
    """Once one of `gates`' workers holds the request (`started`), its health says STALLED
    and the others' gates open; that worker's id."""
    wait_until(lambda: any(started(c.workers[i]) for i in gates), 10, interval=0.01)
    wedged = next(i for i in gates if started(c.workers[i]))
    c.set_health(wedged, STALLED)
    for i, gate in gates.items():
        if i != wedged:
            gate.set()
    return wedged


def _shown_stalled(c: LocalConductor, wedged: str) -> None:
    inst = c.call(lambda: c.conductor.registry.get(wedged))
    assert (inst.state, inst.why) == ("unhealthy", "stalled")
    assert metric(c.url, "kvcluster_instance_unhealthy_total", why="stalled") == 1
    assert metric(c.url, "kvcluster_instance_state", instance=wedged, role=inst.role,
                  state="unhealthy", why="stalled") == 1


@pytest.mark.parametrize("chunks", [0, 3], ids=["before_first_token", "mid_stream"])
def test_a_decode_instance_whose_engine_stalls_has_its_streams_moved_and_no_new_work(
        model_dir, chunks):
    """A worker whose health answers STALLED (its engine holds work and does not step) is
    lost, not draining: its calls are cancelled, and their requests retry (no token yet) or
    migrate in seconds, not after the stall deadline; new requests go elsewhere; it shows
    unhealthy, stalled, until its health says SERVING again."""
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        conductor_args=("--health-interval-s", "0.2",
                                        "--stall-timeout-s", "120")) as c:
        gates = _gated_decodes(c, chunks)
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(
            complete(c.url, PROMPT, max_tokens=10, stream=True)))
        t.start()
        try:
            wedged = _stalled_one(c, lambda w: w.counts.generates, gates)
            t.join(timeout=25)
            assert not t.is_alive(), "the stream waited for the stall deadline"
            text, _ = streamed_text(out[0])
            assert text == expected(PROMPT, 10)
            assert c.workers[wedged].counts.aborted == 1  # its call was cancelled
            if chunks:
                assert metric(c.url, "kvcluster_stream_migrations_total") == 1
            else:
                assert metric(c.url, "kvcluster_retries_total", stage="decode") == 1
            _shown_stalled(c, wedged)
            for n in range(3):
                assert complete(c.url, PROMPT + [n]).status_code == 200
            assert c.workers[wedged].counts.generates == 1
            c.set_health(wedged, health_pb2.HealthCheckResponse.SERVING)
            wait_until(lambda: c.call(lambda: dict(
                (i.instance_id, i.state) for i in c.conductor.registry.all()))[wedged]
                == "serving", 10)  # once its breaker (the cancelled call) closed
        finally:
            for gate in gates.values():
                gate.set()
            t.join(timeout=10)


def test_every_call_of_a_stalled_instance_moves_whatever_the_retry_budget(model_dir):
    """Six requests on one instance when its engine stalls, a retry budget of 3: all six
    move (each once, off an instance no longer routed to), none is answered with the
    failure."""
    with LocalConductor(model_dir, roles=("prefill", "decode", "decode"),
                        conductor_args=("--health-interval-s", "0.2", "--retry-budget", "0",
                                        "--stall-timeout-s", "120")) as c:
        gate = threading.Event()
        c.workers["decode-0"].knobs = Knobs(continue_sequence=True, decode_gate=gate)
        c.workers["decode-1"].knobs = Knobs(continue_sequence=True)
        registry = c.conductor.registry
        c.set_health("decode-1", health_pb2.HealthCheckResponse.NOT_SERVING)
        wait_until(lambda: c.call(lambda: registry.get("decode-1").unhealthy), 10)
        out: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda n=n: out.__setitem__(
            n, complete(c.url, PROMPT + [n]))) for n in range(6)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: c.workers["decode-0"].counts.generates == 6, 10)
            c.set_health("decode-1", health_pb2.HealthCheckResponse.SERVING)
            wait_until(lambda: c.call(lambda: registry.get("decode-1").routable), 10)
            c.set_health("decode-0", STALLED)
            for t in threads:
                t.join(timeout=25)
            assert not any(t.is_alive() for t in threads)
        finally:
            gate.set()
            for t in threads:
                t.join(timeout=10)
        for n, r in out.items():
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected(PROMPT + [n], 6)
        assert c.workers["decode-0"].counts.aborted == 6
        assert metric(c.url, "kvcluster_retries_total", stage="decode") == 6
        assert metric(c.url, "kvcluster_retries_refused_total") == 0


def test_a_prefill_on_a_stalled_engine_is_retried_on_another_prefill_instance(model_dir):
    with LocalConductor(model_dir, roles=("prefill", "prefill", "decode"),
                        conductor_args=("--health-interval-s", "0.2", "--disaggregate",
                                        "always")) as c:
        gates = {}
        for iid, w in c.workers.items():
            gates[iid] = threading.Event()
            w.knobs = Knobs(continue_sequence=True, prefill_gate=gates[iid])
        gates.pop("decode-0").set()
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(complete(c.url, PROMPT)))
        t.start()
        try:
            wedged = _stalled_one(c, lambda w: w.counts.prefills, gates)
            t.join(timeout=25)
            assert not t.is_alive(), "the request waited for its stalled prefill"
            assert out[0].status_code == 200, out[0].text
            assert out[0].json()["choices"][0]["text"] == expected(PROMPT, 6)
            assert c.workers[wedged].counts.aborted == 1
            assert metric(c.url, "kvcluster_retries_total", stage="prefill") == 1
            _shown_stalled(c, wedged)
        finally:
            for gate in gates.values():
                gate.set()
            t.join(timeout=10)


def test_chaos_counts_the_calls_moved_on_from_silent_workers():
    from benchmarks.chaos.__main__ import silenced

    log = ("x [warning  ] decode_stalled                 instance=decode-0 seconds=10.0\n"
           "x [warning  ] instance_lost_calls_cancelled  calls=3 instance_id=decode-1 "
           "why=DEADLINE_EXCEEDED\n")
    assert silenced(log) == 4
    assert silenced("x [warning  ] instance_unhealthy instance_id=decode-1 why=NOT_SERVING") == 0
