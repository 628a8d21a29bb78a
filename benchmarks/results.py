"""Where the benchmarks write their raw output by default: `results/<benchmark>` at the
repository's root, which git ignores. docs/ keeps only the tables and figures the docs show
(docs/benchmarks.md says how a run's figure is published)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def default_out(name: str) -> str:
    """The default `--out` of the benchmark called `name`."""
    return str(RESULTS / name)
