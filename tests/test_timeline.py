"""Where a request's time goes: the timeline's stages, the `kvcluster_stage_seconds` histogram
and the OpenTelemetry spans, over fake workers that report engine times."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import wait_until
from fake_worker import Knobs, LocalConductor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conductor.timeline import Timeline
from conductor.tracing import Tracing
from protos import worker_pb2


def test_an_rpc_splits_into_send_engine_stages_and_return():
    tl = Timeline(received=100.0)
    for name, at in (("prepared", 100.001), ("routed", 100.002), ("prefill_sent", 100.003),
                     ("decode_sent", 100.003), ("prefill_done", 100.050),
                     ("first_chunk", 100.080), ("first_token", 100.081),
                     ("last_token", 100.200)):
        tl.mark(name, at)
    tl.engine("prefill", worker_pb2.EngineTimes(received=100.004, queued=100.005,
                                                scheduled=100.006, first_token=100.046))
    tl.engine("decode", worker_pb2.EngineTimes(received=100.004, queued=100.060,
                                               scheduled=100.068, first_token=100.075,
                                               held=0.050, kv_wait=0.002, kv_load=0.003))
    st = tl.stages()
    assert st["prefill"] == pytest.approx(st["prefill_send"] + st["prefill_queue"]
                                          + st["prefill_compute"] + st["prefill_return"])
    assert st["decode_start"] == pytest.approx(st["decode_send"] + st["kv_wait"]
                                               + st["kv_load"] + st["decode_queue"]
                                               + st["decode_compute"] + st["decode_return"])
    assert st["kv_wait"] == pytest.approx(0.052)  # held by the worker, then in the engine
    assert st["ttft"] == pytest.approx(0.081) and st["decode"] == pytest.approx(0.119)


def test_later_engine_times_complete_earlier_ones():
    tl = Timeline(received=1.0)
    tl.engine("decode", worker_pb2.EngineTimes(queued=2.0, scheduled=3.0, first_token=4.0))
    tl.engine("decode", worker_pb2.EngineTimes(kv_wait=0.5, kv_load=0.25))
    assert tl.decode.queued == 2.0 and tl.decode.kv_load == 0.25


@pytest.fixture
def traced(model_dir):
    knobs = Knobs(engine_times=True, prefill_delay_s=0.02)
    with LocalConductor(model_dir, knobs=knobs,
                        conductor_args=("--disaggregate", "always")) as c:
        exporter = InMemorySpanExporter()
        c.app.state.conductor.metrics.tracing = Tracing(SimpleSpanProcessor(exporter))
        yield c, exporter


def test_a_request_exports_its_spans_under_the_callers_trace(traced):
    c, exporter = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(f"{c.url}/v1/completions", timeout=30,
                   headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                   json={"prompt": "word " * 80, "max_tokens": 3})
    assert r.status_code == 200, r.text
    # exported once the answer is out
    wait_until(lambda: any(s.name == "request" for s in exporter.get_finished_spans()))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"request", "accept", "parse", "route", "prefill", "decode", "engine.queue",
            "engine.compute", "kv.hold"} <= set(spans)
    root = spans["request"]
    assert f"{root.context.trace_id:032x}" == trace_id
    assert f"{root.parent.span_id:016x}" == parent
    assert root.attributes["request_id"] == r.headers["x-request-id"]
    for name in ("accept", "parse", "route", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
        assert root.start_time <= spans[name].start_time <= spans[name].end_time <= root.end_time
    assert spans["kv.hold"].parent.span_id == spans["decode"].context.span_id
    assert any(e.name == "first_token" for e in spans["decode"].events)


def test_without_a_tracer_no_span_and_the_histogram_still_counts(model_dir):
    with LocalConductor(model_dir, knobs=Knobs(engine_times=True),
                        conductor_args=("--disaggregate", "always")) as c:
        assert c.app.state.conductor.metrics.tracing is None  # off unless configured
        for stream in (False, True):
            assert httpx.post(f"{c.url}/v1/completions", timeout=30, json={
                "prompt": "word " * 80, "max_tokens": 3, "stream": stream}).status_code == 200

        def counts() -> dict[str, str]:
            text = httpx.get(f"{c.url}/metrics", timeout=10).text
            return dict(re.findall(r'kvcluster_stage_seconds_count\{stage="(\w+)"\} ([0-9.]+)',
                                   text))

        # a stream's timeline is sunk once its last bytes are out, maybe after the client read
        wait_until(lambda: float(counts().get("answer", 0)) == 2.0)
        got = counts()
    for stage in ("accept", "parse", "route", "prefill", "prefill_compute", "decode_start",
                  "decode_compute", "kv_wait", "ttft", "decode", "answer"):
        assert float(got[stage]) == 2.0, (stage, got)


def test_the_timeline_starts_at_arrival_and_ends_with_the_answer():
    tl = Timeline(received=10.0)
    for name, at in (("accepted", 10.0002), ("prepared", 10.0010), ("routed", 10.0012),
                     ("first_token", 10.020), ("last_token", 10.050), ("answered", 10.0503)):
        tl.mark(name, at)
    st = tl.stages()
    assert st["accept"] == pytest.approx(0.0002) and st["parse"] == pytest.approx(0.0008)
    assert st["ttft"] == pytest.approx(0.020) and st["answer"] == pytest.approx(0.0003)
    # a timeline made without the handler's mark (an error before it) parses from arrival
    bare = Timeline(received=10.0)
    bare.mark("prepared", 10.001)
    assert "accept" not in bare.stages() and bare.stages()["parse"] == pytest.approx(0.001)


def test_a_decode_caching_the_prompt_is_not_held_for_the_prefill_beside_it(model_dir):
    with LocalConductor(model_dir, knobs=Knobs(engine_times=True),
                        conductor_args=("--disaggregate", "always")) as c:
        decode = c.worker("decode")
        body = {"prompt": "word " * 80, "max_tokens": 2}
        first = httpx.post(f"{c.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        wait = decode.counts.last_pool_wait
        assert wait is not None and wait.hold and wait.blocks > 0
        assert decode.counts.pool_ready == 1
        # the decode instance's cache now holds the prompt (the index's view): the same
        # prompt again still runs its prefill beside, but the decode does not wait for it
        again = httpx.post(f"{c.url}/v1/completions", json=body, timeout=30)
        assert again.status_code == 200, again.text
        assert not decode.counts.last_pool_wait.hold
        assert decode.counts.prefills == 0 and c.worker("prefill").counts.prefills == 2
        assert decode.counts.pool_ready == 1
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_the_answer_does_not_wait_for_the_decode_stream_to_end(model_dir):
    """The worker's last chunk (every choice finished, its engine times) completes the answer;
    the stream's end comes later and is still waited for, not cancelled (no abort)."""
    import threading

    from conftest import wait_until

    end = threading.Event()
    with LocalConductor(model_dir, knobs=Knobs(engine_times=True, end_gate=end),
                        conductor_args=("--disaggregate", "never")) as c:
        decode = c.worker("decode")
        r = httpx.post(f"{c.url}/v1/completions", timeout=30,
                       json={"prompt": "word " * 8, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert decode.counts.running == 1  # its stream is still open
        end.set()
        wait_until(lambda: decode.counts.running == 0)
        assert decode.counts.aborted == 0


def test_the_parse_span_starts_where_the_parse_stage_does():
    exporter = InMemorySpanExporter()
    tracing = Tracing(SimpleSpanProcessor(exporter))
    for marks, start in (({"accepted": 10.0002, "prepared": 10.001}, 10.0002),
                         ({"prepared": 10.001}, 10.0)):  # no handler mark: from arrival
        tl = Timeline(received=10.0)
        for name, at in marks.items():
            tl.mark(name, at)
        exporter.clear()
        tracing.export(tl, 200)
        span = next(s for s in exporter.get_finished_spans() if s.name == "parse")
        assert span.start_time == int(start * 1e9) and span.end_time == int(10.001 * 1e9)
        assert tl.marks[tl.parse_from] == start
        assert tl.stages()["parse"] == pytest.approx(10.001 - start)
    tracing.shutdown()
