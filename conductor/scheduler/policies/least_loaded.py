"""least_loaded: the prefill and the decode instance with the fewest requests in flight."""

from __future__ import annotations

from conductor.scheduler.policies.estimate import describe
from conductor.scheduler.snapshot import ClusterSnapshot, InstanceLoad, Route, RouteRequest


def _least(instances: tuple[InstanceLoad, ...]) -> InstanceLoad | None:
    if not instances:
        return None
    return min(instances, key=lambda i: (i.in_flight, i.queued_prompt_tokens, i.instance_id))


def least_loaded(snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
    p, d = _least(snap.prefill()), _least(snap.decode())
    if p is None or d is None:
        return None
    return describe(snap, req, p, d)
