"""The pool's transfer counters per instance, for /metrics.

Every instance's `Stats` RPC is polled every `interval_s` (`PoolStatsPoller`); the reply's
`pool` (the engine's KV connector counters, cumulative) is kept once the instance is admitted
(`conductor.registry`: it proved itself; its figures price every request's transfers), and
`PoolCollector` turns the latest ones into Prometheus metrics at scrape time. A scrape never
calls a worker: a slow or dead one only leaves its last figures in place until it leaves
membership.

The figures are as fresh as the last request that finished in each engine: a request carries
the counters out when it finishes, before its own background saves are done, so a prefill
instance's saves are counted once the next request finished there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

import structlog
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from conductor.registry import Instance, PerInstance, Registry
from protos import worker_pb2

log = structlog.get_logger(__name__)

BLOCK_KINDS = {
    "saved": "blocks_written",
    "saved_generated": "blocks_saved_generated",
    "deduplicated": "blocks_deduplicated",
    "save_skipped_full": "save_skipped_full",
    "save_failed": "save_failed",
    "loaded": "blocks_loaded",
    "load_failed": "load_failed",
    "checksum_failed": "checksum_failed",
    "lookup_hit": "lookup_blocks_hit",
}
"""`kvcluster_pool_blocks_total{kind}`: the `PoolStats` field each kind counts."""


class PoolStatsPoller(PerInstance):
    """Follows the registry: one polling task per instance, `latest` its last `PoolStats`."""

    task_name = "pool-stats"

    def __init__(self, registry: Registry, interval_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = interval_s
        self.latest: dict[str, worker_pb2.PoolStats] = {}
        super().__init__(registry)

    def instance_left(self, inst: Instance) -> None:
        super().instance_left(inst)
        self.latest.pop(inst.instance_id, None)

    def seconds_per_block(self, min_blocks: int = 64) -> float | None:
        """The pool's measured time per block moved (loads and saves of every engine, their
        batches' fixed costs included); None until `min_blocks` were moved."""
        blocks = seconds = 0.0
        for s in self.latest.values():
            blocks += s.blocks_loaded + s.blocks_written
            seconds += s.load.sum_seconds + s.save.sum_seconds
        return seconds / blocks if blocks >= min_blocks else None

    async def _run(self, inst: Instance) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                reply = await inst.stub.Stats(worker_pb2.StatsRequest(), timeout=self.timeout_s)
                if reply.HasField("pool") and inst.admitted:  # a stranger's figures: none
                    self.latest[inst.instance_id] = reply.pool
            except asyncio.CancelledError:
                raise
            except Exception as e:  # unreachable, slow, closing: the health checker acts
                log.debug("pool_stats_failed", instance_id=inst.instance_id, error=repr(e))
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.05))


class PoolCollector(Collector):
    """`kvcluster_pool_*` metrics per instance from the latest `PoolStats`, at scrape."""

    def __init__(self, latest: Callable[[], Mapping[str, worker_pb2.PoolStats]]) -> None:
        self._latest = latest

    def collect(self) -> Iterable[Metric]:
        stats = sorted(self._latest().items())
        blocks = CounterMetricFamily(
            "kvcluster_pool_blocks", "KV blocks through the instance's pool connector, by kind: "
            "saved (of which saved_generated), deduplicated (already pooled, not written), "
            "save_skipped_full, save_failed, loaded, load_failed (recomputed; of which "
            "checksum_failed: arrived whole, did not match their digest), lookup_hit.",
            labels=["instance", "kind"])
        nbytes = CounterMetricFamily("kvcluster_pool_bytes", "KV bytes written to (save) and "
                                     "read from (load) the pool.",
                                     labels=["instance", "direction"])
        lookups = CounterMetricFamily("kvcluster_pool_lookups", "Prompt lookups in the pool, "
                                      "by result: hit (every usable block found), miss (fewer), "
                                      "unavailable (no pool: recomputed).",
                                      labels=["instance", "result"])
        seconds = HistogramMetricFamily("kvcluster_pool_transfer_seconds", "Latency of one "
                                        "save or load batch of a request's blocks.",
                                        labels=["instance", "direction"])
        holds = CounterMetricFamily(
            "kvcluster_pool_holds", "Requests whose KV blocks stayed allocated for a pool call "
            "that could still read or write them, by cause: abandoned_call (a call given up on "
            "after its timeout, until it returned), preemption (the engine's step waited for "
            "a preempted request's saves before vLLM could reuse its blocks).",
            labels=["instance", "cause"])
        held = CounterMetricFamily("kvcluster_pool_held_seconds", "Seconds of those holds "
                                   "(kvcluster_pool_holds), by cause.",
                                   labels=["instance", "cause"])
        for iid, s in stats:
            for kind, name in BLOCK_KINDS.items():
                blocks.add_metric([iid, kind], getattr(s, name))
            nbytes.add_metric([iid, "save"], s.bytes_written)
            nbytes.add_metric([iid, "load"], s.bytes_loaded)
            found = s.lookups - s.lookup_misses - s.lookup_unavailable
            for result, n in (("hit", found), ("miss", s.lookup_misses),
                              ("unavailable", s.lookup_unavailable)):
                lookups.add_metric([iid, result], n)
            for direction, h in (("save", s.save), ("load", s.load)):
                if len(h.counts) == len(h.bounds) + 1:
                    seconds.add_metric([iid, direction], _cumulative(h), h.sum_seconds)
            for cause, n, secs in (
                    ("abandoned_call", s.held_abandoned, s.held_abandoned_seconds),
                    ("preemption", s.held_preempted, s.held_preempted_seconds)):
                holds.add_metric([iid, cause], n)
                held.add_metric([iid, cause], secs)
        yield from (blocks, nbytes, lookups, seconds, holds, held)

    def describe(self) -> Iterable[Metric]:
        return []


def _cumulative(h: worker_pb2.LatencyHistogram) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*map(str, h.bounds), "+Inf"], h.counts, strict=True):
        total += n
        out.append((bound, total))
    return out
