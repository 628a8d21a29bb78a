"""Immutable views of cluster state that routing policies read (and the simulator builds).

A policy is a pure function `(ClusterSnapshot, RouteRequest) -> Route | Reject | None`: every
figure it needs (loads, the index's prefix matches, the fitted time models, the SLOs, the
clock reading `now`) is in these frozen objects, so a decision can be replayed and timed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from conductor.scheduler.decode_model import TbtModel
from conductor.scheduler.orders import Orders
from conductor.scheduler.prefill_model import PrefillTimeModel

BESIDE_PRIOR = 1.4
"""A prompt's time beside streams decoding on the same engine over its time alone, until the
engine has timed one (`InstanceLoad.prefill_speed_beside`): its steps carry the streams'
tokens too, and a step budget cuts the prompt into more steps. Between the ratios of a CPU
engine with a core of its own and of the side engine, which has half the step budget
(docs/design.md, "A speed apart for prompts beside streams"); priced at its speed alone, an
engine's first burst of cold prompts would be priced too fast before it had timed one."""


def beside_speed(alone: float, beside: float | None) -> float:
    """The speed beside streams: as timed, else `BESIDE_PRIOR` times the speed alone."""
    return alone * BESIDE_PRIOR if beside is None else beside


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
    """Sequences decoding on it: those of the decode requests dispatched to it and not
    finished (a request sampling `n` choices runs `n`), counted before their prefill ends."""
    kv_tokens: int = 0
    """KV tokens its decode requests hold now (prompt + generated so far)."""
    kv_capacity_tokens: int = 0
    """Its KV cache size in tokens; 0 means unknown (never full)."""
    finishes: tuple[float, ...] = ()
    """Predicted finish times of its decoding sequences, ascending (monotonic seconds): a
    request of `n` choices appears `n` times."""
    max_seqs: int = 0
    """Sequences its engine runs at once (vLLM's `max_num_seqs`); 0: unknown (unbounded).
    A request whose sequences do not fit waits inside the engine for others to finish."""
    cached_blocks: int = 0
    """Blocks the index holds for its local cache."""
    host: str = ""
    cores: frozenset[int] = frozenset()
    """The cores its engine computes on (CPU); empty: unknown."""
    threads: int = 0
    """Its engine's compute threads (CPU); 0: unknown."""
    side: bool = False
    """It computes on the serving processes' cores (`cluster.instance.InstanceInfo.side`)."""
    gpus: frozenset[int] = frozenset()
    """The accelerators it computes on."""
    prefill_speed: float = 1.0
    """Its prefills take this many times the fitted model's prediction (measured per
    instance, `LoadState.observe_prefill`): engines on fewer or busier cores are slower."""
    prefill_speed_beside: float | None = None
    """The same while streams of its own decode beside the prompt (None: not timed yet,
    `BESIDE_PRIOR` times `prefill_speed`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fastest", min(self.prefill_speed, beside_speed(
            self.prefill_speed, self.prefill_speed_beside)))
        decoding = self.running if self.can_decode() else 0
        object.__setattr__(self, "prefill_like", (
            decoding, self.prefill_speed, self.prefill_speed_beside,
            self.finishes[-1] if decoding and self.finishes else 0.0))

    fastest: float = field(init=False, repr=False, compare=False)
    """The lower of its two speeds: no prefill here takes less than this many times the
    fitted model's prediction (`prefill_seconds`)."""
    prefill_like: tuple = field(init=False, repr=False, compare=False)
    """What tells its idle prefill price from another's, but for its side and hit: the
    streams it decodes, its speeds and its last finish (kv_centric prices one of alike idle
    instances)."""

    def speed(self, beside: bool) -> float:
        """Its prefill speed with (`beside`) or without streams of its own decoding."""
        return beside_speed(self.prefill_speed, self.prefill_speed_beside) if beside \
            else self.prefill_speed

    def prefill_seconds(self, model_s: float, start: float) -> float:
        """A prefill the fitted model puts at `model_s`, computed here from `start`: at its
        speed beside streams for as long as streams of its own are predicted to decode (the
        last of `finishes`), at its speed alone after. Priced beside streams whole, a long
        prompt queued behind streams about to end would be predicted too slow and refused
        where it would have met its SLO."""
        alone = model_s * self.prefill_speed
        overlap = self.finishes[-1] - start if self.finishes else 0.0
        if overlap <= 0.0:
            return alone
        beside = model_s * self.speed(True)
        if overlap >= beside:
            return beside
        return alone + overlap * (1.0 - alone / beside)  # the rest at the speed alone

    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class SchedulerParams:
    """Models, SLOs and policy knobs, frozen with the snapshot."""

    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.3
    disaggregate: str = "auto"
    """kv_centric: auto (prefill beside the decode instance or on it, whichever the models
    say costs less), always (on another instance whenever one can), never (on the decode
    instance itself)."""
    prefill: PrefillTimeModel = field(default_factory=PrefillTimeModel)
    tbt: TbtModel = field(default_factory=TbtModel)
    transfer_s_per_block: float = 1.3e-4
    """Time to move one block between an engine and the pool (measured by the workers)."""
    transfer_s_fixed: float = 1e-3
    """Per-request overhead of a pull (lookup, connection), paid when any block is pulled."""
    near_min_rel: float = 0.05
    near_min_abs_s: float = 0.005
    """kv_centric: prefill instances within this of the best TTFT count as ties, broken by the
    longest local match (locality kept at almost no cost)."""
    balance_abs: int = 32
    balance_rel: float = 1.5
    side_cost: float = 1.0
    """kv_centric: a route prefilling on a side instance (one computing on the serving
    processes' cores, `InstanceLoad.side`) costs this many times its time; a local route
    there (prefill and decode) costs one predicted TBT more per output token whatever this is:
    its compute takes turns with the processes that carry every stream's tokens (its own
    streams' too: about twice the token gaps of the engine with a core of its own), which
    its speed, probed on an idle core, does not show. Without the TBT term lone requests go to
    it whenever its probe comes out faster; with it they stay off it. A multiplier above 1
    keeps bursts of long prompts queued on the dedicated engine instead (docs/design.md, "A
    side engine on the serving core")."""
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
        prefill = tuple(i for i in self.instances if i.can_prefill())
        decode = tuple(i for i in self.instances if i.can_decode())
        tbt = self.params.tbt
        _set(self, _prefill=prefill, _decode=decode,
             _prefill_by_id={i.instance_id: i for i in prefill},
             _prefill_by_queue=tuple(sorted(prefill, key=_queue_key)),
             _decode_rows=tuple(_decode_row(tbt, i) for i in decode),
             _orders=Orders.build(prefill, decode, tbt),
             _pos={i.instance_id: n for n, i in enumerate(self.instances)},
             _prefill_pos={i.instance_id: n for n, i in enumerate(prefill)},
             _decode_pos={i.instance_id: n for n, i in enumerate(decode)})

    def at(self, now: float) -> ClusterSnapshot:
        """The same loads read at another clock time (nothing recomputed)."""
        new = object.__new__(ClusterSnapshot)
        new.__dict__.update(self.__dict__)
        object.__setattr__(new, "now", now)
        return new

    def replacing(self, changed: Iterable[InstanceLoad], now: float) -> ClusterSnapshot:
        """This snapshot with some instances' loads replaced (same ids, same roles), at `now`:
        the derived tables are patched for the changed instances, not rebuilt, so keeping a
        snapshot current costs per change, not per instance."""
        new = self.at(now)
        changed = list(changed)
        if not changed:
            return new
        pos, ppos, dpos = self._pos, self._prefill_pos, self._decode_pos  # type: ignore[attr-defined]
        instances = list(self.instances)
        prefill, decode = list(self._prefill), list(self._decode)  # type: ignore[attr-defined]
        rows = list(self._decode_rows)  # type: ignore[attr-defined]
        by_queue = list(self._prefill_by_queue)  # type: ignore[attr-defined]
        by_id = self._prefill_by_id  # type: ignore[attr-defined]
        tbt = self.params.tbt
        prefill_changes, decode_changes = [], []
        for load in changed:
            iid = load.instance_id
            old = instances[pos[iid]]
            if old.role != load.role:
                raise ValueError(f"{iid}: a role change needs a new snapshot")
            instances[pos[iid]] = load
            if iid in ppos:
                prefill_changes.append((ppos[iid], prefill[ppos[iid]], load))
                prefill[ppos[iid]] = load
                if by_id is self._prefill_by_id:  # type: ignore[attr-defined]
                    by_id = dict(by_id)
                by_id[iid] = load
                at = bisect_left(by_queue, _queue_key(old), key=_queue_key)
                del by_queue[at]
                insort(by_queue, load, key=_queue_key)
            if iid in dpos:
                decode_changes.append((dpos[iid], decode[dpos[iid]], load))
                decode[dpos[iid]] = load
                rows[dpos[iid]] = _decode_row(tbt, load)
        prefill_t, decode_t = tuple(prefill), tuple(decode)
        orders = self._orders.replacing(  # type: ignore[attr-defined]
            prefill_changes, decode_changes, prefill_t, decode_t, tbt)
        _set(new, instances=tuple(instances), _prefill=prefill_t, _decode=decode_t,
             _prefill_by_id=by_id, _prefill_by_queue=tuple(by_queue), _decode_rows=tuple(rows),
             _orders=orders)
        return new

    def prefill(self) -> tuple[InstanceLoad, ...]:
        return self._prefill  # type: ignore[attr-defined]

    def decode(self) -> tuple[InstanceLoad, ...]:
        return self._decode  # type: ignore[attr-defined]

    def prefill_by_queue(self) -> tuple[InstanceLoad, ...]:
        """The prefill-capable instances, the soonest idle first (ties by id)."""
        return self._prefill_by_queue  # type: ignore[attr-defined]

    def decode_rows(self) -> tuple[tuple[float, float, tuple[float, ...], str, InstanceLoad], ...]:
        """Per decode-capable instance, what a policy's inner loop reads, computed once:
        (the TBT model's load term for its running requests and KV, its free KV tokens,
        its predicted finish times, its id, its load)."""
        return self._decode_rows  # type: ignore[attr-defined]

    def orders(self) -> Orders:
        """The instances sorted by the bounds kv_centric's searches walk (`orders.Orders`)."""
        return self._orders  # type: ignore[attr-defined]

    def prefill_position(self, instance_id: str) -> int | None:
        """Its index in `prefill()`, if it can prefill."""
        return self._prefill_pos.get(instance_id)  # type: ignore[attr-defined]

    def decode_position(self, instance_id: str) -> int | None:
        """Its index in `decode()`, if it can decode."""
        return self._decode_pos.get(instance_id)  # type: ignore[attr-defined]

    def prefill_instance(self, instance_id: str) -> InstanceLoad | None:
        """The prefill-capable instance of that id, if any."""
        return self._prefill_by_id.get(instance_id)  # type: ignore[attr-defined]


