"""The end-to-end benchmark's pure parts: workload generators and the report (no engines)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from benchmarks.e2e import spread
from benchmarks.e2e.report import RequestRecord, Summary, plot_cdf, ratio, summarize, token_gaps
from benchmarks.e2e.workloads import (
    Vocab,
    low_reuse,
    multi_turn,
    reuse_ratio,
    shared_prefix,
    skeletons,
    trace_derived,
)

VOCAB = Vocab(100, 30000)
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def _shared(seed: int = 1, n: int = 64):
    return shared_prefix(seed, n_requests=n, n_groups=4, prefix_tokens=256, suffix_tokens=16,
                         max_tokens=8, rate_rps=4.0, vocab=VOCAB)


def _low(seed: int = 1, n: int = 64):
    return low_reuse(seed, n_requests=n, prompt_tokens=128, max_tokens=8, rate_rps=4.0,
                     vocab=VOCAB)


def _write_trace(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    return _write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 1536, "output_length": 500, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [4, 5]},
        {"timestamp": 4000, "input_length": 100, "output_length": 7, "hash_ids": [6]},
    ])


def _trace(path: Path, seed: int = 1, n: int = 3):
    return trace_derived(seed, path, n_requests=n, max_prompt_tokens=60, max_tokens_cap=64,
                         rate_rps=1.0, vocab=VOCAB)


def test_generators_are_deterministic_per_seed(small_trace: Path) -> None:
    for make in (_shared, _low, lambda seed: _trace(small_trace, seed)):
        assert make(seed=7) == make(seed=7)
        a, b = make(seed=7), make(seed=8)
        assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in b.requests]


def test_tokens_in_vocab_and_arrivals_ordered_from_zero(small_trace: Path) -> None:
    for w in (_shared(), _low(), _trace(small_trace)):
        tokens = [t for r in w.requests for t in r.prompt_token_ids]
        assert min(tokens) >= VOCAB.lo and max(tokens) < VOCAB.hi
        arrivals = [r.arrival_s for r in w.requests]
        assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
        assert len({r.request_id for r in w.requests}) == len(w.requests)
        assert w.description


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    w = shared_prefix(3, n_requests=2000, n_groups=4, prefix_tokens=4, suffix_tokens=4,
                      max_tokens=1, rate_rps=8.0, vocab=VOCAB)
    rate = (len(w.requests) - 1) / w.requests[-1].arrival_s
    assert rate == pytest.approx(8.0, rel=0.1)


def test_shared_prefix_groups_share_prefix_and_interleave() -> None:
    w = _shared()
    groups = [r.group for r in w.requests]
    assert groups != sorted(groups)
    changes = sum(a != b for a, b in zip(groups, groups[1:], strict=False))
    assert changes / (len(groups) - 1) > 0.5
    sizes = {g: groups.count(g) for g in set(groups)}
    assert len(sizes) == 4 and max(sizes.values()) - min(sizes.values()) <= 1
    for g in sizes:
        prompts = [r.prompt_token_ids for r in w.requests if r.group == g]
        assert len({p[:256] for p in prompts}) == 1
    assert len({r.prompt_token_ids[256:] for r in w.requests}) == len(w.requests)
    assert len({r.prompt_token_ids[:256] for r in w.requests}) == 4


def test_trace_equal_hash_prefixes_give_equal_token_prefixes(small_trace: Path) -> None:
    a, b, c = (r.prompt_token_ids for r in _trace(small_trace).requests)
    # 3 blocks at most, 60 tokens: 20 tokens per trace block
    assert a[:40] == b[:40]
    assert a[40:60] != b[40:60]
    assert c[:20] != a[:20] and c[20:40] != a[20:40]
    assert (len(a), len(b), len(c)) == (60, 43, 24)  # ceil(input_length * 20 / 512)


def test_trace_outputs_arrivals_and_groups(small_trace: Path) -> None:
    w = _trace(small_trace)
    assert [r.max_tokens for r in w.requests] == [64, 1, 7]
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.0, 2 / 3, 2.0])
    assert [r.group for r in w.requests] == ["0", "0", "4"]


def test_trace_window_and_explicit_block_tokens(small_trace: Path) -> None:
    w = trace_derived(1, small_trace, n_requests=2, max_prompt_tokens=50, max_tokens_cap=8,
                      rate_rps=1.0, vocab=VOCAB, start=2, block_tokens=32)
    assert [r.group for r in w.requests] == ["4", "6"]
    assert [len(r.prompt_token_ids) for r in w.requests] == [38, 7]
    whole = trace_derived(1, small_trace, n_requests=4, max_prompt_tokens=50, max_tokens_cap=8,
                          rate_rps=1.0, vocab=VOCAB, block_tokens=32)
    assert w.requests[0].prompt_token_ids == whole.requests[2].prompt_token_ids
    with pytest.raises(ValueError):
        _trace(small_trace, n=5)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not here")
def test_real_trace_prompts_fit_and_keep_reuse() -> None:
    w = trace_derived(1, TRACE, n_requests=200, max_prompt_tokens=2048, max_tokens_cap=128,
                      rate_rps=4.0, vocab=VOCAB, start=3793, block_tokens=32)
    assert max(len(r.prompt_token_ids) for r in w.requests) <= 2048
    assert max(r.max_tokens for r in w.requests) <= 128
    assert reuse_ratio(w, 32) > 0.5
    head = trace_derived(1, TRACE, n_requests=200, max_prompt_tokens=1000, max_tokens_cap=128,
                         rate_rps=4.0, vocab=VOCAB)
    assert max(len(r.prompt_token_ids) for r in head.requests) <= 1000


def test_reuse_ratio_separates_the_workloads() -> None:
    assert reuse_ratio(_low(), 16) == 0.0
    assert len({r.prompt_token_ids[0] for r in _low().requests}) == 64
    # 4 first sights of 16 prefix blocks, 60 hits of 16 blocks, 1 suffix block each
    assert reuse_ratio(_shared(), 16) == pytest.approx(60 * 16 / (64 * 17))
    with pytest.raises(ValueError):
        low_reuse(1, n_requests=11, prompt_tokens=4, max_tokens=1, rate_rps=1.0,
                  vocab=Vocab(0, 10))


def test_token_gaps_split_chunks_evenly() -> None:
    assert token_gaps([1.0, 1.1, 1.3, 1.3, 1.6]) == pytest.approx([0.1, 0.1, 0.1, 0.3])
    assert token_gaps([1.0, 1.0, 1.2]) == pytest.approx([0.2])
    assert token_gaps([1.0]) == [] and token_gaps([]) == []


def _record(sent: float, times: list[float], ok: bool = True, **kw) -> RequestRecord:
    return RequestRecord(system="s", workload="w", request_id=f"r{sent}", ok=ok,
                         error=None if ok else "boom", sent_s=sent,
                         first_token_s=times[0] if times else None, token_times_s=times,
                         prompt_tokens=10, output_tokens=len(times), **kw)


RECORDS = [
    _record(0.0, [0.5, 0.6, 0.7, 0.8]),  # meets both SLOs
    _record(1.0, [3.0, 3.1]),  # TTFT 2 s: misses
    _record(2.0, [2.2, 2.3, 2.8]),  # gaps 0.1, 0.5: p90 0.46 misses
    _record(3.0, [3.1], ok=False),  # would meet, but failed
]


def test_summarize_known_values() -> None:
    s = summarize(RECORDS, ttft_slo_s=1.0, tbt_slo_s=0.2, duration_s=10.0)
    assert (s.n, s.ok, s.failed) == (4, 3, 1)
    assert s.ttft_p50_s == pytest.approx(0.5)
    assert s.ttft_p99_s == pytest.approx(0.5 + 0.98 * 1.5)  # of 0.2, 0.5, 2.0
    assert s.tbt_p50_s == pytest.approx(0.1)
    assert s.tbt_p99_s == pytest.approx(0.1 + 0.95 * 0.4)  # of 0.1 x5, 0.5
    assert s.output_tok_s == pytest.approx(0.9)
    assert s.goodput_rps == pytest.approx(0.1)
    assert s.slo_attainment == pytest.approx(0.25)
    json.dumps(asdict(s))


def test_summarize_slo_filters() -> None:
    fixed = [*RECORDS[:3], replace(RECORDS[3], ok=True, error=None)]
    assert summarize(fixed, 1.0, 0.2, 10.0).goodput_rps == pytest.approx(0.2)
    assert summarize(RECORDS, 2.0, 0.2, 10.0).goodput_rps == pytest.approx(0.2)
    assert summarize(RECORDS, 2.0, 0.5, 10.0).slo_attainment == pytest.approx(0.75)
    empty = summarize([], 1.0, 0.2, 10.0)
    assert empty.n == 0 and math.isnan(empty.ttft_p99_s) and math.isnan(empty.slo_attainment)


def test_ratio() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1.0, 0.0) == math.inf
    assert math.isnan(ratio(0.0, 0.0))


def _runs(goodput: dict[tuple[str, str], list[float]],
          ttft_p99: dict[tuple[str, str], list[float]] | None = None
          ) -> dict[tuple[str, str], list[Summary]]:
    base = summarize(RECORDS, 1.0, 0.2, 10.0)
    ttft_p99 = ttft_p99 or {}
    return {key: [replace(base, goodput_rps=g, ttft_p99_s=t)
                  for g, t in zip(gs, ttft_p99.get(key, [1.0] * len(gs)), strict=True)]
            for key, gs in goodput.items()}


ARMS = ("kv_centric", "kv_centric_2p2d", "round_robin", "vllm_router", "vllm_router_dp",
        "colocated")
LINE = re.compile(r"e2e worst_vs_best=(\S+) goodput_vs_rr=(\S+) goodput_vs_vllm_router=(\S+) "
                  r"goodput_vs_vllm_router_dp=(\S+) goodput_vs_colocated=(\S+) "
                  r"ttft_p99_vs_vllm_router=(\S+) overhead_ms=(\S+) "
                  r"vllm_router_overhead_ms=(\S+)")


def test_summary_line_exact_format_from_medians() -> None:
    shared = dict(zip(ARMS, ([3.0, 2.0, 4.0], [1.0] * 3, [1.5] * 3, [1.0, 1.2, 0.8],
                             [2.0] * 3, [2.0, 1.0, 3.0]), strict=True))
    low = dict(zip(ARMS, ([1.0] * 3, [2.0] * 3, [0.5] * 3, [0.5] * 3, [0.5] * 3, [0.5] * 3),
                   strict=True))
    goodput = {(a, "shared_prefix"): g for a, g in shared.items()}
    goodput |= {(a, "low_reuse"): g for a, g in low.items()}
    ttft = {("kv_centric", "shared_prefix"): [0.5, 0.4, 0.9],
            ("vllm_router", "shared_prefix"): [2.0, 2.0, 2.0]}
    line = spread.summary_line(_runs(goodput, ttft), overhead_ms=1.234, router_overhead_ms=0.5)
    m = LINE.fullmatch(line)
    assert m and all(re.fullmatch(r"\d+\.\d\d", v) for v in m.groups())
    assert line == ("e2e worst_vs_best=0.50 goodput_vs_rr=2.00 goodput_vs_vllm_router=3.00 "
                    "goodput_vs_vllm_router_dp=1.50 goodput_vs_colocated=1.50 "
                    "ttft_p99_vs_vllm_router=4.00 overhead_ms=1.23 "
                    "vllm_router_overhead_ms=0.50")
    assert spread.worst_vs_best(_runs(goodput)) == (0.5, "low_reuse")


def test_a_difference_counts_only_beyond_the_spread() -> None:
    a, b, c = spread.Spread.of([1.0, 2.0, 3.0]), spread.Spread.of([2.5, 4.0, 5.0]), \
        spread.Spread.of([3.5, 4.0])
    assert (a.median, a.lo, a.hi, a.n) == (2.0, 1.0, 3.0, 3)
    assert not spread.beyond(a, b) and spread.beyond(a, c) and spread.beyond(c, a)
    assert not spread.beyond(a, spread.Spread.of([])) and not spread.beyond(
        spread.Spread.of([9.0]), a)
    runs = _runs({("kv_centric", "w"): [3.0, 3.2, 3.1], ("colocated", "w"): [1.0, 1.1, 0.9],
                  ("round_robin", "w"): [2.9, 3.5, 2.0]})
    rows = spread.markdown_table(runs).splitlines()
    assert len(rows) == 2 + 3 and all(r.count("|") == 11 for r in rows)
    assert rows[2].startswith("| w | kv_centric | 3 | 9/12 | 3.10 [3.00-3.20] |")
    assert rows[3].endswith("| 3.10* |") and rows[4].endswith("| 1.07 |")


def test_prewarm_break_even_is_the_smallest_n_where_it_pays() -> None:
    def row(n: int, warm: float, cold: float) -> dict:
        return {"n": n, "prewarm": {"amortised_ms": warm}, "no_prewarm": {"amortised_ms": cold}}
    rows = [row(4, 900, 500), row(4, 800, 600), row(8, 500, 520), row(8, 700, 480),
            row(8, 510, 530), row(16, 300, 500)]
    assert spread.break_even(rows) == 8
    assert spread.break_even([row(4, 900, 500)]) is None


def test_multi_turn_conversations_extend_their_previous_turn() -> None:
    w = multi_turn(5, n_conversations=3, turns=4, doc_tokens=64, question_tokens=16,
                   max_tokens=8, rate_rps=2.0, think_s=0.5, vocab=VOCAB)
    assert w == multi_turn(5, 3, 4, 64, 16, 8, 2.0, 0.5, VOCAB)
    assert len(w.requests) == 12
    firsts = [r for r in w.requests if r.follows is None]
    assert len(firsts) == 3 and [len(r.prompt_token_ids) for r in firsts] == [80] * 3
    assert [r.arrival_s for r in firsts] == sorted(r.arrival_s for r in firsts)
    whole = skeletons(w)
    for r in w.requests:
        if r.follows is not None:
            assert len(r.prompt_token_ids) == 16 and r.think_s == 0.5
            prev = whole[r.follows]
            assert whole[r.request_id][:len(prev)] == prev
            assert len(whole[r.request_id]) == len(prev) + 8 + 16
    # each follow-up hits its predecessor's prompt and answer; first turns hit nothing
    assert 0.5 < reuse_ratio(w, 8) < 1.0


def test_plots_write_png(tmp_path: Path) -> None:
    spread.plot(_runs({("kv_centric", "w"): [1.0, 2.0], ("colocated", "w"): [0.5, 0.6]}),
                tmp_path / "bars.png")
    records = RECORDS + [replace(r, system="t") for r in RECORDS]
    plot_cdf(records, tmp_path / "cdf.png", ttft_slo_s=1.0)
    for name in ("bars.png", "cdf.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    with pytest.raises(ValueError):
        plot_cdf([*RECORDS, replace(RECORDS[0], workload="x")], tmp_path / "x.png")


def test_admission_calibration_pairs_each_prediction_with_its_ttft_per_workload(tmp_path):
    from benchmarks import conductor_log
    from benchmarks.e2e import calibration

    def line(event: str, **kv) -> str:
        fields = " ".join(f"{k}={v}" for k, v in kv.items())
        return f"2026-11-27T06:03:05.323973Z [info     ] {event:30s} {fields}\n"

    first = (line("routed", prefill="both-0", predicted_ttft_s=2.0, request_id="a")
             + line("routed", predicted_ttft_s=0.5, request_id="b")
             + line("rejected", reason="'predicted TTFT 5.847s exceeds the SLO 5.000s on every "
                    "instance'", request_id="c", retry_after_s=1.0)
             + line("timeline", status=200, ttft_ms=1500.0, request_id="a"))
    second = (line("routed", predicted_ttft_s=1.0, request_id="d")
              # b's line comes after its answer, in the next workload's lines
              + line("timeline", status=200, ttft_ms=1000.0, request_id="b")
              + line("timeline", status=429, request_id="x")
              + json.dumps({"event": "timeline", "status": 200, "ttft_ms": 3000.0,
                            "request_id": "d"}) + "\n")
    log = tmp_path / "conductor.log"
    log.write_text(line("routed", predicted_ttft_s=0.01, request_id="probe") + first + second)
    a = len(line("routed", predicted_ttft_s=0.01, request_id="probe").encode())
    b = a + len(first.encode())
    got = calibration.read_spans(log, {"shared_prefix": (a, b),
                                       "trace": (b, conductor_log.size(log))})
    assert sorted((p.request_id, p.predicted_ttft_s, p.actual_ttft_s, p.rejected)
                  for p in got["shared_prefix"]) == [("a", 2.0, 1.5, False),
                                                     ("b", 0.5, 1.0, False),
                                                     ("c", 5.847, None, True)]
    assert [(p.request_id, p.actual_ttft_s) for p in got["trace"]] == [("d", 3.0)]
    bins = {(b.lo, b.hi): b for b in calibration.bins(got["shared_prefix"])}
    assert bins[(0.3, 1.0)].served == 1 and bins[(0.3, 1.0)].ratio_median == 2.0
    assert (1.0, 2.0) not in bins  # 2.0 s starts the next bin
    assert bins[(2.0, 5.0)].ratio_median == 0.75
    assert bins[(5.0, math.inf)].rejected == 1 and bins[(5.0, math.inf)].served == 0
    table = calibration.markdown({("kv_centric", "trace"): got["trace"]})
    assert "| kv_centric | trace | 1-2 s | 1 | 0 | 3.00 | 3.00 | 3.00 |" in table
    assert conductor_log.size(tmp_path / "missing.log") == 0


def test_bench_burst_summarises_by_position_and_leaves_failures_out(tmp_path: Path) -> None:
    from benchmarks.bench_burst import _plot, _summary

    reps = [{"variant": "ours", "bursts": [[1.0, 2.0, None], [3.0, 4.0, 5.0]],
             "actual_vs_predicted": [1.0, 2.0, 4.0]},
            {"variant": "vllm", "bursts": [[9.0]], "actual_vs_predicted": []}]
    s = _summary(reps, "ours")
    assert (s["n"], s["ok"], s["max_s"]) == (6, 5, 5.0)
    assert s["mean_s"] == pytest.approx(3.0) and s["first_two_s"] == pytest.approx(2.5)
    assert s["by_position"] == [(2.0, 1.0, 3.0), (3.0, 2.0, 4.0), (5.0, 5.0, 5.0)]
    assert s["actual_vs_predicted"] == 2.0
    assert math.isnan(_summary(reps, "vllm")["actual_vs_predicted"])
    _plot({"vllm": _summary(reps, "vllm"), "ours": s}, tmp_path / "burst.png")
    assert (tmp_path / "burst.png").stat().st_size > 0


def test_the_added_latency_splits_into_conductor_rpc_and_hop(tmp_path: Path) -> None:
    from benchmarks.e2e import overhead

    log = tmp_path / "conductor.log"
    line = ("2026-11-28T07:00:00.000000Z [info     ] timeline                       "
            "accept_ms={a} answer_ms=0.3 decode_ms=0.0 decode_start_ms=14.0 parse_ms=0.5 "
            "request_id={rid} route_ms=0.25 status=200 stream=False ttft_ms=15.0\n")
    log.write_text(line.format(a=0.2, rid="cmpl-1") + line.format(a=0.4, rid="cmpl-2")
                   + line.format(a=9.0, rid="cmpl-other")  # not a probe
                   + "2026-11-28T07:00:01Z [info     ] routed request_id=cmpl-1\n")
    probes = {"cmpl-1": (0.0170, 0.0135), "cmpl-2": (0.0172, 0.0135)}
    got = overhead.split(log, probes)
    assert got["where_n"] == 2
    assert got["where_accept_ms"] == pytest.approx(0.3)  # the median of 0.2 and 0.4
    assert got["where_conductor_ms"] == pytest.approx(15.3 - 14.0)
    assert got["where_rpc_vs_direct_ms"] == pytest.approx(0.5)
    assert got["where_hop_ms"] == pytest.approx(17.1 - 15.3)
    # the three parts add up to the request's added latency (through - direct)
    assert got["where_sum_ms"] == pytest.approx(17.1 - 13.5)
    assert "hop 1.80" in overhead.describe(got)
    # lines from before the stages existed give no split rather than a wrong one
    log.write_text("2026-11-28T07:00:00Z [info     ] timeline request_id=cmpl-1 ttft_ms=15.0\n")
    assert overhead.split(log, probes) == {} and overhead.describe({"ms": 2.0}) == ""
