"""What an end-to-end run measured: per-request records in, summaries, a table, plots and
the one-line verdict out.

Definitions (times in seconds, run-relative, from one monotonic clock):
- TTFT: `first_token_s - sent_s`, over ok requests that received a token.
- TBT: the gaps between consecutive output tokens, pooled over all ok requests
  (`token_gaps`). A streamed chunk of k tokens arriving at t after the previous chunk at
  t' counts as k gaps of (t - t') / k; tokens arriving in the first chunk, with the first
  token, add no gap (their spacing is not observable).
- A request meets the SLOs when it is ok, its TTFT <= `ttft_slo_s` and the 90th percentile
  of its own gaps <= `tbt_slo_s` (a request with fewer than two output chunks has no gap
  and meets the TBT SLO).
- goodput: requests meeting the SLOs per second of `duration_s`; SLO attainment: those
  requests over all requests, failed ones included.
- Percentiles: numpy's (linear interpolation); nan when there is no value.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHARED_PREFIX = "shared_prefix"
LOW_REUSE = "low_reuse"


@dataclass
class RequestRecord:
    system: str
    workload: str
    request_id: str
    ok: bool
    error: str | None
    sent_s: float
    """When sent (monotonic seconds, run-relative)."""
    first_token_s: float | None
    """When the first output token arrived; None if none did."""
    token_times_s: list[float] = field(default_factory=list)
    """Arrival time of every output token; tokens arriving in one chunk share a time."""
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class Summary:
    n: int
    ok: int
    failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    output_tok_s: float
    """Output tokens of ok requests per second of the run."""
    goodput_rps: float
    """Requests meeting both SLOs per second of the run."""
    slo_attainment: float
    """Requests meeting both SLOs over all requests."""
    ttft_slo_s: float
    tbt_slo_s: float
    duration_s: float


def token_gaps(token_times_s: Sequence[float]) -> list[float]:
    """One request's inter-token gaps: a chunk of k tokens after the previous chunk's time
    gives k equal gaps; the first chunk gives none."""
    chunks = [(t, len(list(g))) for t, g in itertools.groupby(token_times_s)]
    return [(t - prev) / k for (prev, _), (t, k) in itertools.pairwise(chunks)
            for _ in range(k)]


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's percentile (q in [0, 100]); nan for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def meets_slo(record: RequestRecord, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    if not record.ok or record.first_token_s is None:
        return False
    gaps = token_gaps(record.token_times_s)
    return (record.first_token_s - record.sent_s <= ttft_slo_s
            and (not gaps or percentile(gaps, 90) <= tbt_slo_s))


def summarize(records: Sequence[RequestRecord], ttft_slo_s: float, tbt_slo_s: float,
              duration_s: float) -> Summary:
    """Metrics of one (system, workload) run lasting `duration_s` (see the module doc)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive: {duration_s}")
    ok = [r for r in records if r.ok]
    ttft = [r.first_token_s - r.sent_s for r in ok if r.first_token_s is not None]
    gaps = [g for r in ok for g in token_gaps(r.token_times_s)]
    good = sum(meets_slo(r, ttft_slo_s, tbt_slo_s) for r in records)
    return Summary(
        n=len(records), ok=len(ok), failed=len(records) - len(ok),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tbt_p50_s=percentile(gaps, 50), tbt_p99_s=percentile(gaps, 99),
        output_tok_s=sum(r.output_tokens for r in ok) / duration_s,
        goodput_rps=good / duration_s,
        slo_attainment=good / len(records) if records else math.nan,
        ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, duration_s=duration_s)


Summaries = Mapping[tuple[str, str], Summary]
"""Keyed by (system, workload)."""


