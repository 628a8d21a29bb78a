"""bench-e2e's slowest requests: the ids the load generator sends, and each run's slowest
request joined to the conductor's timeline of it (no engines)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from benchmarks.e2e import client, slowest
from benchmarks.e2e.report import RequestRecord
from benchmarks.e2e.workloads import BenchRequest


def _stream(seen: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        chunks = [{"choices": [{"text": "a", "token_ids": [5]}]},
                  {"choices": [{"text": "b", "token_ids": [6]}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(answer)


@pytest.mark.parametrize("prefix", ["kv_centric.0.trace.", ""])
def test_a_request_carries_its_id_only_when_given_a_prefix(prefix: str) -> None:
    seen: list[httpx.Request] = []
    req = BenchRequest("r7", (1, 2, 3), max_tokens=2, arrival_s=0.0, group=None)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=_stream(seen)) as c:
            return await client._one(c, "http://test", "m", "kv_centric", "trace", req, "p",
                                     t0=0.0, id_prefix=prefix)
    rec = asyncio.run(go())
    assert rec.ok and rec.output_tokens == 2 and rec.prompt_tokens == 3
    assert rec.sent_id == (f"{prefix}r7" if prefix else "")
    assert seen[0].headers.get("x-request-id") == (rec.sent_id or None)


def _line(event: str, **kv) -> str:
    fields = " ".join(f"{k}={v}" for k, v in kv.items())
    return f"2026-11-28T16:23:35.081737Z [info     ] {event:30s} {fields}\n"


def _rec(rid: str, sent: float, first: float | None, last: float | None = None) -> RequestRecord:
    times = [] if first is None else [first, last or first]
    return RequestRecord(system="kv_centric", workload="w", request_id=rid, ok=first is not None,
                         error=None, sent_s=sent, first_token_s=first, token_times_s=times,
                         prompt_tokens=2250, output_tokens=len(times), sent_id=f"p.{rid}")


def test_each_runs_slowest_request_is_joined_to_its_timeline(tmp_path: Path) -> None:
    log = tmp_path / "conductor.log"
    log.write_text(
        _line("routed", cached_blocks=0, decode="both-0", predicted_ttft_s=0.38, prefill="both-1",
              request_id="i-slow")
        + _line("routed", cached_blocks=68, decode="both-0", prefill="both-0", request_id="i-b")
        # an id another client chose, and a request no client id names: neither is joined
        + _line("timeline", client_request_id="cmpl-p.b", request_id="i-b", status=200,
                ttft_ms=90.0, parse_ms=5.0, decode_start_ms=80.0, decode_queue_ms=10.0,
                decode_compute_ms=60.0)
        + _line("timeline", request_id="i-anon", status=200, ttft_ms=1.0)
        # disaggregated: the Generate RPC waits beside the Prefill RPC, whose token comes first
        + _line("timeline", accept_ms=0.5, client_request_id="cmpl-p.slow", decode_queue_ms=50.0,
                decode_send_ms=2.0, decode_start_ms=2500.0, kv_wait_ms=2400.0, parse_ms=20.0,
                prefill_ms=1970.0, prefill_send_ms=2.0, prefill_queue_ms=400.0,
                prefill_compute_ms=1500.0, prefill_return_ms=60.0, request_id="i-slow",
                route_ms=0.5, status=200, ttft_ms=2000.0))
    fields = slowest.read(log)
    assert set(fields) == {"p.b", "p.slow"}
    assert fields["p.slow"]["prefill"] == "both-1" and fields["p.slow"]["cached_blocks"] == "0"
    records = [_rec("a", 0.0, 0.3, 5.0),   # still streaming when the slowest was sent
               _rec("b", 0.5, 0.6, 0.9),   # done by then
               _rec("slow", 1.0, 3.1),
               _rec("late", 2.0, 2.1),     # sent after it
               _rec("lost", 0.2, None)]    # no first token: no TTFT, never in flight
    got = slowest.pick("kv_centric", "w", 2, records, fields)
    assert got is not None and got.record.request_id == "slow" and got.in_flight == 1
    assert got.ttft_s == pytest.approx(2.1)
    stages = got.stages_ms()
    assert stages["prefill_compute"] == 1500.0 and stages["prefill_queue"] == 400.0
    assert not {"kv_wait", "decode_send", "decode_queue"} & set(stages)  # the other RPC's
    assert stages["other"] == pytest.approx(2000.0 - 1500 - 400 - 60 - 2 - 20 - 0.5 - 0.5)
    assert stages["client"] == pytest.approx(100.0)
    assert "ttft" not in stages and "status" not in stages
    table = slowest.markdown([got], top=2)
    assert ("| kv_centric | w | 3 | 2100 | 2250 | 1 | both-1 -> both-0 (0, 0.38 s) | "
            "prefill_compute 1500, prefill_queue 400 |") in table
    assert got.as_json()["stages_ms"] == stages
    local = slowest.Slowest("kv_centric", "w", 0, records[1], 0, fields["p.b"])
    assert local.stages_ms() == pytest.approx({"parse": 5.0, "decode_queue": 10.0,
                                               "decode_compute": 60.0, "other": 15.0,
                                               "client": 10.0})


def test_a_run_without_its_timelines_still_names_its_slowest() -> None:
    assert slowest.pick("kv_centric", "w", 0, [_rec("lost", 0.0, None)], {}) is None
    got = slowest.pick("kv_centric", "w", 0, [_rec("a", 0.0, 1.0)], {})
    assert got is not None and got.stages_ms() == {}
    row = "| kv_centric | w | 1 | 1000 | 2250 | 0 | not in the log | - |"
    assert row in slowest.markdown([got])
