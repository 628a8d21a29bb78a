"""The vLLM engine of a worker, in-process (`AsyncLLM`), with our pool connector loaded."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import structlog

from cluster.instance import cpu_list
from cluster.process import DIST_ENV, IPC_ENV, vllm_scratch
from store.namespace import kv_namespace
from worker.config import WorkerConfig
from worker.dtype import resolve as resolve_dtype
from worker.progress import Progress
from worker.vllm_plugin import (
    CPU_SEEDS_ENV,
    CPU_VLLM_ENV,
    FINISH_FIRST_ENV,
    PARENT_ENV,
    step_budgeted,
)

log = structlog.get_logger(__name__)

PROBE_TOKEN_RANGE = (100, 1000)
"""Token ids a speed probe draws from: inside any real vocabulary."""

FORCED_FIRST_TOKEN_PROCESSOR = "worker.forced_token:ForcedFirstToken"
"""Loaded by every engine: a decode makes its first token the prefill's (`worker.forced_token`)."""


@dataclass(frozen=True)
class PrefillResult:
    num_prompt_tokens: int
    num_cached_tokens: int
    blocks_saved: int
    blocks_in_pool: int
    engine_seconds: float
    output: Any = None
    """The final `RequestOutput` (its metrics and kv_transfer_params)."""
    pool_stats: dict | None = None
    """The connector's cumulative counters the request carried out (`kv_transfer_params`)."""