def markdown_table(summaries: Summaries) -> str:
    """One row per (workload, system), workloads then systems in first-seen order."""
    rows = ["| workload | system | ok/n | TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) "
            "| TBT p99 (ms) | out tok/s | goodput req/s | SLO % |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    systems, workloads = _axes(summaries)
    for w in workloads:
        for sys_ in systems:
            s = summaries.get((sys_, w))
            if s is None:
                continue
            rows.append(
                f"| {w} | {sys_} | {s.ok}/{s.n} | {s.ttft_p50_s * 1e3:.1f} "
                f"| {s.ttft_p99_s * 1e3:.1f} | {s.tbt_p50_s * 1e3:.1f} "
                f"| {s.tbt_p99_s * 1e3:.1f} | {s.output_tok_s:.1f} | {s.goodput_rps:.2f} "
                f"| {s.slo_attainment * 100:.1f} |")
    return "\n".join(rows) + "\n"


def plot(summaries: Summaries, path_png: str | Path) -> None:
    """Two panels side by side, goodput and TTFT p99, bars per system grouped by workload."""
    plt = _plt()
    systems, workloads = _axes(summaries)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(systems), 1)
    x = np.arange(len(workloads))
    panels = [("goodput_rps", "goodput (req/s meeting both SLOs)", "higher is better"),
              ("ttft_p99_s", "TTFT p99 (s)", "lower is better")]
    for ax, (attr, label, better) in zip(axes, panels, strict=True):
        for i, sys_ in enumerate(systems):
            ys = [getattr(summaries[(sys_, w)], attr) if (sys_, w) in summaries else math.nan
                  for w in workloads]
            ax.bar(x + (i - (len(systems) - 1) / 2) * width, ys, width, label=sys_)
        ax.set_xticks(x, workloads)
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' (')[0]}: {better}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(plt, fig, path_png)


def plot_cdf(records: Sequence[RequestRecord], path_png: str | Path,
             ttft_slo_s: float | None = None) -> None:
    """TTFT CDF per system of one workload's records; the y axis counts all requests, so a
    system's curve ends below 1 by its failures."""
    workloads = {r.workload for r in records}
    if len(workloads) > 1:
        raise ValueError(f"records of one workload expected, got {sorted(workloads)}")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_system: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_system.setdefault(r.system, []).append(r)
    for sys_, rs in by_system.items():
        ttft = sorted(r.first_token_s - r.sent_s for r in rs
                      if r.ok and r.first_token_s is not None)
        ax.step(ttft, np.arange(1, len(ttft) + 1) / len(rs), where="post", label=sys_)
    if ttft_slo_s is not None:
        ax.axvline(ttft_slo_s, color="grey", ls="--", lw=1, label=f"TTFT SLO {ttft_slo_s:g} s")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of all requests")
    ax.set_title(f"TTFT CDF: {next(iter(workloads), '')}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(plt, fig, path_png)


def ratio(a: float, b: float) -> float:
    """a / b; b == 0 gives inf (nan when a == 0 too)."""
    if b == 0:
        return math.nan if a == 0 else math.inf
    return a / b


def summary_line(summaries: Summaries, ours: str = "kv_centric", rr: str = "round_robin",
                 router: str = "vllm_router", colocated: str = "colocated", *,
                 overhead_ms: float, router_overhead_ms: float) -> str:
    """The run's last line. Ratios are ours over theirs on "shared_prefix" (TTFT p99: theirs
    over ours), so > 1 is better for us; `lowreuse_vs_best` is our goodput on "low_reuse"
    over the best other system's there. A missing summary makes its ratio nan."""
    def get(system: str, workload: str, attr: str) -> float:
        s = summaries.get((system, workload))
        return getattr(s, attr) if s is not None else math.nan

    def goodput_vs(other: str) -> float:
        return ratio(get(ours, SHARED_PREFIX, "goodput_rps"),
                     get(other, SHARED_PREFIX, "goodput_rps"))

    others = [s.goodput_rps for (sys_, w), s in summaries.items()
              if w == LOW_REUSE and sys_ != ours and not math.isnan(s.goodput_rps)]
    best_other = max(others, default=math.nan)
    values = {
        "goodput_vs_rr": goodput_vs(rr),
        "goodput_vs_vllm_router": goodput_vs(router),
        "goodput_vs_colocated": goodput_vs(colocated),
        "lowreuse_vs_best": ratio(get(ours, LOW_REUSE, "goodput_rps"), best_other),
        "ttft_p99_vs_vllm_router": ratio(get(router, SHARED_PREFIX, "ttft_p99_s"),
                                         get(ours, SHARED_PREFIX, "ttft_p99_s")),
        "overhead_ms": overhead_ms,
        "vllm_router_overhead_ms": router_overhead_ms,
    }
    return "e2e " + " ".join(f"{k}={v:.2f}" for k, v in values.items())


def _axes(summaries: Summaries) -> tuple[list[str], list[str]]:
    """Systems and workloads in first-seen order."""
    return (list(dict.fromkeys(s for s, _ in summaries)),
            list(dict.fromkeys(w for _, w in summaries)))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path_png: str | Path) -> None:
    Path(path_png).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
