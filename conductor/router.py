"""What the pipeline calls to place a request: look its blocks up in the KV index, freeze a
snapshot, ask the policy, and count the choice into the load model and the index's predicted
overlay at once (dispatch time). The returned `Dispatch` reports the request's progress back
(replies feed the index and refit the time models) and releases its load exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from cluster.instance import PROBE_TOKENS
from conductor.config import DISAGGREGATE, ConductorConfig
from conductor.errors import InvalidRequest, NoCapacity, Overloaded
from conductor.registry import Instance, Registry
from conductor.scheduler.decode_model import TbtFitter
from conductor.scheduler.index import POOL, KVIndex
from conductor.scheduler.policies.estimate import loadable_blocks
from conductor.scheduler.policy import POLICIES
from conductor.scheduler.prefill_model import PrefillTimeFitter, plausible
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    Reject,
    Route,
    RouteRequest,
    SchedulerParams,
)
from store.block_hash import extend_hashes

log = structlog.get_logger(__name__)

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8": 1, "fp8": 1}


def kv_block_bytes(model_dir: str, block_size: int, dtype: str | None = None) -> int:
    """Bytes of one KV block of `block_size` tokens, all layers (from the model's config)."""
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    layers = int(cfg.get("num_hidden_layers", 1))
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or cfg.get("hidden_size", 64) // heads)
    name = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float16"
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(str(name), 2) * block_size


SPEED_MIN_TOKENS = 256
"""Prefills computing fewer tokens do not count towards their instance's speed: their time is
mostly a step's fixed costs (and the decode steps a `both` engine interleaves), which a speed
factor would spread over every token of the next long prompt, making a `both` engine's
predictions many times too long (docs/design.md, "Each instance has a prefill speed")."""


@dataclass
class Counters:
    routed: int = 0
    rejected: int = 0
    local_prefills: int = 0
    predicted_hit_tokens: int = 0
    reported_hit_tokens: int = 0
    """Prefill-side cache hits: as predicted at dispatch, and as the engines reported."""
    reported_prompt_tokens: int = 0
    """The prompt tokens of the prefills that reported."""


class Router:
    def __init__(self, config: ConductorConfig, registry: Registry,
                 block_bytes: int | None = None) -> None:
        self.config = config
        self.registry = registry
        self.policy_name = config.policy
        self.policy = POLICIES[config.policy]
        self.index = KVIndex(config.index_max_blocks, config.predicted_ttl_s)
        self.prefill_fit = PrefillTimeFitter()
        self._speeds_against = self.prefill_fit.model
        """The model the instances' speeds were last computed against (`LoadState.respeed`)."""
        self.tbt_fit = TbtFitter()
        self.warm: set[str] = set()
        """Prefill instances whose first prefill completed: that one is not timed."""
        self.counters = Counters()
        self._block_bytes = block_bytes
        self._base = SchedulerParams(ttft_slo_s=config.ttft_slo_s, tbt_slo_s=config.tbt_slo_s,
                                     disaggregate=config.disaggregate)
        self.transfer_s_per_block: Callable[[], float | None] = lambda: None
        """The pool's measured seconds per block moved (`conductor.pool_stats`); None: not
        measured yet (the prior from `pool_gbps` then)."""
        self._params: SchedulerParams | None = None
        self._seq = 0
        self.freed: Callable[[], None] = lambda: None
        """Called when a routed request frees capacity (it ended, or its prefill did): the
        flow's batch queue tries its waiting requests (`conductor.flow`)."""
        self.follower = None
        if config.kv_events:
            from conductor.scheduler.events import KvEventFollower

            self.follower = KvEventFollower(self.index)
        registry.listen(self)

    # ------------------------------------------------------------------ membership

    def instance_joined(self, inst: Instance) -> None:
        self.index.add_location(inst.instance_id)
        if inst.info.prefill_probe_s > 0:  # its speed before its first request
            inst.load.observe_prefill(PROBE_TOKENS, 0, inst.info.prefill_probe_s,
                                      self.prefill_fit.model)
        self._params = None

    def instance_admitted(self, inst: Instance) -> None:
        if self.follower is not None:  # a stranger's events never reach the index
            self.follower.follow(inst)

    def instance_left(self, inst: Instance) -> None:
        if self.follower is not None:
            self.follower.unfollow(inst.instance_id)
        self.index.remove_location(inst.instance_id)

    def set_slo(self, ttft_slo_s: float | None = None, tbt_slo_s: float | None = None
                ) -> tuple[float, float]:
        """Change the default SLOs (None: unchanged); returns them."""
        changes = {k: v for k, v in (("ttft_slo_s", ttft_slo_s), ("tbt_slo_s", tbt_slo_s))
                   if v is not None}
        for k, v in changes.items():
            if not v > 0:
                raise ValueError(f"{k} must be positive, got {v}")
        self._base = replace(self._base, **changes)
        self._params = None
        log.info("slo_set", ttft_slo_s=self._base.ttft_slo_s, tbt_slo_s=self._base.tbt_slo_s)
        return self._base.ttft_slo_s, self._base.tbt_slo_s

    def set_policy(self, policy: str, disaggregate: str) -> None:
        """Route by `policy` (`conductor.scheduler.policy.POLICIES`) with `disaggregate` from
        the next request on."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {policy!r}")
        if disaggregate not in DISAGGREGATE:
            raise ValueError(f"disaggregate must be one of {DISAGGREGATE}, got {disaggregate!r}")
        if (policy, disaggregate) == (self.policy_name, self._base.disaggregate):
            return
        self.policy_name, self.policy = policy, POLICIES[policy]
        self._base = replace(self._base, disaggregate=disaggregate)
        self._params = None
        log.info("policy_set", policy=policy, disaggregate=disaggregate)

    @property
    def disaggregate(self) -> str:
        return self._base.disaggregate

    @property
    def ttft_slo_s(self) -> float:
        """The default TTFT SLO now."""
        return self._base.ttft_slo_s

    @property
    def tbt_slo_s(self) -> float:
        """The default TBT SLO now."""
        return self._base.tbt_slo_s

    def slos(self, ttft_slo_s: float | None, tbt_slo_s: float | None, loosen: bool = False,
             share: float = 1.0) -> tuple[float | None, float | None]:
        """A request's own SLOs as the operator allows them: tighter than `share` of the
        defaults as asked, never looser (a client cannot switch load shedding off), unless
        `loosen` (its tenant is allowed to). None: the default."""
        def one(own: float | None, default: float) -> float | None:
            if own is None:
                return None if share == 1.0 else default * share
            return own if loosen else min(own, default * share)

        return one(ttft_slo_s, self._base.ttft_slo_s), one(tbt_slo_s, self._base.tbt_slo_s)

    # ------------------------------------------------------------------ deciding

    def params(self, block_size: int) -> SchedulerParams:
        """The SLOs with the current fitted models and measured transfer time; rebuilt only
        when one of them changed."""
        p = self._params
        tpb = self.transfer_s_per_block()
        if tpb is None:
            bb = self._block_bytes or kv_block_bytes(self.config.model, block_size)
            self._block_bytes = bb
            tpb = bb / (self.config.pool_gbps * 1e9)
        if (p is None or p.prefill is not self.prefill_fit.model
                or p.tbt is not self.tbt_fit.model or p.transfer_s_per_block != tpb):
            p = self._params = replace(self._base, prefill=self.prefill_fit.model,
                                       tbt=self.tbt_fit.model, transfer_s_per_block=tpb)
        return p

    def snapshot(self, now: float, block_size: int) -> ClusterSnapshot:
        self.prefill_fit.refresh(now)
        self.tbt_fit.refresh(now)
        if self._speeds_against is not self.prefill_fit.model:  # refitted: speeds follow it
            self._speeds_against = self.prefill_fit.model
            for inst in self.registry.all():
                inst.load.respeed(self._speeds_against)
        self.registry.mark_changed(self.index.take_changed())
        return self.registry.snapshot(now, self.params(block_size), self.index.blocks)

    def route(self, request_id: str, token_ids: list[int], block_hashes: tuple[int, ...],
              max_tokens: int, block_size: int, cache_salt: str = "",
              ttft_slo_s: float | None = None, tbt_slo_s: float | None = None,
              exclude: Collection[str] = (), sequences: int = 1) -> Dispatch:
        """Choose where the request runs and count it there; raise Overloaded (429) or
        NoCapacity (503) instead when it cannot be placed. `exclude`: instances this request
        must not use (they failed it)."""
        now = time.monotonic()
        self.index.expire(now)
        snap = self.snapshot(now, block_size)
        if exclude:
            snap = ClusterSnapshot(tuple(i for i in snap.instances
                                         if i.instance_id not in exclude), now, snap.params)
        _fits_somewhere(snap, len(token_ids), max_tokens, sequences)
        self._seq += 1
        req = RouteRequest(len(token_ids), block_hashes, self.index.match(block_hashes),
                           max_tokens, self._seq, ttft_slo_s, tbt_slo_s, sequences)
        decision = self.policy(snap, req)
        if decision is None:
            missing = [role for role, have in (("prefill", snap.prefill()),
                                               ("decode", snap.decode())) if not have]
            raise NoCapacity(f"no {' or '.join(missing) or 'suitable'}-capable instance is up; "
                             "retry later")
        if isinstance(decision, Reject):
            self.counters.rejected += 1
            log.info("rejected", request_id=request_id, reason=decision.reason,
                     retry_after_s=round(decision.retry_after_s, 3))
            raise Overloaded(decision.reason, code="slo_unattainable",
                             retry_after=decision.retry_after_s)
        p, d = self.registry.get(decision.prefill_id), self.registry.get(decision.decode_id)
        if p is None or d is None:
            raise NoCapacity("the chosen instance left the cluster")
        self.registry.dispatched(request_id, (p.instance_id, d.instance_id))
        loadable = loadable_blocks(len(token_ids), block_size)
        pool = min(req.match.pool, loadable)
        tail = list(token_ids[len(block_hashes) * block_size:])
        return Dispatch(self, decision, p, d, request_id, len(token_ids), tail, block_hashes,
                        block_size, cache_salt, max_tokens, now, pool,
                        decode_has_prompt=req.match.local.get(d.instance_id, 0) >= loadable,
                        sequences=sequences)

    def pin(self, request_id: str, token_ids: list[int], block_hashes: tuple[int, ...],
            max_tokens: int, block_size: int, cache_salt: str, inst: Instance,
            sequences: int = 1) -> Dispatch:
        """The request on `inst` alone, whatever the policy would choose (a fall-back: the
        prefill beside it failed)."""
        now = time.monotonic()
        self.registry.dispatched(request_id, (inst.instance_id,))
        match = self.index.match(block_hashes)
        pool = min(match.pool, loadable_blocks(len(token_ids), block_size))
        route = Route(prefill_id=inst.instance_id, decode_id=inst.instance_id,
                      cached_blocks=pool, uncached_tokens=len(token_ids) - pool * block_size)
        tail = list(token_ids[len(block_hashes) * block_size:])
        return Dispatch(self, route, inst, inst, request_id, len(token_ids), tail, block_hashes,
                        block_size, cache_salt, max_tokens, now, pool, sequences=sequences)


def _fits_somewhere(snap: ClusterSnapshot, prompt_tokens: int, max_tokens: int,
                    sequences: int) -> None:
    """InvalidRequest for a request no decode-capable instance could run even idle: more
    sequences than any batches at once, or more KV than any holds (waiting would not help)."""
    decodes = snap.decode()
    if not decodes:
        return
    if all(d.max_seqs for d in decodes) and sequences > max(d.max_seqs for d in decodes):
        raise InvalidRequest(f"n={sequences} is more sequences than any instance runs at once "
                             f"({max(d.max_seqs for d in decodes)})", param="n")
    need = prompt_tokens + max_tokens * sequences
    if all(d.kv_capacity_tokens for d in decodes) and need > max(
            d.kv_capacity_tokens for d in decodes):
        raise InvalidRequest(
            f"the prompt and {sequences} x max_tokens={max_tokens} need {need} KV tokens, more "
            f"than any instance holds ({max(d.kv_capacity_tokens for d in decodes)}): ask for "
            "fewer tokens or choices", param="max_tokens" if sequences == 1 else "n")


@dataclass(eq=False)
class Dispatch:
    """One routed request's footprint in the load model and the index, until `release()`."""

    router: Router
    route: Route
    prefill: Instance
    decode: Instance
    request_id: str
    num_prompt_tokens: int
    prompt_tail: list[int]
    """The prompt's tokens after its last full block: the generated ones extend them."""
    block_hashes: tuple[int, ...]
    block_size: int
    cache_salt: str
    max_tokens: int
    started: float
    pool_blocks: int = 0
    """Of the prompt's loadable blocks, how many the pool holds (the index's view): the
    engine that computes the prompt loads them without asking the pool."""
    decode_has_prompt: bool = False
    """The decode instance's own cache holds every loadable block (the index's view): a
    disaggregated decode need not wait for the prefill beside it."""
    sequences: int = 1
    """The choices it decodes at once (`n`)."""
    _prefill_open: bool = True
    _decode_open: bool = True
    _solo: bool = False
    _beside: bool | None = False
    """Streams of the prefill instance's own were predicted to decode through its predicted
    prefill (True), not at all (False), or part of it (None: not timed, `LoadState.speed`)."""
    _first_token_at: float = 0.0
    _last_token_at: float = 0.0
    _tokens: int = 0
    _batch_sum: int = 0
    _kv_sum: int = 0
    _steady_at: float = 0.0
    """When the second chunk arrived: the token gaps the TBT model learns from start here."""
    _steady_tokens: int = 0
    _output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        r, now, idx = self.route, self.started, self.router.index
        n = self.num_prompt_tokens
        p, d = self.prefill.load, self.decode.load
        self._solo = p.prefills_in_flight() == 0
        until = p.streams_until()
        self._beside = False if until <= now else (
            True if until >= now + r.predicted_ttft_s else None)
        p.add_prefill(self.request_id, n, r.uncached_tokens, r.prefill_s, now)
        finish = now + r.predicted_ttft_s + self.max_tokens * r.predicted_tbt_s
        d.add_decode(self.request_id, n, finish, self.sequences)
        # What this request will leave behind, until events or replies confirm it: in the
        # prefilling engine's cache from now on (a request queued behind it there finds the
        # prefix computed; its queue is priced); in the pool and a disaggregated route's
        # decode instance only once the prefill is done (`first_token`, `prefill_done`).
        # Predicted there at once, a prompt of a prefix still being computed was priced as a
        # pool hit on another engine, which then computed it all again (docs/design.md).
        idx.predict(self.prefill.instance_id, self.block_hashes, now)
        c = self.router.counters
        c.routed += 1
        c.local_prefills += not r.disaggregated
        c.predicted_hit_tokens += r.cached_blocks * self.block_size

    def announce(self) -> None:
        """Log the decision (`routed`). The pipeline calls it once the request's RPC is on its
        way: the line (~0.1 ms) is then written while the engine works, not before."""
        r = self.route
        log.info("routed", request_id=self.request_id, prefill=r.prefill_id, decode=r.decode_id,
                 prompt_tokens=self.num_prompt_tokens, cached_blocks=r.cached_blocks,
                 local_prefill=not r.disaggregated,
                 predicted_ttft_s=round(r.predicted_ttft_s, 4),
                 predicted_tbt_s=round(r.predicted_tbt_s, 4))

    def prefill_done(self, num_prompt_tokens: int, num_cached_tokens: int, blocks_in_pool: int,
                     engine_seconds: float) -> None:
        """The prefill instance's reply: its engine's cache hit, what the pool now holds, and a
        timing for the prefill model: the engine's own when the request ran alone, else the
        time since the instance's previous completion (a busy server's inter-departure time
        is its service time), so the model follows the machine during bursts too."""
        now = time.monotonic()
        p = self.prefill.load
        solo, service = self._end_prefill(now)
        idx = self.router.index
        idx.store(self.prefill.instance_id, self.block_hashes)
        idx.store(POOL, self.block_hashes[:blocks_in_pool])
        # the worker read the pool after its save: blocks past that prefix are gone (evicted,
        # or never written), whatever the index believed. (Mooncake's master could publish
        # its evictions, but the 0.3.13 wheel's master is built without the ZMQ publisher.)
        idx.truncate(POOL, self.block_hashes, blocks_in_pool)
        self.router.freed()
        self.router.counters.reported_hit_tokens += num_cached_tokens
        self.router.counters.reported_prompt_tokens += num_prompt_tokens
        uncached = num_prompt_tokens - num_cached_tokens
        seconds = engine_seconds if solo else service
        if self._timed(uncached, num_cached_tokens, seconds, solo):
            # the instance's speed takes what sets it apart, the model learns the rest
            self.router.prefill_fit.observe(uncached, num_cached_tokens,
                                            seconds / p.speed(self._beside), exact=solo,
                                            now=now)

    def first_token(self, num_cached_tokens: int | None = None) -> None:
        """The first token is out. A prompt the decode instance computed itself (`num_cached_
        tokens`: what its engine reported not computing, else as the route predicted) is
        timed like a prefill instance's, with the conductor's clock: from its dispatch when no
        other prefill was in flight there (prompts sent after it wait for it: its engine
        finishes one prompt before packing the next, `worker.step_budget.finish_first`), else
        from the instance's previous completion. Untimed, the model of an arm that computes
        most prompts where they decode would stay at its prior, far below what cold prompts
        take on a CPU."""
        now = time.monotonic()
        self._first_token_at = self._last_token_at = now
        if self._prefill_open:  # prefilled by the decode instance itself, saving it now
            self.router.index.predict(POOL, self.block_hashes, now)
            _, service = self._end_prefill(now)
            r = self.route
            cached = (r.cached_blocks * self.block_size if num_cached_tokens is None
                      else num_cached_tokens)
            uncached = self.num_prompt_tokens - cached
            # alone at dispatch: from then (a short prompt sent after it may ride along in its
            # last step and finish a moment before it, which would leave it that moment)
            seconds = now - self.started if self._solo else service
            if self._timed(uncached, cached, seconds, self._solo):
                self.router.prefill_fit.observe(uncached, cached,
                                                seconds / self.prefill.load.speed(self._beside),
                                                exact=self._solo, now=now)
        else:  # the decode instance loaded the prefill's blocks
            self.router.index.predict(self.decode.instance_id, self.block_hashes, now)

    def _timed(self, uncached: int, cached: int, seconds: float, exact: bool) -> bool:
        """Whether a prefill's timing is one for the model (an engine's first prefill pays
        its warm-up: seconds for a few tokens here; an inter-departure time far from the
        prediction is a batch or a wait, not a service time: `prefill_model.plausible`). One
        of a prefill that ran alone and computed `SPEED_MIN_TOKENS` or more also joins the
        instance's speed: short ones time a step's overheads, and inter-departure times on
        engines sharing cores can be many times the model, which the queue then counted
        again."""
        iid = self.prefill.instance_id
        if iid not in self.router.warm:
            self.router.warm.add(iid)
            return False
        if self._beside is None:  # streams beside part of it: neither speed's timing
            return False
        predicted = self.router.prefill_fit.model.predict(uncached, cached)
        load = self.prefill.load
        if uncached <= 0 or (not exact and not plausible(
                seconds, predicted * load.speed(self._beside))):
            return False
        if exact and uncached >= SPEED_MIN_TOKENS:
            load.observe_prefill(uncached, cached, seconds, self.router.prefill_fit.model,
                                 beside=self._beside)
        return True

    def tokens(self, token_ids: list[int], record: bool = True) -> None:
        """New output tokens; `record`: they extend the sequence the decode cache will hold
        (one choice's only, when several are sampled)."""
        if not token_ids:
            return
        self._last_token_at = time.monotonic()
        if self._tokens and not self._steady_at:
            self._steady_at = self._last_token_at
            self._steady_tokens = self._tokens + len(token_ids)
        self._tokens += len(token_ids)
        d = self.decode.load
        d.decode_progress(self.request_id, len(token_ids))
        self._batch_sum += d.running()
        self._kv_sum += d.kv_tokens
        if record and len(self._output) < self.max_tokens:
            self._output.extend(token_ids)

    def decode_done(self) -> None:
        """The stream ended normally: the decode instance's cache holds the whole sequence."""
        hashes = self.block_hashes
        if self._output:
            hashes = hashes + tuple(extend_hashes(hashes[-1] if hashes else None,
                                                  self.prompt_tail + self._output,
                                                  self.block_size, self.cache_salt))
        self.router.index.store(self.decode.instance_id, hashes)
        # the gaps after the second chunk: the first gap is the hand-over from the prefill
        # (or its load) on a disaggregated route, seconds when the pool stalls, not a step
        steps = self._tokens - self._steady_tokens
        if self._steady_at and steps >= 2 and self._last_token_at > self._steady_at:
            n = self._tokens
            self.router.tbt_fit.observe(self._batch_sum / n, self._kv_sum / n,
                                        (self._last_token_at - self._steady_at) / steps)
        self.release()

    def withdraw(self, instance_id: str) -> None:
        """The request will leave nothing on that instance (it failed there, or will not run
        there): take back what it was predicted to leave there."""
        self.router.index.withdraw(instance_id, self.block_hashes)

    def release(self) -> None:
        """End the request's load wherever it is still counted; idempotent."""
        now = time.monotonic()
        if self._prefill_open:
            self._end_prefill(now)
        if self._decode_open:
            self._decode_open = False
            self.decode.load.end_decode(self.request_id)
            self.router.registry.released(self.request_id, (self.prefill.instance_id,
                                                            self.decode.instance_id))
            self.router.freed()

    def _end_prefill(self, now: float) -> tuple[bool, float]:
        """Close the prefill; (whether it ran alone, its service time) for `_timed`."""
        p = self.prefill.load
        solo = self._solo and p.prefills_in_flight() == 1
        service = p.service_time(now)
        self._prefill_open = False
        p.end_prefill(self.request_id, now)
        return solo, service
