"""Reading the conductor's log (`cluster.logging`: structlog's console lines, or JSON lines with
`KVCLUSTER_LOG_JSON=1`) in the benchmarks: a line's event and fields, and where a log ends."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

_KV = re.compile(r"(\w+)=('[^']*'|\"[^\"]*\"|\S+)")


def parse(line: str) -> tuple[str, dict[str, str]]:
    """A line's event and its fields as text (quotes around a value with spaces dropped);
    ("", {}) for a line that is not one of the log's records."""
    line = line.strip()
    if line.startswith("{"):
        try:
            rec = json.loads(line)
        except ValueError:
            return "", {}
        return str(rec.get("event", "")), {k: str(v) for k, v in rec.items()}
    _, sep, rest = line.partition("] ")
    if not sep:
        return "", {}
    event, _, fields = rest.strip().partition(" ")
    return event, {k: v.strip("'\"") for k, v in _KV.findall(fields)}


def size(path: Path | None) -> int:
    """Where the next line of a log will start (0: no log)."""
    return path.stat().st_size if path is not None and path.exists() else 0


def lines(path: Path, offset: int = 0) -> Iterator[tuple[int, str]]:
    """The log's lines from byte `offset` on, each with its own offset."""
    with path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            yield offset, raw.decode(errors="replace")
            offset += len(raw)


def events(path: Path, name: str, offset: int = 0) -> Iterator[dict[str, str]]:
    """The fields of every `name` line of the log from byte `offset` on."""
    for _, line in lines(path, offset):
        event, fields = parse(line)
        if event == name:
            yield fields
