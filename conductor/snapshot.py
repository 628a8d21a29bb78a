"""Immutable views of cluster state that routing policies read (and the simulator builds)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceLoad:
    instance_id: str
    role: str
    """prefill | decode | both"""
    in_flight: int
    """Requests dispatched to it and not finished, counted by the conductor at dispatch."""
    queued_prompt_tokens: int
    block_size: int

    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class ClusterSnapshot:
    instances: tuple[InstanceLoad, ...]

    def prefill(self) -> tuple[InstanceLoad, ...]:
        return tuple(i for i in self.instances if i.can_prefill())

    def decode(self) -> tuple[InstanceLoad, ...]:
        return tuple(i for i in self.instances if i.can_decode())


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request."""

    num_prompt_tokens: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class Route:
    """A policy's choice: the pair to run on (the same id twice: no disaggregation)."""

    prefill_id: str
    decode_id: str
