"""Starting and retiring worker processes for `ResizePool`.

Embedded mode (`--embedded-workers spec.json`, written by the launcher): new workers start
as children of the conductor (they die with it), named `<role>-s<n>`. Any mode: an instance
drained to shrink a pool is asked to `Retire` once nothing is in flight on it (or after
`retire_after_s` regardless), so it deregisters and exits cleanly. A deployed cluster has no
spec: `can_start` is False and growing a pool is left to the operator's scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
import structlog

from cluster.process import ManagedProcess
from cluster.workers import WorkerSpec
from conductor.registry import Instance
from protos import worker_pb2

log = structlog.get_logger(__name__)

_POLL_S = 0.2


class Provisioner:
    def __init__(self, spec: WorkerSpec | None, retire_after_s: float = 600.0) -> None:
        self.spec = spec
        self.retire_after_s = retire_after_s
        self.processes: dict[str, ManagedProcess] = {}
        self._n = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def can_start(self) -> bool:
        return self.spec is not None

    def started_here(self, instance_id: str) -> bool:
        return instance_id in self.processes

    def start(self, role: str) -> str:
        """Start a worker of `role`; it joins routing when it registers (its engine loaded)."""
        assert self.spec is not None, "not in embedded mode"
        instance_id = f"{role}-s{self._n}"
        self._n += 1
        proc, port = self.spec.start(role, instance_id)
        self.processes[instance_id] = proc
        log.info("worker_started", instance_id=instance_id, pid=proc.pid, port=port)
        return instance_id

    def retire_when_idle(self, inst: Instance) -> None:
        task = asyncio.get_running_loop().create_task(self._retire(inst))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, inst: Instance) -> None:
        deadline = time.monotonic() + self.retire_after_s
        while inst.load.in_flight() and time.monotonic() < deadline:
            if not inst.draining:  # undrained meanwhile: keep it
                return
            await asyncio.sleep(_POLL_S)
        if not inst.draining:
            return
        try:
            await inst.stub.Retire(worker_pb2.RetireRequest(reason="pool resized"), timeout=5.0)
            log.info("worker_retired", instance_id=inst.instance_id)
        except grpc.aio.AioRpcError as e:
            log.warning("worker_retire_failed", instance_id=inst.instance_id,
                        code=e.code().name, details=e.details())
            proc = self.processes.get(inst.instance_id)
            if proc is not None:
                await asyncio.to_thread(proc.stop, 20.0)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        procs = list(self.processes.values())
        self.processes.clear()
        if procs:
            await asyncio.to_thread(_stop_all, procs)


def _stop_all(procs: list[ManagedProcess]) -> None:
    for p in procs:
        p.signal_group(signal.SIGTERM)
    for p in procs:
        p.stop(timeout=20.0)
