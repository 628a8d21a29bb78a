"""What one end-to-end run of a (system, workload) cell measured: per-request records in, a
summary and a TTFT CDF plot out (`benchmarks.e2e.spread` aggregates the repetitions).

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHARED_PREFIX = "shared_prefix"


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
    sent_id: str = ""
    """The X-Request-Id it was sent with ("": none; `benchmarks.e2e.slowest` joins on it)."""


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


def plot_cdf(records: Sequence[RequestRecord], path_png: str | Path,
             ttft_slo_s: float | None = None) -> None:
    """TTFT CDF per system of one workload's records; the y axis counts all requests, so a
    system's curve ends below 1 by its failures."""
    workloads = {r.workload for r in records}
    if len(workloads) > 1:
        raise ValueError(f"records of one workload expected, got {sorted(workloads)}")
    plt = pyplot()
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
    save_png(plt, fig, path_png)


def ratio(a: float, b: float) -> float:
    """a / b; b == 0 gives inf (nan when a == 0 too)."""
    if b == 0:
        return math.nan if a == 0 else math.inf
    return a / b


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(plt, fig, path_png: str | Path) -> None:
    Path(path_png).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
