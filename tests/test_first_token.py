"""The first token from the prefill (`conductor.first_token`): streamed before the decode
beside it produces anything, never twice, and a decode that disagrees breaks the stream
instead of silently diverging. Fakes (no engines); tests/test_e2e.py checks on real engines
that the answers stay bit-identical to one engine's."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conductor.first_token import FirstTokenMismatch, prefill_params, strip_first
from protos import worker_pb2
from tests.fake_worker import Knobs, LocalConductor


def _params(**kw) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(max_tokens=8, **kw)


def test_only_single_choice_requests_without_stop_strings_or_prompt_logprobs():
    assert prefill_params(_params(temperature=0.0)) is not None
    assert prefill_params(_params(n=2)) is None
    assert prefill_params(_params(prompt_logprobs=1)) is None
    assert prefill_params(_params(stop=["x"])) is None


def test_random_sampling_goes_as_asked_no_seed_added():
    """The decode's first token is forced to the prefill's (`worker.forced_token`), not
    drawn from a shared seed: a seeded request chunk-prefilled kills a vLLM-CPU engine."""
    p = _params(temperature=0.8)
    assert not prefill_params(p).HasField("seed") and not p.HasField("seed")
    assert prefill_params(_params(temperature=0.8, seed=7)).seed == 7


def _chunk(tokens, text, **kw) -> worker_pb2.GenerateChunk:
    return worker_pb2.GenerateChunk(token_ids=tokens, text=text, **kw)


def test_the_decodes_first_token_is_dropped_and_the_rest_kept():
    sent = _chunk([5], "a")
    got = strip_first(_chunk([5, 6], "ab", num_prompt_tokens=9, logprobs=[-1.0, -2.0],
                             finish_reason="length"), sent)
    assert list(got.token_ids) == [6] and got.text == "b" and list(got.logprobs) == [-2.0]
    assert got.num_prompt_tokens == 9 and got.finish_reason == "length"
    with pytest.raises(FirstTokenMismatch):
        strip_first(_chunk([4], "a"), sent)
    with pytest.raises(FirstTokenMismatch):
        strip_first(_chunk([5], "z"), sent)


def _stream(url: str, body: dict):
    """(event, payload) pairs of an SSE completion, as they arrive."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def test_the_prefills_token_streams_while_the_decode_is_still_held(model_dir):
    gate = threading.Event()
    with LocalConductor(model_dir, knobs=Knobs(decode_gate=gate),
                        conductor_args=("--disaggregate", "always")) as c:
        events = _stream(c.url, {"prompt": "word " * 80, "max_tokens": 4, "temperature": 0})
        first = next(events)
        # the decode has produced nothing yet: this token is the prefill's
        assert first["choices"][0]["text"] == "w0 "
        assert c.worker("prefill").counts.prefill_params is not None
        gate.set()
        rest = list(events)
        # the decode was told which token to make its first
        assert c.worker("decode").counts.pool_ready_first == [10]
    texts = [e["choices"][0]["text"] for e in [first, *rest] if e["choices"]]
    assert "".join(texts) == "w0 w1 w2 w3 "  # each token once
    usage = [e["usage"] for e in rest if e.get("usage")]
    assert not usage or usage[-1]["completion_tokens"] == 4


def test_a_decode_disagreeing_with_the_streamed_token_continues_from_it(model_dir):
    """The decode's first token is not the one streamed (a real decode released without it):
    not the instance's fault, so the stream goes on from the prompt plus the streamed token,
    on the same decode instance (the only one)."""
    with LocalConductor(model_dir, knobs=Knobs(first_token_shift=1),
                        conductor_args=("--disaggregate", "always")) as c:
        events = list(_stream(c.url, {"prompt": "word " * 80, "max_tokens": 4,
                                      "temperature": 0, "stream_options":
                                      {"include_usage": True}}))
        decode = c.worker("decode").counts
        assert decode.generates == 2  # the stream, then its continuation
        assert decode.last_params.max_tokens == 3
    assert not any("error" in e for e in events), events
    tokens = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert tokens[0] == "w0 " and len("".join(tokens).split()) == 4
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")][-1] == 4
