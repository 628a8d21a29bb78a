"""`python -m simulator --trace T`: every policy (and peer router) over the trace on the
default cluster; the load, pool-capacity and prefix-reuse sweeps; every arm's capacity under
SLO per profile, every router's best split and kv_centric's plan checked against an
exhaustive sweep (`simulator.comparison`). Results into results/sim/, a summary as last line.

`python -m simulator plan --trace T --instances N --ttft-slo S --tbt-slo S`: the planner
(`simulator.planner`): the best prefill/decode split (or colocated) and every candidate's
capacity.

`python -m simulator replicas --trace T`: N conductor replicas, each seeing the others'
dispatches one sync period late (`simulator.replicas`), against one conductor."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from conductor.scheduler import POLICIES
from simulator import comparison, planner
from simulator.capacity import Arm
from simulator.cluster import ClusterSpec
from simulator.comparison import DEFAULT_ARMS, Options
from simulator.planner import Plan
from simulator.profile import load_profile
from simulator.replicas import SPREADS
from simulator.report import (
    metrics_rows,
    plot_capacity,
    plot_lines,
    plot_replicas,
    plot_ttft_cdf,
    summarize,
    write_rows,
)
from simulator.sweeps import (
    capacity_sweep,
    load_runs,
    replica_sweep,
    reuse_traces,
    run_policy,
)
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
    ap.add_argument("--policies", default="kv_centric,cache_aware,least_loaded,round_robin,"
                    "random,dynamo,llm_d,vllm_router,smg")
    ap.add_argument("--load-scales", type=_floats, default=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0])
    ap.add_argument("--load-policies", default="kv_centric,cache_aware,least_loaded,random")
    ap.add_argument("--reuse", type=_floats, default=[1.0, 0.75, 0.5, 0.25, 0.0])
    ap.add_argument("--capacities", default="500,1000,2000,5000,10000,20000,40000,none")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--out", default="results/sim")
    ap.add_argument("--no-sweeps", action="store_true")
    ap.add_argument("--profiles", default="paper_llama2_70b,h100_llama31_8b",
                    help="profiles of the capacity comparison (the first one heads the summary)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help="policy[+pool|-pool][@colocated], comma-separated")
    ap.add_argument("--target", type=float, default=0.9, help="SLO attainment for capacity")
    ap.add_argument("--precision", type=float, default=0.02,
                    help="relative width of the capacity bracket a search stops at")
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (0: up to 2)")
    ap.add_argument("--no-capacity", action="store_true", help="skip the capacity comparison")
    ap.add_argument("--no-plans", action="store_true",
                    help="skip the routers' plans and the exhaustive check")
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
    fields = "" if a.no_capacity else _comparison(a, base, spec, out, summary)
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
            f"least_loaded_goodput={f('least_loaded', 'goodput_rps')}{fields}")


def _comparison(a: argparse.Namespace, trace: list, spec: ClusterSpec, out: Path,
                summary: dict) -> str:
    """Run the capacity comparison, write its files, add it to `summary`; the summary line's
    fields for it."""
    profiles = [p for p in a.profiles.split(",") if p]
    arms = [x for x in a.arms.split(",") if x]
    opt = Options(a.target, a.precision, jobs=a.jobs)
    res = comparison.run(trace, profiles, spec, arms,
                         plan_profiles=() if a.no_plans else profiles,
                         exhaustive_profile=None if a.no_plans else profiles[0], opt=opt)
    rows = [{"profile": p, "arm": arm, "shape": comparison.shape(spec, Arm.named(arm)),
             "capacity_rps": c.rate_rps, "scale": c.scale, "hi_scale": c.hi_scale,
             "attainment": c.attainment, "probes": len(c.probes), "saturated": c.saturated}
            for (p, arm), c in res.capacities.items()]
    write_rows(rows, out / "slo_capacity")
    plot_capacity(rows, out / "slo_capacity.png",
                  f"{Path(a.trace).stem}: capacity at {a.target:.0%} SLO attainment")
    plans = [{"profile": p, "router": r, **_plan_json(pl)} for (p, r), pl in res.plans.items()]
    plans += [{"profile": p, "router": "kv_centric", "exhaustive": True, **_plan_json(pl)}
              for p, pl in res.exhaustive.items()]
    (out / "plans.json").write_text(json.dumps(plans, indent=1) + "\n")
    write_rows(res.stages, out / "stages")
    ratios = [comparison.ratios(res.capacities, p, res.plans) for p in profiles]
    summary["capacity"] = rows
    summary["ratios"] = [asdict(r) for r in ratios]
    head = ratios[0]
    ok = "nan"
    if profiles[0] in res.exhaustive:
        ok = str(comparison.plan_ok(res.plans[(profiles[0], "kv_centric")],
                                    res.exhaustive[profiles[0]])).lower()
    vs_peer = head.vs_best_peer_best_split or head.vs_best_peer
    fields = (f" capacity_vs_best_peer={vs_peer:.3f} "
              f"capacity_vs_colocated={head.vs_colocated:.3f} plan_ok={ok} "
              f"kv_centric_capacity_rps={head.kv_centric_rps:.3f} best_peer={head.best_peer} "
              f"capacity_vs_best_peer_same_shape={head.vs_best_peer:.3f}")
    if head.best_split_kv_centric:
        fields += (f" kv_centric_split={head.best_split_kv_centric}"
                   f" best_peer_split={head.best_split_peer.replace(' ', ':')}")
    for r in ratios[1:]:
        fields += (f" {r.profile}_capacity_vs_best_peer="
                   f"{(r.vs_best_peer_best_split or r.vs_best_peer):.3f}"
                   f" {r.profile}_capacity_vs_colocated={r.vs_colocated:.3f}")
    return fields


def _plan_json(pl: Plan) -> dict:
    return {"best": pl.best.label, "best_rps": pl.best_rps, "runs": pl.runs,
            "cpu_s": pl.cpu_s,
            "candidates": [{"split": c.split.label, "estimate_rps": c.estimate_rps,
                            "capacity_rps": c.capacity_rps, "below_rps": c.below_rps,
                            "runs": c.runs, "pruned": c.pruned, "saturated": c.saturated}
                           for c in pl.candidates]}


def plan_main(argv: list[str]) -> str:
    """`python -m simulator plan`: the planner's table, and a summary as last line."""
    ap = argparse.ArgumentParser(prog="python -m simulator plan",
                                 description=planner.__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--instances", type=int, required=True)
    ap.add_argument("--ttft-slo", type=float, required=True)
    ap.add_argument("--tbt-slo", type=float, required=True)
    ap.add_argument("--profile", default="paper_llama2_70b",
                    help="a name in simulator/profiles/ or a JSON path")
    ap.add_argument("--policy", default="kv_centric", help="a conductor policy or a peer")
    ap.add_argument("--no-pool", action="store_true")
    ap.add_argument("--no-colocated", action="store_true")
    ap.add_argument("--exhaustive", action="store_true", help="bisect every candidate")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--precision", type=float, default=0.02)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--out", default=None, help="also write the plan as JSON here")
    a = ap.parse_args(argv)
    trace = load_trace(a.trace, a.limit)
    pl = planner.plan(trace, load_profile(a.profile), a.instances, a.ttft_slo, a.tbt_slo,
                      policy=a.policy, pool=not a.no_pool, colocated=not a.no_colocated,
                      target=a.target, precision=a.precision, exhaustive=a.exhaustive)
    for c in sorted(pl.candidates, key=lambda c: -c.capacity_rps):
        got = f"{c.capacity_rps:7.3f} req/s" if not c.pruned else "    pruned"
        print(f"{c.split.label:>8}  {got}  below {c.below_rps:7.3f}  "
              f"estimate {c.estimate_rps:7.3f}  runs {c.runs}")
    if a.out:
        Path(a.out).write_text(json.dumps(_plan_json(pl), indent=1) + "\n")
    return (f"plan trace={Path(a.trace).stem} instances={a.instances} best={pl.best.label} "
            f"capacity_rps={pl.best_rps:.3f} runs={pl.runs} cpu_s={pl.cpu_s:.1f}")


