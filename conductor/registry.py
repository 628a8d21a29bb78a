"""The instances the conductor can route to: membership from etcd, one gRPC client each, and
the load counted at dispatch time (`scheduler.load.LoadState`). `snapshot()` freezes it for
the routing policy; listeners (the router) hear joins and leaves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from cluster.instance import InstanceInfo
from conductor.scheduler.load import LoadState
from conductor.snapshot import ClusterSnapshot, SchedulerParams
from protos import worker_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass
class Instance:
    info: InstanceInfo
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    load: LoadState
    draining: bool = False

    @property
    def instance_id(self) -> str:
        return self.info.instance_id


class RegistryListener(Protocol):
    def instance_joined(self, inst: Instance) -> None: ...
    def instance_left(self, inst: Instance) -> None: ...


class Registry:
    def __init__(self) -> None:
        self._instances: dict[str, Instance] = {}
        self._listeners: list[RegistryListener] = []
        self._snap: ClusterSnapshot | None = None
        """The last snapshot, patched with the loads changed since (`_dirty`); None: rebuild."""
        self._dirty: set[str] = set()

    def listen(self, listener: RegistryListener) -> None:
        """Tell `listener` of every instance now and of joins and leaves from now on."""
        self._listeners.append(listener)
        for inst in self._instances.values():
            listener.instance_joined(inst)

    def sync(self, members: dict[str, InstanceInfo]) -> None:
        """Follow membership: open clients for joiners, close those of leavers."""
        for iid in list(self._instances):
            if iid not in members or members[iid].address != self._instances[iid].info.address:
                self._leave(iid)
        for iid, info in members.items():
            if iid not in self._instances:
                channel = grpc.aio.insecure_channel(info.address)
                inst = Instance(info, channel, worker_pb2_grpc.WorkerStub(channel),
                                LoadState(iid, info.role, info.block_size, info.capacity_tokens))
                inst.load.on_change = self._dirty.add
                self._instances[iid] = inst
                self._snap = None
                log.info("instance_joined", instance_id=iid, role=info.role, address=info.address)
                for listener in self._listeners:
                    listener.instance_joined(inst)

    def _leave(self, iid: str) -> Instance:
        inst = self._instances.pop(iid)
        inst.load.on_change = None
        self._snap = None
        log.info("instance_left", instance_id=iid, role=inst.info.role)
        for listener in self._listeners:
            listener.instance_left(inst)
        # Closing cancels RPCs in flight to a dead instance: they fail fast.
        _close_later(inst.channel)
        return inst

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def set_draining(self, instance_id: str, draining: bool) -> Instance | None:
        """Take an instance out of routing (or back in); its requests in flight go on."""
        inst = self._instances.get(instance_id)
        if inst is not None and inst.draining != draining:
            inst.draining = draining
            self._snap = None
        return inst

    def mark_changed(self, instance_ids: Iterable[str]) -> None:
        """Something a snapshot shows of these instances changed outside their load."""
        self._dirty.update(instance_ids)

    def snapshot(self, now: float = 0.0, params: SchedulerParams | None = None,
                 cached_blocks: Callable[[str], int] | None = None) -> ClusterSnapshot:
        """The routable (not draining) instances' loads, frozen. Kept up to date by patching
        the previous snapshot with the instances changed since (`LoadState.on_change`,
        `mark_changed`), so its cost follows the changes, not the cluster's size."""
        params = params or SchedulerParams()
        cached = cached_blocks or _none
        snap, dirty = self._snap, self._dirty
        if snap is None or snap.params is not params:
            loads = tuple(i.load.view(cached(iid))
                          for iid, i in self._instances.items() if not i.draining)
            snap = ClusterSnapshot(loads, now, params)
        else:
            insts = self._instances
            snap = snap.replacing([i.load.view(cached(iid)) for iid in dirty
                                   if (i := insts.get(iid)) is not None and not i.draining], now)
        dirty.clear()
        self._snap = snap
        return snap

    async def close(self) -> None:
        for inst in list(self._instances.values()):
            for listener in self._listeners:
                listener.instance_left(inst)
            await inst.channel.close(grace=None)
        self._instances.clear()
        self._snap = None


def _none(_: str) -> int:
    return 0


def _close_later(channel: grpc.aio.Channel) -> None:
    import asyncio

    try:
        asyncio.get_running_loop().create_task(channel.close(grace=1.0))
    except RuntimeError:
        pass
