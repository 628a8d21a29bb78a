"""One vLLM engine, in this process, with the pool connector over an in-memory pool whose reads
the pool gives up on and that land later (a Mooncake read abandoned after `op_timeout_s`
that completes once the network is back). Run by tests/test_late_read.py; prints one line
"RESULT <json>".

1. Prompt X is computed once (its blocks saved to the pool), then dropped from the engine's
   prefix cache, so that asking X again loads its blocks from the pool.
2. Reads are made late. X is asked again together with a longer prompt Y, which the engine
   prefills in chunks of two blocks; X's load is given up on with nothing valid (no local
   prefix hit). Y's length is chosen so that, the step after X's blocks are freed, Y needs a
   new block (for its first generated token) before X asks for blocks again.
3. As the late read lands (`late_s` after), `landed_in` records who holds each block it
   writes: the prompt length of the request, None for a free block. Y is asked again after,
   answered from its prefix cache.

argv: model directory. Settings on stdin as JSON: {"kv_cache_bytes", "late_s"}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

BLOCK = 32


def main() -> None:
    model = sys.argv[1]
    job = json.loads(sys.stdin.read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine here: the pool patched in
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory(prefix="kvcluster-late-") as scratch:
        os.environ["VLLM_RPC_BASE_PATH"] = os.environ["TMPDIR"] = scratch
        tempfile.tempdir = scratch
        print("RESULT " + json.dumps(_run(model, job)), flush=True)


def _run(model: str, job: dict) -> dict:
    import torch

    import store.connector.connector as connector
    from store.pool import InMemoryPool
    from store.pool.protocol import Ranges

    class ReadsLate(InMemoryPool):
        """Writes are never late here; reads are once `late` is set up. As a late read lands,
        `landed_in` records who holds the blocks it writes (`holders`)."""

        landed = threading.Event()
        holders: Callable | None = None
        landed_in: list[int | None] = []

        def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                     segment: str | None = None, fences=None):
            return self._put_now(keys, ranges)

        def _get_now(self, keys: Sequence[str], ranges: Sequence[Ranges]) -> list[bool]:
            late = threading.current_thread().name == "late-call"  # `InMemoryPool._abandoned`
            if late and self.holders is not None:
                self.landed_in = self.holders(ranges)
            ok = super()._get_now(keys, ranges)
            if late:
                self.landed.set()
            return ok

    pool = ReadsLate()

    class Shared:
        def get(self) -> ReadsLate:
            return pool

    connector.shared_pool = lambda settings: Shared()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="PoolConnector", kv_connector_module_path="store.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"master_addr": "-", "metadata_url": "-",
                                   "namespace": "late", "load_poll_s": 0.001})
    llm = LLM(model=model, block_size=BLOCK, dtype="float32", max_model_len=512,
              enforce_eager=True, kv_cache_memory_bytes=job["kv_cache_bytes"],
              max_num_batched_tokens=2 * BLOCK, enable_prefix_caching=True,
              kv_transfer_config=ktc, disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    pool.holders = _holders(llm)
    gen = torch.Generator().manual_seed(0)

    def prompt(tokens: int) -> list[int]:
        return torch.randint(3, 2000, (tokens,), generator=gen).tolist()

    def run(*prompts: list[int]) -> list[dict]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                 "lps": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                        o.outputs[0].logprobs, strict=True)],
                 "kv": {k: v for k, v in (o.kv_transfer_params or {}).items()
                        if k != "pool_stats"}} for o in outs]

    # Y's last chunk (32 tokens) leaves 32 for X's first after X's blocks were freed; in the
    # next step Y, running, needs a new block for its first generated token before X asks
    x, y = prompt(5 * BLOCK + 7), prompt(11 * BLOCK)
    (first_x,) = run(x)
    deadline = time.monotonic() + 30
    while len(pool) < 5 and time.monotonic() < deadline:  # the saver's writes
        time.sleep(0.05)
    # X's blocks are freed once its saves are reported, at a later step: a tiny request
    while not llm.reset_prefix_cache():  # (no full block: it moves nothing) makes steps
        assert time.monotonic() < deadline, "the prefix cache could not be reset"
        run([5, 6, 7])

    pool.late = threading.Event()
    threading.Timer(job["late_s"], pool.late.set).start()
    t0 = time.monotonic()
    again_x, first_y = run(x, y)  # Y is prefilled in chunks of two blocks meanwhile
    together_s = time.monotonic() - t0
    assert pool.landed.wait(60), "the late read never landed"
    pool.late = None
    (again_y,) = run(y)
    return {"x_first": first_x, "x_again": again_x, "y_first": first_y, "y_again": again_y,
            "together_s": together_s, "x_tokens": len(x), "landed_in": pool.landed_in}


def _holders(llm) -> Callable:
    """ranges -> per object, the prompt length of the request holding the block it lands in
    (None: a free block), from the engine's own scheduler and the connector's layout."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layout = get_kv_transfer_group().worker_side.transfer.layout
    block_of = {layout.ranges(b)[0][0]: b for b in range(layout.num_blocks)}
    sched = llm.llm_engine.engine_core.engine_core.scheduler

    def holders(ranges) -> list[int | None]:
        owner: dict[int, int] = {}
        for req in list(sched.requests.values()):
            for b in sched.kv_cache_manager.get_block_ids(req.request_id)[0]:
                owner[b] = req.num_prompt_tokens
        return [owner.get(block_of[r[0][0]]) for r in ranges]
    return holders


if __name__ == "__main__":
    main()
