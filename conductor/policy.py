"""Routing policies: pure functions of an immutable snapshot and the request, no I/O.

`None` means no pair can take the request (the caller answers 503)."""

from __future__ import annotations

from collections.abc import Callable

from conductor.snapshot import ClusterSnapshot, InstanceLoad, Route, RouteRequest

Policy = Callable[[ClusterSnapshot, RouteRequest], "Route | None"]


def _least(instances: tuple[InstanceLoad, ...]) -> InstanceLoad | None:
    if not instances:
        return None
    return min(instances, key=lambda i: (i.in_flight, i.queued_prompt_tokens, i.instance_id))


def least_loaded(snapshot: ClusterSnapshot, request: RouteRequest) -> Route | None:
    """The prefill and the decode instance with the fewest requests in flight."""
    p = _least(snapshot.prefill())
    d = _least(snapshot.decode())
    if p is None or d is None:
        return None
    return Route(prefill_id=p.instance_id, decode_id=d.instance_id)


POLICIES: dict[str, Policy] = {"least_loaded": least_loaded}
