"""kv_centric's decode instance for a disaggregated route whose prefill is chosen.

The choice is defined over the decode-capable instances other than the prefill's, in snapshot
order: of those that keep the TBT SLO with room for the request when the prefill ends, the
lowest score (TBT then + the blocks it pulls + the streams a shared core slows + the wait for
its own prompts), the first on ties.

What it prices: the instances holding a hit, those on the prefill's host, and those with more
than `orders.SOON` streams predicted to end before the prefill does, one by one; the others
in the order of `orders.Orders.decode_tbt`, whose key plus what the request adds to every TBT
and a full pull bounds their score from below, until that bound cannot beat the best.
"""

from __future__ import annotations

from bisect import bisect_right
from operator import itemgetter

from conductor.scheduler.orders import SOON
from conductor.scheduler.policies.kv_price import DecodeBest, Prices
from conductor.scheduler.snapshot import InstanceLoad

_key = itemgetter(0)
_INF = float("inf")


def choose_decode(pr: Prices, p: InstanceLoad, arrive: float, save: float, cost: float
                  ) -> DecodeBest | None:
    """(score, position, instance, tbt, pull, stall, busy) of the chosen decode instance, or
    None when none can take the request."""
    snap = pr.snap
    orders, decode, rows = snap.orders(), snap.decode(), snap.decode_rows()
    skip = snap.decode_position(p.instance_id)
    late = orders.decode_late
    priced = {pos for _, pos in late[:bisect_right(late, arrive, key=_key)]}
    if p.host:
        priced.update(orders.decode_hosts.get(p.host, ()))
    priced.discard(skip)  # type: ignore[arg-type]
    best: DecodeBest | None = None
    for pos in priced:
        best = _better(best, pr.decode(decode[pos], pos, rows[pos], p, arrive, save, cost))
    tbt_base, per_seq = pr.decode_base(pull=False), max(pr.prm.tbt.per_seq_s, 0.0)
    local = pr.local
    # the longest hits pull least: each by its own bound, the lowest first
    bounds = []
    for iid, hit in pr.high.items():
        pos = snap.decode_position(iid)
        if hit and pos is not None and pos != skip and pos not in priced:
            load_s, fin = rows[pos][0], rows[pos][2]
            bounds.append((tbt_base + (load_s - per_seq * min(SOON, len(fin)))
                           + _pull(pr, hit), pos))
    high = {pos for _, pos in bounds}
    for bound, pos in sorted(bounds):
        if best is not None and not pr.may_beat(bound, best[0]):
            break
        best = _better(best, pr.decode(decode[pos], pos, rows[pos], p, arrive, save, cost))
    # the rest by `decode_tbt`, their pulls no shorter than the longest hit among them allows
    least, ceiling = tbt_base + _pull(pr, pr.rest_hit), _INF
    pulls: dict[int, float] = {}
    if best is not None:
        ceiling = pr.ceiling(best[0])
    for key, pos in orders.decode_tbt:
        if least + key > ceiling:
            break
        if pos == skip or pos in priced or pos in high:
            continue
        if local and ceiling < _INF:
            hit = local.get(decode[pos].instance_id, 0)
            pull = pulls.get(hit)
            if pull is None:
                pull = pulls[hit] = _pull(pr, hit)
            if tbt_base + key + pull > ceiling:
                continue
        new = _better(best, pr.decode(decode[pos], pos, rows[pos], p, arrive, save, cost))
        if new is not best:
            best, ceiling = new, pr.ceiling(new[0])  # type: ignore[index]
    return best


def _pull(pr: Prices, hit: int) -> float:
    """A decode instance's pull when it holds `hit` blocks of the prompt."""
    loadable = pr.loadable
    if not hit:
        return pr.tfix + loadable * pr.tpb if loadable else 0.0
    return pr.tfix + (loadable - hit) * pr.tpb if hit < loadable else 0.0


def _better(best: DecodeBest | None, new: DecodeBest | None) -> DecodeBest | None:
    """The lower score, the earlier position on ties."""
    if new is None:
        return best
    if best is None or new[0] < best[0] or new[0] == best[0] and new[1] < best[1]:
        return new
    return best
