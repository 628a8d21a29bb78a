"""The tenant flood, after the fault schedule: one tenant sends far over the limit the operator
gave it while another sends interactive traffic, first alone, then beside the flood.

- Three tenants by API key: `ops` (the fault schedule's traffic), `interactive` and `flood`.
  The operator's limits (`--tenant-limits-file`): `flood` may have `FLOOD_CONCURRENCY`
  request in flight, in the `batch` class; the others have no limits.
- `interactive` sends the same kind of requests as the fault schedule, paced one every
  `gap_s`, once alone (its solo run) and once while `FLOOD_SENDERS` senders of `flood` each
  send again as soon as their last answer came (after a refusal, `FLOOD_PAUSE_S` later: a
  client that ignores `Retry-After`, without spinning a core).
- Goodput: `interactive`'s answers that are right (the reference's tokens) and meet the
  conductor's default SLOs (`ConductorConfig.ttft_slo_s`, `tbt_slo_s`; a non-streamed answer
  its TTFT SLO plus one TBT SLO per token), per second from its first request sent to its last
  answer. `tenant_isolation` = goodput beside the flood / goodput alone. The two runs send
  prompts drawn alike from different seeds, so neither finds the other's prefixes cached.
- Every `flood` answer is classified like any other (ok, clean_error, ...); a refusal counts as
  one only with `Retry-After` and the reason header.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import httpx

from benchmarks.chaos.traffic import Req, Result, build_requests, run_one
from conductor.config import ConductorConfig

TENANTS = ("ops", "interactive", "flood")
FLOOD_CONCURRENCY = 1
FLOOD_SENDERS = 8
FLOOD_PAUSE_S = 0.25
FLOOD_PROMPTS = 8
"""Distinct prompts the flood cycles through (each checked against the reference)."""


def _default(name: str) -> float:
    return next(f.default for f in fields(ConductorConfig) if f.name == name)


TTFT_SLO_S = _default("ttft_slo_s")
TBT_SLO_S = _default("tbt_slo_s")


@dataclass(frozen=True)
class Plan:
    keys: dict[str, str]
    """tenant -> its API key."""
    conductor_args: tuple[str, ...]
    solo: list[Req]
    beside: list[Req]
    flood: list[Req]

    def prompts(self) -> list[tuple[int, ...]]:
        return [r.prompt for r in (*self.solo, *self.beside, *self.flood)]


def plan(run_dir: Path, n: int, seed: int, vocab: int) -> Plan:
    """The API keys and limits files in `run_dir`, and the three request sets."""
    keys = {t: secrets.token_urlsafe(24) for t in TENANTS}
    keys_file, limits_file = run_dir / "api-keys", run_dir / "tenant-limits.toml"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in keys.items()))
    keys_file.chmod(0o600)
    limits_file.write_text(f'[tenants.flood]\nmax_concurrency = {FLOOD_CONCURRENCY}\n'
                           f'priority = "batch"\n')

    def renumber(reqs: list[Req], base: int) -> list[Req]:
        return [Req(base + r.index, r.prompt, r.max_tokens, r.stream, r.group) for r in reqs]

    return Plan(keys, ("--api-keys-file", str(keys_file), "--tenant-limits-file",
                       str(limits_file)),
                solo=renumber(build_requests(n, seed + 101, vocab), 10_000),
                beside=renumber(build_requests(n, seed + 102, vocab), 20_000),
                flood=renumber(build_requests(FLOOD_PROMPTS, seed + 103, vocab), 30_000))


def client(key: str, connections: int) -> httpx.Client:
    """One connection per request (the fault schedule's client too), with the tenant's key
    ("": none)."""
    return httpx.Client(headers={"Authorization": f"Bearer {key}"} if key else {},
                        limits=httpx.Limits(max_connections=connections + 4,
                                            max_keepalive_connections=0))


def meets_slo(r: Result) -> bool:
    if r.cls != "ok":
        return False
    if r.stream and r.ttft is not None:
        tbt = (r.t_end - r.t_start - r.ttft) / max(r.tokens - 1, 1)
        return r.ttft <= TTFT_SLO_S and tbt <= TBT_SLO_S
    return r.t_end - r.t_start <= TTFT_SLO_S + r.tokens * TBT_SLO_S


def goodput(results: list[Result]) -> dict:
    span = max(r.t_end for r in results) - min(r.t_start for r in results)
    good = sum(meets_slo(r) for r in results)
    return {"requests": len(results), "good": good, "span_s": round(span, 2),
            "goodput_rps": round(good / span, 4) if span > 0 else 0.0,
            "classes": dict(Counter(r.cls for r in results))}


def _paced(url: str, key: str, reqs: list[Req], refs: dict, gap_s: float, deadline_s: float,
           slo_ms: float) -> list[Result]:
    t0 = time.monotonic()
    with client(key, len(reqs)) as c, ThreadPoolExecutor(len(reqs)) as pool:
        def one(i: int, req: Req) -> Result:
            time.sleep(max(0.0, t0 + i * gap_s - time.monotonic()))
            return run_one(c, url, req, refs[req.prompt], deadline_s, t0, slo_ms)
        return list(pool.map(one, range(len(reqs)), reqs))


def _flood(url: str, key: str, reqs: list[Req], refs: dict, stop: threading.Event,
           deadline_s: float, slo_ms: float, out: list[Result]) -> None:
    lock = threading.Lock()
    t0 = time.monotonic()

    def sender(k: int) -> None:
        with client(key, 1) as c:
            n = k
            while not stop.is_set():
                req = reqs[n % len(reqs)]
                n += FLOOD_SENDERS
                res = run_one(c, url, req, refs[req.prompt], deadline_s, t0, slo_ms)
                with lock:
                    out.append(res)
                if res.status == 429:
                    stop.wait(FLOOD_PAUSE_S)

    threads = [threading.Thread(target=sender, args=(k,), daemon=True)
               for k in range(FLOOD_SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(url: str, p: Plan, refs: dict, gap_s: float, deadline_s: float, slo_ms: float) -> dict:
    """Both runs; the summary (`tenant_isolation` and the flood's answers)."""
    print(f"tenant flood: {len(p.solo)} interactive requests alone, one every {gap_s}s ...",
          flush=True)
    solo = _paced(url, p.keys["interactive"], p.solo, refs, gap_s, deadline_s, slo_ms)
    print(f"tenant flood: again beside {FLOOD_SENDERS} senders of a tenant limited to "
          f"{FLOOD_CONCURRENCY} in flight ...", flush=True)
    stop = threading.Event()
    flood: list[Result] = []
    flooder = threading.Thread(target=_flood, args=(url, p.keys["flood"], p.flood, refs, stop,
                                                    deadline_s, slo_ms, flood), daemon=True)
    flooder.start()
    try:
        beside = _paced(url, p.keys["interactive"], p.beside, refs, gap_s, deadline_s, slo_ms)
    finally:
        stop.set()
        flooder.join()
    alone, with_flood = goodput(solo), goodput(beside)
    refused = [r for r in flood if r.status == 429]
    isolation = (with_flood["goodput_rps"] / alone["goodput_rps"]) if alone["goodput_rps"] \
        else 0.0
    return {
        "slo_s": {"ttft": TTFT_SLO_S, "tbt": TBT_SLO_S},
        "gap_s": gap_s,
        "interactive_alone": alone,
        "interactive_beside_flood": with_flood,
        "tenant_isolation": round(isolation, 3),
        "flood": {"limit_in_flight": FLOOD_CONCURRENCY, "senders": FLOOD_SENDERS,
                  "answers": len(flood), "classes": dict(Counter(r.cls for r in flood)),
                  "refused_429": len(refused),
                  "refused_with_retry_after_and_reason": sum(bool(r.refusal) for r in refused),
                  "reasons": dict(Counter(r.refusal.partition("/")[2] for r in refused))},
        "hung": sum(r.cls == "hung" for r in (*solo, *beside, *flood)),
        "lost": sum(r.cls == "lost" for r in (*solo, *beside, *flood)),
        "wrong": sum(r.cls == "wrong" for r in (*solo, *beside, *flood)),
    }


def print_summary(t: dict) -> None:
    a, b, f = t["interactive_alone"], t["interactive_beside_flood"], t["flood"]
    print("\n== tenant flood ==")
    print(f"  interactive alone:       {a['good']}/{a['requests']} within SLO in {a['span_s']}s "
          f"({a['goodput_rps']} req/s) {a['classes']}")
    print(f"  interactive beside flood: {b['good']}/{b['requests']} within SLO in "
          f"{b['span_s']}s ({b['goodput_rps']} req/s) {b['classes']}")
    print(f"  flood (limit {f['limit_in_flight']} in flight, {f['senders']} senders): "
          f"{f['answers']} answers {f['classes']}; 429: {f['refused_429']} "
          f"({f['refused_with_retry_after_and_reason']} with Retry-After and reason: "
          f"{f['reasons']})")
    print(f"  tenant_isolation={t['tenant_isolation']} hung={t['hung']} lost={t['lost']} "
          f"wrong={t['wrong']}")
