"""What a prefill costs the streams of the engine it computes on, when some of them have not
started (a stream counts from its predicted first token), and what the prompts a decode
instance computes itself cost a request handed to it. Pure parts on factories."""

from __future__ import annotations

import dataclasses

import pytest

from conductor.scheduler.load import LoadState
from conductor.scheduler.policies.kv_centric import kv_centric
from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.snapshot import (
    BESIDE_PRIOR,
    ClusterSnapshot,
    InstanceLoad,
    RouteRequest,
    SchedulerParams,
)

BS = 32
NOW = 1000.0
MODEL = PrefillTimeModel(base_s=0.0, per_token_s=0.5e-3, per_attn_s=0.0)  # 2048 tokens: 1.024 s


def inst(iid: str, role: str = "both", **load: object) -> InstanceLoad:
    return InstanceLoad(instance_id=iid, role=role, in_flight=0, queued_prompt_tokens=0,
                        block_size=BS, **load)


def test_a_stream_holds_a_prefill_up_from_its_first_token_to_its_finish():
    streaming = inst("a", running=1, finishes=(NOW + 2.0,))
    assert streaming.stall_seconds(NOW, NOW + 1.0) == pytest.approx(1.0)
    assert streaming.stall_seconds(NOW + 1.5, NOW + 3.0) == pytest.approx(0.5)  # it ends
    due = dataclasses.replace(streaming, starts=(NOW + 0.75,))  # its prompt still computing
    assert due.stall_seconds(NOW, NOW + 1.0) == pytest.approx(0.25)
    assert due.stall_seconds(NOW, NOW + 0.5) == 0.0
    two = inst("a", running=2, finishes=(NOW + 0.5, NOW + 2.0), starts=(NOW + 1.5,))
    assert two.stall_seconds(NOW, NOW + 1.0) == pytest.approx(0.5)
    assert two.stall_seconds(NOW, NOW + 3.0) == pytest.approx(0.5 + 0.5)
    unlisted = inst("a", running=3, finishes=(NOW + 0.5,))  # by other means: running on
    assert unlisted.stall_seconds(NOW, NOW + 1.0) == pytest.approx(2 * 1.0 + 0.5)
    assert inst("a").stall_seconds(NOW, NOW + 1.0) == 0.0


def test_a_prefill_meets_streams_only_once_they_begin():
    """1 s of work alone, 1.4 s beside streams: streams beginning 0.5 s in leave half the
    work to run beside them (0.7 s), 1.2 s in all; ending 0.2 s after they begin, the rest of
    the half runs alone again."""
    due = inst("a", running=1, starts=(NOW + 0.5,), finishes=(NOW + 5.0,))
    assert due.prefill_seconds(1.0, NOW) == pytest.approx(0.5 + 0.5 * BESIDE_PRIOR)
    assert due.prefill_seconds(1.0, NOW + 1.0) == pytest.approx(BESIDE_PRIOR)
    assert dataclasses.replace(due, starts=(NOW + 2.0,)).prefill_seconds(1.0, NOW) == 1.0
    short = dataclasses.replace(due, finishes=(NOW + 0.7,))
    left = 0.5 - 0.2 / BESIDE_PRIOR
    assert short.prefill_seconds(1.0, NOW) == pytest.approx(0.5 + 0.2 + left)
    streaming = dataclasses.replace(due, starts=())
    assert streaming.prefill_seconds(1.0, NOW) == pytest.approx(BESIDE_PRIOR)


def test_a_cold_prompt_computes_on_the_engine_whose_stream_has_not_begun():
    """bench-e2e run 15's first burst: the side engine b1 computes a cold prompt until 0.9 s
    for a stream that will decode on b0. A second cold prompt (1 s of work) computed on b0
    meets that stream 0.9 s in, and holds it up for 0.17 s: b0 computes it. Counted from
    dispatch, the stream made b0 cost 2.7 s, and the prompt queued behind the first on b1."""
    b0 = inst("b0", running=1, starts=(NOW + 0.9,), finishes=(NOW + 1.3,))
    b1 = inst("b1", busy_until=NOW + 0.9, side=True)
    snap = ClusterSnapshot((b0, b1), NOW, SchedulerParams(prefill=MODEL))
    req = RouteRequest(2048, (), max_tokens=32)
    route = kv_centric(snap, req)
    assert (route.prefill_id, route.decode_id) == ("b0", "b0")
    assert route.predicted_ttft_s == pytest.approx(0.9 + (1 - 0.9 / 1.024) * 1.024 * BESIDE_PRIOR)
    counted = ClusterSnapshot((dataclasses.replace(b0, starts=()), b1), NOW,
                              SchedulerParams(prefill=MODEL))
    assert kv_centric(counted, req).prefill_id == "b1"


def test_a_load_lists_the_streams_not_begun_until_their_first_token():
    load = LoadState("b0", "both", BS)
    load.add_decode("r1", 100, NOW + 5.0, start_at=NOW + 1.0)
    load.add_decode("r2", 100, NOW + 6.0)
    assert load.view().starts == (NOW + 1.0,)
    load.decode_started("r1")
    load.decode_started("r1")  # once
    assert load.view().starts == ()
    load.add_decode("r3", 100, NOW + 7.0, start_at=NOW + 2.0)
    load.end_decode("r3")  # ended (failed) before its first token
    assert load.view().starts == () and load.view().running == 2


def test_a_prompt_handed_over_waits_for_the_prompts_its_decode_instance_computes():
    """Session 21's short run, the trace: a warm prompt prefilled on the side engine (10 tokens)
    and handed to the main engine, predicted at 0.04 s, took 1.92: its last block waited for
    the cold prompt the main engine was computing (an engine finishes one prompt before it
    packs the next). Priced so, it decodes where nothing computes."""
    p0 = inst("p0", role="prefill")
    busy = inst("d0", role="decode", busy_until=NOW + 1.9)
    idle = inst("d1", role="decode")
    params = SchedulerParams(prefill=MODEL, disaggregate="always")
    route = kv_centric(ClusterSnapshot((p0, busy), NOW, params), RouteRequest(320, ()))
    assert route.decode_id == "d0" and route.predicted_ttft_s > 1.9
    route = kv_centric(ClusterSnapshot((p0, busy, idle), NOW, params), RouteRequest(320, ()))
    assert route.decode_id == "d1" and route.predicted_ttft_s < 0.5
