"""kv_centric's local route: a decode-capable instance computing the prompt itself.

The choice is defined over the decode-capable instances in snapshot order: of those that keep
the TBT SLO with room for the request, the lowest total (its queue + the pull + the prefill,
plus the seconds its running streams wait for it; on a side engine times `side_cost`, plus a
TBT per output token), the first on ties.

What it prices: side instances and those with a stream predicted to have ended already; the
longest hits (`kv_price.FEW`) by their own bounds; the others by threshold, walking
`orders.Orders.decode_busy` and `.decode_wait` side by side (no instance not yet reached in
either totals less than the next queue + the pull + the prompt's model seconds past the
longest hit among them times the next wait key), each priced only if its own bound (its
exact total when it has no streams ending) could beat the best. Capped by a disaggregated
route, only one costing less than the cap is sought. With instances of several block sizes,
or bounds that do not hold, every one is priced.
"""

from __future__ import annotations

from bisect import bisect_right
from operator import itemgetter

from conductor.scheduler.policies.estimate import loadable_blocks
from conductor.scheduler.policies.kv_price import Prices
from conductor.scheduler.snapshot import Route

_key = itemgetter(0)
_INF = float("inf")


def choose_local(pr: Prices, cap: float = _INF) -> Route | None:
    """The chosen local route, or None when no instance can take the request; with a `cap`,
    possibly None as well when none would cost less than `cap`."""
    snap, now = pr.snap, pr.now
    orders, decode = snap.orders(), snap.decode()
    bs = decode[0].block_size
    pool = min(pr.req.match.pool, loadable_blocks(pr.n, bs))
    if orders.decode_odd_block or not pr.pruning or orders.decode_speed[0][0] < 0.0:
        best, best_pos = _first_lowest((pos, pr.local_price(d)) for pos, d in enumerate(decode))
        return None if best is None else pr.route(decode[best_pos], best)
    first = orders.decode_first
    priced = set(orders.decode_side)
    priced.update(pos for _, pos in first[:bisect_right(first, now, key=_key)])
    best, best_pos = _first_lowest((pos, pr.local_price(decode[pos])) for pos in priced)
    if cap < _INF and (best is None or best[0] >= cap):  # only one cheaper matters
        best, best_pos = (cap,), -1
    loadable, local = loadable_blocks(pr.n, bs), pr.local

    def bound(pos: int, hit: int) -> float:
        d = decode[pos]
        cached = max(hit, pool)
        pull = pr.tfix + (pool - hit) * pr.tpb if pool > hit else 0.0
        return max(d.busy_until - now, 0.0) + pull + pr.model_cost(cached, bs, local=True) \
            * (d.fastest * (1 + max(d.running, 0)))

    def exact(pos: int, hit: int) -> float:
        """The total of an instance with no streams ending (not side), computed as its price
        computes it: ties and all."""
        d = decode[pos]
        cached = max(hit, pool)
        pull = pr.tfix + (pool - hit) * pr.tpb if pool > hit else 0.0
        cost = pr.model_cost(cached, bs, local=True) * d.prefill_speed
        return max(d.busy_until - now, 0.0) + pull + cost + max(d.running, 0) * cost

    # the longest hits compute least: each by its own bound, the lowest first
    high = {}
    for iid, blocks in pr.high.items():
        pos = snap.decode_position(iid)
        if blocks and pos is not None and pos not in priced:
            high[pos] = bound(pos, min(blocks, loadable))
    for pos in sorted(high, key=high.__getitem__):
        if best is not None and not pr.may_beat(high[pos], best[0]):
            break
        best, best_pos = _lower(best, best_pos, pr.local_price(decode[pos]), pos)
    # the rest by threshold, walking `decode_busy` and `decode_wait` side by side
    rest = min(pr.rest_hit, loadable)
    c_rest = pr.model_cost(max(rest, pool), bs, local=True)
    pull_rest = pr.tfix + (pool - rest) * pr.tpb if pool > rest else 0.0
    busy, wait = orders.decode_busy, orders.decode_wait
    seen = priced.union(high)
    a = w = 0
    while a < len(busy) and w < len(wait):  # once one is walked, every instance was met
        queue = max(busy[a][0] - now, 0.0)
        per_s = wait[w][0]
        if best is not None and not pr.may_beat(queue + pull_rest + c_rest * per_s,
                                                best[0]):
            break
        # step the order whose next key raises the threshold more
        gain_a = max(busy[a + 1][0] - now, 0.0) - queue if a + 1 < len(busy) else _INF
        gain_w = c_rest * (wait[w + 1][0] - per_s) if w + 1 < len(wait) else _INF
        if gain_w >= gain_a:
            pos = wait[w][1]
            w += 1
        else:
            pos = busy[a][1]
            a += 1
        if pos in seen:
            continue
        seen.add(pos)
        if best is not None:
            hit = min(local.get(decode[pos].instance_id, 0), loadable) if local else 0
            if decode[pos].finishes:
                if not pr.may_beat(bound(pos, hit), best[0]):
                    continue
            elif (exact(pos, hit), pos) > (best[0], best_pos):
                continue
        best, best_pos = _lower(best, best_pos, pr.local_price(decode[pos]), pos)
    return None if best is None or best_pos < 0 else pr.route(decode[best_pos], best)


def _lower(best: tuple | None, best_pos: int, price: tuple | None, pos: int
           ) -> tuple[tuple | None, int]:
    """The lower cost, the earlier position on ties."""
    if price is not None and (best is None or price[0] < best[0]
                              or price[0] == best[0] and pos < best_pos):
        return price, pos
    return best, best_pos


def _first_lowest(priced) -> tuple[tuple | None, int]:  # type: ignore[no-untyped-def]
    """Of (position, price or None) pairs, the lowest cost, the earliest position on ties."""
    best, best_pos = None, -1
    for pos, price in priced:
        best, best_pos = _lower(best, best_pos, price, pos)
    return best, best_pos
