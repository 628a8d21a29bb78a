"""What a `ResizePool` call does to bring a pool to its target (`plan`): a pure function of
the instances, the workers still starting, and whether this conductor can start processes.

A pool is what serves a role: `prefill` or `decode` (instances routed as that role or as
"both"), or `both` (instances routed as "both"). Workers this conductor started that have not
joined yet count as members already, so that a repeated call (a client's retry, or the same
call twice at once) starts nothing more.

Growing takes, in order: drained instances of the pool (their engines are loaded), instances
registered as "both" and routed as another role (switched), then new processes (embedded
mode); what is left is `short`. Shrinking stops workers still starting first, then takes
members out: those this conductor started first, then side engines, then the least loaded.
Out of `prefill` or `decode`, an instance registered as "both" switches to the other role
where something serves that one, else it is drained; out of `both`, it is drained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")


def serves(routed: str, role: str) -> bool:
    """Whether an instance routed as `routed` is a member of the `role` pool."""
    return routed == role or (routed == "both" and role != "both")


@dataclass(frozen=True)
class Member:
    """What the plan reads of one instance the conductor knows."""

    instance_id: str
    role: str
    """What it is routed as."""
    registered: str
    """The role it registered: only "both" can be switched."""
    routable: bool
    draining: bool = False
    unhealthy: bool = False
    in_flight: int = 0
    started_here: bool = False
    side: bool = False


@dataclass(frozen=True)
class Starting:
    """A worker this conductor started that has not joined routing yet."""

    instance_id: str
    role: str


@dataclass(frozen=True)
class ResizePlan:
    role: str
    target: int
    before: int
    """Routable members of the pool when planned."""
    starting: tuple[str, ...] = ()
    """Workers started earlier, counted toward the target and kept."""
    undrain: tuple[str, ...] = ()
    switch: tuple[tuple[str, str], ...] = ()
    """(instance, the role it is routed as from now on)."""
    start: int = 0
    """New worker processes of `role`."""
    cancel: tuple[str, ...] = ()
    """Workers still starting, stopped: the pool has more than the target without them."""
    drain: tuple[str, ...] = ()
    short: int = 0
    """Members still missing once this is done: nothing here can start them."""


def plan(role: str, target: int, members: Sequence[Member], starting: Sequence[Starting],
         can_start: bool) -> ResizePlan:
    """The plan for `target` members of `role`; ValueError for an unknown role or a negative
    target."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if target < 0:
        raise ValueError(f"target must be >= 0, got {target}")
    serving = [m for m in members if m.routable and serves(m.role, role)]
    pending = tuple(s.instance_id for s in starting if serves(s.role, role))
    base = ResizePlan(role, target, len(serving), pending)
    short = target - len(serving) - len(pending)
    if short >= 0:
        return _grow(base, members, short, can_start)
    return _shrink(base, members, serving, -short)


def _grow(p: ResizePlan, members: Sequence[Member], short: int, can_start: bool
          ) -> ResizePlan:
    undrain = tuple(m.instance_id for m in sorted(members, key=lambda m: m.instance_id)
                    if m.draining and not m.unhealthy and serves(m.role, p.role))[:short]
    short -= len(undrain)
    switchable = sorted((m for m in members if m.routable and m.registered == "both"
                         and not serves(m.role, p.role)), key=lambda m: m.in_flight)
    switch = tuple((m.instance_id, p.role) for m in switchable[:max(short, 0)])
    short -= len(switch)
    start = short if can_start else 0
    return ResizePlan(p.role, p.target, p.before, p.starting, undrain, switch, start,
                      short=short - start)


def _shrink(p: ResizePlan, members: Sequence[Member], serving: Sequence[Member],
            surplus: int) -> ResizePlan:
    cancel = tuple(reversed(p.starting))[:surplus]  # the newest first
    keep = tuple(s for s in p.starting if s not in cancel)
    surplus -= len(cancel)
    other = {"prefill": "decode", "decode": "prefill"}.get(p.role, "")
    routes = {m.instance_id: m.role for m in members if m.routable}
    switch, drain = [], []
    order = sorted(serving, key=lambda m: (not m.started_here, not m.side, m.in_flight,
                                           m.instance_id))
    for m in order[:surplus]:
        if other and m.registered == "both" and any(serves(r, other)
                                                    for r in routes.values()):
            switch.append((m.instance_id, other))
            routes[m.instance_id] = other
        else:
            drain.append(m.instance_id)
            routes.pop(m.instance_id)
    return ResizePlan(p.role, p.target, p.before, keep, switch=tuple(switch), cancel=cancel,
                      drain=tuple(drain))
