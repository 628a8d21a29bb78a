"""kv_centric, the default: Mooncake's Algorithm 1 over the global KV index, under SLOs.

For each prefill instance p (its cached prefix is its own or the pool's, whichever is longer;
the connector pulls the difference from the pool):

    TTFT(p) = queue(p) + prefill(uncached tokens, cached prefix) + transfer(pulled blocks)

then the decode instance d adds its own pull of the blocks its cache lacks and one step:

    TTFT(p, d) = TTFT(p) + transfer(blocks d lacks) + TBT(d with this request)

with TBT(d) predicted at the time the prefill ends, from the decode requests still running
then (prediction-based rejection: the decode load the request will meet, not today's). A
decode instance qualifies if that TBT is within the SLO and the request fits its free KV.

- Keep locality under load: prefill instances within `near_min_*` of the best TTFT are ties,
  broken by the longest local match, so a prefix is not scattered for a negligible gain.
- Decode affinity: a decode instance already holding the prefix pulls fewer blocks, which the
  transfer term rewards (multi-turn conversations return to it).
- Conditional disaggregation: a decode instance whose uncached part of the prompt is at most
  `local_prefill_max_tokens` may prefill it itself (route p == d: no Prefill RPC, no pull of
  the prompt's new blocks); it wins when its TTFT is within the tie band of the best pair.
- Early rejection: if no pair meets the TTFT and TBT SLOs, a `Reject` (429 with
  Retry-After) before any work is done.
"""

from __future__ import annotations

from bisect import bisect_right

from conductor.scheduler.policies.estimate import loadable_blocks
from conductor.snapshot import ClusterSnapshot, Reject, Route, RouteRequest

_RETRY_MIN_S = 1.0
_RETRY_MAX_S = 60.0


def kv_centric(snap: ClusterSnapshot, req: RouteRequest) -> Route | Reject | None:
    prefills, decodes = snap.prefill(), snap.decode()
    if not prefills or not decodes:
        return None
    prm = snap.params
    now = snap.now
    n = req.num_prompt_tokens
    bs = prefills[0].block_size
    loadable = loadable_blocks(n, bs)
    local = req.match.local
    pool = min(req.match.pool, loadable)
    ttft_slo = prm.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s
    tbt_slo = prm.tbt_slo_s if req.tbt_slo_s is None else req.tbt_slo_s
    pm = prm.prefill
    tpb, tfix = prm.transfer_s_per_block, prm.transfer_s_fixed

    # ---- prefill side: in queue order, until the queue plus the cheapest conceivable
    # prefill (the longest hit anywhere) is past the tie band of the best so far
    best_hit = min(req.match.longest, loadable)
    floor = pm.predict(n - best_hit * bs, best_hit * bs)
    rows = []
    band = float("inf")
    costs: dict[int, float] = {}
    idle_hits: set[int] = set()  # an idle instance ties with an earlier idle one of equal hit
    for p in snap.prefill_by_queue():
        queue = p.busy_until - now
        hit = local.get(p.instance_id, 0) if local else 0
        if hit > loadable:
            hit = loadable
        if queue <= 0.0:
            if hit in idle_hits:
                continue
            idle_hits.add(hit)
            queue = 0.0
        elif queue + floor > band:
            break
        cached = hit if hit > pool else pool
        cost = costs.get(cached)
        if cost is None:
            cost = costs[cached] = pm.predict(n - cached * bs, cached * bs)
        ttft = queue + cost + (tfix + (pool - hit) * tpb if pool > hit else 0.0)
        rows.append((ttft, hit, p, cached, cost))
        if ttft * (1.0 + prm.near_min_rel) + prm.near_min_abs_s < band:
            band = ttft * (1.0 + prm.near_min_rel) + prm.near_min_abs_s
    ttft_p, _, p, cached, cost = max((r for r in rows if r[0] <= band),
                                     key=lambda r: (r[1], -r[0]))
    uncached = n - cached * bs

    # ---- decode side, at the time the prefill is predicted to end
    tm = prm.tbt
    base = tm.base_s + tm.per_seq_s + tm.per_kv_token_s * n  # + this request
    per_seq = tm.per_seq_s
    arrive = now + ttft_p
    kv_need = n + req.max_tokens
    full_pull = tfix + loadable * tpb if loadable else 0.0
    d_best = None
    d_score = d_tbt = 0.0
    earliest_free = float("inf")
    for load_s, room, fin, iid, d in snap.decode_rows():
        tbt = base + load_s
        if fin and fin[0] <= arrive:
            tbt -= per_seq * bisect_right(fin, arrive)
        if tbt > tbt_slo or room < kv_need:
            if fin and fin[0] < earliest_free:
                earliest_free = fin[0]
            continue
        score = tbt + full_pull
        if local:
            hit = local.get(iid)
            if hit:
                score = tbt + (tfix + (loadable - hit) * tpb if hit < loadable else 0.0)
        if d_best is None or score < d_score:
            d_best, d_score, d_tbt = d, score, tbt
    if d_best is None:
        wait = earliest_free - now if earliest_free != float("inf") else _RETRY_MIN_S
        return Reject(f"no decode instance is predicted to keep TBT within {tbt_slo:.3f}s "
                      "with free KV for this request", _clamp(wait))
    route = Route(prefill_id=p.instance_id, decode_id=d_best.instance_id, cached_blocks=cached,
                  uncached_tokens=uncached, prefill_s=cost,
                  predicted_ttft_s=ttft_p + d_score, predicted_tbt_s=d_tbt)

    # ---- conditional disaggregation: a short uncached part prefilled on the decode instance
    if n - best_hit * bs <= prm.local_prefill_max_tokens:
        route = _maybe_local(snap, req, route, loadable, pool, tbt_slo) or route

    if route.predicted_ttft_s > ttft_slo:
        late = route.predicted_ttft_s - ttft_slo
        return Reject(f"predicted TTFT {route.predicted_ttft_s:.3f}s exceeds the SLO "
                      f"{ttft_slo:.3f}s on every instance", _clamp(late))
    return route


