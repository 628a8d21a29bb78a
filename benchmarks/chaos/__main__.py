"""`python -m benchmarks.chaos` (`make chaos`): the run (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import chaos
from benchmarks.chaos import tenants
from benchmarks.chaos.config import (
    BLOCK_SIZE,
    CLASSES,
    DTYPE,
    FAULTS,
    MAX_MODEL_LEN,
    STALL_TIMEOUT_S,
)
from benchmarks.chaos.faults import Admin, Chaos, wait_until
from benchmarks.chaos.report import print_summary, scrape, summarize
from benchmarks.chaos.traffic import Req, Result, build_requests, reference, run_one
from benchmarks.results import default_out
from cluster.signals import stop_on_signals
from embedded import ClusterSpec, EmbeddedCluster


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.chaos", description=chaos.__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="run/chaos",
                   help="cluster logs and the cached reference (default: run/chaos)")
    p.add_argument("--json-out", default=default_out("chaos.json"))
    p.add_argument("--model", default=os.environ.get("KVCLUSTER_MODEL", ""),
                   help="local HF model directory (default: the built-in tiny model)")
    p.add_argument("--deadline-s", type=float, default=120.0,
                   help="a request without a complete answer by then is hung")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, run in this order (of {','.join(FAULTS)}; "
                        "empty: none, a baseline)")
    p.add_argument("--slo-ms", type=float, default=600_000.0,
                   help="per-request ttft_slo_ms and tbt_slo_ms (0: the conductor's defaults, "
                        "which reject with 429 when this machine is slow)")
    p.add_argument("--lease-ttl", type=float, default=3.0)
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--tenant-requests", type=int, default=24,
                   help="interactive requests in each run of the tenant flood, after the "
                        "faults (0: no tenant flood)")
    p.add_argument("--tenant-gap-s", type=float, default=1.5,
                   help="seconds between the tenant flood's interactive requests")
    a = p.parse_args(argv)
    a.fault_list = [f for f in a.faults.split(",") if f]
    bad = set(a.fault_list) - set(FAULTS)
    if bad:
        p.error(f"unknown faults {sorted(bad)}; known: {FAULTS}")
    if a.requests < 1 or a.concurrency < 1:
        p.error("--requests and --concurrency must be positive")
    if a.tenant_requests < 0 or a.tenant_gap_s <= 0:
        p.error("--tenant-requests must be >= 0 and --tenant-gap-s positive")
    return a


def silenced(conductor_log: str) -> int:
    """Calls the conductor moved on from because their worker went silent: at the
    inter-token deadline (`decode_stalled`), or cancelled when its health checks went
    unanswered (`instance_lost_calls_cancelled calls=<n>`)."""
    cancelled = sum(int(n) for n in re.findall(
        r"instance_lost_calls_cancelled\W.*?\bcalls=(\d+)", conductor_log))
    return conductor_log.count("decode_stalled") + cancelled


RETRIED_FROM = re.compile(r"\bretry\b(?!_).*?\bfailed=([\w.-]+)")


def before_first(conductor_log: str, instances: list[str]) -> int:
    """Requests moved off `instances` before their first token: the conductor retries a
    request that failed before it (`retry ... failed=<instance>`), and migrates one after it."""
    return sum(m.group(1) in instances for m in RETRIED_FROM.finditer(conductor_log))


def main(argv: list[str] | None = None) -> int:
    from cluster.logging import configure
    from conductor.tokenizer import Tokenizer
    from tinymodel.builder import ensure_model

    args = parse_args(argv)
    configure("chaos", level=os.environ.get("KVCLUSTER_LOG_LEVEL", "WARNING"))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = args.model or str(ensure_model())
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    vocab = Tokenizer(model).vocab_size
    reqs = build_requests(args.requests, args.seed, vocab)
    flood = tenants.plan(run_dir, args.tenant_requests, args.seed, vocab) \
        if args.tenant_requests else None
    distinct = list(dict.fromkeys([*(r.prompt for r in reqs),
                                   *(flood.prompts() if flood else ())]))
    refs = reference(model, distinct, run_dir)

    stop_on_signals()

    n = len(reqs)
    faults = args.fault_list
    at = [int(n * (k + 1) / (len(faults) + 1.5)) for k in range(len(faults))]
    cluster_dir = run_dir / time.strftime("cluster-%Y%m%dT%H%M%S")
    # the operator's SLOs: a request's own only tighten them
    slo = ("--ttft-slo-s", str(args.slo_ms / 1e3), "--tbt-slo-s", str(args.slo_ms / 1e3)) \
        if args.slo_ms > 0 else ()
    spec = ClusterSpec(model=model, prefill=2, decode=2, http_port=0, run_dir=str(cluster_dir),
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype=DTYPE,
                       kv_cache_bytes=256 << 20, pool_segment_bytes=256 << 20,
                       lease_ttl=args.lease_ttl, admin_port=0,
                       conductor_args=("--health-interval-s", str(args.health_interval),
                                       "--stall-timeout-s", str(STALL_TIMEOUT_S), *slo,
                                       *(flood.conductor_args if flood else ())))
    cluster = EmbeddedCluster(spec)
    admin: Admin | None = None
    chaos: Chaos | None = None
    pool: ThreadPoolExecutor | None = None
    results: list[Result] = []
    metrics: dict = {}
    flooded: dict | None = None
    t_traffic = time.monotonic()
    try:
        print(f"starting the cluster: 2 prefill + 2 decode (logs in {cluster_dir}) ...",
              flush=True)
        t0 = time.monotonic()
        cluster.start(timeout=600)
        admin = Admin(cluster)
        if not wait_until(lambda: len(admin.serving()) == 4, 600, every=0.5):
            raise RuntimeError(f"not all 4 workers registered: {admin.serving()}")
        print(f"cluster ready in {time.monotonic() - t0:.0f}s at {cluster.url}; "
              f"{n} requests, concurrency {args.concurrency}, faults {faults or 'none'} "
              f"at requests {at}", flush=True)

        t_traffic = time.monotonic()
        chaos = Chaos(cluster, admin, faults, at, n, args.concurrency, args.lease_ttl, t_traffic)
        chaos.thread.start()
        # a connection per request: a pooled one the server closed while idle would show as
        # a reset that no fault caused
        client = tenants.client(flood.keys["ops"] if flood else "", args.concurrency)
        slots = threading.Semaphore(args.concurrency)
        lock = threading.Lock()
        tally: Counter[str] = Counter()
        every = max(1, n // 20)

        def task(req: Req) -> Result:
            try:
                res = run_one(client, cluster.url, req, refs[req.prompt], args.deadline_s,
                              t_traffic, args.slo_ms)
            finally:
                slots.release()
            with lock:
                results.append(res)
                tally[res.cls] += 1
                chaos.done_one()
                if len(results) % every == 0 or len(results) == n:
                    print(f"[t={time.monotonic() - t_traffic:7.1f}s] {len(results)}/{n} done: "
                          + " ".join(f"{c}={tally[c]}" for c in CLASSES), flush=True)
            return res

        pool = ThreadPoolExecutor(args.concurrency, thread_name_prefix="client")
        futures = []
        for req in reqs:
            chaos.before_send(req.index)
            slots.acquire()
            futures.append(pool.submit(task, req))
            chaos.sent_one()
        for f in futures:
            f.result()
        for ev in chaos.recovered:  # every fault fired and recovered (the thread stays)
            ev.wait()
        metrics = scrape(cluster.url)
        if flood is not None:
            flooded = tenants.run(cluster.url, flood, refs, args.tenant_gap_s, args.deadline_s,
                                  args.slo_ms)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the cluster ...", flush=True)
        if chaos is not None:
            chaos.stop.set()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        if chaos is not None:
            chaos.stop.set()
        if admin is not None:
            admin.close()
        cluster.stop()
        if chaos is not None:
            chaos.release.set()
            chaos.thread.join(timeout=120)
            cluster.stop()  # again: a worker the fault thread started meanwhile
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    assert chaos is not None
    elapsed = time.monotonic() - t_traffic
    results.sort(key=lambda r: r.index)
    log = Path(cluster_dir, "conductor.log")
    text = log.read_text(errors="replace") if log.exists() else ""
    stalled = silenced(text)
    stalled_first = before_first(text, chaos.stalled_engines)
    summary = summarize(results, chaos, metrics, args, elapsed, stalled)
    summary["tenant_flood"] = flooded
    summary["stalled_before_first"] = stalled_first
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary)
    if flooded is not None:
        tenants.print_summary(flooded)
    print(f"\nJSON: {out}")
    c = summary["classes"]
    fallbacks = summary["fallbacks_total"] + summary["retries_total"]
    print(f"chaos total={summary['total']} ok={c['ok']} clean_errors={c['clean_error']} "
          f"hung={c['hung']} lost={c['lost']} wrong={c['wrong']} "
          f"migrated={summary['migrated']} fallbacks={fallbacks} stalled={stalled} "
          f"tenant_isolation={flooded['tenant_isolation'] if flooded else 'none'} "
          f"stalled_before_first={stalled_first}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130) from None
