"""Starting and retiring worker processes for `ResizePool`.

Embedded mode (`--embedded-workers spec.json`, written by the launcher): new workers start
as children of the conductor (they die with it), named `<role>-s<n>`, once `refusal` finds
room for them on this machine (`cluster.capacity`); until they join routing they are
`starting`, and a worker still starting can be cancelled. Any mode: an instance drained to
shrink a pool is asked to `Retire` once nothing is in flight on it (or after `retire_after_s`
regardless), so it deregisters and exits cleanly. A deployed cluster has no spec: `can_start`
is False and growing a pool is left to the operator's scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import structlog

from cluster.capacity import Capacity, Machine, engine_bytes
from cluster.process import ManagedProcess
from cluster.workers import WorkerSpec
from conductor.registry import Instance
from conductor.resize import Starting
from protos import worker_pb2

log = structlog.get_logger(__name__)

_POLL_S = 0.2


class Provisioner:
    def __init__(self, spec: WorkerSpec | None, retire_after_s: float = 600.0,
                 max_engines: int = 0, machine: Callable[[], Machine] | None = None) -> None:
        self.spec = spec
        self.retire_after_s = retire_after_s
        self.processes: dict[str, ManagedProcess] = {}
        self.roles: dict[str, str] = {}
        """The role each worker started here was started in."""
        self.max_engines = max_engines
        """The most engines on this machine (`cluster.capacity`); 0: per its cores."""
        self.machine = machine or (
            lambda: Machine.here(self.spec.machine_cpus if self.spec else ""))
        """This machine as it is now (a function: tests hand in another)."""
        self._retiring: set[str] = set()
        self._n = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def can_start(self) -> bool:
        return self.spec is not None

    def started_here(self, instance_id: str) -> bool:
        return instance_id in self.processes

    def starting(self, joined: Callable[[str], bool]) -> list[Starting]:
        """Workers started here, alive, not retiring, that have not `joined` yet, oldest
        first."""
        return [Starting(iid, self.roles[iid]) for iid, proc in self.processes.items()
                if iid not in self._retiring and proc.alive() and not joined(iid)]

    def refusal(self, new: int, engines: int, starting: int) -> str:
        """Why `new` workers cannot start beside `engines` (`starting` of them loading);
        "" when they can (`cluster.capacity`)."""
        if not new:
            return ""
        assert self.spec is not None, "not in embedded mode"
        capacity = Capacity(engine_bytes(self.spec), self.max_engines)
        return capacity.refusal(self.machine(), engines, starting, new)

    def name(self, role: str) -> str:
        """A new instance id for a worker of `role` to start (`start`)."""
        instance_id = f"{role}-s{self._n}"
        self._n += 1
        return instance_id

    def start(self, role: str, instance_id: str | None = None) -> str:
        """Start a worker of `role` (named `instance_id`, else a new name); it joins routing
        when it registers (its engine loaded)."""
        assert self.spec is not None, "not in embedded mode"
        instance_id = instance_id or self.name(role)
        proc, port = self.spec.start(role, instance_id)
        self.processes[instance_id] = proc
        self.roles[instance_id] = role
        log.info("worker_started", instance_id=instance_id, pid=proc.pid, port=port)
        return instance_id

    def cancel(self, instance_id: str) -> None:
        """Stop a worker started here before it joined (in the background)."""
        proc = self.processes.get(instance_id)
        if proc is None:
            return
        self._retiring.add(instance_id)
        log.info("worker_cancelled", instance_id=instance_id)
        self._spawn(asyncio.to_thread(proc.stop, 20.0))

    def retire_when_idle(self, inst: Instance) -> None:
        if inst.instance_id in self.processes:
            self._retiring.add(inst.instance_id)
        self._spawn(self._retire(inst))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, inst: Instance) -> None:
        deadline = time.monotonic() + self.retire_after_s
        while inst.load.in_flight() and time.monotonic() < deadline:
            if not inst.draining:  # undrained meanwhile: keep it
                self._retiring.discard(inst.instance_id)
                return
            await asyncio.sleep(_POLL_S)
        if not inst.draining:
            self._retiring.discard(inst.instance_id)
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
