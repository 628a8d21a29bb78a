"""What the prompts a decode instance computes itself cost a request handed to it. Pure parts on
factories."""

from __future__ import annotations

from conductor.scheduler.policies.kv_centric import kv_centric
from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    InstanceLoad,
    RouteRequest,
    SchedulerParams,
)

BS = 32
NOW = 1000.0
MODEL = PrefillTimeModel(base_s=0.0, per_token_s=0.5e-3, per_attn_s=0.0)


def inst(iid: str, role: str = "both", **load: object) -> InstanceLoad:
    return InstanceLoad(instance_id=iid, role=role, in_flight=0, queued_prompt_tokens=0,
                        block_size=BS, **load)


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
