"""A standalone vLLM engine, no connector, no disaggregation: the reference the cluster's output
must equal. Reads {"model", "block_size", "max_model_len", "dtype", "prompts": [[ids...]],
"max_tokens", optional "runner_up": true, optional "threads": N} as JSON on stdin; writes
[{"token_ids", "logprobs" (, "runner_up": [[token, logprob] per position])}] on the stdout
line that starts with
"RESULT " (vLLM logs to stdout too). The runner-up tells an exact tie (two tokens of equal
logit, which float noise may order either way) from a real difference.

"threads" sets the engine's OpenMP threads (else the environment's): the reference must compute
with as many threads as the engines it is compared with, because on some CPUs (AVX2-only ones)
float32 GEMM results move in the last bits with the thread count; at equal threads, batching
and a cached prefix change nothing (docs/design.md, "Exact comparisons")."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if job.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(int(job["threads"]))
    # vLLM's socket files (`cluster.process.IPC_ENV`) and its engine core's torch.distributed
    # store file (in the temporary directory; an eager engine compiles nothing there): ours
    with tempfile.TemporaryDirectory(prefix="kvcluster-ref-") as scratch:
        os.environ["VLLM_RPC_BASE_PATH"] = os.environ["TMPDIR"] = scratch
        tempfile.tempdir = scratch
        _run(job)


def _run(job: dict) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], block_size=job["block_size"], dtype=job["dtype"],
              max_model_len=job["max_model_len"], enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    runner_up = bool(job.get("runner_up"))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                            logprobs=2 if runner_up else 1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params)
    result = []
    for out in outs:
        comp = out.outputs[0]
        item = {
            "token_ids": list(comp.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs,
                                                                 strict=True)],
        }
        if runner_up:
            item["runner_up"] = [
                next(([k, v.logprob] for k, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob)
                      if k != t), [-1, float("-inf")])
                for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
        result.append(item)
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
