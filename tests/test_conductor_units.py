"""Fast unit tests of the conductor's pure parts: validation, errors, routing, sampling,
response shapes, metrics."""

from __future__ import annotations

import asyncio
import copy

import grpc
import pytest

from conductor.chat import ChatTemplate
from conductor.deltas import Delta, TokenLogprob
from conductor.errors import (
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    Overloaded,
    Timeout,
    UpstreamFailed,
    error_body,
    from_worker_status,
    mapping,
)
from conductor.metrics import Metrics
from conductor.pipeline import Outcome
from conductor.protocol import parse_chat, parse_completion
from conductor.response import ResponseSpec, collect, stream
from conductor.sampling import ModelDefaults, sampling
from conductor.scheduler.policy import least_loaded
from conductor.scheduler.snapshot import BESIDE_PRIOR, ClusterSnapshot, InstanceLoad, RouteRequest


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({}, "prompt"),
])
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_completion(body)
    assert e.value.param == param


def test_non_object_body_is_rejected():
    with pytest.raises(InvalidRequest):
        parse_completion(["prompt"])


def test_good_request_parses():
    r = parse_completion({"prompt": "x", "stop": "\n", "stream": True,
                          "stream_options": {"include_usage": True}, "unknown_field": 1})
    assert r.stop_list() == ["\n"] and r.stream_options.include_usage


def test_error_table_and_openai_body():
    assert mapping(InvalidRequest("m")).http == 400
    assert mapping(ModelNotFound("m")).http == 404
    assert mapping(Overloaded("m")).http == 429
    assert mapping(NoCapacity("m")).http == 503
    body = error_body(InvalidRequest("bad", param="top_p"))
    assert body == {"error": {"message": "bad", "type": "BadRequestError", "param": "top_p",
                              "code": 400}}


def _inst(iid: str, role: str, in_flight: int) -> InstanceLoad:
    return InstanceLoad(instance_id=iid, role=role, in_flight=in_flight,
                        queued_prompt_tokens=0, block_size=32)


def test_least_loaded_picks_the_emptiest_of_each_role():
    snap = ClusterSnapshot((_inst("p0", "prefill", 3), _inst("p1", "prefill", 1),
                            _inst("d0", "decode", 0), _inst("d1", "decode", 2)))
    route = least_loaded(snap, RouteRequest(10, ()))
    assert (route.prefill_id, route.decode_id) == ("p1", "d0")


def test_least_loaded_without_a_decode_instance_is_none():
    snap = ClusterSnapshot((_inst("p0", "prefill", 0),))
    assert least_loaded(snap, RouteRequest(10, ())) is None


def test_both_role_serves_either_side():
    snap = ClusterSnapshot((_inst("b0", "both", 0),))
    route = least_loaded(snap, RouteRequest(10, ()))
    assert (route.prefill_id, route.decode_id) == ("b0", "b0")


# ---------------------------------------------------------------- sampling


def test_max_tokens_is_lowered_to_fit_the_context_not_rejected():
    req = parse_completion({"prompt": "x", "max_tokens": 2000})
    s = sampling(req, prompt_len=100, max_model_len=2048, vocab_size=50, defaults=ModelDefaults())
    assert s.max_tokens == s.params.max_tokens == 1948
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert sampling(chat, 100, 2048, 50, ModelDefaults()).max_tokens == 1948  # no limit: room
    with pytest.raises(InvalidRequest) as e:
        sampling(parse_completion({"prompt": "x", "max_tokens": 2049}), 10, 2048, 50,
                 ModelDefaults())
    assert e.value.param == "max_tokens"


def test_sampling_defaults_come_from_the_generation_config_then_openai():
    defaults = ModelDefaults(values={"temperature": 0.6, "top_k": 20})
    s = sampling(parse_completion({"prompt": "x"}), 1, 2048, 50, defaults)
    assert (round(s.params.temperature, 5), s.params.top_k, s.params.top_p) == (0.6, 20, 1.0)
    s = sampling(parse_completion({"prompt": "x", "temperature": 0, "top_k": 0}), 1, 2048, 50,
                 defaults)
    assert (s.params.temperature, s.params.top_k) == (0.0, -1)


