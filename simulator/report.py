"""Per-policy metrics from a run's request results, and their JSON, CSV and PNG forms.

Definitions:
- TTFT: arrival to the first output token on the decode instance (queueing, prefill, KV
  transfer, decode admission and one step); percentiles over admitted requests.
- TBT: a request's mean time between tokens after the first; percentiles over requests.
- SLO attainment: requests with TTFT <= ttft_slo and TBT <= tbt_slo over ALL requests
  (a rejected request misses).
- goodput: those requests per second of the trace's arrival span.
- hit ratio: prompt tokens the prefilling engine did not compute (taken from its own cache or
  pulled from the pool) over the prompt tokens of admitted requests. The block holding the
  prompt's last token is always computed, so it stays just under the trace's ideal ratio
  (`trace.ideal_hit_ratio`: tokens in blocks whose whole prefix appeared before).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from simulator.engine import STAGES, RequestResult


@dataclass(frozen=True)
class PolicyMetrics:
    policy: str
    label: str
    requests: int
    rejected: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    slo_attainment: float
    goodput_rps: float
    hit_ratio: float
    pool_hit_ratio: float
    """Of the prompt tokens, those pulled from the pool (not in the engine's own cache)."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(policy: str, results: Sequence[RequestResult], ttft_slo_s: float,
              tbt_slo_s: float, label: str = "") -> PolicyMetrics:
    ok = [r for r in results if not r.rejected]
    ttft = [r.ttft_s for r in ok]
    tbt = [r.tbt_s for r in ok]
    good = sum(1 for r in ok if r.ttft_s <= ttft_slo_s and r.tbt_s <= tbt_slo_s)
    arrivals = [r.arrival_s for r in results]
    span = (max(arrivals) - min(arrivals)) if len(arrivals) > 1 else 1.0
    prompt = sum(r.input_length for r in ok) or 1
    return PolicyMetrics(
        policy=policy, label=label or policy, requests=len(results),
        rejected=len(results) - len(ok),
        ttft_mean_s=sum(ttft) / len(ttft) if ttft else math.nan,
        ttft_p50_s=percentile(ttft, 50), ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99), tbt_p90_s=percentile(tbt, 90),
        tbt_p99_s=percentile(tbt, 99),
        slo_attainment=good / len(results) if results else math.nan,
        goodput_rps=good / (span or 1.0),
        hit_ratio=sum(r.cached_tokens for r in ok) / prompt,
        pool_hit_ratio=sum(r.pool_tokens for r in ok) / prompt)


def stage_row(policy: str, results: Sequence[RequestResult], ttft_slo_s: float,
              tbt_slo_s: float, **extra: object) -> dict:
    """Where a run's TTFT goes: mean and p90 of each stage (`engine.STAGES`) over admitted
    requests, the share prefilled on their decode instance, and the misses by kind."""
    ok = [r for r in results if not r.rejected]
    row: dict = {**extra, "policy": policy, "requests": len(results)}
    for n, stage in enumerate(STAGES):
        xs = [r.stages[n] for r in ok]
        row[f"{stage}_mean_s"] = sum(xs) / len(xs) if xs else math.nan
        row[f"{stage}_p90_s"] = percentile(xs, 90)
    row["local_share"] = sum(r.prefill_id == r.decode_id for r in ok) / len(ok) if ok else 0.0
    prompt = sum(r.input_length for r in ok) or 1
    row["hit_ratio"] = sum(r.cached_tokens for r in ok) / prompt
    row["rejected"] = len(results) - len(ok)
    row["ttft_misses"] = sum(r.ttft_s > ttft_slo_s for r in ok)
    row["tbt_only_misses"] = sum(r.ttft_s <= ttft_slo_s and r.tbt_s > tbt_slo_s
                                 for r in ok)
    return row


def write_rows(rows: Sequence[dict], stem: Path) -> None:
    """`stem`.json and `stem`.csv of flat dict rows."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(list(rows), indent=1) + "\n")
    if rows:
        with stem.with_suffix(".csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def metrics_rows(metrics: Sequence[PolicyMetrics], **extra: object) -> list[dict]:
    return [{**extra, **asdict(m)} for m in metrics]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(runs: dict[str, Sequence[RequestResult]], slo_s: float, path: Path,
                  title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, results in runs.items():
        ttft = sorted(r.ttft_s for r in results if not r.rejected)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(results) for i in range(len(ttft))], label=name)
    ax.axvline(slo_s, color="grey", ls="--", lw=1, label=f"TTFT SLO {slo_s:g} s")
    ax.set_xscale("log")
    _finish(plt, fig, ax, "TTFT (s)", "fraction of all requests (rejected never arrive)",
            title, path)


def plot_lines(series: dict[str, tuple[Sequence[float], Sequence[float]]], xlabel: str,
               ylabel: str, path: Path, title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    _finish(plt, fig, ax, xlabel, ylabel, title, path)


def plot_capacity(rows: Sequence[dict], path: Path, title: str) -> None:
    """Capacity per arm (bars), one group per profile, each relative to kv_centric's."""
    plt = _plt()
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.4, 0.5 * len(arms) * len(profiles)), 4.2))
    width = 0.8 / len(profiles)
    for n, prof in enumerate(profiles):
        by = {r["arm"]: r["capacity_rps"] for r in rows if r["profile"] == prof}
        ref = by.get("kv_centric") or max(by.values()) or 1.0
        ax.bar([i + n * width for i in range(len(arms))],
               [by.get(a, 0.0) / ref for a in arms], width, label=prof)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(arms))])
    ax.set_xticklabels(arms, rotation=45, ha="right", fontsize=7)
    _finish(plt, fig, ax, "", "capacity / kv_centric's", title, path)


def plot_replicas(rows: Sequence[dict], path: Path, title: str) -> None:
    """TTFT p50 and hit ratio over one conductor's against the sync period (log scale), one
    line per replica count, with the +-5% band and the per-step period marked."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.2))
    step = next((r["sync_period_s"] for r in rows if r["per_step"]), None)
    for ax, key, ylabel in ((axes[0], "ttft_p50_vs_one", "TTFT p50 / one conductor's"),
                            (axes[1], "hit_ratio_vs_one", "hit ratio / one conductor's")):
        for n in sorted({r["replicas"] for r in rows}):
            pts = sorted((r["sync_period_s"], r[key]) for r in rows
                         if r["replicas"] == n and r["sync_period_s"] > 0)
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", ms=3, label=f"{n} replica{'s' * (n > 1)}")
        for y in (0.95, 1.05):
            ax.axhline(y, color="grey", ls=":", lw=1)
        if step:
            ax.axvline(step, color="grey", ls="--", lw=1, label="one report per step")
        ax.set_xscale("log")
        _finish(plt, fig, ax, "sync period (s)", ylabel, title if ax is axes[0] else "", None)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _finish(plt, fig, ax, xlabel: str, ylabel: str, title: str, path: Path | None) -> None:
    """Labels, legend and grid as every plot here has them; saved and closed (unless no
    `path`: one panel of several)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if path is None:
        return
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
