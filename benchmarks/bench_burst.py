"""`make bench-burst`: bursts of cold long prompts through `make run`'s shape (bench-e2e's
engines), with vLLM's own step packing and with ours (`worker.step_budget.finish_first`: the
step that finishes a prompt carries no other prompt's chunk), in one run, the two alternating.

A burst is `--burst` prompts of `--tokens` random ordinary tokens, sent as text (fresh each
time: nothing is cached anywhere), `--gap` seconds apart, each streamed for 8 tokens by
bench-e2e's client (`benchmarks.e2e.client`); `--bursts` of them per cluster start, `--reps`
starts per variant. For each request: its TTFT as the client saw it,
and the TTFT the conductor predicted when it routed it (its `routed` log line). Results:
`--out`/results.json, burst.png (TTFT by position in the burst, each variant's mean with its
range). Last line:

    burst ttft_mean_ratio=<vllm/ours> ttft_first_ratio=<the burst's first two> \
          ttft_max_ratio=<...> actual_vs_predicted=<ours, median>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.e2e import calibration, client, systems, workloads
from benchmarks.e2e.__main__ import BENCH_MODEL, TBT_SLO_S, TTFT_SLO_S
from benchmarks.machine import describe
from benchmarks.results import default_out
from cluster.signals import stop_on_signals
from worker.dtype import resolve as resolve_dtype
from worker.vllm_plugin import FINISH_FIRST_ENV

VARIANTS = {"vllm": "0", "ours": "1"}
"""Each variant's `KVCLUSTER_FINISH_FIRST`, inherited by the cluster's engines."""


def _rep(variant: str, engines: systems.Engines, run_dir: Path, a: argparse.Namespace,
         rng: random.Random, tok, vocab: workloads.Vocab) -> dict:  # type: ignore[no-untyped-def]
    os.environ[FINISH_FIRST_ENV] = VARIANTS[variant]
    run = systems.start("kv_centric", engines, run_dir, TTFT_SLO_S, TBT_SLO_S)
    bursts: list[list[float | None]] = []
    try:
        run.warm_up()
        for b in range(a.bursts):
            reqs = [workloads.BenchRequest(
                request_id=f"{variant}-{b}-{k}", max_tokens=8, arrival_s=k * a.gap, group=None,
                prompt_token_ids=tuple(rng.randrange(vocab.lo, vocab.hi)
                                       for _ in range(a.tokens))) for k in range(a.burst)]
            prompts = {r.request_id: tok.decode(list(r.prompt_token_ids)) for r in reqs}
            recs, _ = asyncio.run(client.run(run.url, run.model, variant, "burst", reqs, prompts))
            bursts.append([r.first_token_s - r.sent_s if r.first_token_s is not None else None
                           for r in recs])
            print(f"{variant} burst {b + 1}/{a.bursts}: TTFT "
                  + " ".join(f"{x:.2f}" if x else "failed" for x in bursts[-1]) + " s"
                  + "".join(f"; {r.error}" for r in recs if r.error), flush=True)
            time.sleep(a.pause)
    finally:
        run.stop()
    logs = run_dir / "conductor.log"
    preds = [p for p in calibration.read(logs.read_text().splitlines())
             if p.actual_ttft_s is not None and p.predicted_ttft_s > 0.3]  # the bursts' own
    return {"variant": variant, "bursts": bursts,
            "actual_vs_predicted": [p.actual_ttft_s / p.predicted_ttft_s for p in preds]}


def _summary(reps: list[dict], variant: str) -> dict:
    rows = [b for r in reps if r["variant"] == variant for b in r["bursts"]]
    ok = [x for b in rows for x in b if x is not None]
    n = max((len(b) for b in rows), default=0)
    by_pos = [[b[i] for b in rows if i < len(b) and b[i] is not None] for i in range(n)]
    ratios = [x for r in reps if r["variant"] == variant for x in r["actual_vs_predicted"]]
    return {"n": sum(len(b) for b in rows), "ok": len(ok),
            "mean_s": statistics.mean(ok) if ok else float("nan"),
            "max_s": max(ok, default=float("nan")),
            "first_two_s": statistics.mean([x for p in by_pos[:2] for x in p] or [float("nan")]),
            "by_position": [(statistics.mean(p), min(p), max(p)) if p else None for p in by_pos],
            "actual_vs_predicted": statistics.median(ratios) if ratios else float("nan")}


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, (variant, s) in enumerate(summary.items()):
        pos = [i for i, p in enumerate(s["by_position"]) if p]
        mean = [s["by_position"][i][0] for i in pos]
        lo = [m - s["by_position"][i][1] for m, i in zip(mean, pos, strict=True)]
        hi = [s["by_position"][i][2] - m for m, i in zip(mean, pos, strict=True)]
        ax.bar([i + 1 + (k - 0.5) * 0.38 for i in pos], mean, 0.38, yerr=[lo, hi], capsize=3,
               label={"vllm": "vLLM's packing", "ours": "finish first"}[variant])
    ax.set_xticks(range(1, 1 + max(len(s["by_position"]) for s in summary.values())))
    ax.set_xlabel("position in the burst")
    ax.set_ylabel("TTFT (s): mean, range")
    ax.set_title("bursts of cold prompts, make run's shape")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burst", type=int, default=4, help="prompts per burst")
    p.add_argument("--tokens", type=int, default=2200, help="tokens per prompt")
    p.add_argument("--gap", type=float, default=0.25, help="seconds between a burst's prompts")
    p.add_argument("--pause", type=float, default=4.0, help="seconds between bursts")
    p.add_argument("--bursts", type=int, default=6, help="bursts per cluster start")
    p.add_argument("--reps", type=int, default=2, help="cluster starts per variant")
    p.add_argument("--run-dir", default="/tmp/kvcluster-bench-burst")
    p.add_argument("--out", default=default_out("burst"))
    a = p.parse_args(argv)
    stop_on_signals()
    from transformers import AutoTokenizer

    from tinymodel.builder import ensure_model

    print(f"machine: {describe()}", flush=True)
    model = str(ensure_model(BENCH_MODEL))
    tok = AutoTokenizer.from_pretrained(model)
    vocab = workloads.Vocab(300, len(tok) - 8)  # bench-e2e's ordinary tokens
    engines = systems.Engines(model=model, prefill=2, decode=2, pool_shm=True,
                              dtype=resolve_dtype(model, "auto"))
    rng = random.Random(7)
    reps = []
    for rep in range(a.reps):
        for variant in VARIANTS:  # alternating, so that drift hits both alike
            run_dir = Path(a.run_dir) / f"{variant}-{rep}"
            print(f"{variant} rep {rep + 1}/{a.reps}: starting", flush=True)
            reps.append(_rep(variant, engines, run_dir, a, rng, tok, vocab))
    summary = {v: _summary(reps, v) for v in VARIANTS}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"args": vars(a), "machine": describe(), "reps": reps, "summary": summary}, indent=1))
    _plot(summary, out / "burst.png")
    print("| variant | requests ok | TTFT mean (s) | first two (s) | max (s) | by position (s) "
          "| actual / predicted |\n| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for v, s in summary.items():
        pos = " ".join(f"{m:.2f}" for m, _, _ in filter(None, s["by_position"]))
        print(f"| {v} | {s['ok']}/{s['n']} | {s['mean_s']:.2f} | {s['first_two_s']:.2f} | "
              f"{s['max_s']:.2f} | {pos} | {s['actual_vs_predicted']:.2f} |")
    v, o = summary["vllm"], summary["ours"]
    print(f"burst ttft_mean_ratio={v['mean_s'] / o['mean_s']:.2f} "
          f"ttft_first_ratio={v['first_two_s'] / o['first_two_s']:.2f} "
          f"ttft_max_ratio={v['max_s'] / o['max_s']:.2f} "
          f"actual_vs_predicted={o['actual_vs_predicted']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
