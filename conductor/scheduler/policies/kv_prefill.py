"""kv_centric's prefill instance for a disaggregated route.

The choice is defined over the prefill-capable instances in queue order (the soonest idle
first): every idle one is a candidate unless an idle one before it is alike (same hit, streams,
speeds and last finish); then the busy ones until one whose queue plus the cheapest
conceivable prefill is past the tie band of the best so far. Of the candidates within the band
(`near_min_*` of the lowest rank), the longest local hit wins, then the lowest rank, then the
first in queue order. A candidate's rank is its TTFT to the prefill's end plus the seconds its
own streams wait (times `side_cost` on a side engine).

What it prices: the odd ones (`orders.Orders.prefill_odd`); of the others, only those whose
lower bound (their queue + the prompt past their cached prefix at their fastest speed, times
their streams + 1, + the pull) could be chosen or move the band: the longest hits
(`kv_price.FEW`) one by one; the idle ones with no prefill queued by class
(`orders.Orders.prefill_classes`), one per class where none decodes streams (the longest hit
dominates the others); the busy ones in queue order until the band ends the walk or none
but the longest hits can matter.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from itertools import repeat

from conductor.scheduler.orders import Orders, odd_prefill, prefill_wait
from conductor.scheduler.policies.kv_price import PrefillRow, Prices
from conductor.scheduler.snapshot import InstanceLoad

_INF = float("inf")


def choose_prefill(pr: Prices) -> PrefillRow:
    """The chosen prefill instance's row: (rank, hit, queue key, instance, cached blocks,
    compute seconds, TTFT seconds to the prefill's end)."""
    snap, now = pr.snap, pr.now
    orders, prefill = snap.orders(), snap.prefill()
    n, bs, loadable, pool = pr.n, pr.bs, pr.loadable, pr.pool
    best_hit = min(pr.req.match.longest, loadable)
    floor = pr.pm.predict(n - best_hit * bs, best_hit * bs) * orders.prefill_speed[0][0]
    high = {iid: min(b, loadable) for iid, b in pr.high.items()
            if b and loadable and snap.prefill_position(iid) is not None}
    odd_ids = {prefill[i].instance_id for i in orders.prefill_odd}
    explicit_ids = odd_ids.union(high)
    explicit = sorted((snap.prefill_instance(i) for i in explicit_ids), key=_queue_key)
    rest_hit = min(pr.rest_hit, loadable)
    c_rest = pr.model_cost(max(rest_hit, pool), bs)
    pull_rest = pr.tfix + (pool - rest_hit) * pr.tpb if pool > rest_hit else 0.0
    walk = _Walk(pr, odd_ids, pr.pruning and orders.prefill_speed[0][0] >= 0.0)

    # idle candidates: the odd ones, then those of the longest hits by their bound, then the
    # rest in their bound's order
    idle = [p for p in explicit if p.busy_until - now <= 0.0]
    for p in walk.idle_odd([p for p in idle if p.instance_id in odd_ids], orders):
        walk.add(pr.prefill(p, 0.0, walk.hit(p)))
    for p in sorted((p for p in idle if p.instance_id not in odd_ids),
                    key=lambda p: (walk.bound(p, 0.0, walk.hit(p)), _queue_key(p))):
        walk.row(p, 0.0, idle=True, likes=walk.high_likes)
    # the rest: classes of the never queued in wait order (one alike instance each, or one
    # per hit while it decodes streams), then those drained but not yet told, one by one
    local, by_queue = pr.local, snap.prefill_by_queue()
    odd_likes = {like[1] for like in walk.shadow}
    ceiling, rows = pr.ceiling(walk.limit(True)), len(walk.rows)
    for w, _, key in orders.prefill_class_order:
        if c_rest * w + pull_rest > ceiling:
            break
        members = orders.prefill_classes[key]
        if not key[1][0] and key[1] not in odd_likes:  # the longest hit dominates the rest
            walk.row(snap.prefill_instance(_longest_hit(members, local, loadable)), 0.0,
                     idle=True)
        else:
            for iid in members:
                if iid not in explicit_ids:
                    walk.row(snap.prefill_instance(iid), 0.0, idle=True)
        if len(walk.rows) > rows:
            ceiling, rows = pr.ceiling(walk.limit(True)), len(walk.rows)
    first_busy = bisect_right(by_queue, now, key=_busy_until)
    for p in by_queue[bisect_right(by_queue, 0.0, key=_busy_until):first_busy]:
        if p.instance_id not in explicit_ids:
            walk.row(p, 0.0, idle=True)

    # busy candidates, in queue order until the band ends the walk; once none of the rest
    # can matter, only the explicit ones
    least_wait = orders.prefill_wait[0][0]
    tail = explicit
    for p in by_queue[first_busy:]:
        queue = p.busy_until - now
        if queue + floor > walk.band:
            tail = []
            break
        if walk.pruning and not pr.may_beat(queue + c_rest * least_wait + pull_rest,
                                            walk.limit(True)):
            tail = explicit[bisect_left(explicit, _queue_key(p), key=_queue_key):]
            break
        walk.row(p, queue)
    for p in tail:
        queue = p.busy_until - now
        if queue <= 0.0:
            continue
        if queue + floor > walk.band:
            break
        walk.row(p, queue)
    rows = sorted(walk.rows, key=lambda r: r[2])
    band = walk.band
    return max((r for r in rows if r[0] <= band), key=lambda r: (r[1], -r[0]))


