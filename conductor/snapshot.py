"""Immutable views of cluster state that routing policies read (and the simulator builds).

A policy is a pure function `(ClusterSnapshot, RouteRequest) -> Route | Reject | None`: every
figure it needs (loads, the index's prefix matches, the fitted time models, the SLOs, the
clock reading `now`) is in these frozen objects, so a decision can be replayed and timed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from conductor.scheduler.decode_model import TbtModel
from conductor.scheduler.prefill_model import PrefillTimeModel


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load as counted by the conductor at dispatch time."""

    instance_id: str
    role: str
    """prefill | decode | both"""
    in_flight: int
    """Requests dispatched to it and not finished (prefill or decode)."""
    queued_prompt_tokens: int
    """Prompt tokens of the prefills dispatched to it and not finished."""
    block_size: int
    queued_uncached_tokens: int = 0
    """Of those, the tokens predicted to be computed (not served from a cache)."""
    busy_until: float = 0.0
    """When its queued prefill work is predicted to end (monotonic seconds, as `now`)."""
    running: int = 0
    """Decode requests dispatched to it and not finished (counted before their prefill ends)."""
    kv_tokens: int = 0
    """KV tokens its decode requests hold now (prompt + generated so far)."""
    kv_capacity_tokens: int = 0
    """Its KV cache size in tokens; 0 means unknown (never full)."""
    finishes: tuple[float, ...] = ()
    """Predicted finish times of its decode requests, ascending (monotonic seconds)."""
    cached_blocks: int = 0
    """Blocks the index holds for its local cache."""

    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class SchedulerParams:
    """Models, SLOs and policy knobs, frozen with the snapshot."""

    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.3
    local_prefill_max_tokens: int = 64
    """Conditional disaggregation: prefill on the decode instance when at most this many
    prompt tokens are uncached there (0 disables it)."""
    prefill: PrefillTimeModel = field(default_factory=PrefillTimeModel)
    tbt: TbtModel = field(default_factory=TbtModel)
    transfer_s_per_block: float = 1.3e-4
    """Time to pull one block from the pool into an engine."""
    transfer_s_fixed: float = 1e-3
    """Per-request overhead of a pull (lookup, connection), paid when any block is pulled."""
    near_min_rel: float = 0.05
    near_min_abs_s: float = 0.005
    """kv_centric: prefill instances within this of the best TTFT count as ties, broken by the
    longest local match (locality kept at almost no cost)."""
    balance_abs: int = 32
    balance_rel: float = 1.5
    cache_threshold: float = 0.3
    """cache_aware (SGLang): imbalanced when max-min load > balance_abs and max > balance_rel
    * min; otherwise the best match wins if it covers more than cache_threshold of the prompt."""


@dataclass(frozen=True)
class ClusterSnapshot:
    instances: tuple[InstanceLoad, ...]
    now: float = 0.0
    """The clock reading the snapshot was taken at (monotonic seconds)."""
    params: SchedulerParams = field(default_factory=SchedulerParams)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_prefill", tuple(i for i in self.instances if i.can_prefill()))
        object.__setattr__(self, "_decode", tuple(i for i in self.instances if i.can_decode()))
        object.__setattr__(self, "_prefill_by_id", {i.instance_id: i for i in self._prefill})
        object.__setattr__(self, "_prefill_by_queue",
                           tuple(sorted(self._prefill, key=lambda i: i.busy_until)))
        tbt = self.params.tbt
        object.__setattr__(self, "_decode_rows", tuple(
            (tbt.per_seq_s * i.running + tbt.per_kv_token_s * i.kv_tokens,
             i.kv_capacity_tokens - i.kv_tokens if i.kv_capacity_tokens else float("inf"),
             i.finishes, i.instance_id, i)
            for i in self._decode))

    def prefill(self) -> tuple[InstanceLoad, ...]:
        return self._prefill  # type: ignore[attr-defined]

    def decode(self) -> tuple[InstanceLoad, ...]:
        return self._decode  # type: ignore[attr-defined]

    def prefill_by_queue(self) -> tuple[InstanceLoad, ...]:
        """The prefill-capable instances, the soonest idle first."""
        return self._prefill_by_queue  # type: ignore[attr-defined]

    def decode_rows(self) -> tuple[tuple[float, float, tuple[float, ...], str, InstanceLoad], ...]:
        """Per decode-capable instance, what a policy's inner loop reads, computed once:
        (the TBT model's load term for its running requests and KV, its free KV tokens,
        its predicted finish times, its id, its load)."""
        return self._decode_rows  # type: ignore[attr-defined]

    def prefill_instance(self, instance_id: str) -> InstanceLoad | None:
        """The prefill-capable instance of that id, if any."""
        return self._prefill_by_id.get(instance_id)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class PrefixMatch:
    """What the KV index holds of a request's blocks: the longest prefix, in blocks, in the
    pool and in each instance's local engine cache (absent: 0)."""

    pool: int = 0
    local: Mapping[str, int] = field(default_factory=dict)
    longest: int = 0
    """The longest of them all (computed when not given)."""

    def __post_init__(self) -> None:
        if not self.longest and (self.pool or self.local):
            object.__setattr__(self, "longest", max(self.pool, *self.local.values(), 0))


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request."""

    num_prompt_tokens: int
    block_hashes: tuple[int, ...]
    match: PrefixMatch = PrefixMatch()
    max_tokens: int = 16
    seq: int = 0
    """The conductor's request counter: round_robin and random derive their choice from it."""
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    """Per-request SLOs; None: the snapshot's defaults."""


@dataclass(frozen=True)
class Route:
    """A policy's choice: the pair to run on. The same id twice means no disaggregation: the
    decode instance prefills the prompt itself and the Prefill RPC is skipped."""

    prefill_id: str
    decode_id: str
    cached_blocks: int = 0
    """Prompt blocks the prefilling engine is predicted not to compute."""
    uncached_tokens: int = 0
    prefill_s: float = 0.0
    """Predicted prefill compute time (without queueing): the work it adds to the queue."""
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_id != self.decode_id


@dataclass(frozen=True)
class Reject:
    """No pair is predicted to meet the SLOs: answer 429 before doing any work."""

    reason: str
    retry_after_s: float
