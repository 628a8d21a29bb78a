"""round_robin: the request counter modulo each pool's size; ignores load and cache."""

from __future__ import annotations

from conductor.scheduler.policies.estimate import describe
from conductor.scheduler.snapshot import ClusterSnapshot, Route, RouteRequest


def round_robin(snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
    prefills, decodes = snap.prefill(), snap.decode()
    if not prefills or not decodes:
        return None
    return describe(snap, req, prefills[req.seq % len(prefills)], decodes[req.seq % len(decodes)])
