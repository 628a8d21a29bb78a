"""Pool transfer metrics, end to end without engines: the connector's counters and latency
buckets (`store.kv_transfer.TransferStats`), their wire form (`worker.servicer.pool_stats`,
`WorkerStats.pool`), and the conductor's per-instance metrics polled from `Stats`
(`conductor.pool_stats`) over fake workers. On real engines: tests/test_e2e.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, fields

import httpx
import pytest
import torch
from fake_worker import Knobs, LocalConductor
from prometheus_client.parser import text_string_to_metric_families

from protos import worker_pb2
from store.kv_transfer import LATENCY_BOUNDS_S, BlockLayout, KVTransfer, TransferStats
from worker.servicer import WorkerServicer, pool_stats

LOOKUPS = {"lookups": 5, "lookup_blocks_hit": 9, "lookup_misses": 1, "lookup_unavailable": 1}
"""What `store.connector.LookupStats` adds to `pool_stats` (not imported: it needs vLLM)."""


def _transfer_without_pool() -> KVTransfer:
    layout = BlockLayout.of([torch.zeros(4, 2, 32, 8)], num_blocks=4)
    return KVTransfer(layout, lambda: None)


def test_every_batch_lands_in_one_latency_bucket_and_stats_add_elementwise(monkeypatch) -> None:
    # a clock of its own, 0.2 ms a reading: on the real one a loaded machine took over 1 ms
    # for a save with no pool (`make test`, 2026-11-26), and the bucket is not what is tested
    ticks = itertools.count(0.0, 0.0002)
    monkeypatch.setattr("store.kv_transfer.time.perf_counter", lambda: next(ticks))
    t = _transfer_without_pool()
    t.save(["a", "b"], [0, 1])
    t.save(["c"], [2])
    t.load(["a"], [0])
    s = t.snapshot()
    assert (s.save_failed, s.save_batches, s.load_failed, s.load_batches) == (3, 2, 1, 1)
    assert len(s.save_buckets) == len(s.load_buckets) == len(LATENCY_BOUNDS_S) + 1
    assert sum(s.save_buckets) == 2 and sum(s.load_buckets) == 1
    assert s.save_buckets[0] == 2 and s.load_buckets[0] == 1  # 0.2 ms each: the first bucket
    assert s.save_seconds == pytest.approx(0.0004) and s.load_seconds == pytest.approx(0.0002)
    both = s.add(s)
    assert both.save_buckets == tuple(2 * n for n in s.save_buckets)
    assert both.save_failed == 6 and both.save_seconds == 2 * s.save_seconds


def test_pool_stats_on_the_wire_carry_every_counter_and_both_histograms() -> None:
    stats = TransferStats(blocks_written=7, bytes_written=7168, blocks_deduplicated=2,
                          save_skipped_full=1, save_failed=3, blocks_saved_generated=4,
                          save_batches=5, save_seconds=0.5, blocks_loaded=6, bytes_loaded=6144,
                          load_failed=1, load_batches=2, load_seconds=0.25,
                          held_abandoned=2, held_abandoned_seconds=3.5, held_preempted=1,
                          held_preempted_seconds=0.25)
    stats.save_buckets = (3, 1) + (0,) * (len(LATENCY_BOUNDS_S) - 2) + (1,)
    # as the engine hands it over: msgpack turns the tuples into lists
    carried = json.loads(json.dumps({**LOOKUPS, **asdict(stats)}))
    wire = pool_stats(carried)
    wire_names = {f.name for f in worker_pb2.PoolStats.DESCRIPTOR.fields}
    for f in fields(TransferStats):
        if f.type == "int" and not f.name.endswith("_batches"):
            assert getattr(wire, f.name) == getattr(stats, f.name), f.name
    assert set(LOOKUPS) <= wire_names
    assert (wire.held_abandoned_seconds, wire.held_preempted_seconds) == (3.5, 0.25)
    assert wire.lookup_misses == 1 and wire.lookups == 5
    assert list(wire.save.bounds) == list(LATENCY_BOUNDS_S)
    assert list(wire.save.counts) == list(stats.save_buckets)
    assert (wire.save.count, wire.save.sum_seconds) == (5, 0.5)
    assert (wire.load.count, wire.load.sum_seconds, sum(wire.load.counts)) == (2, 0.25, 0)


class _Engine:
    load = {"waiting": 2, "kv_usage": 0.25}
    """The engine scheduler's own figures (`worker.telemetry`)."""

    def running(self) -> int:
        return 0


