"""What the engine measures about itself, for the conductor: per request, its stage times
(`worker_pb2.EngineTimes`, from vLLM's own request metrics and our connector's load times);
per engine, its scheduler's queue and KV use (a vLLM stat logger)."""

from __future__ import annotations

import time
from typing import Any

from protos import worker_pb2
from worker.progress import Progress

_MONO_TO_WALL = time.time() - time.monotonic()
"""vLLM's engine-core timestamps are `time.monotonic()` (one clock for every process of the
host); the timeline is wall-clock."""


def engine_times(out: Any, received: float) -> worker_pb2.EngineTimes:
    """The stage times a `RequestOutput` carries (`metrics`: vLLM's `RequestStateStats`, set
    when the engine records stats; `kv_transfer_params["pool_times"]`: the connector's, on the
    finished output). `received`: when the RPC reached the worker (wall clock)."""
    t = worker_pb2.EngineTimes(received=received)
    m = getattr(out, "metrics", None)
    if m is not None and getattr(m, "queued_ts", 0.0):
        t.queued = m.queued_ts + _MONO_TO_WALL
        if m.scheduled_ts:
            t.scheduled = m.scheduled_ts + _MONO_TO_WALL
        if m.first_token_ts:
            t.first_token = m.first_token_ts + _MONO_TO_WALL
    pool = (getattr(out, "kv_transfer_params", None) or {}).get("pool_times")
    if pool:
        t.kv_wait = float(pool.get("wait_s", 0.0))
        t.kv_load = float(pool.get("load_s", 0.0))
        t.kv_blocks = int(pool.get("blocks", 0))
    return t


def load_logger_factory(sink: dict[str, float], progress: Progress | None = None):
    """A vLLM `StatLoggerFactory` whose loggers keep the engine's latest queue and KV use in
    `sink` (`waiting`, `running`, `kv_usage`) and tell `progress` of every step (vLLM calls
    them once per engine step). Passing it to `AsyncLLM` turns vLLM's request metrics on
    without its default loggers."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                sink["waiting"] = (scheduler_stats.num_waiting_reqs
                                   + scheduler_stats.num_skipped_waiting_reqs)
                sink["running"] = scheduler_stats.num_running_reqs
                sink["kv_usage"] = scheduler_stats.kv_cache_usage
            if progress is not None:  # no stats: as if it held work (a check corrects it)
                progress.stepped(scheduler_stats is None
                                 or sink["waiting"] + sink["running"] > 0)

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger
