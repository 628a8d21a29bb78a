"""kv_centric's price of one instance in each of its three searches, and what a request
fixes for all of them (`Prices`): the formulas of `kv_centric`'s docstring, evaluated in full.

The searches (`kv_prefill`, `kv_decode`, `kv_local`) price only the instances a lower bound
does not rule out; `Prices.may_beat` is that test, with room for the bound and the price
rounding differently.
"""

from __future__ import annotations

from bisect import bisect_right

from conductor.scheduler.policies.estimate import loadable_blocks
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    InstanceLoad,
    Route,
    RouteRequest,
    contention,
)

FEW = 16
"""Locations of the longest local hits that each search bounds one by one; every other
instance's hit is bounded by the longest outside them (`Prices.rest_hit`). Any value keeps
the choices; it only sets how much a search walks."""

_SLACK_S = 1e-6
_SLACK_REL = 1e-9
"""A bound this close to the best price is no proof: the instance is priced in full."""
_INF = float("inf")

PrefillRow = tuple  # (rank, hit, queue key, instance, cached blocks, compute s, TTFT s)
DecodeBest = tuple  # (score, position, instance, tbt, pull, stall, busy)


class Prices:
    """What one request fixes for every instance, and the price of each."""

    def __init__(self, snap: ClusterSnapshot, req: RouteRequest, tbt_slo: float) -> None:
        prm = self.prm = snap.params
        self.snap, self.req, self.tbt_slo, self.now = snap, req, tbt_slo, snap.now
        self.n = n = req.num_prompt_tokens
        self.local = req.match.local
        self.pm = prm.prefill
        self.tpb, self.tfix = prm.transfer_s_per_block, prm.transfer_s_fixed
        self._prefill_costs: dict[int, float] = {}
        self._local_costs: dict[int, float] = {}
        """cached blocks -> model seconds, one table per search (the local one computed at
        the block size of the first instance priced: they agree in a cluster of one size)"""
        prefills = snap.prefill()
        self.bs = bs = prefills[0].block_size if prefills else 0
        self.loadable = loadable = loadable_blocks(n, bs) if prefills else 0
        self.pool = min(req.match.pool, loadable)
        pm = prm.prefill
        self.pruning = 1.0 + prm.near_min_rel >= 0.0 and min(pm.coefficients()) >= 0.0
        """the bounds hold (no prefill takes negative time, one costs less the more is cached,
        the tie band grows with the rank); otherwise every instance is priced"""
        self.high: dict[str, int] = {}
        """location -> blocks of the (at most `FEW`) longest local hits"""
        self.rest_hit = 0
        """no location outside `high` holds more blocks than this"""
        for blocks, names in req.match.levels:
            if len(self.high) + len(names) > FEW:
                self.rest_hit = blocks
                break
            self.high.update(dict.fromkeys(names, blocks))

    def may_beat(self, bound: float, best: float) -> bool:
        """Whether an instance whose price is at least `bound` may still match `best`."""
        return bound <= best + _SLACK_S + abs(best) * _SLACK_REL or not self.pruning

    def ceiling(self, best: float) -> float:
        """The bound above which an instance cannot match `best` (`may_beat`)."""
        return best + _SLACK_S + abs(best) * _SLACK_REL if self.pruning else _INF

    def model_cost(self, cached: int, bs: int, local: bool = False) -> float:
        """The fitted model's seconds for the prompt past `cached` blocks of `bs` tokens."""
        costs = self._local_costs if local else self._prefill_costs
        cost = costs.get(cached)
        if cost is None:
            cost = costs[cached] = self.pm.predict(self.n - cached * bs, cached * bs)
        return cost

    # ---------------------------------------------------------------- prefill side

    def prefill(self, p: InstanceLoad, queue: float, hit: int) -> PrefillRow:
        """A disaggregated route's prefill on `p` after `queue` seconds: (rank, hit, queue
        key, p, cached, cost, TTFT to the prefill's end)."""
        pool, now = self.pool, self.now
        decoding = p.running if p.can_decode() else 0
        cached = hit if hit > pool else pool
        cost = self.model_cost(cached, self.bs)
        pull_p = self.tfix + (pool - hit) * self.tpb if pool > hit else 0.0
        cost = p.prefill_seconds(cost, now + queue + pull_p)
        ttft = queue + cost + pull_p
        rank = ttft + decoding * cost  # its own streams wait for this prefill
        if p.side:
            rank *= self.prm.side_cost
        return (rank, hit, (p.busy_until, p.instance_id), p, cached, cost, ttft)

    # ---------------------------------------------------------------- decode side

    def decode(self, d: InstanceLoad, pos: int, row: tuple, p: InstanceLoad, arrive: float,
               save: float, cost: float) -> DecodeBest | None:
        """A disaggregated route's decode on `d` (its `decode_rows` row), the prefill on `p`
        ending at `arrive` and taking `cost`: None when `d` cannot take the request then."""
        load_s, room, fin, iid, _ = row
        prm, req, seqs = self.prm, self.req, self.req.sequences
        tm = prm.tbt
        tbt = tm.base_s + tm.per_seq_s * seqs + tm.per_kv_token_s * self.n + load_s
        done = bisect_right(fin, arrive) if fin and fin[0] <= arrive else 0
        tbt -= tm.per_seq_s * done
        if tbt > self.tbt_slo or room < self.n + req.max_tokens * seqs \
                or not fits(d, d.running - done, seqs):
            return None
        loadable, tpb, tfix, local = self.loadable, self.tpb, self.tfix, self.local
        pull = tfix + loadable * tpb if loadable else 0.0
        if local:
            hit = local.get(iid)
            if hit:
                pull = tfix + (loadable - hit) * tpb if hit < loadable else 0.0
        share = contention(p, d)
        stall = share * d.running * cost if share and d.running else 0.0
        # its last block waits for the prompts d is computing itself (finish first)
        busy = max(d.busy_until - (arrive + save + pull), 0.0)
        return (tbt + pull + stall + busy, pos, d, tbt, pull, stall, busy)

    def decode_base(self, pull: bool = True) -> float:
        """The part of every decode instance's TBT this request adds, and a full pull."""
        tm, req = self.prm.tbt, self.req
        base = tm.base_s + tm.per_seq_s * req.sequences + tm.per_kv_token_s * self.n
        if not pull:
            return base
        return base + (self.tfix + self.loadable * self.tpb if self.loadable else 0.0)

    # ---------------------------------------------------------------- local

    def route(self, d: InstanceLoad, price: tuple) -> Route:
        """The local route of `local_price`'s price."""
        total, tbt, cached, cost, ttft = price
        return Route(prefill_id=d.instance_id, decode_id=d.instance_id, cached_blocks=cached,
                     uncached_tokens=self.n - cached * d.block_size, prefill_s=cost,
                     predicted_ttft_s=ttft, predicted_tbt_s=tbt, cost_s=total)

    def local_price(self, d: InstanceLoad) -> tuple | None:
        """`d` computing the prompt itself: (cost, tbt, cached blocks, compute s, TTFT s), or
        None when it cannot take the request."""
        prm, req, now, n, local = self.prm, self.req, self.now, self.n, self.local
        bs = d.block_size
        loadable = loadable_blocks(n, bs)
        pool = min(req.match.pool, loadable)
        hit = min(local.get(d.instance_id, 0), loadable) if local else 0
        running = d.running - bisect_right(d.finishes, now)
        tbt = prm.tbt.predict(running + req.sequences, d.kv_tokens + n)
        if tbt > self.tbt_slo or not fits(d, running, req.sequences) or (
                d.kv_capacity_tokens and d.kv_tokens + n + req.max_tokens * req.sequences
                > d.kv_capacity_tokens):
            return None
        cached = max(hit, pool)
        cost = self.model_cost(cached, bs, local=True)
        pull = prm.transfer_s_fixed + (pool - hit) * prm.transfer_s_per_block \
            if pool > hit else 0.0
        queue = max(d.busy_until - now, 0.0)
        cost = d.prefill_seconds(cost, now + queue + pull)
        ttft = queue + pull + cost
        total = ttft + max(running, 0) * cost
        if d.side:  # and its tokens come at about half speed: one TBT more each
            total = total * prm.side_cost + req.max_tokens * tbt
        return (total, tbt, cached, cost, ttft)


def fits(d: InstanceLoad, running: int, sequences: int) -> bool:
    """`sequences` more fit in `d`'s batch beside the `running` it holds then: beyond its
    `max_seqs` they would wait in the engine's queue, unpriced."""
    return not d.max_seqs or running + sequences <= d.max_seqs