def _periods(text: str) -> list[float | None]:
    return [None if x == "step" else float(x) for x in text.split(",") if x]


def replicas_main(argv: list[str]) -> str:
    """`python -m simulator replicas`: every replica count x sync period against one
    conductor into `--out` (replicas.{json,csv}, replicas.png), a summary as last line."""
    ap = argparse.ArgumentParser(prog="python -m simulator replicas",
                                 description=__doc__.split("\n\n")[-1])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--profile", default="paper_llama2_70b",
                    help="a name in simulator/profiles/ or a JSON path")
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--scale", type=float, default=1.0, help="arrival-rate factor")
    ap.add_argument("--ttft-slo", type=float, default=30.0)
    ap.add_argument("--tbt-slo", type=float, default=0.1)
    ap.add_argument("--policy", default="kv_centric", help="a conductor policy")
    ap.add_argument("--replicas", default="1,2,4,8")
    ap.add_argument("--periods", type=_periods, default=_periods("0.01,step,0.05,0.1,0.5,1"),
                    help="sync periods in seconds; step: one report per decode step (the "
                         "one-conductor run's mean step)")
    ap.add_argument("--spread", choices=SPREADS, default="round_robin",
                    help="how the load balancer spreads requests over the replicas")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--out", default="results/sim-replicas")
    a = ap.parse_args(argv)
    trace = time_scaled(load_trace(a.trace, a.limit), a.scale)
    name = Path(a.trace).stem
    spec = ClusterSpec(prefill=a.prefill, decode=a.decode, ttft_slo_s=a.ttft_slo,
                       tbt_slo_s=a.tbt_slo)
    counts = [int(x) for x in a.replicas.split(",") if x]
    bar = tqdm(total=(1 + len(counts) * len(a.periods)) * len(trace), unit="req",
               desc="replicas", mininterval=0.5)
    rows = replica_sweep(trace, load_profile(a.profile), spec, counts, a.periods, a.policy,
                         a.spread, bar.update)
    bar.close()
    out = Path(a.out)
    write_rows(rows, out / "replicas")
    plot_replicas(rows, out / "replicas.png",
                  f"{name} x{a.scale:g}, {a.prefill}P+{a.decode}D, {a.policy}, {a.spread}")
    per_step = [r for r in rows if r["per_step"]]
    fields = "".join(f" r{r['replicas']}_ttft_p50_vs_one={r['ttft_p50_vs_one']:.3f}"
                     f" r{r['replicas']}_hit_vs_one={r['hit_ratio_vs_one']:.3f}"
                     for r in per_step)
    ok = all(abs(r[k] - 1) <= 0.05 for r in per_step if r["replicas"] in (2, 4)
             for k in ("ttft_p50_vs_one", "hit_ratio_vs_one"))
    step = f"{per_step[0]['sync_period_s']:.4f}" if per_step else "nan"
    return (f"sim-replicas trace={name} scale={a.scale:g} one_ttft_p50_s="
            f"{rows[0]['ttft_p50_s']:.4f} one_hit_ratio={rows[0]['hit_ratio']:.4f} "
            f"step_period_s={step}{fields} within_5pct={str(ok and bool(per_step)).lower()}")


def cli(argv: list[str]) -> str:
    if argv and argv[0] == "plan":
        return plan_main(argv[1:])
    if argv and argv[0] == "replicas":
        return replicas_main(argv[1:])
    return main(argv)


if __name__ == "__main__":
    assert set(POLICIES) >= {"kv_centric", "cache_aware", "least_loaded", "random"}
    print(cli(sys.argv[1:]), flush=True)
