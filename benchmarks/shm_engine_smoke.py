"""Smoke check of the connector over the shm path: a producer engine and a consumer engine
(each a Mooncake dummy client of one standalone mooncake_client), same prompt, KV loaded."""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import torch

MiB = 1 << 20
BLOCK = 32


def engine(model_dir, role, master, svc, namespace):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="PoolConnector", kv_connector_module_path="store.connector",
        kv_role=role, kv_load_failure_policy="recompute",
        kv_connector_extra_config={"master_addr": master.master_addr,
                                   "metadata_url": master.metadata_url,
                                   "namespace": namespace, "op_timeout_s": 10.0,
                                   "store_client": svc.address,
                                   "store_client_segment": svc.segment_name})
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    llm = LLM(model=model_dir, block_size=BLOCK, dtype="float32", max_model_len=1024,
              enforce_eager=True, kv_cache_memory_bytes=64 * MiB, enable_prefix_caching=True,
              kv_transfer_config=ktc, disable_log_stats=True)
    procs = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    return llm, procs


def run(llm, prompt, max_tokens=8):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    c = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
    return (list(c.token_ids), logprobs,
            out.num_cached_tokens or 0, (out.kv_transfer_params or {}).get("pool_stats"))


def main() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from store.master import StoreClientService, StoreMaster
    from tinymodel.builder import ensure_model

    model_dir = str(ensure_model())
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 2048, (5 * BLOCK + 7,), generator=gen).tolist()
    engines = []
    with StoreMaster() as master:
        svc = StoreClientService(master, segment="256MB").start()
        try:
            p, pp = engine(model_dir, "kv_producer", master, svc, "smoke")
            engines.append(pp)
            a = run(p, prompt)
            time.sleep(2)
            print("producer", a[2], run(p, [5, 6, 7], 1)[3], flush=True)
            c, cp = engine(model_dir, "kv_consumer", master, svc, "smoke")
            engines.append(cp)
            b = run(c, prompt)
            print("consumer cached", b[2], "stats", b[3], flush=True)
            same = a[0] == b[0] and all(abs(x - y) < 1e-3 for x, y in zip(a[1], b[1], strict=True))
            print("SMOKE", "same tokens+logprobs:", same, "cached:", b[2], flush=True)
        finally:
            for procs in engines:
                for pr in procs:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        pr.kill()
                psutil.wait_procs(procs, timeout=10)
            svc.stop()


if __name__ == "__main__":
    main()
