"""`make bench-e2e`: our conductor against what users would run instead, on real engines.

Six arms (benchmarks/e2e/systems.py), each on the same cores and total KV memory: ours in the
shape the conductor chooses (kv_centric), ours in Mooncake's 2P+2D shape, ours with round-robin
routing, vllm-router P/D over vLLM servers with our connector, vllm-router's regular
cache-aware mode over data-parallel vLLM servers, one colocated vLLM server. Four deterministic
workloads (benchmarks/e2e/workloads.py): shared_prefix, trace (the Mooncake trace's reuse scaled
to the model), low_reuse and multi_turn (conversations, closed loop within each). Every
workload runs --reps times per arm with fresh prefixes each time, the arms interleaved (one
repetition of every arm, then the next, each starting with another arm) so that the machine's
drift hits all of them alike. Per arm and repetition also the added latency of the system (a
1-token request through it vs. straight to an engine), and on kv_centric the field note's
background-prewarm experiment. Results: JSON, a markdown table with spreads and PNG plots with
error bars in --out, and for our arms how right admission was (calibration.py) and each run's
slowest first token with the conductor's timeline of it (slowest.py); the last line is the
summary (benchmarks/e2e/spread.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from benchmarks import conductor_log
from benchmarks.e2e import (
    calibration,
    capacity,
    client,
    overhead,
    report,
    slowest,
    spread,
    systems,
    workloads,
)
from benchmarks.machine import cpu_probe_s, describe
from benchmarks.results import default_out
from cluster.signals import stop_on_signals
from tinymodel.builder import ModelSpec, ensure_model
from worker.dtype import DTYPES
from worker.dtype import resolve as resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"

BENCH_MODEL = ModelSpec(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                        num_kv_heads=4, head_dim=64, max_position_embeddings=4096, train_steps=8)
"""25.7M parameters, 4K context: prefill visibly costs on CPU (the weights are barely trained:
the benchmark generates with ignore_eos, so what the tokens say does not matter)."""

TTFT_SLO_S = 5.0
TBT_SLO_S = 0.1
"""The SLOs goodput counts against (see docs/benchmarks.md): a request is good when it
succeeded, its TTFT <= 5 s and its 90th-percentile token gap <= 100 ms. Set from this machine's
speed, once, before comparing systems: a lone cold prefill of a shared_prefix prompt (~2,200
tokens) took 3-6 s on one engine thread with four engines sharing two cores, a lone decode
step ~12 ms."""


def _workloads(args: argparse.Namespace, vocab: workloads.Vocab, rep: int,
               rate: float | None = None, step: int = 0) -> list[workloads.Workload]:
    """Fixed before any run, the same for every system (not tuned to a result); repetition
    `rep` draws fresh prefixes (its own seeds), and so does each `step` of a sweep of rates
    (seeds 100,000 apart: clear of every repetition's and the prewarm experiment's)."""
    n = max(4, round(48 * args.scale))
    seed = 100_000 * step + 1000 * rep
    rate = args.rate if rate is None else rate
    return [
        workloads.shared_prefix(seed=seed + 1, n_requests=n, n_groups=6, prefix_tokens=2048,
                                suffix_tokens=64, max_tokens=32, rate_rps=rate,
                                vocab=vocab),
        # the trace's last lines, where its reuse is (about two thirds of their blocks)
        workloads.trace_derived(seed=seed + 2, trace_path=args.trace, n_requests=n,
                                max_prompt_tokens=3072, max_tokens_cap=32, rate_rps=rate,
                                vocab=vocab, start=3993 - n, block_tokens=64),
        workloads.low_reuse(seed=seed + 3, n_requests=n, prompt_tokens=1024, max_tokens=32,
                            rate_rps=rate, vocab=vocab),
        workloads.multi_turn(seed=seed + 4, n_conversations=max(1, n // 4), turns=4,
                             doc_tokens=1024, question_tokens=64, max_tokens=32,
                             rate_rps=rate, think_s=1.0, vocab=vocab),
    ]


def _prewarm(run: systems.Running, tok, vocab: workloads.Vocab, ns: tuple[int, ...], rep: int,
             concurrency: int = 8) -> list[dict]:
    """The field note's experiment: N requests sharing a fresh long prefix, `concurrency` at a
    time, with and without a background Prewarm of the prefix first. Amortised cost per request
    = (prewarm seconds + the requests' summed latency) / N."""
    import grpc

    from protos import admin_pb2, admin_pb2_grpc

    cluster_dir = run.logs
    assert cluster_dir is not None
    token = (cluster_dir / "admin.token").read_text().strip()
    admin_addr = run.extra["admin_addr"]
    auth = (("authorization", f"Bearer {token}"),)

    def set_slo(ttft_ms: float, tbt_ms: float) -> admin_pb2.SetSLOReply:
        with grpc.insecure_channel(admin_addr) as ch:
            return admin_pb2_grpc.AdminStub(ch).SetSLO(
                admin_pb2.SetSLORequest(ttft_ms=ttft_ms, tbt_ms=tbt_ms), timeout=30,
                metadata=auth)

    # a cost experiment: nothing may be refused for its SLO (the operator's lever: a request
    # can only tighten them)
    before = set_slo(0, 0)
    set_slo(600_000, 60_000)
    try:
        return _prewarm_runs(run, tok, vocab, ns, rep, concurrency, admin_addr, auth)
    finally:
        set_slo(before.ttft_ms, before.tbt_ms)


def _prewarm_runs(run: systems.Running, tok, vocab: workloads.Vocab, ns: tuple[int, ...],
                  rep: int, concurrency: int, admin_addr: str, auth: tuple) -> list[dict]:
    import grpc
    import httpx

    from protos import admin_pb2, admin_pb2_grpc

    rows = []
    seed = 100 + 1000 * rep
    for n in ns:
        row: dict = {"n": n, "rep": rep}
        for warm in (False, True):
            seed += 1
            wl = workloads.shared_prefix(seed=seed, n_requests=n, n_groups=1, prefix_tokens=1536,
                                         suffix_tokens=32, max_tokens=8, rate_rps=1.0,
                                         vocab=vocab)
            prefix = tok.decode(list(wl.requests[0].prompt_token_ids[:1536]))
            prompts = [tok.decode(list(r.prompt_token_ids)) for r in wl.requests]
            prewarm_s = 0.0
            if warm:
                with grpc.insecure_channel(admin_addr) as ch:
                    t0 = time.perf_counter()
                    admin_pb2_grpc.AdminStub(ch).Prewarm(
                        admin_pb2.PrewarmRequest(prompt=prefix), timeout=300,
                        metadata=auth)
                    prewarm_s = time.perf_counter() - t0

            async def go(prompts: list[str] = prompts) -> list[float]:
                sem = asyncio.Semaphore(concurrency)
                async with httpx.AsyncClient(timeout=300) as c:
                    async def one(p: str) -> float:
                        async with sem:
                            t0 = time.perf_counter()
                            r = await c.post(f"{run.url}/v1/completions", json={
                                "model": run.model, "prompt": p, "max_tokens": 8,
                                "temperature": 0, "ignore_eos": True})
                            r.raise_for_status()
                            return time.perf_counter() - t0
                    return list(await asyncio.gather(*(one(p) for p in prompts)))
            lat = asyncio.run(go())
            key = "prewarm" if warm else "no_prewarm"
            row[key] = {"prewarm_s": prewarm_s, "sum_latency_s": sum(lat),
                        "p50_s": statistics.median(lat),
                        "amortised_ms": (prewarm_s + sum(lat)) / n * 1e3}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-e2e", description=__doc__.splitlines()[0])
    p.add_argument("--systems", "--arms", dest="systems", default=",".join(systems.SYSTEMS))
    p.add_argument("--workloads", default="shared_prefix,trace,low_reuse,multi_turn")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every (arm, workload)")
    p.add_argument("--scale", type=float, default=0.5,
                   help="multiplies every workload's request count (1: 48 requests; 0.1 for a "
                   "smoke run)")
    p.add_argument("--rate", type=float, default=1.0, help="arrival rate, requests/s")
    p.add_argument("--rates", default="",
                   help="a sweep: every workload at each of these rates (e.g. 1,2,3,4), named "
                   "<workload>@<rate>, and each arm's capacity (benchmarks/e2e/capacity.py) "
                   "as the last line instead of the e2e summary")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="every arm's dtype (auto: as vllm serve picks it for the model here)")
    p.add_argument("--pool", choices=("shm", "tcp"), default="shm",
                   help="the pool's transport for the disaggregated systems (default: shared "
                   "memory through one mooncake_client, the best Mooncake offers on one host)")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--prewarm-n", default="4,8,16", help="'' skips the prewarm experiment")
    p.add_argument("--out", default=default_out("e2e"))
    p.add_argument("--run-dir", default="")
    args = p.parse_args(argv)
    try:
        rates = sorted({float(x) for x in args.rates.split(",")}) if args.rates else []
    except ValueError:
        p.error(f"--rates takes numbers separated by commas: {args.rates!r}")
    if any(not r > 0 for r in rates):
        p.error(f"--rates must be positive: {args.rates!r}")
    stop_on_signals()
    names = args.systems.split(",")
    unknown = set(names) - set(systems.SYSTEMS)
    if unknown or args.reps < 1:
        p.error(f"unknown arms {sorted(unknown)} (of {systems.SYSTEMS})" if unknown
                else "--reps must be >= 1")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="bench-e2e-"))
    print(f"machine: {describe()}", flush=True)
    model = str(ensure_model(BENCH_MODEL))
    print(f"model: {model} (25.7M params, 4K context); logs in {run_root}", flush=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    vocab = workloads.Vocab(300, len(tok) - 8)
    wanted = args.workloads.split(",")
    if rates:
        plan = [[workloads.renamed(w, capacity.rated(w.name, r), f"@{r:g}")
                 for k, r in enumerate(rates) for w in _workloads(args, vocab, rep, r, k)
                 if w.name in wanted] for rep in range(args.reps)]
    else:
        plan = [[w for w in _workloads(args, vocab, rep) if w.name in wanted]
                for rep in range(args.reps)]
    for w in plan[0]:
        print(f"workload {w.name}: {w.description}; reuse "
              f"{workloads.reuse_ratio(w, 32):.0%} of full blocks", flush=True)
    engines = systems.Engines(model=model, prefill=args.prefill, decode=args.decode,
                              pool_shm=args.pool == "shm", dtype=resolve_dtype(model, args.dtype))
    print(f"every arm computes in {engines.dtype}", flush=True)

    records: list[report.RequestRecord] = []
    runs: dict[tuple[str, str], list[report.Summary]] = {}
    added: dict[str, list[dict[str, float]]] = {}
    prewarm_rows: list[dict] = []
    probes: dict[str, list[float]] = {}
    predictions: dict[tuple[str, str], list[calibration.Prediction]] = {}
    shapes: dict[str, str] = {}
    slow: list[slowest.Slowest] = []
    total = len(names) * sum(len(w.requests) for wls in plan for w in wls)
    bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
    t_start = time.monotonic()
    for rep, wls in enumerate(plan):
        prompts = {r.request_id: tok.decode(list(r.prompt_token_ids))
                   for w in wls for r in w.requests}
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            tag = f"{name} rep {rep + 1}/{args.reps}"
            bar.set_description(f"{tag}: starting")
            probes.setdefault(name, []).append(cpu_probe_s())  # nothing of ours running
            t0 = time.monotonic()
            spans: dict[str, tuple[int, int]] = {}
            sent: dict[str, list[report.RequestRecord]] = {}
            run = systems.start(name, engines, run_root / f"{name}-{rep}", TTFT_SLO_S, TBT_SLO_S)
            shapes[name] = run.extra.get("shape", "")
            tqdm.write(f"{tag}: started in {time.monotonic() - t0:.0f}s at {run.url} (cpu probe "
                       f"{probes[name][-1] * 1e3:.0f} ms before)"
                       + (f"; shape: {shapes[name]}" if shapes[name] else ""))
            log_path = run.logs / "conductor.log" if run.logs is not None else None
            try:
                run.warm_up()
                if run.direct is not None:  # on the idle system: what the hop itself adds
                    bar.set_description(f"{tag}: overhead")
                    o = overhead.measure(run)
                    added.setdefault(name, []).append(o)
                    tqdm.write(f"{tag}: added latency {o['ms']:.2f} ms ({o['httpx_ms']:.2f} ms "
                               f"with httpx through it; direct {o['direct_ms']:.1f} ms)"
                               + overhead.describe(o))
                for w in wls:
                    bar.set_description(f"{tag}: {w.name}")
                    start = conductor_log.size(log_path)
                    # ids our conductor logs, to find the slowest requests' timelines
                    ids = f"{name}.{rep}.{w.name}." if log_path is not None else ""
                    recs, wall = asyncio.run(client.run(run.url, run.model, name, w.name,
                                                        w.requests, prompts,
                                                        on_done=lambda _r: bar.update(),
                                                        id_prefix=ids))
                    records += recs
                    sent[w.name] = recs
                    spans[w.name] = (start, conductor_log.size(log_path))
                    s = report.summarize(recs, TTFT_SLO_S, TBT_SLO_S, wall)
                    runs.setdefault((name, w.name), []).append(s)
                    errors = sorted({r.error for r in recs if r.error})[:3]
                    tqdm.write(f"{tag}/{w.name}: ok {s.ok}/{s.n} goodput {s.goodput_rps:.3f} "
                               f"req/s ttft p50/p99 {s.ttft_p50_s:.2f}/{s.ttft_p99_s:.2f}s tbt "
                               f"p50/p99 {s.tbt_p50_s * 1e3:.0f}/{s.tbt_p99_s * 1e3:.0f}ms"
                               + (f" errors: {errors}" if errors else ""))
                if name == spread.OURS and args.prewarm_n:
                    bar.set_description(f"{tag}: prewarm")
                    ns = tuple(int(x) for x in args.prewarm_n.split(","))
                    rows = _prewarm(run, tok, vocab, ns, rep)
                    prewarm_rows += rows
                    for row in rows:
                        tqdm.write(f"{tag}: prewarm N={row['n']}: amortised "
                                   f"{row['prewarm']['amortised_ms']:.0f} ms vs "
                                   f"{row['no_prewarm']['amortised_ms']:.0f} ms without")
            finally:
                run.stop()
                if log_path is not None and log_path.exists():  # our arms: admission
                    for wname, preds in calibration.read_spans(log_path, spans).items():
                        predictions.setdefault((name, wname), []).extend(preds)
                    timelines = slowest.read(log_path)
                    slow += [x for wname, recs in sent.items()
                             if (x := slowest.pick(name, wname, rep, recs, timelines))]
    bar.close()
    elapsed = time.monotonic() - t_start

    def median_ms(name: str) -> float:
        vals = [o["ms"] for o in added.get(name, [])]
        return statistics.median(vals) if vals else float("nan")

    even = spread.break_even(prewarm_rows) if prewarm_rows else None
    worst, worst_w = spread.worst_vs_best(runs)
    result = {
        "machine": describe(), "model": model, "engines": asdict(engines), "reps": args.reps,
        "scale": args.scale, "elapsed_s": elapsed, "shapes": shapes,
        "slo": {"ttft_s": TTFT_SLO_S, "tbt_s": TBT_SLO_S},
        "workloads": {w.name: {"description": w.description,
                               "reuse": workloads.reuse_ratio(w, 32)} for w in plan[0]},
        "runs": {f"{s}/{w}": [asdict(v) for v in vs] for (s, w), vs in runs.items()},
        "overhead_ms": added, "prewarm": prewarm_rows, "prewarm_break_even_n": even,
        "worst_vs_best_workload": worst_w, "cpu_probe_s": probes,
        "admission": {f"{s}/{w}": [asdict(b) for b in calibration.bins(ps)]
                      for (s, w), ps in predictions.items()},
        "slowest": [x.as_json() for x in slow],
        "records": [asdict(r) for r in records],
    }
    if rates:
        result["rates"] = rates
        result["capacity"] = {w: {s: capacity.per_rep(runs, s, w) for s in names}
                              for w in wanted}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    table = spread.markdown_table(runs)
    (out / "table.md").write_text(table + "\n")
    admission = calibration.markdown(predictions)
    (out / "admission.md").write_text(admission + "\n")
    slowest_table = slowest.markdown(slow)
    (out / "slowest.md").write_text(slowest_table + "\n")
    spread.plot(runs, out / "e2e.png")
    for w in plan[0]:
        report.plot_cdf([r for r in records if r.workload == w.name],
                        out / f"ttft_cdf_{w.name}.png", TTFT_SLO_S)
    print(table)
    print("admission: predicted TTFT against actual, our arms' conductor logs "
          "(benchmarks/e2e/calibration.py)")
    print(admission)
    print("slowest first token of each run through our arms, from the conductor's timeline "
          "(benchmarks/e2e/slowest.py)")
    print(slowest_table)
    print(f"{args.reps} repetitions, {elapsed / 60:.1f} minutes; * marks a goodput difference "
          f"beyond the spread (ranges that do not overlap); worst_vs_best on {worst_w}")
    if prewarm_rows:
        print(f"prewarm break-even N: {even if even is not None else 'none of ' + args.prewarm_n}")
    if rates:
        for w in wanted:
            table = capacity.markdown_table(runs, w)
            (out / f"capacity_{w}.md").write_text(table)
            capacity.plot(runs, w, out / f"capacity_{w}.png")
            print(table)
        print("\n".join(capacity.summary_line(runs, w) for w in wanted), flush=True)
        return 0
    print(spread.summary_line(runs, overhead_ms=median_ms(spread.OURS),
                              router_overhead_ms=median_ms("vllm_router")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
