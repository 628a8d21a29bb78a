"""`make bench-e2e`: our conductor against what users would run instead, on real engines.

Systems (benchmarks/e2e/systems.py), one after another on the same engines and cores:
kv_centric and round_robin (our conductor), vllm_router (vllm-router's PD mode over vLLM
servers with our connector) and colocated (one vLLM server with prefix caching). Each runs
three deterministic workloads (benchmarks/e2e/workloads.py): shared_prefix, trace (the Mooncake
trace's reuse scaled to the model) and low_reuse. Then the added latency of our conductor and
of vllm-router (a 1-token request through it vs. straight to an engine), and on kv_centric the
field note's background-prewarm experiment. Results: JSON, a markdown table and PNG plots in
--out; the last line is the summary (benchmarks/e2e/report.py).
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

from benchmarks.e2e import client, report, systems, workloads
from benchmarks.machine import cpu_probe_s, describe
from tinymodel.builder import ModelSpec, ensure_model

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


def _workloads(args: argparse.Namespace, vocab: workloads.Vocab) -> list[workloads.Workload]:
    """Fixed before any run, the same for every system (not tuned to a result)."""
    n = max(4, round(48 * args.scale))
    return [
        workloads.shared_prefix(seed=1, n_requests=n, n_groups=6, prefix_tokens=2048,
                                suffix_tokens=64, max_tokens=32, rate_rps=args.rate,
                                vocab=vocab),
        # the trace's last lines, where its reuse is (about two thirds of their blocks)
        workloads.trace_derived(seed=2, trace_path=args.trace, n_requests=n,
                                max_prompt_tokens=3072, max_tokens_cap=32, rate_rps=args.rate,
                                vocab=vocab, start=3993 - n, block_tokens=64),
        workloads.low_reuse(seed=3, n_requests=n, prompt_tokens=1024, max_tokens=32,
                            rate_rps=args.rate, vocab=vocab),
    ]


def _overhead_ms(run: systems.Running, pairs: int = 100) -> dict[str, float]:
    """Latency of a 1-token request through the system minus straight to an engine (the one
    that served it, where the system says), the median over pairs sent back to back (the
    machine's speed drifts between pairs by more than the hop costs): `ms` with a lean client
    (`systems.LeanHttp`, whose own cost is close to the direct gRPC call's), and `httpx_ms`
    with httpx through the system (the figure before 2026-11-25: it charged httpx's own
    ~0.5-1.5 ms to the conductor and not to vllm-router, measured with httpx both ways)."""
    import httpx

    if run.direct is None:
        return {}
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    body = {"model": run.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    lean, heavy, direct = [], [], []
    http = systems.LeanHttp(run.url)
    try:
        with httpx.Client(timeout=60) as c:
            for i in range(pairs + 3):
                t, request_id = http.post("/v1/completions", body)
                t0 = time.perf_counter()
                c.post(f"{run.url}/v1/completions", json=body).raise_for_status()
                h = time.perf_counter() - t0
                d = run.direct(prompt, request_id)
                if i >= 3:  # the first rounds warm every path's caches
                    lean.append(t)
                    heavy.append(h)
                    direct.append(d)
    finally:
        http.close()

    def paired(through: list[float]) -> float:
        return statistics.median(t - d for t, d in zip(through, direct, strict=True)) * 1e3

    return {"ms": paired(lean), "httpx_ms": paired(heavy),
            "unpaired_ms": (statistics.median(lean) - statistics.median(direct)) * 1e3,
            "direct_ms": statistics.median(direct) * 1e3}


def _prewarm(run: systems.Running, tok, vocab: workloads.Vocab, ns: tuple[int, ...],
             concurrency: int = 8) -> list[dict]:
    """The field note's experiment: N requests sharing a fresh long prefix, `concurrency` at a
    time, with and without a background Prewarm of the prefix first. Amortised cost per request
    = (prewarm seconds + the requests' summed latency) / N."""
    import grpc
    import httpx

    from protos import admin_pb2, admin_pb2_grpc

    cluster_dir = run.logs
    assert cluster_dir is not None
    token = (cluster_dir / "admin.token").read_text().strip()
    admin_addr = run.extra["admin_addr"]
    rows = []
    seed = 100
    for n in ns:
        row: dict = {"n": n}
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
                        metadata=(("authorization", f"Bearer {token}"),))
                    prewarm_s = time.perf_counter() - t0

            async def go(prompts: list[str] = prompts) -> list[float]:
                sem = asyncio.Semaphore(concurrency)
                async with httpx.AsyncClient(timeout=300) as c:
                    async def one(p: str) -> float:
                        async with sem:
                            t0 = time.perf_counter()
                            r = await c.post(f"{run.url}/v1/completions", json={
                                "model": run.model, "prompt": p, "max_tokens": 8,
                                "temperature": 0, "ignore_eos": True,
                                # a cost experiment: nothing may be refused for its SLO
                                "ttft_slo_ms": 600_000, "tbt_slo_ms": 60_000})
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
    p.add_argument("--systems", default=",".join(systems.SYSTEMS))
    p.add_argument("--workloads", default="shared_prefix,trace,low_reuse")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies every workload's request count (0.25 for a smoke run)")
    p.add_argument("--rate", type=float, default=1.0, help="arrival rate, requests/s")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--pool", choices=("shm", "tcp"), default="shm",
                   help="the pool's transport for the disaggregated systems (default: shared "
                   "memory through one mooncake_client, the best Mooncake offers on one host)")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--prewarm-n", default="8,16,32", help="'' skips the prewarm experiment")
    p.add_argument("--out", default=str(ROOT / "docs" / "e2e"))
    p.add_argument("--run-dir", default="")
    args = p.parse_args(argv)

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
    wls = [w for w in _workloads(args, vocab) if w.name in wanted]
    prompts = {r.request_id: tok.decode(list(r.prompt_token_ids)) for w in wls for r in w.requests}
    for w in wls:
        print(f"workload {w.name}: {w.description}; reuse "
              f"{workloads.reuse_ratio(w, 32):.0%} of full blocks", flush=True)
    engines = systems.Engines(model=model, prefill=args.prefill, decode=args.decode,
                              pool_shm=args.pool == "shm")

    records: list[report.RequestRecord] = []
    summaries: dict[tuple[str, str], report.Summary] = {}
    overhead: dict[str, dict[str, float]] = {}
    prewarm_rows: list[dict] = []
    probes: dict[str, float] = {}
    total = len(args.systems.split(",")) * sum(len(w.requests) for w in wls)
    bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
    for name in args.systems.split(","):
        bar.set_description(f"{name}: starting")
        probes[name] = cpu_probe_s()  # the machine's speed, with nothing of ours running
        t0 = time.monotonic()
        run = systems.start(name, engines, run_root / name, TTFT_SLO_S, TBT_SLO_S)
        tqdm.write(f"{name}: started in {time.monotonic() - t0:.0f}s at {run.url} (cpu probe "
                   f"{probes[name] * 1e3:.0f} ms before)")
        try:
            _warm_up(run)
            if run.direct is not None:  # on the idle system: what the hop itself adds
                bar.set_description(f"{name}: overhead")
                o = overhead[name] = _overhead_ms(run)
                tqdm.write(f"{name}: added latency {o['ms']:.2f} ms ({o['httpx_ms']:.2f} ms "
                           f"with httpx through it; direct {o['direct_ms']:.1f} ms)")
            for w in wls:
                bar.set_description(f"{name}/{w.name}")
                recs, wall = asyncio.run(client.run(run.url, run.model, name, w.name, w.requests,
                                                    prompts, on_done=lambda _r: bar.update()))
                records += recs
                s = summaries[(name, w.name)] = report.summarize(recs, TTFT_SLO_S, TBT_SLO_S,
                                                                 wall)
                errors = sorted({r.error for r in recs if r.error})[:3]
                tqdm.write(f"{name}/{w.name}: ok {s.ok}/{s.n} goodput {s.goodput_rps:.3f} req/s "
                           f"ttft p50/p99 {s.ttft_p50_s:.2f}/{s.ttft_p99_s:.2f}s tbt p50/p99 "
                           f"{s.tbt_p50_s * 1e3:.0f}/{s.tbt_p99_s * 1e3:.0f}ms"
                           + (f" errors: {errors}" if errors else ""))
            if name == "kv_centric" and args.prewarm_n:
                bar.set_description(f"{name}: prewarm")
                ns = tuple(int(x) for x in args.prewarm_n.split(","))
                prewarm_rows = _prewarm(run, tok, vocab, ns)
                for row in prewarm_rows:
                    tqdm.write(f"prewarm N={row['n']}: amortised "
                               f"{row['prewarm']['amortised_ms']:.0f} ms vs "
                               f"{row['no_prewarm']['amortised_ms']:.0f} ms without")
        finally:
            run.stop()
    bar.close()

    result = {
        "machine": describe(), "model": model, "engines": asdict(engines),
        "slo": {"ttft_s": TTFT_SLO_S, "tbt_s": TBT_SLO_S},
        "workloads": {w.name: {"description": w.description,
                               "reuse": workloads.reuse_ratio(w, 32)} for w in wls},
        "summaries": {f"{s}/{w}": asdict(v) for (s, w), v in summaries.items()},
        "overhead_ms": overhead, "prewarm": prewarm_rows, "cpu_probe_s": probes,
        "records": [asdict(r) for r in records],
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    table = report.markdown_table(summaries)
    (out / "table.md").write_text(table + "\n")
    report.plot(summaries, out / "e2e.png")
    for w in wls:
        report.plot_cdf([r for r in records if r.workload == w.name],
                        out / f"ttft_cdf_{w.name}.png", TTFT_SLO_S)
    print(table)
    nan = {"ms": float("nan")}
    print(report.summary_line(summaries, overhead_ms=overhead.get("kv_centric", nan)["ms"],
                              router_overhead_ms=overhead.get("vllm_router", nan)["ms"]),
          flush=True)
    return 0


def _warm_up(run: systems.Running) -> None:
    """One short request, so that no system's first workload pays a cold path."""
    import httpx

    httpx.post(f"{run.url}/v1/completions", timeout=300, json={
        "model": run.model, "prompt": "warm up", "max_tokens": 2, "temperature": 0,
    }).raise_for_status()


if __name__ == "__main__":
    raise SystemExit(main())
