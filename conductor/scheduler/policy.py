"""Routing policies by name: pure functions of an immutable snapshot and the request, no I/O.

A policy answers a `Route`, a `Reject` (no pair meets the SLOs: 429 before any work), or
None (no instance can take the request: 503). One module per policy under
`conductor/scheduler/policies/`; `kv_centric` is the default.
"""

from __future__ import annotations

from collections.abc import Callable

from conductor.scheduler.policies.cache_aware import cache_aware
from conductor.scheduler.policies.kv_centric import kv_centric
from conductor.scheduler.policies.least_loaded import least_loaded
from conductor.scheduler.policies.random_choice import random_choice
from conductor.scheduler.policies.round_robin import round_robin
from conductor.scheduler.snapshot import ClusterSnapshot, Reject, Route, RouteRequest

Decision = Route | Reject | None
Policy = Callable[[ClusterSnapshot, RouteRequest], Decision]

POLICIES: dict[str, Policy] = {
    "kv_centric": kv_centric,
    "cache_aware": cache_aware,
    "least_loaded": least_loaded,
    "round_robin": round_robin,
    "random": random_choice,
}
DEFAULT_POLICY = "kv_centric"
DECODES_ALONE: frozenset[str] = frozenset({"kv_centric"})
"""The policies that serve with decode instances alone, computing prompts on them while no
prefill instance is up; the others need both roles."""

__all__ = ["DECODES_ALONE", "DEFAULT_POLICY", "POLICIES", "Decision", "Policy", "cache_aware",
           "kv_centric", "least_loaded", "random_choice", "round_robin"]
