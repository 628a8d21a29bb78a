"""How right the conductor's admission is: each request's predicted TTFT (its `routed` log line,
or the figure in a `rejected` line's reason) against the TTFT it then had (its `timeline`
line), binned by the prediction. Admission answers 429 when the prediction exceeds the TTFT
SLO, so a prediction that runs high there turns away requests another arm serves in time.

`python -m benchmarks.e2e.calibration CONDUCTOR_LOG...` prints the table for whole logs (the
benchmark's own probes included); `make bench-e2e` counts only the requests its workloads
sent (`read_spans`).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import conductor_log
from benchmarks.e2e.report import percentile

BINS_S = (0.0, 0.3, 1.0, 2.0, 5.0, math.inf)
"""Bin edges of the predicted TTFT (seconds); 5 s is the benchmark's TTFT SLO."""

_REJECTED = re.compile(r"predicted TTFT ([0-9.]+)s")


@dataclass(frozen=True)
class Prediction:
    request_id: str
    predicted_ttft_s: float
    actual_ttft_s: float | None
    """None: rejected, or never answered with a first token."""
    rejected: bool = False


def read(lines: Iterable[str]) -> list[Prediction]:
    """The requests routed or rejected in these conductor log lines (rejected ones first)."""
    return split((("", line) for line in lines), ("",))[""]


def read_spans(path: Path, spans: Mapping[str, tuple[int, int]]) -> dict[str, list[Prediction]]:
    """The requests decided (routed or rejected) within each named span [start, end) of the
    log's byte offsets."""
    def span_of(offset: int) -> str | None:
        return next((n for n, (a, b) in spans.items() if a <= offset < b), None)

    return split(((span_of(offset), line) for offset, line in conductor_log.lines(path)),
                 tuple(spans))


def split(lines: Iterable[tuple[str | None, str]], names: Sequence[str]
          ) -> dict[str, list[Prediction]]:
    """`lines`, each with the name of the part it belongs to (None: none of `names`): the
    requests decided in each part, each paired with its TTFT wherever in the log its `timeline`
    line is (written after the answer, it can fall in the next part)."""
    routed: dict[str, tuple[str, float]] = {}
    actual: dict[str, float] = {}
    out: dict[str, list[Prediction]] = {name: [] for name in names}
    for name, line in lines:
        event, kv = conductor_log.parse(line)
        rid = kv.get("request_id", "")
        if event == "timeline" and kv.get("status") == "200" and "ttft_ms" in kv:
            actual[rid] = float(kv["ttft_ms"]) / 1e3
        elif name is None:
            continue
        elif event == "routed" and "predicted_ttft_s" in kv:
            routed.setdefault(rid, (name, float(kv["predicted_ttft_s"])))
        elif event == "rejected" and (m := _REJECTED.search(kv.get("reason", ""))):
            out[name].append(Prediction(rid, float(m.group(1)), None, rejected=True))
    for rid, (name, predicted) in routed.items():
        out[name].append(Prediction(rid, predicted, actual.get(rid)))
    return out


@dataclass(frozen=True)
class Bin:
    lo: float
    hi: float
    served: int
    rejected: int
    ratio_p10: float
    ratio_median: float
    ratio_p90: float
    """Actual TTFT over predicted, of the requests served in this bin."""


def bins(preds: Sequence[Prediction]) -> list[Bin]:
    out = []
    for lo, hi in zip(BINS_S, BINS_S[1:], strict=False):
        inside = [p for p in preds if lo <= p.predicted_ttft_s < hi]
        ratios = [p.actual_ttft_s / p.predicted_ttft_s for p in inside
                  if p.actual_ttft_s is not None and p.predicted_ttft_s > 0]
        rejected = sum(p.rejected for p in inside)
        if ratios or rejected:
            out.append(Bin(lo, hi, len(ratios), rejected, percentile(ratios, 10),
                           percentile(ratios, 50), percentile(ratios, 90)))
    return out


def markdown(cells: Mapping[tuple[str, str], Sequence[Prediction]]) -> str:
    """One row per (system, workload) and bin of predicted TTFT."""
    rows = ["| system | workload | predicted TTFT | served | rejected | actual / predicted "
            "p10 | median | p90 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (system, workload), preds in sorted(cells.items()):
        for b in bins(preds):
            span = f"{b.lo:g}-{b.hi:g} s" if math.isfinite(b.hi) else f">= {b.lo:g} s"
            rows.append(f"| {system} | {workload} | {span} | {b.served} | {b.rejected} | "
                        f"{b.ratio_p10:.2f} | {b.ratio_median:.2f} | {b.ratio_p90:.2f} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python -m benchmarks.e2e.calibration CONDUCTOR_LOG...", file=sys.stderr)
        return 2
    cells = {}
    for arg in argv:
        path = Path(arg)
        cells[(path.parent.name or str(path), "all")] = read(
            path.read_text(errors="replace").splitlines())
    print(markdown(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
