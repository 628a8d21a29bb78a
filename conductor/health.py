"""Active health checks: every instance's gRPC health service, polled every `interval_s`.

An instance whose check fails leaves routing, long before its etcd lease would expire: at
once when it refuses the connection or is not SERVING (a worker in graceful shutdown says
NOT_SERVING; one whose engine holds work and makes no progress says `STALLED`,
`cluster.health`), after two checks in a row when it is merely slow to answer (a busy
machine is not a dead one). The next successful check brings it back. Its calls in flight go
on while it says NOT_SERVING (a graceful drain); when it is stalled, or does not answer at all
(refused, or twice too slow: a stopped process keeps its connections open and silent) they
are cancelled, and their requests retry or migrate at once instead of waiting for the stall
deadline.

Until an instance is verified, each round first asks its worker to prove itself (`_verify`):
its `Stats` must report the registration etcd holds, with the cluster secret's proof when the
cluster has one.
"""

from __future__ import annotations

import asyncio
import secrets

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.health import SERVICE, STALLED
from cluster.instance import InstanceInfo
from cluster.secret import NONCE_KEY, PROOF_KEY, metadata_value
from conductor.registry import Instance, PerInstance, Registry
from protos import worker_pb2

log = structlog.get_logger(__name__)

SILENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
"""Health answers that mean the instance is gone or wedged (`Registry.set_unhealthy(lost)`)."""
STALLED_WHY = "stalled"
"""Why an instance whose health says `STALLED` is unhealthy: lost too (its engine holds its
calls and does not step)."""
LOST = (*SILENT, STALLED_WHY)


def _reports(registration: bytes, info: InstanceInfo) -> bool:
    try:
        return InstanceInfo.from_json(registration) == info
    except ValueError:
        return False


class HealthChecker(PerInstance):
    task_name = "health"

    def __init__(self, registry: Registry, interval_s: float) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = max(2 * interval_s, 2.0)
        """A busy machine answers late; a dead instance refuses at once, whatever this is."""
        self.failures_total = 0
        self._told: set[tuple[str, str]] = set()
        super().__init__(registry)

    async def _verify(self, inst: Instance) -> None:
        """Set `inst.verified` once the worker at its address reports this very registration
        in its `Stats`, with the proof of the cluster secret in the trailing metadata when
        the cluster has one. Without a secret (a loopback cluster), that report is the proof:
        an entry pointing at nothing, or at another worker, or changed behind its worker's
        back, is not believed."""
        secret = self.registry.secret
        address = inst.info.address
        metadata: tuple[tuple[str, str], ...] = ()
        nonce = ""
        if secret is not None:
            nonce = secrets.token_hex(16)
            metadata = (*secret.metadata(address), (NONCE_KEY, nonce))
        try:
            call = inst.stub.Stats(worker_pb2.StatsRequest(), timeout=self.timeout_s,
                                   metadata=metadata)
            stats = await call
            proof = metadata_value(await call.trailing_metadata(), PROOF_KEY)
        except grpc.aio.AioRpcError as e:
            self._unverified(inst, e.code().name)
            return
        if secret is not None and not secret.proves(address, nonce, proof):
            self._unverified(inst, "no proof of the cluster secret")
        elif not _reports(stats.registration, inst.info):
            self._unverified(inst, "its worker reports another registration")
        else:
            self.registry.set_verified(inst.instance_id)

    def _unverified(self, inst: Instance, why: str) -> None:
        """Logged once per instance and reason: it is asked again every interval."""
        if (inst.instance_id, why) not in self._told:
            self._told.add((inst.instance_id, why))
            log.warning("instance_unverified", instance_id=inst.instance_id,
                        address=inst.info.address, why=why)

    async def _run(self, inst: Instance) -> None:
        stub = health_pb2_grpc.HealthStub(inst.channel)
        loop = asyncio.get_running_loop()
        iid = inst.instance_id
        slow = 0
        while True:
            started = loop.time()
            why = ""
            if not inst.verified:
                await self._verify(inst)
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                         timeout=self.timeout_s)
                if reply.status == STALLED:
                    why = STALLED_WHY
                elif reply.status != health_pb2.HealthCheckResponse.SERVING:
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
                self.registry.set_unhealthy(iid, bool(why), why, lost=why in LOST)
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.05))