def test_the_worker_keeps_the_newest_snapshot_and_reports_it_in_stats() -> None:
    servicer = WorkerServicer(_Engine(), "prefill-0", "prefill")  # type: ignore[arg-type]
    reply = asyncio.run(servicer.Stats(worker_pb2.StatsRequest(), None))
    assert not reply.HasField("pool")
    assert reply.waiting == 2 and reply.kv_usage == 0.25
    newer = {**LOOKUPS, **asdict(TransferStats(blocks_written=8, save_batches=3))}
    older = {**LOOKUPS, **asdict(TransferStats(blocks_written=4, save_batches=2))}
    servicer._note_pool(newer)
    servicer._note_pool(older)  # handled late: another request finished first
    servicer._note_pool(None)
    reply = asyncio.run(servicer.Stats(worker_pb2.StatsRequest(), None))
    assert reply.pool.blocks_written == 8


def _families(url: str) -> dict[str, list]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels: str) -> float | None:
    return next((s.value for s in samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())),
                None)


def test_conductor_exposes_each_instances_pool_counters(model_dir: str) -> None:
    pool = worker_pb2.PoolStats(
        lookups=5, lookup_misses=1, lookup_unavailable=1, lookup_blocks_hit=9,
        blocks_written=7, bytes_written=7168, blocks_deduplicated=2, save_skipped_full=1,
        blocks_saved_generated=4, blocks_loaded=6, bytes_loaded=6144, load_failed=1,
        held_abandoned=2, held_abandoned_seconds=3.5, held_preempted=1,
        held_preempted_seconds=0.25,
        save=worker_pb2.LatencyHistogram(bounds=[0.01, 0.1], counts=[3, 1, 1], sum_seconds=0.4,
                                         count=5))
    with LocalConductor(model_dir, conductor_args=("--stats-interval-s", "0.1")) as c:
        c.worker("prefill").knobs = Knobs(pool=pool)
        c.worker("decode").knobs = Knobs(stats_delay_s=30.0)  # hung: never answers in time
        deadline = time.monotonic() + 10
        while True:
            fams = _families(c.url)
            blocks = fams.get("kvcluster_pool_blocks", [])
            if _value(blocks, "kvcluster_pool_blocks_total", instance="prefill-0") is not None:
                break
            assert time.monotonic() < deadline, "no pool metrics for prefill-0"
            time.sleep(0.1)
        t0 = time.perf_counter()
        fams = _families(c.url)
        scrape_s = time.perf_counter() - t0
    assert scrape_s < 1.0, f"/metrics took {scrape_s:.2f} s with a hung worker"
    blocks = fams["kvcluster_pool_blocks"]
    name = "kvcluster_pool_blocks_total"
    want = {"saved": 7, "saved_generated": 4, "deduplicated": 2, "save_skipped_full": 1,
            "save_failed": 0, "loaded": 6, "load_failed": 1, "lookup_hit": 9}
    for kind, n in want.items():
        assert _value(blocks, name, instance="prefill-0", kind=kind) == n, kind
    assert all(s.labels["instance"] == "prefill-0" for f in fams if f.startswith("kvcluster_pool")
               for s in fams[f]), "the hung decode worker has no figures"
    nbytes = fams["kvcluster_pool_bytes"]
    assert _value(nbytes, "kvcluster_pool_bytes_total", direction="save") == 7168
    assert _value(nbytes, "kvcluster_pool_bytes_total", direction="load") == 6144
    lookups = fams["kvcluster_pool_lookups"]
    for result, n in (("hit", 3), ("miss", 1), ("unavailable", 1)):
        assert _value(lookups, "kvcluster_pool_lookups_total", result=result) == n, result
    hist = fams["kvcluster_pool_transfer_seconds"]
    bucket = "kvcluster_pool_transfer_seconds_bucket"
    assert _value(hist, bucket, direction="save", le="0.01") == 3
    assert _value(hist, bucket, direction="save", le="0.1") == 4
    assert _value(hist, bucket, direction="save", le="+Inf") == 5
    assert _value(hist, "kvcluster_pool_transfer_seconds_count", direction="save") == 5
    assert _value(hist, "kvcluster_pool_transfer_seconds_sum", direction="save") == 0.4
    assert _value(hist, bucket, direction="load") is None, "no load histogram was reported"
    holds, held = fams["kvcluster_pool_holds"], fams["kvcluster_pool_held_seconds"]
    for cause, n, seconds in (("abandoned_call", 2, 3.5), ("preemption", 1, 0.25)):
        assert _value(holds, "kvcluster_pool_holds_total", cause=cause) == n, cause
        assert _value(held, "kvcluster_pool_held_seconds_total", cause=cause) == seconds, cause