def _maybe_local(snap: ClusterSnapshot, req: RouteRequest, pair: Route, loadable: int,
                 pool: int, tbt_slo: float) -> Route | None:
    """The best decode instance to prefill the request itself, if it is as good as `pair`."""
    prm = snap.params
    n = req.num_prompt_tokens
    limit = prm.local_prefill_max_tokens
    local = req.match.local
    best: Route | None = None
    for d in snap.decode():
        bs = d.block_size
        hit = min(local.get(d.instance_id, 0), loadable)
        cached = max(hit, pool)
        u = n - cached * bs
        if u > limit or (d.kv_capacity_tokens
                         and d.kv_tokens + n + req.max_tokens > d.kv_capacity_tokens):
            continue
        running = d.running - bisect_right(d.finishes, snap.now)
        tbt = prm.tbt.predict(running + 1, d.kv_tokens + n)
        if tbt > tbt_slo:
            continue
        cost = prm.prefill.predict(u, cached * bs)
        xfer = prm.transfer_s_fixed + (pool - hit) * prm.transfer_s_per_block if pool > hit else 0.0
        ttft = max(d.busy_until - snap.now, 0.0) + cost + xfer + tbt
        if best is None or ttft < best.predicted_ttft_s:
            best = Route(prefill_id=d.instance_id, decode_id=d.instance_id, cached_blocks=cached,
                         uncached_tokens=u, prefill_s=cost, predicted_ttft_s=ttft,
                         predicted_tbt_s=tbt)
    band = pair.predicted_ttft_s * (1.0 + prm.near_min_rel) + prm.near_min_abs_s
    if best is not None and best.predicted_ttft_s <= band:
        return best
    return None


def _clamp(seconds: float) -> float:
    return min(max(seconds, _RETRY_MIN_S), _RETRY_MAX_S)
