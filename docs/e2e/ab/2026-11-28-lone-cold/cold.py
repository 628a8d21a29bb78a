"""This A/B's harness: `N` lone cold ~2,250-token prompts (random ids, max_tokens 1, 1 s
apart) through one arm, each TTFT printed; run with `KVCLUSTER_STEP_LOG=<dir>` for the
engines' step times. From a checkout: `.venv/bin/python docs/e2e/ab/2026-11-28-lone-cold/cold.py
ARM RUN_DIR N`, ARM one of kv_centric (make run's shape), kv_tcp (the same, pool over TCP,
the KV cache in vLLM's own memory), serve1 (one `vllm serve`, one thread, no connector), or
any bench-e2e arm. run.sh alternates arms and prints each run's medians."""
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the checkout
from benchmarks.e2e import systems
from benchmarks.e2e.__main__ import BENCH_MODEL
from tinymodel.builder import ensure_model

arm, rd, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
rd.mkdir(parents=True, exist_ok=True)
e = systems.Engines(model=str(ensure_model(BENCH_MODEL)))
if arm == "serve1":  # bench-e2e's colocated server, on one thread
    run = systems.colocated(dataclasses.replace(e, cores=1), rd)
elif arm == "kv_tcp":
    run = systems.start("kv_centric", dataclasses.replace(e, pool_shm=False), rd, 10.0, 1.0)
else:
    run = systems.start(arm, e, rd, 10.0, 1.0)
rng = np.random.default_rng(int(time.time()))
http = systems.LeanHttp(run.url)
try:
    run.warm_up()
    subprocess.run("ps -eLo pid,tid,psr,pcpu,comm | awk '$4>0.5' | sort -k4 -nr | head -25",
                   shell=True)
    for i in range(n):
        ids = rng.integers(100, 2000, 2250).tolist()
        t, rid = http.post("/v1/completions", {"model": run.model, "prompt": ids,
                                                "max_tokens": 1, "temperature": 0})
        print(f"cold {i} {t*1000:.0f} ms {rid}", flush=True)
        time.sleep(1.0)
finally:
    http.close()
    run.stop()
