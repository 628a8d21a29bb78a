"""`python -m simulator.calibrate --model DIR`: a latency profile measured on this repo's real
CPU engine (vLLM CPU with the tiny model of `make model`), written to
`simulator/profiles/cpu_tiny.json`.

Prefill: wall time of one 1-token generation per (cached, uncached) pair, prefix caching on
and the cached part generated first. Decode: per-token time of batches of `k` prompts, from
the difference between generating T and 1 tokens. Both fitted by least squares to the
conductor's model shapes. Takes about a minute on two cores; wall times include vLLM's
per-call overhead, as a real request would.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from cluster.process import vllm_scratch_here
from conductor.scheduler import PrefillTimeModel, TbtModel, prefill_features
from simulator.profile import PROFILES, LatencyProfile


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


KV_BYTES = 256 << 20


def measure(model: str, block_size: int = 32) -> LatencyProfile:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    with vllm_scratch_here():  # the engine's socket files go with it
        llm = LLM(model=model, block_size=block_size, dtype="float32", max_model_len=2048,
                  enforce_eager=True, kv_cache_memory_bytes=KV_BYTES,
                  enable_prefix_caching=True)
        try:
            return _measure(llm, model, block_size)
        finally:
            llm.llm_engine.engine_core.shutdown()


def _measure(llm, model: str, block_size: int) -> LatencyProfile:
    rng = np.random.default_rng(0)

    def toks(n: int) -> list[int]:
        return rng.integers(3, 2000, n).tolist()

    _timed(llm, [toks(64)], 1)  # warm-up
    rows, ys = [], []
    for cached in (0, 256, 1024):
        for uncached in (64, 256, 512, 1000):
            prefix = toks(cached)
            if cached:
                _timed(llm, [prefix], 1)
            ys.append(_timed(llm, [prefix + toks(uncached)], 1))
            rows.append(prefill_features(uncached, cached))
    pre = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0].clip(min=0)
    rows, ys = [], []
    for batch in (1, 4, 16):
        for length in (64, 512):
            prompts = [toks(length) for _ in range(batch)]
            t1 = _timed(llm, prompts, 1)
            prompts = [toks(length) for _ in range(batch)]
            steps = 32
            tn = _timed(llm, prompts, steps + 1)
            rows.append((1.0, batch, batch * (length + steps / 2)))
            ys.append((tn - t1) / steps)
    dec = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0].clip(min=0)
    cfg = json.loads(open(os.path.join(model, "config.json")).read())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    return LatencyProfile(
        name="cpu_tiny",
        source=(f"measured on vLLM CPU with {os.path.basename(model.rstrip('/'))} (block "
                f"{block_size}, fp32) by `python -m simulator.calibrate --model <dir>` on "
                f"{os.cpu_count()} cores at {time.strftime('%Y-%m-%d')}; transfer: 1 GB/s TCP"),
        block_size=block_size,
        prefill=PrefillTimeModel(*map(float, pre)),
        tbt=TbtModel(*map(float, dec)),
        transfer_s_per_block=per_token * block_size / 1e9,
        transfer_s_fixed=1e-3,
        kv_capacity_tokens=KV_BYTES // per_token,
        local_cache_blocks=KV_BYTES // (per_token * block_size),
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m simulator.calibrate")
    ap.add_argument("--model", required=True, help="the tiny model's directory (make model)")
    ap.add_argument("--block-size", type=int, default=32)
    a = ap.parse_args()
    prof = measure(a.model, a.block_size)
    out = PROFILES / f"{prof.name}.json"
    out.write_text(json.dumps(prof.to_json(), indent=2) + "\n")
    print(out)
