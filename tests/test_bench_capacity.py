"""bench-capacity's arithmetic (benchmarks/e2e/capacity.py) and bench-e2e's sweep of rates."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.e2e import capacity, workloads
from benchmarks.e2e.__main__ import main
from benchmarks.e2e.report import Summary

BASE = Summary(n=20, ok=20, failed=0, ttft_p50_s=0.5, ttft_p99_s=2.0, tbt_p50_s=0.03,
               tbt_p99_s=0.09, output_tok_s=10.0, goodput_rps=1.0, slo_attainment=1.0,
               ttft_slo_s=5.0, tbt_slo_s=0.1, duration_s=20.0)


def _runs(attainment: dict[str, dict[float, list[float]]], workload: str = "shared_prefix"):
    return {(system, capacity.rated(workload, rate)):
            [replace(BASE, slo_attainment=a, goodput_rps=a * rate) for a in reps]
            for system, by_rate in attainment.items() for rate, reps in by_rate.items()}


def test_rated_names_round_trip() -> None:
    assert capacity.rated("shared_prefix", 2.0) == "shared_prefix@2"
    assert capacity.rated("trace", 2.5) == "trace@2.5"
    assert capacity.parse_rated("shared_prefix@2.5") == ("shared_prefix", 2.5)
    assert capacity.parse_rated("shared_prefix") is None
    assert capacity.parse_rated("shared_prefix@fast") is None


def test_a_repetitions_capacity_stops_at_the_first_rate_it_misses() -> None:
    runs = _runs({"kv_centric": {1: [1.0, 1.0, 1.0], 2: [0.95, 0.85, 1.0],
                                 3: [0.9, 1.0, 0.5], 4: [0.5, 1.0, 0.4]},
                  "vllm_router": {1: [1.0, 0.8, 1.0], 2: [0.7, 0.9, 0.6],
                                  3: [0.6, 0.6, 0.6], 4: [0.4, 0.4, 0.4]}})
    # rep 2 of ours misses at 2, so its success at 3 and 4 does not count
    assert capacity.per_rep(runs, "kv_centric", "shared_prefix") == [3.0, 1.0, 2.0]
    assert capacity.per_rep(runs, "vllm_router", "shared_prefix") == [1.0, 0.0, 1.0]
    assert capacity.capacity(runs, "kv_centric", "shared_prefix") == 2.0
    assert capacity.capacity(runs, "vllm_router", "shared_prefix") == 1.0
    assert math.isnan(capacity.capacity(runs, "colocated", "shared_prefix"))
    assert math.isnan(capacity.capacity(runs, "kv_centric", "trace"))
    line = capacity.summary_line(runs, "shared_prefix")
    assert line == ("capacity shared_prefix (>= 90% within the SLOs) kv_centric=2 "
                    "vllm_router=1 ours_vs_vllm_router=2.00")


def test_a_capacity_at_the_highest_rate_tried_is_a_lower_bound() -> None:
    runs = _runs({"kv_centric": {1: [1.0], 2: [1.0]}, "vllm_router": {1: [1.0], 2: [0.5]},
                  "colocated": {1: [1.0], 2: [1.0]}})
    assert capacity.summary_line(runs, "shared_prefix") == (
        "capacity shared_prefix (>= 90% within the SLOs) kv_centric>=2 vllm_router=1 "
        "colocated>=2 ours_vs_vllm_router>=2.00 ours_vs_colocated>=1.00")
    assert capacity.markdown_table(runs, "shared_prefix").splitlines()[2].endswith(
        "| >=2 [2] |")


def test_rates_sort_as_numbers_and_other_workloads_stay_apart() -> None:
    runs = _runs({"kv_centric": {10: [1.0], 2: [1.0], 3: [0.5]}})
    runs |= _runs({"kv_centric": {1: [0.1]}}, workload="trace")
    assert capacity.per_rep(runs, "kv_centric", "shared_prefix") == [2.0]
    assert capacity.per_rep(runs, "kv_centric", "trace") == [0.0]


def test_table_and_plot(tmp_path) -> None:
    runs = _runs({"kv_centric": {1: [1.0, 1.0], 2: [1.0, 0.8]},
                  "colocated": {1: [1.0, 0.5], 2: [0.5, 0.5]}})
    rows = capacity.markdown_table(runs, "shared_prefix").splitlines()
    assert rows[0].startswith("| system | 1 req/s: attainment, goodput | 2 req/s:")
    assert rows[2].startswith("| kv_centric | 100% [100%-100%], 1 [1-1] | 90% [80%-100%]")
    assert rows[2].endswith("| 1.5 [2, 1] |") and rows[3].endswith("| 0.5 [1, 0] |")
    capacity.plot(runs, "shared_prefix", tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_a_renamed_workload_keeps_its_conversations_linked() -> None:
    w = workloads.multi_turn(seed=1, n_conversations=2, turns=3, doc_tokens=64,
                             question_tokens=8, max_tokens=4, rate_rps=1.0, think_s=1.0,
                             vocab=workloads.Vocab(300, 1000))
    r = workloads.renamed(w, "multi_turn@2", "@2")
    assert r.name == "multi_turn@2" and len(r.requests) == len(w.requests)
    ids = {x.request_id for x in r.requests}
    assert all(x.request_id.endswith("@2") for x in r.requests)
    assert all(x.follows in ids for x in r.requests if x.follows is not None)
    assert [x.follows is None for x in r.requests] == [x.follows is None for x in w.requests]
    assert [x.prompt_token_ids for x in r.requests] == [x.prompt_token_ids for x in w.requests]


@pytest.mark.parametrize(("rates", "says"), [("1,fast", "numbers separated by commas"),
                                              ("0,2", "must be positive"),
                                              ("-1", "must be positive")])
def test_bad_rates_are_refused_before_anything_starts(rates: str, says: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([f"--rates={rates}", "--run-dir", "/nonexistent"])
    assert e.value.code == 2
    assert says in capsys.readouterr().err