def contention(p: InstanceLoad, d: InstanceLoad) -> float:
    """The share of `d`'s speed a prefill running on `p` takes away: 1 on the same engine, 0
    on other hardware; engines on one host's CPU contend by how far their threads outnumber
    the cores they can run on together, and fully where `p` is a side engine: it computes on
    the cores of the serving processes, which carry `d`'s tokens."""
    if p.instance_id == d.instance_id:
        return 1.0
    if not p.host or p.host != d.host:
        return 0.0
    if p.side and not (p.gpus or d.gpus):
        return 1.0
    if p.gpus or d.gpus:
        return 1.0 if p.gpus & d.gpus else 0.0
    if not (p.cores and d.cores and p.threads and d.threads):
        return 0.0
    over = p.threads + d.threads - len(p.cores | d.cores)
    return min(max(over / d.threads, 0.0), 1.0)


def _set(obj: object, **fields: object) -> None:
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


def _queue_key(i: InstanceLoad) -> tuple[float, str]:
    return (i.busy_until, i.instance_id)


def _decode_row(tbt: TbtModel, i: InstanceLoad) -> tuple:
    return (tbt.per_seq_s * i.running + tbt.per_kv_token_s * i.kv_tokens,
            i.kv_capacity_tokens - i.kv_tokens if i.kv_capacity_tokens else float("inf"),
            i.finishes, i.instance_id, i)