def test_logprobs_zero_asks_the_engine_for_one_and_echo_for_prompt_logprobs():
    s = sampling(parse_completion({"prompt": "x", "logprobs": 0, "echo": True}), 1, 2048, 50,
                 ModelDefaults())
    assert s.params.logprobs == 1 and s.params.HasField("prompt_logprobs")
    s = sampling(parse_completion({"prompt": "x", "echo": True, "max_tokens": 0}), 1, 2048, 50,
                 ModelDefaults())
    assert s.echo_only and s.max_tokens == 1
    with pytest.raises(InvalidRequest) as e:
        sampling(parse_completion({"prompt": "x", "stop_token_ids": [50]}), 1, 2048, 50,
                 ModelDefaults())
    assert e.value.param == "stop_token_ids"


def test_worker_status_maps_back_through_the_table():
    assert isinstance(from_worker_status(grpc.StatusCode.INVALID_ARGUMENT, "x"), InvalidRequest)
    assert isinstance(from_worker_status(grpc.StatusCode.DEADLINE_EXCEEDED, "x"), Timeout)
    busy = from_worker_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "x")
    assert isinstance(busy, Overloaded) and busy.retry_after == 1.0
    assert isinstance(from_worker_status(grpc.StatusCode.INTERNAL, "x"), UpstreamFailed)
    assert error_body(UpstreamFailed("boom"))["error"]["code"] == 502


# ---------------------------------------------------------------- response shapes


async def _deltas(*items: Delta):
    for d in items:
        yield d


def _lp(token: str, logprob: float, *alts: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(0, token, logprob, ((token, logprob), *alts))


def test_completion_logprobs_offsets_and_top_entries():
    spec = ResponseSpec(chat=False, request_id="cmpl-1", model="m", created=1, logprobs=1)
    a = Delta(text="ab", token_ids=[1], logprobs=[_lp("ab", -0.1, ("x", -2.0), ("y", -3.0))])
    b = Delta(text="c", token_ids=[2], logprobs=[_lp("c", -0.2)], finish_reason="length")
    body = asyncio.run(collect(spec, Outcome(prompt_tokens=3, completion_tokens=2), None,
                               _deltas(a, b)))
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["ab", "c"] and lp["text_offset"] == [0, 2]
    assert lp["top_logprobs"][0] == {"ab": -0.1, "x": -2.0}  # the chosen one and the top 1
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_sends_role_echo_content_usage_done():
    spec = ResponseSpec(chat=True, request_id="chatcmpl-1", model="m", created=1,
                        echo_text="Hi", include_usage=True)
    first = Delta(text=" there", token_ids=[5], finish_reason="stop", stop_reason="!")

    async def run() -> list[bytes]:
        return [e async for e in stream(spec, Outcome(), first, _deltas())]

    events = asyncio.run(run())
    assert events[-1] == b"data: [DONE]\n\n"
    assert b'"delta":{"role":"assistant","content":""}' in events[0]
    assert b'"delta":{"content":"Hi"}' in events[1]
    assert b'"finish_reason":"stop","stop_reason":"!"' in events[2]
    assert b'"choices":[],"usage"' in events[3]


def test_chat_template_falls_back_when_the_tokenizer_has_none(tokenizer):
    hf = copy.copy(tokenizer.hf)
    hf.chat_template = None
    template = ChatTemplate(hf)
    assert template.builtin
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]})
    assert template.render(req) == f"{hf.bos_token}user: a\nb\nassistant:"


def test_metrics_count_requests_tokens_and_cache_hits():
    m = Metrics()
    timer = m.timer("completions")
    timer.tokens(1)
    timer.tokens(3)
    timer.finish(200)
    timer.finish(500)  # counted once
    m.cache_hit(prompt_tokens=100, cached_tokens=64, pool_tokens=32)
    text = m.exposition().decode()
    assert 'kvcluster_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert "kvcluster_inter_token_latency_seconds_count 3.0" in text
    assert 'kvcluster_cache_hit_ratio{source="pool"} 0.32' in text
    assert 'kvcluster_cache_hit_ratio{source="local"} 0.32' in text


def test_metrics_show_each_instances_prices():
    load = InstanceLoad(instance_id="b0", role="both", in_flight=0, queued_prompt_tokens=0,
                        block_size=32, prefill_speed=2.0)
    text = Metrics(lambda: [load]).exposition().decode()
    for when, value in (("alone", 2.0), ("beside", 2.0 * BESIDE_PRIOR)):
        assert (f'kvcluster_instance_prefill_slowdown{{instance="b0",role="both",when="{when}"}}'
                f" {value}") in text
