"""Request traces in Mooncake's format: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (chained prefix-block ids, 512 tokens each)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

TRACE_BLOCK = 512
"""Tokens per block of the trace's `hash_ids`."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """Trace blocks (512 tokens), chained: equal ids mean equal whole prefixes."""


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace; requests sorted by arrival."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]),
                                    max(int(r["output_length"]), 1), tuple(r["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    return sorted(out, key=lambda r: r.arrival_s)


def block_hashes(req: TraceRequest, block_size: int) -> tuple[int, ...]:
    """The request's blocks at `block_size` tokens (which must divide 512): trace block `h`
    becomes sub-blocks `h * k + j`, as many as `ceil(input_length / block_size)`."""
    if TRACE_BLOCK % block_size:
        raise ValueError(f"block_size must divide {TRACE_BLOCK}: {block_size}")
    k = TRACE_BLOCK // block_size
    n = -(-req.input_length // block_size)
    if k == 1:
        return req.hash_ids[:n]
    return tuple(h * k + j for h in req.hash_ids for j in range(k))[:n]


def time_scaled(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrivals at `factor` times the trace's rate (2.0: twice the load)."""
    if factor <= 0:
        raise ValueError(f"factor must be positive: {factor}")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in trace]


def thinned_reuse(trace: list[TraceRequest], keep: float, seed: int = 1) -> list[TraceRequest]:
    """Less prefix reuse: each request keeps its ids with probability `keep`, else all its
    blocks get fresh ids never seen elsewhere (keep=0: no request shares anything)."""
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep must be in [0, 1]: {keep}")
    fresh = max((h for r in trace for h in r.hash_ids), default=0) + 1
    out = []
    for i, r in enumerate(trace):
        x = ((i + seed) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        if (x >> 11) / float(1 << 53) < keep:
            out.append(r)
            continue
        ids = tuple(range(fresh, fresh + len(r.hash_ids)))
        fresh += len(ids)
        out.append(replace(r, hash_ids=ids))
    return out


def ideal_hit_ratio(trace: list[TraceRequest], block_size: int = TRACE_BLOCK) -> float:
    """Prompt tokens whose whole prefix block appeared in an earlier request, over all prompt
    tokens, with an unlimited cache: the trace's own reuse, independent of any cluster."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        hashes = block_hashes(r, block_size)
        k = 0
        while k < len(hashes) and hashes[k] in seen:
            k += 1
        hit += min(k * block_size, r.input_length)
        total += r.input_length
        seen.update(hashes)
    return hit / total if total else 0.0
