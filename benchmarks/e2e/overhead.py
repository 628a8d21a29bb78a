"""The latency a system adds to a request (`overhead_ms`), measured on the idle system, and for
our arms where it goes, from the conductor's own timeline of the same requests."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks import conductor_log
from benchmarks.e2e import systems

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def measure(run: systems.Running, pairs: int = 50) -> dict[str, float]:
    """Latency of a 1-token request through the system minus straight to an engine (the one
    that served it, where the system says), the median over pairs sent back to back (the
    machine's speed drifts between pairs by more than the hop costs): `ms` with a lean client
    (`systems.LeanHttp`, whose own cost is close to the direct gRPC call's), and `httpx_ms`
    with httpx through the system (the figure before 2026-11-25: it charged httpx's own
    ~0.5-1.5 ms to the conductor and not to vllm-router, measured with httpx both ways).
    With a conductor log, also `split`'s figures for the lean requests (`where`)."""
    import httpx

    if run.direct is None:
        return {}
    body = {"model": run.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    lean, heavy, direct, ids = [], [], [], []
    http = systems.LeanHttp(run.url)
    try:
        with httpx.Client(timeout=60) as c:
            for i in range(pairs + 3):
                t, request_id = http.post("/v1/completions", body)
                t0 = time.perf_counter()
                c.post(f"{run.url}/v1/completions", json=body).raise_for_status()
                h = time.perf_counter() - t0
                d = run.direct(PROMPT, request_id)
                if i >= 3:  # the first rounds warm every path's caches
                    lean.append(t)
                    heavy.append(h)
                    direct.append(d)
                    ids.append(request_id)
    finally:
        http.close()

    def paired(through: list[float]) -> float:
        return statistics.median(t - d for t, d in zip(through, direct, strict=True)) * 1e3

    out = {"ms": paired(lean), "httpx_ms": paired(heavy),
           "unpaired_ms": (statistics.median(lean) - statistics.median(direct)) * 1e3,
           "direct_ms": statistics.median(direct) * 1e3}
    log = run.logs / "conductor.log" if run.logs is not None else None
    if log is not None and log.exists():
        time.sleep(0.5)  # the last request's line is written once its answer is out
        out.update(split(log, {i: (t, d) for i, t, d in zip(ids, lean, direct, strict=True)}))
    return out


WHERE = ("accept", "parse", "route", "rpc_vs_direct", "answer", "conductor", "hop")
"""`split`'s figures (ms, medians over the requests), in the order a request meets them."""


def split(log: Path, probes: dict[str | None, tuple[float, float]]) -> dict[str, float]:
    """Where the lean requests' added latency went, from their `timeline` lines in the
    conductor's log (`probes`: request id -> (seconds through the system, seconds direct)):
    `accept`, `parse`, `route` and `answer` are the conductor's stages (`conductor.timeline`);
    `conductor` is everything the conductor did on the request's path but its engine RPC
    (arrival to the answer written, less the RPC from its send to the first chunk);
    `rpc_vs_direct` is that RPC less the benchmark's own direct call; `hop` is the client's
    time less arrival-to-answer: the HTTP hop both ways, the client's own work and the
    wake-ups between processes. The three add up to the request's added latency
    (`where_sum_ms`: the sum of their medians, beside the paired median `ms`)."""
    per: dict[str, list[float]] = {k: [] for k in WHERE}
    for f in conductor_log.events(log, "timeline"):
        if f.get("request_id") not in probes:
            continue
        try:
            st = {k: float(f[f"{k}_ms"]) for k in ("ttft", "decode_start", "answer")}
            stages = {k: float(f.get(f"{k}_ms", 0.0)) for k in ("accept", "parse", "route")}
            decode = float(f.get("decode_ms", 0.0))
        except (KeyError, ValueError):
            continue  # a line from before these stages existed, or not a probe's
        through, direct = probes[f["request_id"]]
        server = st["ttft"] + decode + st["answer"]
        for k, v in stages.items():
            per[k].append(v)
        per["answer"].append(st["answer"])
        per["conductor"].append(server - st["decode_start"])
        per["rpc_vs_direct"].append(st["decode_start"] - direct * 1e3)
        per["hop"].append(through * 1e3 - server)
    if not per["hop"]:
        return {}
    out = {f"where_{k}_ms": statistics.median(v) for k, v in per.items() if v}
    out["where_sum_ms"] = sum(out[f"where_{k}_ms"] for k in ("conductor", "rpc_vs_direct", "hop"))
    out["where_n"] = float(len(per["hop"]))
    return out


def describe(o: dict[str, float]) -> str:
    """`split`'s figures for a progress line ("" without them)."""
    if "where_hop_ms" not in o:
        return ""
    parts = ", ".join(f"{k} {o[f'where_{k}_ms']:.2f}" for k in WHERE if f"where_{k}_ms" in o)
    return f"; where (ms, medians): {parts}"
