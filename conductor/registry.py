"""The instances the conductor can route to: membership from etcd, one gRPC client each, and
the load counted at dispatch time. `snapshot()` freezes it for the routing policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import structlog

from cluster.instance import InstanceInfo
from conductor.snapshot import ClusterSnapshot, InstanceLoad
from protos import worker_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass
class Instance:
    info: InstanceInfo
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    in_flight: int = 0
    queued_prompt_tokens: int = 0
    draining: bool = False
    dispatched_total: int = 0
    tags: dict[str, str] = field(default_factory=dict)


class Registry:
    def __init__(self) -> None:
        self._instances: dict[str, Instance] = {}

    def sync(self, members: dict[str, InstanceInfo]) -> None:
        """Follow membership: open clients for joiners, close those of leavers."""
        for iid in list(self._instances):
            if iid not in members or members[iid].address != self._instances[iid].info.address:
                inst = self._instances.pop(iid)
                log.info("instance_left", instance_id=iid, role=inst.info.role)
                # Closing cancels RPCs in flight to a dead instance: they fail fast.
                _close_later(inst.channel)
        for iid, info in members.items():
            if iid not in self._instances:
                channel = grpc.aio.insecure_channel(info.address)
                self._instances[iid] = Instance(info, channel, worker_pb2_grpc.WorkerStub(channel))
                log.info("instance_joined", instance_id=iid, role=info.role, address=info.address)

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def snapshot(self) -> ClusterSnapshot:
        loads = tuple(
            InstanceLoad(
                instance_id=i.info.instance_id,
                role=i.info.role,
                in_flight=i.in_flight,
                queued_prompt_tokens=i.queued_prompt_tokens,
                block_size=i.info.block_size,
            )
            for i in self._instances.values()
            if not i.draining
        )
        return ClusterSnapshot(instances=loads)

    async def close(self) -> None:
        for inst in self._instances.values():
            await inst.channel.close(grace=None)
        self._instances.clear()


def _close_later(channel: grpc.aio.Channel) -> None:
    import asyncio

    try:
        asyncio.get_running_loop().create_task(channel.close(grace=1.0))
    except RuntimeError:
        pass
