"""kv_centric's decode instance for a disaggregated route whose prefill is chosen.

The choice is defined over the decode-capable instances other than the prefill's, in snapshot
order: of those that keep the TBT SLO with room for the request when the prefill ends, the
lowest score (TBT then + the blocks it pulls + the streams a shared core slows + the wait for
its own prompts), the first on ties.

What it prices: only instances whose TBT then plus pull, computed as the score computes them
(the stall and the wait are never negative), could beat the best: the longest hits
(`kv_price.FEW`) first, then the others in the order of `orders.Orders.decode_tbt` (its key +
what the request adds to every TBT + the pull of the longest hit among them bounds the rest),
then those on the prefill's host and those with more than `orders.SOON` streams ending before
the prefill does.
"""

from __future__ import annotations

from bisect import bisect_right
from operator import itemgetter

from conductor.scheduler.policies.kv_price import DecodeBest, Prices, fits
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
    tm, local = pr.prm.tbt, pr.local
    tbt_base, tbt_slo = pr.decode_base(pull=False), pr.tbt_slo
    seqs = pr.req.sequences
    kv_need = pr.n + pr.req.max_tokens * seqs
    pulls: dict[int, float] = {}

    def bound(pos: int) -> float:
        """Its TBT and pull, exact: its score less the stall and the wait (inf: it cannot
        take the request)."""
        load_s, room, fin, iid, d = rows[pos]
        done = bisect_right(fin, arrive) if fin and fin[0] <= arrive else 0
        tbt = tbt_base + load_s - tm.per_seq_s * done
        if tbt > tbt_slo or room < kv_need or not fits(d, d.running - done, seqs):
            return _INF
        hit = local.get(iid, 0) if local else 0
        pull = pulls.get(hit)
        if pull is None:
            pull = pulls[hit] = _pull(pr, hit)
        return tbt + pull

    # one by one: the longest hits (their pulls) first, the lowest bound first; after the
    # rest, those with more than SOON streams ending before the prefill does and those on
    # the prefill's host (their stalls)
    late = orders.decode_late
    apart = {pos for _, pos in late[:bisect_right(late, arrive, key=_key)]}
    if p.host:
        apart.update(orders.decode_hosts.get(p.host, ()))
    apart.discard(skip)  # type: ignore[arg-type]
    high = set()
    for iid, hit in pr.high.items():
        pos = snap.decode_position(iid)
        if hit and pos is not None and pos != skip and pos not in apart:
            high.add(pos)
    best: DecodeBest | None = None
    ceiling = _INF

    def consider(pos: int) -> None:
        nonlocal best, ceiling
        new = _better(best, pr.decode(decode[pos], pos, rows[pos], p, arrive, save, cost))
        if new is not best:
            best, ceiling = new, pr.ceiling(new[0])  # type: ignore[index]

    for b, pos in sorted((bound(pos), pos) for pos in high):
        if b == _INF or best is not None and (b, pos) > best[:2]:
            break
        consider(pos)
    # the rest by `decode_tbt`, their pulls no shorter than the longest hit among them allows
    least = tbt_base + _pull(pr, pr.rest_hit)
    for key, pos in orders.decode_tbt:
        if least + key > ceiling:
            break
        if pos == skip or pos in apart or pos in high:
            continue
        if local and ceiling < _INF:  # its own pull first: the cheaper test
            hit = local.get(decode[pos].instance_id, 0)
            pull = pulls.get(hit)
            if pull is None:
                pull = pulls[hit] = _pull(pr, hit)
            if tbt_base + key + pull > ceiling:
                continue
        b = bound(pos)  # computed as the score is, less terms >= 0: exact, ties and all
        if b == _INF or best is not None and (b, pos) > best[:2]:
            continue
        consider(pos)
    per_seq = max(tm.per_seq_s, 0.0)
    for pos in apart:
        if ceiling < _INF:  # every stream ended, its own pull: the cheaper test
            load_s, _, fin, iid, _ = rows[pos]
            if tbt_base + load_s - per_seq * len(fin) + _pull(
                    pr, local.get(iid, 0) if local else 0) > ceiling:
                continue
        b = bound(pos)
        if b == _INF or best is not None and (b, pos) > best[:2]:
            continue
        consider(pos)
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
