"""An engine stepped by hand: vLLM's own v1 `Scheduler` (the tiny model's config, a KV cache of
a few blocks) with our connector's scheduler side, our connector's worker side over a small
fake paged cache, and a forward pass that writes into each scheduled request's blocks the KV
of their tokens: every element of a full block is `mark(key)` of its pool key, of a block
still filling `PARTIAL`. So any object in the pool is right only if it holds its own key's
mark (`wrong_objects`), whoever wrote it, whenever it was read out of the cache.

A step calls what vLLM calls, in vLLM's order (`EngineCore.step`, `GPUModelRunner.execute_model`,
`KVConnectorModelRunnerMixin`): schedule; the worker's `handle_preemptions`; the forward pass;
`start_load_kv`, `wait_for_save`, `get_finished`, `invalid_blocks`, `worker_meta`; then the
aborts that arrived while the step ran (`EngineCore._process_aborts_queue`), and only then
`update_from_output`. `schedule` and `execute` are apart so that a test can run a step's
worker part on a thread of its own, and see whether it blocks.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable

import numpy as np
import torch

BLOCK = 16
PARTIAL = -1.0
NAMESPACE = "steps"


def mark(key: str) -> float:
    """The value every element of the block with pool key `key` holds once computed."""
    return float(zlib.crc32(key.encode()) % (1 << 20) + 1)


class SteppedEngine:
    def __init__(self, model_dir: str, pool, num_blocks: int, role: str = "kv_both",
                 max_batched_tokens: int = 256) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        import store.connector.connector as connector
        from store.connector.settings import ConnectorSettings
        from store.connector.worker import WorkerSide

        class Shared:
            def get(self):
                return pool

        connector.shared_pool = lambda settings: Shared()  # type: ignore[assignment]
        extra = {"master_addr": "-", "metadata_url": "-", "namespace": NAMESPACE,
                 "load_poll_s": 0.001}
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, dtype="float32", seed=0,
                                     max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8,
                                             max_num_batched_tokens=max_batched_tokens,
                                             max_model_len=1024, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PoolConnector", kv_connector_module_path="store.connector",
                kv_role=role, kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra),
            device_config=DeviceConfig("cpu"))
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=BLOCK, log_stats=True)
        self.layers = [torch.zeros(num_blocks, 2, BLOCK, 4) for _ in range(2)]
        self.worker = WorkerSide(ConnectorSettings(**extra), Shared(),  # type: ignore[arg-type]
                                 saves=config.kv_transfer_config.is_kv_producer)
        self.worker.register_kv_caches({f"l{i}": t for i, t in enumerate(self.layers)},
                                       num_blocks)
        self.pool = pool
        self.preempted: set[str] = set()
        self.outputs: dict[str, list[int]] = {}

    # ---------------------------------------------------------------- requests

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, None)
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
            pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256)))

    def keys(self, tokens: list[int]) -> list[str]:
        from store.block_hash import block_hashes, block_key

        return [block_key(NAMESPACE, h) for h in block_hashes(tokens, BLOCK)]

    def pooled(self, tokens: list[int]) -> None:
        """Put the KV of `tokens`' full blocks in the pool, as another engine would."""
        nbytes = self.worker.transfer.layout.block_nbytes  # type: ignore[union-attr]
        self.pool.put_many([(k, np.full(nbytes // 4, mark(k), np.float32).tobytes())
                            for k in self.keys(tokens)])

    # ---------------------------------------------------------------- steps

    def schedule(self):
        out = self.scheduler.schedule()
        self.preempted |= set(out.preempted_req_ids or ())
        return out

    def execute(self, out, aborts: Iterable[str] = ()) -> None:
        """The step's worker part, the aborts that arrived meanwhile, `update_from_output`."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        meta = out.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(meta)
        sampled = self._forward(out)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        sent, received = worker.get_finished(out.finished_req_ids)
        kv = KVConnectorOutput(finished_sending=sent, finished_recving=received,
                               invalid_block_ids=worker.invalid_blocks(),
                               kv_connector_worker_meta=worker.worker_meta())
        ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[sampled[r] for r in ids],
                                   kv_connector_output=kv)
        aborts = set(aborts)
        if aborts:
            self.scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        self.scheduler.update_from_output(out, result)

    def step(self, aborts: Iterable[str] = ()) -> None:
        self.execute(self.schedule(), aborts)

    def run(self, until, steps: int = 2000) -> None:
        """Step until `until()` holds (the steps' loads run on the loader's thread)."""
        for _ in range(steps):
            if until():
                return
            self.step()
            threading.Event().wait(0.001)
        raise AssertionError("not reached in time")

    def _forward(self, out) -> dict[str, list[int]]:
        """Write each scheduled request's KV into its blocks; a token for each request whose
        prompt is done."""
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens  # the schedule advanced it already
            tokens = list(req.all_token_ids)
            keys = self.keys(tokens[:end])
            blocks = self.block_ids(rid)
            for b in range((end - n) // BLOCK, (end + BLOCK - 1) // BLOCK):
                value = mark(keys[b]) if b < len(keys) else PARTIAL
                for t in self.layers:
                    t[blocks[b]].fill_(value)
            done = end >= req.num_tokens
            sampled[rid] = [(sum(tokens[-3:]) * 31 + len(tokens)) % 1000 + 3] if done else []
            if done:
                self.outputs.setdefault(rid, []).append(sampled[rid][0])
        return sampled

    # ---------------------------------------------------------------- what holds

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks vLLM's scheduler gives `request_id` now (none once freed)."""
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return [b.block_id for b in manager.req_to_blocks.get(request_id, [])]

    def owners(self, block_id: int) -> set[str]:
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return {rid for rid, blocks in manager.req_to_blocks.items()
                if any(b.block_id == block_id for b in blocks)}

    def wrong_objects(self) -> list[str]:
        """Keys whose object in the pool is not the KV of their own tokens."""
        wrong = []
        for key in list(self.pool._data):
            value = np.frombuffer(self.pool._data[key], np.float32)
            if not np.all(value == mark(key)):
                wrong.append(key)
        return wrong

    def leaks(self) -> list[str]:
        """What a drained engine must not hold: requests, or blocks in use."""
        s = self.scheduler
        pool = s.kv_cache_manager.block_pool
        out = [f"request {r}" for r in s.requests]
        used = pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks
        if used:
            out.append(f"{used} blocks in use")
        return out
