"""One vLLM engine, in this process, with the pool connector over an in-memory pool that gives
up on every write, which then reads the blocks only later (a Mooncake write abandoned after
`op_timeout_s` that completes once the network is back). Run by tests/test_preempt_save.py;
prints one line "RESULT <json>".

1. Prompts X and Y decode together in a KV cache too small for both: vLLM preempts one of
   them (Y), frees its blocks and gives them to the other in that very step. Y's saves have
   not read them yet: the writes land `late_s` after the preemption (a timer started then).
2. Every write records the bytes of its blocks as they were when it was made; as it lands,
   the object stored must be those bytes (`mismatched`: keys whose object is not).
3. Y's stream is continued from the pool as a stream migrating after its decode instance
   died is: its prompt plus the tokens it generated before the preemption, with the engine's
   own prefix cache emptied, loads every full block of that from the pool (the prompt's and
   the one its tokens filled) and must go on as Y did.

argv: model directory. Settings on stdin as JSON: {"kv_cache_bytes", "late_s"}.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

BLOCK = 32


def main() -> None:
    model = sys.argv[1]
    job = json.loads(sys.stdin.read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine here: the pool patched in
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory(prefix="kvcluster-preempt-") as scratch:
        os.environ["VLLM_RPC_BASE_PATH"] = os.environ["TMPDIR"] = scratch
        tempfile.tempdir = scratch
        print("RESULT " + json.dumps(_run(model, job)), flush=True)


def _run(model: str, job: dict) -> dict:
    import torch

    import store.connector.connector as connector
    import store.connector.worker as worker
    from store.pool import InMemoryPool
    from store.pool.protocol import Ranges

    class WritesLate(InMemoryPool):
        """Every write given up on; each records its blocks' bytes as they were when made."""

        made: dict[str, bytes] = {}

        def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                     segment: str | None = None, fences=None):
            for key, rs in zip(keys, ranges, strict=True):
                self.made.setdefault(key, b"".join(ctypes.string_at(a, n) for a, n in rs))
            return super().put_from(keys, ranges, segment=segment, fences=fences)

    pool = WritesLate()
    late = pool.late = threading.Event()

    class Shared:
        def get(self) -> WritesLate:
            return pool

    connector.shared_pool = lambda settings: Shared()
    # a worker that gives up waiting after a fixed time (it did, after 30 s) shows it here
    worker._PREEMPT_WAIT_S = 0.5  # type: ignore[attr-defined]
    preempted: list[str] = []
    waited: list[float] = []
    handle = worker.WorkerSide.handle_preemptions

    def handle_preemptions(self, meta) -> None:  # type: ignore[no-untyped-def]
        if meta.preempted and not preempted:
            threading.Timer(job["late_s"], late.set).start()
        preempted.extend(sorted(meta.preempted))
        t0 = time.monotonic()
        handle(self, meta)
        if meta.preempted:
            waited.append(time.monotonic() - t0)

    worker.WorkerSide.handle_preemptions = handle_preemptions  # type: ignore[method-assign]

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="PoolConnector", kv_connector_module_path="store.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"master_addr": "-", "metadata_url": "-",
                                   "namespace": "preempt", "load_poll_s": 0.001})
    llm = LLM(model=model, block_size=BLOCK, dtype="float32", max_model_len=256,
              enforce_eager=True, kv_cache_memory_bytes=job["kv_cache_bytes"],
              enable_prefix_caching=True, kv_transfer_config=ktc, disable_log_stats=True)
    gen = torch.Generator().manual_seed(0)

    def prompt(tokens: int) -> list[int]:
        return torch.randint(3, 2000, (tokens,), generator=gen).tolist()

    def run(prompts: list[list[int]], max_tokens: int) -> list[dict]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1,
                                ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                 "lps": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                        o.outputs[0].logprobs, strict=True)],
                 "kv": o.kv_transfer_params or {}} for o in outs]

    # each holds 4 of the 8 blocks at 128 tokens; the next block one needs preempts the other
    x, y = prompt(3 * BLOCK + 7), prompt(3 * BLOCK + 7)
    _, first_y = run([x, y], max_tokens=40)
    late.set()  # had there been no preemption
    deadline = time.monotonic() + 60
    while len(pool) < len(pool.made) and time.monotonic() < deadline:
        time.sleep(0.05)  # the late writes landing
    mismatched = [k for k, made in pool.made.items() if pool._data.get(k) != made]
    pool.late = None
    while not llm.reset_prefix_cache():  # blocks held for writes are freed at later steps
        assert time.monotonic() < deadline, "the prefix cache could not be reset"
        run([[5, 6, 7]], max_tokens=1)
    sent = 4 * BLOCK - len(y) + 5  # Y's tokens up to the preemption, and a few more
    (again_y,) = run([y + first_y["ids"][:sent]], max_tokens=8)
    return {"preempted": preempted, "waited_s": waited, "writes": len(pool.made),
            "mismatched": len(mismatched), "y_first": first_y, "y_again": again_y,
            "sent": sent}


if __name__ == "__main__":
    main()
