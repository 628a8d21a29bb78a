"""random: a uniform pick in each pool, drawn from the request counter (so it replays)."""

from __future__ import annotations

from conductor.scheduler.policies.estimate import describe
from conductor.scheduler.snapshot import ClusterSnapshot, Route, RouteRequest

_MIX = 0x9E3779B97F4A7C15


def _draw(seq: int, salt: int) -> int:
    x = ((seq + salt) * _MIX) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) >> 16


def random_choice(snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
    prefills, decodes = snap.prefill(), snap.decode()
    if not prefills or not decodes:
        return None
    return describe(snap, req, prefills[_draw(req.seq, 0) % len(prefills)],
                    decodes[_draw(req.seq, 1) % len(decodes)])
