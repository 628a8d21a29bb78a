"""Metrics, the summary and the last line."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections import Counter
from dataclasses import asdict

import httpx

from benchmarks.chaos.config import (
    BLOCK_SIZE,
    CLASSES,
    DTYPE,
    LOGPROB_TOL,
    MAX_MODEL_LEN,
    MAX_TOKENS,
)
from benchmarks.chaos.faults import Chaos
from benchmarks.chaos.traffic import TIE_EPS, Result


def scrape(url: str) -> dict[str, float]:
    """The counters the report needs from the conductor's /metrics (0 when absent)."""
    out = {"stream_migrations": 0.0, "fallbacks_total": 0.0, "retries_total": 0.0}
    by_label: dict[str, dict[str, float]] = {"fallbacks": {}, "retries": {}, "requests": {}}
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as e:
        print(f"warning: /metrics not scraped: {e}", file=sys.stderr)
        return {**out, "scraped": False}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "kvcluster_stream_migrations_total":
            out["stream_migrations"] += value
        elif name == "kvcluster_fallbacks_total":
            out["fallbacks_total"] += value
            by_label["fallbacks"][labels] = value
        elif name == "kvcluster_retries_total":
            out["retries_total"] += value
            by_label["retries"][labels] = value
        elif name == "kvcluster_requests_total":
            by_label["requests"][labels] = value
    return {**out, **{f"{k}_by_label": v for k, v in by_label.items()}, "scraped": True}


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _group_key(cls: str, status: int, detail: str) -> str:
    generic = re.sub(r"\b(chaos|cmpl)-\d+\b", r"\1-N", detail)
    generic = re.sub(r"(prefill|decode)-(s?)\d+", r"\1-\2N", generic)
    generic = re.sub(r"\d+(\.\d+)?", "N", generic)
    return f"{cls} {status}: {generic[:240]}"


def summarize(results: list[Result], chaos: Chaos, metrics: dict, args: argparse.Namespace,
              elapsed: float, stalled: int = 0) -> dict:
    counts = Counter(r.cls for r in results)
    ok = [r for r in results if r.cls == "ok"]
    lat = [r.t_end - r.t_start for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    groups: dict[str, dict] = {}
    for r in results:
        if r.cls == "ok":
            continue
        g = groups.setdefault(_group_key(r.cls, r.status, r.detail),
                              {"count": 0, "example": r.detail, "requests": []})
        g["count"] += 1
        if len(g["requests"]) < 20:
            g["requests"].append(r.index)
    per_fault = []
    for w in chaos.windows:
        # every request in flight at some point between the fault and its recovery (+5 s)
        hit = [r for r in results if r.t_start <= w["end"] + 5.0 and r.t_end >= w["start"]]
        per_fault.append({"fault": w["fault"], "start_s": round(w["start"], 2),
                          "recovered_s": round(w["end"], 2), "requests_overlapping": len(hit),
                          "classes": dict(Counter(r.cls for r in hit))})
    drift = [r.logprob_drift for r in ok]
    return {
        "command": "python -m benchmarks.chaos " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"requests": args.requests, "concurrency": args.concurrency,
                   "seed": args.seed, "deadline_s": args.deadline_s, "faults": args.faults,
                   "slo_ms": args.slo_ms, "lease_ttl_s": args.lease_ttl,
                   "health_interval_s": args.health_interval,
                   "workers": {"prefill": 2, "decode": 2}, "block_size": BLOCK_SIZE,
                   "max_model_len": MAX_MODEL_LEN, "dtype": DTYPE, "max_tokens": MAX_TOKENS},
        "elapsed_s": round(elapsed, 1),
        "total": len(results),
        "classes": {c: counts.get(c, 0) for c in CLASSES},
        "by_mode": {mode: dict(Counter(r.cls for r in results if r.stream == (mode == "stream")))
                    for mode in ("stream", "non_stream")},
        "latency_ok_s": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)},
        "ttft_ok_stream_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "logprob_drift_ok": {"tolerance": LOGPROB_TOL,
                             "over_tolerance": sum(d > LOGPROB_TOL for d in drift),
                             "max": max(drift, default=0.0)},
        "ok_by_tie": [{"request": r.index, "position": r.tie_at} for r in results
                      if r.cls == "ok" and r.tie_at is not None],
        "migrated": int(metrics.get("stream_migrations", 0)),
        "stalled": stalled,
        "fallbacks_total": int(metrics.get("fallbacks_total", 0)),
        "retries_total": int(metrics.get("retries_total", 0)),
        "metrics": metrics,
        "timeline": chaos.timeline,
        "per_fault": per_fault,
        "errors": dict(sorted(groups.items(), key=lambda kv: -kv[1]["count"])),
        "requests": [asdict(r) for r in results],
    }


def print_summary(s: dict) -> None:
    print("\n== fault timeline ==")
    for e in s["timeline"]:
        print(f"  t={e['t']:7.1f}s  sent={e['sent']:4d}  {e['fault']:8s} {e['action']:15s} "
              f"{e['detail']}")
    print("\n== per fault (requests in flight from the fault to 5 s after its recovery) ==")
    for f in s["per_fault"]:
        classes = " ".join(f"{c}={n}" for c, n in sorted(f["classes"].items()))
        print(f"  {f['fault']:8s} {f['start_s']:7.1f}s -> {f['recovered_s']:7.1f}s  "
              f"{f['requests_overlapping']:4d} requests: {classes}")
    print("\n== classes ==")
    print(f"  {'class':12s} {'all':>6s} {'stream':>7s} {'non-str':>7s}")
    for c in CLASSES:
        print(f"  {c:12s} {s['classes'][c]:6d} {s['by_mode']['stream'].get(c, 0):7d} "
              f"{s['by_mode']['non_stream'].get(c, 0):7d}")
    lat, ttft = s["latency_ok_s"], s["ttft_ok_stream_s"]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"
    print(f"\n  ok latency p50 {fmt(lat['p50'])} p99 {fmt(lat['p99'])}; "
          f"ok stream TTFT p50 {fmt(ttft['p50'])} p99 {fmt(ttft['p99'])}")
    d = s["logprob_drift_ok"]
    print(f"  ok answers with a logprob off the reference by > {d['tolerance']}: "
          f"{d['over_tolerance']} (max {d['max']:.2e})")
    print(f"  ok answers that took the other side of an exact tie (|logprob difference| <= "
          f"{TIE_EPS}): {len(s['ok_by_tie'])} {s['ok_by_tie']}")
    print(f"  conductor: stream migrations {s['migrated']}, fall-backs {s['fallbacks_total']}, "
          f"retries {s['retries_total']}; elapsed {s['elapsed_s']}s")
    if s["errors"]:
        print("\n== not ok, grouped ==")
        for key, g in list(s["errors"].items())[:15]:
            print(f"  {g['count']:4d}  {key}")


