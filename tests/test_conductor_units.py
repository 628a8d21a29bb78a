"""Fast unit tests of the conductor's pure parts: validation, errors, routing."""

from __future__ import annotations

import pytest

from conductor.errors import (
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    Overloaded,
    error_body,
    mapping,
)
from conductor.policy import least_loaded
from conductor.protocol import parse_completion
from conductor.snapshot import ClusterSnapshot, InstanceLoad, RouteRequest


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
