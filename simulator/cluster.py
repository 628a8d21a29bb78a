"""The simulated cluster's shape, and one instance: an executor that runs either a prefill
(its FIFO queue first) or one continuous-batching decode step at a time.

A prefill-only instance never holds a batch and a decode-only one prefills only when the
policy routes a request to it alone (conditional disaggregation); a colocated (`both`)
instance interleaves the two, so its prefills stall its decodes, as in an engine without
chunked prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from conductor.scheduler import LoadState, Route
from simulator.pool import EVICTIONS, BlockCache
from simulator.trace import TraceRequest


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 4
    decode: int = 4
    colocated: int = 0
    """Instances that both prefill and decode (the colocated baseline); usually with 0/0."""
    pool_blocks: int | None = None
    """KV pool capacity in blocks; None: unlimited (Mooncake's pool spans every node's DRAM)."""
    eviction: str = "lru"
    use_pool: bool = True
    """False: engines reuse only their own local caches and KV goes straight from P to D."""
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("instance counts must be >= 0")
        if not (self.prefill and self.decode) and not self.colocated:
            raise ValueError("need prefill and decode instances, or colocated ones")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}: {self.eviction!r}")

    def roles(self) -> list[tuple[str, str]]:
        """(instance id, role) of every instance."""
        return ([(f"p{i}", "prefill") for i in range(self.prefill)]
                + [(f"d{i}", "decode") for i in range(self.decode)]
                + [(f"c{i}", "both") for i in range(self.colocated)])


@dataclass(eq=False)
class Job:
    """One admitted request on its way through the cluster."""

    rid: str
    index: int
    req: TraceRequest
    hashes: tuple[int, ...]
    route: Route
    prefill: Instance
    decode: Instance
    cached_tokens: int = 0
    pool_tokens: int = 0
    """Of the cached tokens, those pulled from the pool (not in the prefill engine's cache)."""
    generated: int = 0
    prefill_at: float = -1.0
    prefilled_at: float = -1.0
    joined_at: float = -1.0
    """When its KV was all on its decode instance."""
    admitted_at: float = -1.0
    first_token_at: float = -1.0
    last_token_at: float = -1.0
    missed: bool = False
    """Counted as an SLO miss already (late first token or slow tokens)."""


@dataclass(eq=False)
class Instance:
    iid: str
    role: str
    load: LoadState
    cache: BlockCache
    kv_capacity_tokens: int
    queue: deque[Job] = field(default_factory=deque)
    """Prefills routed here, in dispatch order."""
    batch: list[Job] = field(default_factory=list)
    """Decodes running (admitted to the KV cache)."""
    waiting: deque[Job] = field(default_factory=deque)
    """Decodes whose KV arrived but do not fit yet."""
    running_prefill: Job | None = None
    stepping: list[Job] | None = None
    """The batch of the decode step in progress."""
    kv_tokens: int = 0
    """KV tokens the batch holds now (prompts + generated)."""
    kv_reserved: int = 0
    """KV tokens the batch will hold at the end (prompts + outputs): admission counts these."""
    arriving: int = 0
    """Requests whose KV is on its way here from their prefill instance."""
    busy_s: float = 0.0
    steps: int = 0
    step_s: float = 0.0
    """Decode steps run, and their seconds."""

    @property
    def busy(self) -> bool:
        return self.running_prefill is not None or self.stepping is not None

    def fits(self, job: Job) -> bool:
        need = job.req.input_length + job.req.output_length
        return not self.batch or self.kv_reserved + need <= self.kv_capacity_tokens
