"""Active health checks: every instance's gRPC health service, polled every `interval_s`.

An instance whose check fails leaves routing, long before its etcd lease would expire: at
once when it refuses the connection or is not SERVING (a worker in graceful shutdown says
NOT_SERVING), after two checks in a row when it is merely slow to answer (a busy machine is
not a dead one). The next successful check brings it back. Requests in flight are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conductor.registry import Instance, Registry

log = structlog.get_logger(__name__)

SERVICE = "kvcluster.v1.Worker"


class HealthChecker:
    def __init__(self, registry: Registry, interval_s: float) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = max(2 * interval_s, 2.0)
        """A busy machine answers late; a dead instance refuses at once, whatever this is."""
        self._tasks: dict[str, asyncio.Task] = {}
        self.failures_total = 0
        registry.listen(self)

    def instance_joined(self, inst: Instance) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: the registry is offline
            self._tasks[inst.instance_id] = asyncio.get_running_loop().create_task(
                self._watch(inst), name=f"health-{inst.instance_id}")

    def instance_left(self, inst: Instance) -> None:
        task = self._tasks.pop(inst.instance_id, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, inst: Instance) -> None:
        stub = health_pb2_grpc.HealthStub(inst.channel)
        loop = asyncio.get_running_loop()
        iid = inst.instance_id
        slow = 0
        while True:
            started = loop.time()
            why = ""
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                         timeout=self.timeout_s)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    why = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as e:
                # UNIMPLEMENTED: a worker without the health service, left to its lease
                why = "" if e.code() == grpc.StatusCode.UNIMPLEMENTED else e.code().name
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a closed channel: the instance is leaving
                why = repr(e)
            slow = slow + 1 if why == "DEADLINE_EXCEEDED" else 0
            if why:
                self.failures_total += 1
            if slow != 1:  # one slow answer alone changes nothing
                self.registry.set_unhealthy(iid, bool(why), why)
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.05))
