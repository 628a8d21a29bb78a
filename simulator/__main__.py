"""`python -m simulator --trace T`: every policy over the trace on the default cluster, then
the load, capacity and prefix-reuse sweeps; results into --out
(results/sim/, which git ignores), a summary as last line."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from conductor.scheduler import POLICIES
from simulator.cluster import ClusterSpec
from simulator.profile import load_profile
from simulator.report import metrics_rows, plot_lines, plot_ttft_cdf, summarize, write_rows
from simulator.sweeps import capacity_sweep, load_runs, reuse_traces, run_policy
from simulator.trace import ideal_hit_ratio, load_trace, time_scaled

DEFAULT_TRACE = "../shared/traces/mooncake_synthetic_trace.jsonl"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--profile", default="paper_llama2_70b",
                    help="a name in simulator/profiles/ or a JSON path")
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--pool-blocks", type=int, default=None, help="default: unlimited")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="arrival-rate factor for the main run (2: twice the trace's rate)")
    ap.add_argument("--ttft-slo", type=float, default=30.0)
    ap.add_argument("--tbt-slo", type=float, default=0.1)
    ap.add_argument("--policies", default="kv_centric,cache_aware,least_loaded,round_robin,random")
    ap.add_argument("--load-scales", type=_floats, default=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0])
    ap.add_argument("--load-policies", default="kv_centric,cache_aware,least_loaded,random")
    ap.add_argument("--reuse", type=_floats, default=[1.0, 0.75, 0.5, 0.25, 0.0])
    ap.add_argument("--capacities", default="500,1000,2000,5000,10000,20000,40000,none")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--out", default="results/sim")
    ap.add_argument("--no-sweeps", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_trace(a.trace, a.limit)
    name = Path(a.trace).stem
    prof = load_profile(a.profile)
    spec = ClusterSpec(prefill=a.prefill, decode=a.decode, pool_blocks=a.pool_blocks,
                       ttft_slo_s=a.ttft_slo, tbt_slo_s=a.tbt_slo)
    coloc = replace(spec, prefill=0, decode=0, colocated=a.prefill + a.decode)
    policies = [p for p in a.policies.split(",") if p]
    load_pols = [p for p in a.load_policies.split(",") if p]
    trace = time_scaled(base, a.scale)
    loads = [] if a.no_sweeps else load_runs(base, a.load_scales)
    reuses = [] if a.no_sweeps else reuse_traces(trace, a.reuse)
    runs = len(policies) + len(loads) * len(load_pols) + 3 * len(reuses)
    bar = tqdm(total=runs * len(base), unit="req", desc="sim", mininterval=0.5)
    tick = bar.update

    main_runs = {p: run_policy(trace, prof, spec, p, tick) for p in policies}
    metrics = [summarize(p, r, a.ttft_slo, a.tbt_slo) for p, r in main_runs.items()]
    write_rows(metrics_rows(metrics, trace=name, scale=a.scale), out / "policies")
    plot_ttft_cdf(main_runs, a.ttft_slo, out / "ttft_cdf.png",
                  f"{name} x{a.scale:g}, {a.prefill}P+{a.decode}D, {prof.name}")

    if loads:
        rows = []
        for scale, tr in loads:
            for p in load_pols:
                m = summarize(p, run_policy(tr, prof, spec, p, tick), a.ttft_slo, a.tbt_slo)
                rows += metrics_rows([m], scale=scale, rate_rps=len(tr) / (tr[-1].arrival_s or 1))
        write_rows(rows, out / "load")
        plot_lines({p: ([r["rate_rps"] for r in rows if r["policy"] == p],
                        [r["goodput_rps"] for r in rows if r["policy"] == p]) for p in load_pols},
                   "offered load (req/s)", "goodput (req/s meeting TTFT and TBT SLOs)",
                   out / "goodput_vs_load.png", f"{name}, {a.prefill}P+{a.decode}D")

    if reuses:
        rows = []
        for keep, tr in reuses:
            ideal = ideal_hit_ratio(tr, prof.block_size)
            for label, p, s, pool in (
                    ("disaggregated + pool (kv_centric)", "kv_centric", spec, True),
                    ("disaggregated, local caches only (kv_centric)", "kv_centric", spec, False),
                    ("colocated, local caches (kv_centric's pick)", "colocated", coloc, False)):
                m = summarize(p, run_policy(tr, prof, s, p, tick, pool), a.ttft_slo, a.tbt_slo,
                              label)
                rows += metrics_rows([m], keep=keep, trace_reuse=ideal)
        write_rows(rows, out / "reuse")
        labels = list(dict.fromkeys(r["label"] for r in rows))
        for key, ylabel, fname in (("goodput_rps", "goodput (req/s)", "reuse_goodput.png"),
                                   ("ttft_mean_s", "mean TTFT (s)", "reuse_ttft.png")):
            plot_lines({lb: ([r["trace_reuse"] for r in rows if r["label"] == lb],
                             [r[key] for r in rows if r["label"] == lb]) for lb in labels},
                       "trace prefix reuse (ideal hit ratio)", ylabel, out / fname,
                       f"{name} x{a.scale:g}, {a.prefill + a.decode} instances")
        bs = prof.block_size
        caps = [None if c == "none" else int(c) for c in a.capacities.split(",")]
        crow = capacity_sweep(base, bs, caps)
        write_rows(crow, out / "capacity")
        plot_lines({ev: ([r["capacity_blocks"] for r in crow
                          if r["eviction"] == ev and r["capacity_blocks"] != "unlimited"],
                         [r["hit_ratio"] for r in crow
                          if r["eviction"] == ev and r["capacity_blocks"] != "unlimited"])
                    for ev in ("lru", "lfu")},
                   f"pool capacity (blocks of {bs} tokens)", "hit ratio",
                   out / "capacity.png", f"{name}: pool hit ratio vs capacity")
    bar.close()

    by = {m.policy: m for m in metrics}
    summary = {"trace": name, "profile": asdict(prof), "cluster": asdict(spec), "scale": a.scale,
               "ideal_hit_ratio": ideal_hit_ratio(base, prof.block_size),
               "policies": [asdict(m) for m in metrics]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    def f(policy: str, field: str) -> str:
        m = by.get(policy)
        return f"{getattr(m, field):.4f}" if m else "nan"

    hit = by.get("kv_centric") or metrics[0]
    return (f"sim trace={name} hit_ratio={hit.hit_ratio:.4f} "
            f"kv_centric_ttft_mean_s={f('kv_centric', 'ttft_mean_s')} "
            f"cache_aware_ttft_mean_s={f('cache_aware', 'ttft_mean_s')} "
            f"least_loaded_ttft_mean_s={f('least_loaded', 'ttft_mean_s')} "
            f"random_ttft_mean_s={f('random', 'ttft_mean_s')} "
            f"kv_centric_goodput={f('kv_centric', 'goodput_rps')} "
            f"least_loaded_goodput={f('least_loaded', 'goodput_rps')}")


if __name__ == "__main__":
    assert set(POLICIES) >= {"kv_centric", "cache_aware", "least_loaded", "random"}
    print(main(), flush=True)