class Engine:
    """One `AsyncLLM` configured from a `WorkerConfig`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.dtype = resolve_dtype(config.model, config.dtype)
        """What the engine computes in ("auto" resolved, `worker.dtype`)."""
        self.namespace = kv_namespace(config.model, config.block_size, self.dtype,
                                      checksum=config.kv_checksum)
        self._llm = None
        self.relay = None
        """The KV event relay (`worker.kv_events`), when `config.kv_events`."""
        self.load: dict[str, float] = {}
        """The engine scheduler's latest queue and KV use (`worker.telemetry`)."""
        from store.connector.settings import ConnectorSettings

        self.progress = Progress(config.stall_floor_s, config.stall_factor,
                                 config.stall_warmup_steps,
                                 pool_wait_s=ConnectorSettings.op_timeout_s)
        """Whether the engine makes progress (`worker.progress`): each step reports to it."""
        self._ipc_dir = ""
        """Where its processes' ZeroMQ sockets are (`IPC_ENV`), removed at shutdown."""

    def start(self) -> None:
        # Imported here: vLLM is heavy and the engine-core process is spawned.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.config.device == "cpu":  # read by its engine's processes (`worker.vllm_plugin`)
            os.environ[CPU_SEEDS_ENV] = "1"
            os.environ.setdefault(FINISH_FIRST_ENV, "1")
            for k, v in CPU_VLLM_ENV.items():
                os.environ.setdefault(k, v)
        self._claim_ipc_dir()
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        c = self.config
        if current_platform.device_type != c.device:
            raise RuntimeError(f"--device {c.device} but the installed vLLM build runs on "
                               f"{current_platform.device_type}: install the matching extra")
        ktc = KVTransferConfig(
            kv_connector="PoolConnector",
            kv_connector_module_path="store.connector",
            kv_role=c.kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "master_addr": c.pool_master,
                "metadata_url": c.pool_metadata,
                "namespace": self.namespace,
                "segment_bytes": c.pool_segment_bytes,
                # other nodes read this engine's segment there (loopback in the embedded
                # cluster, the advertised address on a real one)
                "local_host": c.advertise_host,
                "store_client": c.pool_store_client,
                "store_client_segment": c.pool_store_client_segment,
                "checksum": c.kv_checksum,
            },
        )
        args = AsyncEngineArgs(
            model=c.model,
            served_model_name=[c.served_model_name],
            dtype=self.dtype,
            block_size=c.block_size,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens or None,
            kv_cache_memory_bytes=c.kv_cache_bytes,
            enable_prefix_caching=True,
            enforce_eager=c.enforce_eager,
            kv_transfer_config=ktc,
            disable_log_stats=True,
            logits_processors=[FORCED_FIRST_TOKEN_PROCESSOR],
        )
        if c.kv_events:
            import asyncio

            from worker.kv_events import KvEventRelay

            self.relay = KvEventRelay(c.block_size)
            self.relay.start(asyncio.get_running_loop())
            args.kv_events_config = self.relay.events_config()
        from worker.telemetry import load_logger_factory

        with _forking_on(c.engine_core_cpus or c.engine_cpus), _dying_with_me():
            self._llm = AsyncLLM.from_engine_args(
                args, stat_loggers=[load_logger_factory(self.load, self.progress)])
        log.info("engine_started", model=c.model, role=c.role, namespace=self.namespace)

    def _claim_ipc_dir(self) -> None:
        """A socket directory of the engine's own (`IPC_ENV`), unless one is set (by the
        launcher that started this worker: `cluster.process.vllm_scratch`)."""
        self._ipc_dir = vllm_scratch(os.environ) or ""

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("engine not started")
        return self._llm

    @staticmethod
    def _prompt(token_ids: list[int], cache_salt: str) -> dict:
        prompt: dict = {"prompt_token_ids": token_ids}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        return prompt

    @staticmethod
    def with_pool_wait(params: Any, pool_wait: tuple[int, float] | None) -> Any:
        """`params` telling our connector what the pool holds of the prompt (`PoolWait`)."""
        if pool_wait is not None:
            blocks, wait_s = pool_wait
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": {
                "pool_wait": {"blocks": blocks, "wait_s": wait_s}}}
        return params

    async def prefill(self, request_id: str, token_ids: list[int], cache_salt: str,
                      pool_wait: tuple[int, float] | None = None,
                      params: Any = None) -> PrefillResult:
        """Compute the prompt so its blocks reach the pool (the saves finish in the
        background) and sample one token: with `params` (vLLM's, the request's) as the request
        would, else greedy and discarded."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        if params is None:
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        else:
            params.n, params.max_tokens = 1, 1
            params.min_tokens = min(params.min_tokens, 1)
        params = self.with_pool_wait(params, pool_wait)
        self.progress.submitted()
        final = None
        async for out in self.llm.generate(self._prompt(token_ids, cache_salt), params,
                                           request_id):
            final = out
        assert final is not None
        ktp = final.kv_transfer_params or {}
        return PrefillResult(
            num_prompt_tokens=len(token_ids),
            num_cached_tokens=final.num_cached_tokens or 0,
            blocks_saved=int(ktp.get("pool_blocks_saved", 0)),
            blocks_in_pool=int(ktp.get("pool_blocks_in_pool", 0)),
            engine_seconds=time.perf_counter() - t0,
            output=final,
            pool_stats=ktp.get("pool_stats"),
        )

    async def probe_prefill(self, tokens: int, runs: int = 2) -> float:
        """Seconds to prefill `tokens` tokens here, the best of `runs` (the first also warms
        the engine up): distinct random prompts under a random cache salt, so that no cache
        serves them and no request ever shares their blocks."""
        rng = random.Random()
        best = float("inf")
        for _ in range(runs):
            ids = [rng.randrange(PROBE_TOKEN_RANGE[0], PROBE_TOKEN_RANGE[1])
                   for _ in range(tokens)]
            result = await self.prefill(f"probe-{uuid.uuid4().hex}", ids,
                                        f"probe-{uuid.uuid4().hex}")
            best = min(best, result.engine_seconds)
        return best

    def generate(self, request_id: str, token_ids: list[int], params, cache_salt: str,
                 pool_wait: tuple[int, float] | None = None,
                 first_token: int | None = None) -> AsyncIterator:
        """Stream `RequestOutput` deltas; cancelling the iterator aborts the engine request.
        `first_token`: what the first output token must be (`worker.forced_token`)."""
        if first_token is not None:
            from worker.forced_token import forced

            forced(params, first_token)
        self.progress.submitted()
        return self.llm.generate(self._prompt(token_ids, cache_salt),
                                 self.with_pool_wait(params, pool_wait), request_id)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def set_step_target(self, step_ms: float) -> float | None:
        """The engine core's step target beside streams, from its next step on; None where
        it was started without a step budget (`worker.step_budget`)."""
        if not step_budgeted():  # its engine core read the same environment at start
            return None
        return await self.llm.engine_core.call_utility_async("kvcluster_step_target", step_ms)

    def kv_capacity_tokens(self) -> int:
        """The engine's KV cache size in tokens (0 before it is known)."""
        blocks = self.llm.vllm_config.cache_config.num_gpu_blocks or 0
        return blocks * self.config.block_size

    def running(self) -> int:
        try:
            return self.llm.output_processor.get_num_unfinished_requests()
        except AttributeError:
            return 0

    async def ping(self) -> None:
        """Returns once the engine core answered a call (between two of its steps)."""
        await self.llm.is_sleeping()

    def dead(self) -> BaseException | None:
        """Why the engine core is dead (a fatal error in a step, its process killed), or None
        while it serves."""
        if self._llm is None or not self._llm.errored:
            return None
        return self._llm.dead_error

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        if self._ipc_dir:  # and the variable pointing at it, for an engine started next
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            for name in (IPC_ENV, DIST_ENV):
                if os.environ.get(name) == self._ipc_dir:
                    del os.environ[name]
            self._ipc_dir = ""


@contextlib.contextmanager
def _dying_with_me() -> Iterator[None]:
    """The engine's processes, started inside, die with this one (`worker.vllm_plugin`)."""
    os.environ[PARENT_ENV] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(PARENT_ENV, None)


@contextlib.contextmanager
def _forking_on(cpus: str) -> Iterator[None]:
    """The engine's processes, forked inside, start on `cpus` (a child inherits its forking
    thread's affinity); then every thread of this process gets its own cores back."""
    if not cpus:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpu_list(cpus))
    try:
        yield
    finally:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), own)
