"""Repeated runs: each figure's median and spread over the repetitions of a (system, workload)
cell, which differences exceed the spread, the table, the plots with error bars and the
run's last line.

A difference between two cells "exceeds the spread" when their ranges over the repetitions
(min to max) do not overlap: with three repetitions a crude test, but one that does not claim
what run-to-run noise could have made.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.e2e.report import SHARED_PREFIX, Summary, pyplot, ratio, save_png

OURS = "kv_centric"
"""Arm 1: our conductor in the shape it chooses for the machine."""

Runs = Mapping[tuple[str, str], list[Summary]]
"""(system, workload) -> one Summary per repetition."""


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))

    def __str__(self) -> str:
        return f"{self.median:.3g} [{self.lo:.3g}-{self.hi:.3g}]"


def spread(runs: Runs, system: str, workload: str, attr: str) -> Spread:
    return Spread.of([getattr(s, attr) for s in runs.get((system, workload), [])])


def beyond(a: Spread, b: Spread) -> bool:
    """The two ranges do not overlap: the difference exceeds the spread (never said of a
    single repetition, which has no spread to exceed)."""
    return a.n > 1 and b.n > 1 and (a.lo > b.hi or a.hi < b.lo)


def axes(runs: Runs) -> tuple[list[str], list[str]]:
    """Systems and workloads in first-seen order."""
    return (list(dict.fromkeys(s for s, _ in runs)), list(dict.fromkeys(w for _, w in runs)))


def markdown_table(runs: Runs) -> str:
    """One row per (workload, system): medians over the repetitions with [min-max], and our
    arm's goodput over this one's (medians), marked * where the difference exceeds the
    spread."""
    rows = ["| workload | system | reps | ok/n | goodput req/s | TTFT p50 (ms) | TTFT p99 (ms) "
            "| TBT p50 (ms) | TBT p99 (ms) | ours/this goodput |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    systems, workloads = axes(runs)
    for w in workloads:
        ours = spread(runs, OURS, w, "goodput_rps")
        for sys_ in systems:
            cell = runs.get((sys_, w))
            if not cell:
                continue
            g = spread(runs, sys_, w, "goodput_rps")
            ms = {a: spread(runs, sys_, w, a) for a in ("ttft_p50_s", "ttft_p99_s",
                                                         "tbt_p50_s", "tbt_p99_s")}
            vs = "" if sys_ == OURS else (f"{ratio(ours.median, g.median):.2f}"
                                          + ("*" if beyond(ours, g) else ""))
            rows.append(f"| {w} | {sys_} | {len(cell)} | {sum(s.ok for s in cell)}/"
                        f"{sum(s.n for s in cell)} | {g.median:.2f} [{g.lo:.2f}-{g.hi:.2f}] | "
                        + " | ".join(_ms(v) for v in ms.values()) + f" | {vs} |")
    return "\n".join(rows) + "\n"


def _ms(s: Spread) -> str:
    return f"{s.median * 1e3:.0f} [{s.lo * 1e3:.0f}-{s.hi * 1e3:.0f}]"


def plot(runs: Runs, path_png: str | Path) -> None:
    """Goodput and TTFT p99 per system, grouped by workload: bars at the median, error bars
    from the lowest to the highest repetition."""
    plt = pyplot()
    systems, workloads = axes(runs)
    fig, axs = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / max(len(systems), 1)
    x = np.arange(len(workloads))
    panels = [("goodput_rps", "goodput (req/s meeting both SLOs)", "higher is better"),
              ("ttft_p99_s", "TTFT p99 (s)", "lower is better")]
    for ax, (attr, label, better) in zip(axs, panels, strict=True):
        for i, sys_ in enumerate(systems):
            sp = [spread(runs, sys_, w, attr) for w in workloads]
            med = np.array([s.median for s in sp])
            err = np.array([[s.median - s.lo for s in sp], [s.hi - s.median for s in sp]])
            ax.bar(x + (i - (len(systems) - 1) / 2) * width, med, width, label=sys_,
                   yerr=err, capsize=2, error_kw={"lw": 0.8})
        ax.set_xticks(x, workloads)
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' (')[0]}: {better} (median, min-max of the repetitions)",
                     fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axs[0].legend(fontsize=7)
    save_png(plt, fig, path_png)


def worst_vs_best(runs: Runs) -> tuple[float, str]:
    """The minimum over workloads of our goodput over the best other arm's there (medians),
    and that workload."""
    systems, workloads = axes(runs)
    worst, where = math.nan, ""
    for w in workloads:
        others = [spread(runs, s, w, "goodput_rps").median for s in systems if s != OURS]
        others = [o for o in others if not math.isnan(o)]
        if not others:
            continue
        r = ratio(spread(runs, OURS, w, "goodput_rps").median, max(others))
        if math.isnan(worst) or r < worst:
            worst, where = r, w
    return worst, where


def summary_line(runs: Runs, *, overhead_ms: float, router_overhead_ms: float) -> str:
    """The run's last line: `worst_vs_best` (see `worst_vs_best`), ours over each arm on the
    shared-prefix workload (goodput medians), vllm-router P/D's TTFT p99 over ours (medians;
    above 1 is better for us), and the added latencies (medians over the repetitions)."""
    def goodput_vs(other: str) -> float:
        return ratio(spread(runs, OURS, SHARED_PREFIX, "goodput_rps").median,
                     spread(runs, other, SHARED_PREFIX, "goodput_rps").median)

    values = {
        "worst_vs_best": worst_vs_best(runs)[0],
        "goodput_vs_rr": goodput_vs("round_robin"),
        "goodput_vs_vllm_router": goodput_vs("vllm_router"),
        "goodput_vs_vllm_router_dp": goodput_vs("vllm_router_dp"),
        "goodput_vs_colocated": goodput_vs("colocated"),
        "ttft_p99_vs_vllm_router": ratio(
            spread(runs, "vllm_router", SHARED_PREFIX, "ttft_p99_s").median,
            spread(runs, OURS, SHARED_PREFIX, "ttft_p99_s").median),
        "overhead_ms": overhead_ms,
        "vllm_router_overhead_ms": router_overhead_ms,
    }
    return "e2e " + " ".join(f"{k}={v:.2f}" for k, v in values.items())


def break_even(rows: list[dict]) -> int | None:
    """The prewarm experiment: the smallest N whose median amortised cost with a prewarm is
    at most the one without (None: no N tried)."""
    for n in sorted({r["n"] for r in rows}):
        warm = statistics.median(r["prewarm"]["amortised_ms"] for r in rows if r["n"] == n)
        cold = statistics.median(r["no_prewarm"]["amortised_ms"] for r in rows if r["n"] == n)
        if warm <= cold:
            return n
    return None
