"""Follows each worker's `KvEvents` stream into the KV index: the exact content of its
engine's prefix cache (vLLM's BlockStored / BlockRemoved, re-keyed by the worker into the
chained hashes of `store.block_hash`).

Each stream starts with a reset carrying everything the engine holds, so a conductor that
restarts, or reconnects after a network failure, rebuilds that instance's part of the index
from the worker. A worker without the RPC is left to the replies and the predicted overlay.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from conductor.scheduler.index import KVIndex
from protos import worker_pb2
from store.block_hash import from_wire

log = structlog.get_logger(__name__)

_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class KvEventFollower:
    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._tasks: dict[str, asyncio.Task] = {}
        self.batches = 0
        self.stored = 0
        self.removed = 0

    def follow(self, inst) -> None:
        """Start following `inst` (needs a running event loop; no-op without one)."""
        iid = inst.instance_id
        if iid in self._tasks:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._tasks[iid] = loop.create_task(self._run(iid, inst.stub), name=f"kv-events-{iid}")

    def unfollow(self, instance_id: str) -> None:
        task = self._tasks.pop(instance_id, None)
        if task is not None:
            task.cancel()

    def following(self) -> list[str]:
        return list(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _run(self, iid: str, stub) -> None:
        attempt = 0
        while True:
            try:
                async for batch in stub.KvEvents(worker_pb2.KvEventsRequest()):
                    attempt = 0
                    self.apply(iid, batch)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("kv_events_unsupported", instance_id=iid)
                    return
                log.info("kv_events_interrupted", instance_id=iid, code=e.code().name)
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1

    def apply(self, iid: str, batch: worker_pb2.KvEventBatch) -> None:
        """One batch: a reset first (the engine's whole cache follows), then evictions, then
        stores (a block evicted and stored again within a batch ends up present)."""
        self.batches += 1
        log.debug("kv_events", instance_id=iid, reset=batch.reset, stored=len(batch.stored),
                  removed=len(batch.removed))
        if batch.reset:
            self.index.clear(iid)
            log.info("kv_events_reset", instance_id=iid, blocks=len(batch.stored))
        if batch.removed:
            self.index.remove(iid, from_wire(batch.removed))
            self.removed += len(batch.removed)
        if batch.stored:
            self.index.store(iid, from_wire(batch.stored))
            self.stored += len(batch.stored)