class _Walk:
    """The candidates priced so far, their tie band and lowest ranks."""

    def __init__(self, pr: Prices, odd_ids: set[str], pruning: bool) -> None:
        self.pr, self.odd_ids, self.pruning = pr, odd_ids, pruning
        self.local, self.loadable = pr.local, pr.loadable
        self.rows: list[PrefillRow] = []
        self.band = _INF
        self.lowest = _INF
        self.lowest_missless = _INF
        """the lowest rank of a candidate without a local hit"""
        self.likes: set[tuple] = set()
        self.high_likes: set[tuple] = set()
        """likes of the idle candidates met, apart for those of the longest hits (an alike pair
        across the two is priced both, and the first in queue order wins the tie)"""
        self.shadow: dict[tuple, tuple] = {}
        """like -> queue key of the first odd idle instance that has it"""

    def hit(self, p: InstanceLoad) -> int:
        local = self.local
        return min(local.get(p.instance_id, 0), self.loadable) if local else 0

    def limit(self, hit: bool) -> float:
        """A candidate priced above this can neither be chosen nor move the band: past the
        band and the lowest rank; without a hit, also past the lowest rank of those without."""
        top = self.band if self.band > self.lowest else self.lowest
        return top if hit or self.lowest_missless > top else self.lowest_missless

    def bound(self, p: InstanceLoad, queue: float, hit: int) -> float:
        """No lower rank is possible for `p` (not a side instance) after `queue` seconds."""
        pr = self.pr
        pool = pr.pool
        cached = hit if hit > pool else pool
        pull_p = pr.tfix + (pool - hit) * pr.tpb if pool > hit else 0.0
        return queue + pr.model_cost(cached, pr.bs) * prefill_wait(p) + pull_p

    def add(self, row: PrefillRow) -> None:
        self.rows.append(row)
        rank, hit = row[0], row[1]
        prm = self.pr.prm
        if rank * (1.0 + prm.near_min_rel) + prm.near_min_abs_s < self.band:
            self.band = rank * (1.0 + prm.near_min_rel) + prm.near_min_abs_s
        if rank < self.lowest:
            self.lowest = rank
        if not hit and rank < self.lowest_missless:
            self.lowest_missless = rank

    def row(self, p: InstanceLoad, queue: float, idle: bool = False,
            likes: set[tuple] | None = None) -> None:
        """A candidate: priced unless alike an idle one before it (idle) or its bound rules
        it out; an odd one is priced (busy) or was (idle)."""
        if p.instance_id in self.odd_ids:
            if not idle:
                self.add(self.pr.prefill(p, queue, self.hit(p)))
            return
        hit = self.hit(p)
        if idle:
            like = _like(p, hit)
            likes = self.likes if likes is None else likes
            if like in likes:
                return  # an alike one before it in queue order: the same rank
            likes.add(like)
            first = self.shadow.get(like)
            if first is not None and first < _queue_key(p):
                return
        if self.pruning and not self.pr.may_beat(self.bound(p, queue, hit), self.limit(hit > 0)):
            return
        self.add(self.pr.prefill(p, queue, hit))

    def idle_odd(self, idle: list[InstanceLoad], orders: Orders) -> list[InstanceLoad]:
        """Of the odd idle instances in queue order, those no alike idle one comes before;
        records their likes (`shadow`)."""
        out = []
        likes: set[tuple] = set()
        for p in idle:
            like = _like(p, self.hit(p))
            if like in likes:
                continue
            likes.add(like)
            self.shadow.setdefault(like, _queue_key(p))
            if not self._twin_before(p, like, orders):
                out.append(p)
        return out

    def _twin_before(self, p: InstanceLoad, like: tuple, orders: Orders) -> bool:
        """Whether an idle instance that is not odd, alike `p`, comes before it."""
        order = orders.prefill_wait
        w, key, prefill, now = prefill_wait(p), _queue_key(p), self.pr.snap.prefill(), self.pr.now
        for at in range(bisect_left(order, (w,)), len(order)):
            ww, until, iid, pos = order[at]
            if ww != w or (until, iid) >= key:
                return False
            q = prefill[pos]
            if until - now <= 0.0 and not odd_prefill(q) and _like(q, self.hit(q)) == like:
                return True
        return False


def _longest_hit(members: tuple[str, ...], local: Mapping[str, int], loadable: int) -> str:
    """The first of `members` holding the longest loadable hit."""
    if not local:
        return members[0]
    hits = list(map(local.get, members, repeat(0)))
    top = max(hits)
    if top > loadable:
        return next(m for m, h in zip(members, hits, strict=True) if h >= loadable)
    return members[hits.index(top)]


def _like(p: InstanceLoad, hit: int) -> tuple:
    return (hit, p.prefill_like)


def _queue_key(p: InstanceLoad) -> tuple[float, str]:
    return (p.busy_until, p.instance_id)


def _busy_until(p: InstanceLoad) -> float:
    return p.busy_until
