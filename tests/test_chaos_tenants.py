"""The chaos run's tenant flood (`benchmarks.chaos.tenants`): the files it gives the conductor
load as the conductor loads them, and its goodput counts right answers within the SLOs only."""

from __future__ import annotations

from benchmarks.chaos.tenants import TBT_SLO_S, TTFT_SLO_S, goodput, meets_slo, plan
from benchmarks.chaos.traffic import Result
from conductor.auth import load_api_keys
from conductor.tenants import load_limits


def _res(cls: str = "ok", stream: bool = True, ttft: float | None = 0.5, end: float = 2.0,
         tokens: int = 16, start: float = 1.0) -> Result:
    return Result(0, stream, "unique", cls=cls, t_start=start, t_end=end, ttft=ttft,
                  tokens=tokens)


def test_the_plan_gives_the_conductor_keys_and_limits_it_loads(tmp_path):
    p = plan(tmp_path, 4, 0, 1000)
    args = dict(zip(p.conductor_args[::2], p.conductor_args[1::2], strict=True))
    keys = load_api_keys(args["--api-keys-file"])
    assert sorted(keys.values()) == ["flood", "interactive", "ops"]
    assert {keys[k] for k in p.keys.values()} == set(p.keys)
    limits = load_limits(args["--tenant-limits-file"])
    assert limits["flood"].max_concurrency == 1 and limits["flood"].priority == "batch"
    assert "interactive" not in limits
    assert len(p.solo) == len(p.beside) == 4
    assert not set(p.solo[i].prompt for i in range(4)) & set(r.prompt for r in p.beside)


def test_meets_slo_asks_right_tokens_and_both_slos():
    assert meets_slo(_res())
    assert not meets_slo(_res(cls="clean_error"))
    assert not meets_slo(_res(ttft=TTFT_SLO_S + 1, end=TTFT_SLO_S + 3))
    slow_tbt = 1.0 + 0.5 + 15 * TBT_SLO_S * 2
    assert not meets_slo(_res(end=slow_tbt))
    assert meets_slo(_res(stream=False, ttft=None, end=1.0 + TTFT_SLO_S))
    assert not meets_slo(_res(stream=False, ttft=None, end=1.0 + TTFT_SLO_S + 17 * TBT_SLO_S))


def test_goodput_is_good_answers_per_second_of_the_span():
    g = goodput([_res(start=0.0, end=2.0), _res(start=1.0, end=4.0), _res("wrong", end=3.0)])
    assert g["good"] == 2 and g["span_s"] == 4.0 and g["goodput_rps"] == 0.5
    assert g["classes"] == {"ok": 2, "wrong": 1}


def test_the_chaos_run_counts_requests_retried_off_a_stalled_engine():
    """`stalled_before_first`: retries (a failure before the first token) off the stopped
    engine's instance; its migrations (after the first token), other instances' retries and
    the retry budget's lines do not count."""
    from benchmarks.chaos.__main__ import before_first

    log = ("x [warning  ] retry  attempt=1 error=CANCELLED failed=decode-1 request_id=a "
           "stage=decode\n"
           "x [warning  ] retry  attempt=1 error=CANCELLED failed=decode-0 request_id=b "
           "stage=decode\n"
           "x [warning  ] stream_migrated  error=CANCELLED failed=decode-1 request_id=c\n"
           "x [warning  ] retry_budget_spent  failed=decode-1 request_id=d\n"
           "x [warning  ] retry  attempt=2 error=UNAVAILABLE failed=decode-1 request_id=e "
           "stage=prefill\n")
    assert before_first(log, ["decode-1"]) == 2
    assert before_first(log, []) == 0
