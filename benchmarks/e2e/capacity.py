"""`make bench-capacity`: how much load each arm carries within the SLOs, from a sweep of
arrival rates (`bench-e2e --rates`).

bench-e2e's goodput is measured at one arrival rate (1 request/s), where every arm serves what
arrives and no ratio between arms can exceed the spread by much. A capacity says what the
arms are worth under load, the way DistServe and Mooncake count it: the highest arrival rate
at which at least `ATTAINMENT` of the requests meet both SLOs.

- A workload run at rate r is named `<workload>@<r>` (`rated`, `parse_rated`).
- One repetition's capacity: the highest rate tried at which that repetition, and every lower
  rate tried, reached `ATTAINMENT`; 0 when even the lowest did not. An arm's capacity is the
  median over the repetitions; the table and plot keep each rate's attainment and goodput.
- The rates tried bound the answer: a capacity equal to the highest rate tried means "at
  least", and a ratio between capacities is only as fine as the steps between rates.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from benchmarks.e2e.report import pyplot, ratio, save_png
from benchmarks.e2e.spread import OURS, Runs, axes, spread

ATTAINMENT = 0.9
"""The share of requests that must meet both SLOs (DistServe's 90%)."""


def rated(workload: str, rate_rps: float) -> str:
    return f"{workload}@{rate_rps:g}"


def parse_rated(name: str) -> tuple[str, float] | None:
    """(`workload`, rate) of a `rated` name; None for a name without a rate."""
    workload, sep, rate = name.rpartition("@")
    if not sep:
        return None
    try:
        return workload, float(rate)
    except ValueError:
        return None


def _rates(runs: Runs, workload: str) -> list[tuple[float, str]]:
    """(rate, cell name) of `workload`'s rated cells, by rate."""
    found = {}
    for name in axes(runs)[1]:
        parsed = parse_rated(name)
        if parsed is not None and parsed[0] == workload:
            found[parsed[1]] = name
    return sorted(found.items())


def per_rep(runs: Runs, system: str, workload: str) -> list[float]:
    """Each repetition's capacity (see the module doc)."""
    cells = [(r, runs.get((system, name), [])) for r, name in _rates(runs, workload)]
    reps = max((len(c) for _, c in cells), default=0)
    out = []
    for i in range(reps):
        best = 0.0
        for rate, cell in cells:
            if i >= len(cell) or not cell[i].slo_attainment >= ATTAINMENT:
                break
            best = rate
        out.append(best)
    return out


def capacity(runs: Runs, system: str, workload: str) -> float:
    """The median of the repetitions' capacities; nan when the arm was not swept."""
    reps = per_rep(runs, system, workload)
    return statistics.median(reps) if reps else math.nan


def _top(runs: Runs, workload: str) -> float:
    rates = _rates(runs, workload)
    return rates[-1][0] if rates else math.nan


def markdown_table(runs: Runs, workload: str) -> str:
    """One row per arm: SLO attainment and goodput at each rate (medians over the repetitions
    with [min-max]) and the capacity with each repetition's in brackets."""
    rates = _rates(runs, workload)
    top = _top(runs, workload)
    systems = axes(runs)[0]
    rows = ["| system | " + " | ".join(f"{r:g} req/s: attainment, goodput" for r, _ in rates)
            + " | capacity req/s |",
            "| --- | " + " | ".join("---:" for _ in rates) + " | ---: |"]
    for sys_ in systems:
        cells = []
        for _, name in rates:
            a = spread(runs, sys_, name, "slo_attainment")
            g = spread(runs, sys_, name, "goodput_rps")
            cells.append(f"{a.median:.0%} [{a.lo:.0%}-{a.hi:.0%}], {g}" if a.n else "")
        reps = ", ".join(f"{c:g}" for c in per_rep(runs, sys_, workload))
        c = capacity(runs, sys_, workload)
        rows.append(f"| {sys_} | " + " | ".join(cells)
                    + f" | {'>=' if c == top else ''}{c:g} [{reps}] |")
    return "\n".join(rows) + "\n"


def summary_line(runs: Runs, workload: str) -> str:
    """`capacity <arm>=<req/s> ...` for every arm swept, then ours over each other arm's; a
    capacity at the highest rate tried, and a ratio over it, read ">=" (at least)."""
    systems = axes(runs)[0]
    top = _top(runs, workload)
    caps = {s: capacity(runs, s, workload) for s in systems}
    parts = [f"{s}{'>=' if c == top else '='}{c:g}" for s, c in caps.items()]
    if OURS in caps:
        rel = ">=" if caps[OURS] == top else "="
        parts += [f"ours_vs_{s}{rel}{ratio(caps[OURS], c):.2f}" for s, c in caps.items()
                  if s != OURS]
    return f"capacity {workload} (>= {ATTAINMENT:.0%} within the SLOs) " + " ".join(parts)


def plot(runs: Runs, workload: str, path_png: str | Path) -> None:
    """SLO attainment and goodput against the arrival rate, one line per arm: medians with
    min-max error bars over the repetitions."""
    plt = pyplot()
    rates = _rates(runs, workload)
    fig, axs = plt.subplots(1, 2, figsize=(12, 4.4))
    panels = [("slo_attainment", "SLO attainment (share of requests)"),
              ("goodput_rps", "goodput (req/s meeting both SLOs)")]
    x = np.array([r for r, _ in rates])
    for ax, (attr, label) in zip(axs, panels, strict=True):
        for sys_ in axes(runs)[0]:
            sp = [spread(runs, sys_, name, attr) for _, name in rates]
            med = np.array([s.median for s in sp])
            err = np.array([[s.median - s.lo for s in sp], [s.hi - s.median for s in sp]])
            ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=sys_)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axs[0].axhline(ATTAINMENT, color="grey", ls="--", lw=0.8)
    axs[1].plot(x, x, color="grey", ls=":", lw=0.8, label="arrival rate")
    axs[0].legend(fontsize=7)
    axs[0].set_title(f"{workload}: SLO attainment by arrival rate", fontsize=9)
    axs[1].set_title(f"{workload}: goodput by arrival rate", fontsize=9)
    save_png(plt, fig, path_png)