@dataclass(frozen=True)
class PrefixMatch:
    """What the KV index holds of a request's blocks: the longest prefix, in blocks, in the
    pool and in each instance's local engine cache (absent: 0)."""

    pool: int = 0
    local: Mapping[str, int] = field(default_factory=dict)
    longest: int = 0
    """The longest of them all (computed when not given)."""
    levels: tuple[tuple[int, tuple[str, ...]], ...] = field(default=(), compare=False)
    """`local` grouped: (blocks, the locations holding that many), the most blocks first; a
    group may name the pool too (computed from `local` when not given; the index gives it)."""

    def __post_init__(self) -> None:
        if not self.longest and (self.pool or self.local):
            object.__setattr__(self, "longest", max(self.pool, *self.local.values(), 0))
        if not self.levels and self.local:
            groups: dict[int, list[str]] = {}
            for name, blocks in self.local.items():
                groups.setdefault(blocks, []).append(name)
            object.__setattr__(self, "levels", tuple(
                (blocks, tuple(names)) for blocks, names in sorted(groups.items(), reverse=True)))


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
    """Per-request SLOs; None: the snapshot's defaults. The router passes only SLOs the
    operator allows (`Router.slos`): a client tightens them, never loosens them."""
    sequences: int = 1
    """Sequences the request decodes at once (`n`): each takes a slot of the engine's batch,
    `max_tokens` of KV and a share of every step."""


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
    cost_s: float = 0.0
    """kv_centric's objective: the predicted TTFT plus the seconds the prefill adds to the
    token gaps of the streams decoding where it runs (and on engines sharing its cores)."""
    @property
    def disaggregated(self) -> bool:
        return self.prefill_id != self.decode_id


@dataclass(frozen=True)
class Reject:
    """No pair is predicted to meet the SLOs: answer 429 before doing any work."""

    reason: str
    retry_after_s: float
