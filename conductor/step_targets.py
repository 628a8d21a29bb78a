"""The engines' step target follows the conductor's TBT SLO while the cluster serves.

A CPU engine that decodes holds its steps beside streams to `cluster.shape.step_target_ms` of
the TBT SLO (`worker.step_budget`). The launcher starts it with the SLO the conductor starts
with; this keeps it there when the SLO changes (`conductorctl slo`, admin `SetSLO`) and for an
instance that joins later (a restarted worker, a grown pool), which was started with the
launcher's. Each instance is sent the target as it joins and again on every change, retried
with backoff after a failure of the instance (`conductor.resilience.RETRYABLE`). An engine
without a step budget answers `applied=false` (GPU engines, and workers started without one:
deploy/'s); a worker that predates the call answers UNIMPLEMENTED. Neither is retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from cluster.resilience import Backoff
from cluster.shape import step_target_ms
from conductor.registry import Instance, PerInstance, Registry
from conductor.resilience import RETRYABLE
from protos import worker_pb2

log = structlog.get_logger(__name__)

class StepTargets(PerInstance):
    task_name = "step-target"

    def __init__(self, registry: Registry, tbt_slo_s: Callable[[], float],
                 timeout_s: float = 5.0, retry_s: float = 1.0, max_retry_s: float = 30.0) -> None:
        self.registry = registry
        self.tbt_slo_s = tbt_slo_s
        """The conductor's TBT SLO now (read when an instance is sent its target)."""
        self.timeout_s, self.retry_s, self.max_retry_s = timeout_s, retry_s, max_retry_s
        self.applied: dict[str, float] = {}
        """Each instance's target as its engine last confirmed it."""
        super().__init__(registry)

    def slo_changed(self) -> None:
        """Send every instance the target of the SLO now (a send under way is replaced)."""
        for inst in self.registry.all():
            self.instance_left(inst)
            self.instance_joined(inst)

    def instance_left(self, inst: Instance) -> None:
        super().instance_left(inst)
        self.applied.pop(inst.instance_id, None)

    async def _run(self, inst: Instance) -> None:
        ms = step_target_ms(self.tbt_slo_s())
        backoff = Backoff(self.retry_s, self.max_retry_s, jitter=0.0)
        while True:
            try:
                reply = await inst.stub.SetStepTarget(
                    worker_pb2.StepTargetRequest(step_ms=ms), timeout=self.timeout_s)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    log.info("step_target_refused", instance_id=inst.instance_id,
                             code=e.code().name)
                    return
                wait = backoff.next()
                log.warning("step_target_failed", instance_id=inst.instance_id,
                            code=e.code().name, retry_s=wait)
            await asyncio.sleep(wait)
        if reply.applied:
            self.applied[inst.instance_id] = reply.step_ms
            log.info("step_target_applied", instance_id=inst.instance_id, step_ms=reply.step_ms)
