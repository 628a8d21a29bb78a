"""kv_centric, the default: Mooncake's Algorithm 1 over the global KV index, under SLOs, with
the choice, per request, between disaggregating and not.

Two kinds of route are priced with the fitted models (prefill time, TBT) and the pool's
measured transfer time per block (`transfer_s_per_block`):

- local on a decode-capable instance d: it loads what the pool holds beyond its own cache and
  computes the rest itself (no Prefill RPC); the first token comes out of that step:

      TTFT = queue(d) + pull(pool blocks d lacks) + prefill(uncached on d)

- disaggregated, prefill on p != d (Mooncake's shape): p loads what the pool holds beyond its
  cache, computes the rest and saves it; d loads the whole prefix as it arrives and computes
  the last block:

      TTFT = queue(p) + pull(p) + prefill(uncached on p) + save(computed blocks)
             + pull(blocks d lacks) + wait(d's own prompts still computing) + TBT(d)

prefill(u on x) is the fitted model's time times x's measured speed (`InstanceLoad.speed`:
its start-up probe, then its own timings, apart for prompts beside streams of its own, for as
long as those are predicted to run: `InstanceLoad.prefill_seconds`), so that an engine on
fewer or busier cores, or decoding, is priced as it runs. A side instance
(one on the serving processes' cores, `InstanceLoad.side`) prefills at `SchedulerParams.
side_cost` times the cost (1 by default), and a local route there adds one TBT per output token
(not to its predicted TTFT; a disaggregated route that only decodes there pays no such term):
it gets the prompts that the other engines' queues would hold longer, and short answers, not
the lone long streams.

A prefill also delays the streams decoding where it computes: d's, for a local route; p's own
(an instance in the `both` role) and, in proportion to `snapshot.contention(p, d)`, d's when
the two share cores, for a disaggregated one. A route's cost is its TTFT plus those delays
(running streams x prefill seconds); the cheapest route that keeps the TTFT and TBT SLOs wins
(`SchedulerParams.disaggregate` may force one kind). None does: a `Reject` (429 with
Retry-After) before any work is done.

With no prefill instance up (all of them drained, unhealthy or unreachable) the decode
instances compute prompts themselves, as a fall-back after a failed prefill does: the cluster
serves on, slower, instead of answering 503 until a prefill instance is back. Only without a
decode-capable instance is the answer None.

- Keep locality under load: prefill instances within `near_min_*` of the best are ties,
  broken by the longest local match, so a prefix is not scattered for a negligible gain.
- Decode affinity: a decode instance already holding the prefix pulls fewer blocks.
- Prediction-based rejection: TBT(d) is predicted at the time the prefill ends, from the
  decode requests still running then, so prefill and decode load do not oscillate.
"""

from __future__ import annotations

from bisect import bisect_right

from conductor.scheduler.policies.estimate import loadable_blocks
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    InstanceLoad,
    Reject,
    Route,
    RouteRequest,
    contention,
)

_RETRY_MIN_S = 1.0
_RETRY_MAX_S = 60.0


def kv_centric(snap: ClusterSnapshot, req: RouteRequest) -> Route | Reject | None:
    prefills, decodes = snap.prefill(), snap.decode()
    if not decodes:
        return None
    prm = snap.params
    ttft_slo = prm.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s
    tbt_slo = prm.tbt_slo_s if req.tbt_slo_s is None else req.tbt_slo_s
    pairs = any(p.instance_id != d.instance_id for p in prefills for d in decodes[:2])
    routes: list[Route] = []
    earliest_free = float("inf")
    if pairs and prm.disaggregate != "never":
        route, earliest_free = _disaggregated(snap, req, tbt_slo)
        if route is not None:
            routes.append(route)
    if prm.disaggregate != "always" or not pairs:
        route, free = _local(snap, req, tbt_slo)
        earliest_free = min(earliest_free, free)
        if route is not None:
            routes.append(route)
    if not routes:
        now = snap.now
        wait = earliest_free - now if earliest_free != float("inf") else _RETRY_MIN_S
        return Reject(f"no decode instance is predicted to keep TBT within {tbt_slo:.3f}s "
                      "with free KV and batch room for this request", _clamp(wait))
    best = min(routes, key=lambda r: r.cost_s)
    fast = [r for r in routes if r.predicted_ttft_s <= ttft_slo]
    if not fast:
        late = best.predicted_ttft_s - ttft_slo
        return Reject(f"predicted TTFT {best.predicted_ttft_s:.3f}s exceeds the SLO "
                      f"{ttft_slo:.3f}s on every instance", _clamp(late))
    return min(fast, key=lambda r: r.cost_s)


def _disaggregated(snap: ClusterSnapshot, req: RouteRequest, tbt_slo: float
                   ) -> tuple[Route | None, float]:
    """The best pair p != d, or None; and the earliest predicted finish on a decode instance
    that was too loaded (for Retry-After)."""
    prm = snap.params
    now = snap.now
    n = req.num_prompt_tokens
    prefills = snap.prefill()
    bs = prefills[0].block_size
    loadable = loadable_blocks(n, bs)
    local = req.match.local
    pool = min(req.match.pool, loadable)
    pm = prm.prefill
    tpb, tfix = prm.transfer_s_per_block, prm.transfer_s_fixed

    # ---- prefill side: in queue order, until the queue plus the cheapest conceivable
    # prefill (the longest hit anywhere) is past the tie band of the best so far
    best_hit = min(req.match.longest, loadable)
    floor = pm.predict(n - best_hit * bs, best_hit * bs) * min(
        min(p.speed(False), p.speed(True)) for p in prefills)
    rows = []
    band = float("inf")
    costs: dict[int, float] = {}
    idle_hits: set[tuple] = set()  # an idle one ties with an earlier like it
    for p in snap.prefill_by_queue():
        queue = p.busy_until - now
        hit = min(local.get(p.instance_id, 0) if local else 0, loadable)
        decoding = p.running if p.can_decode() else 0
        if queue <= 0.0:
            like = (hit, decoding, p.prefill_speed, p.prefill_speed_beside,
                    p.finishes[-1] if decoding and p.finishes else 0.0)
            if like in idle_hits:
                continue
            idle_hits.add(like)
            queue = 0.0
        elif queue + floor > band:
            break
        cached = hit if hit > pool else pool
        cost = costs.get(cached)
        if cost is None:
            cost = costs[cached] = pm.predict(n - cached * bs, cached * bs)
        pull_p = tfix + (pool - hit) * tpb if pool > hit else 0.0
        cost = p.prefill_seconds(cost, now + queue + pull_p)
        ttft = queue + cost + pull_p
        rank = ttft + decoding * cost  # its own streams wait for this prefill
        if p.side:
            rank *= prm.side_cost
        rows.append((rank, hit, p, cached, cost, ttft))
        if rank * (1.0 + prm.near_min_rel) + prm.near_min_abs_s < band:
            band = rank * (1.0 + prm.near_min_rel) + prm.near_min_abs_s
    rank_p, _, p, cached, cost, ttft_p = max((r for r in rows if r[0] <= band),
                                             key=lambda r: (r[1], -r[0]))
    stall_p = rank_p - ttft_p
    computed = max(loadable - cached, 0)
    save = tfix + computed * tpb if computed else 0.0

    # ---- decode side, at the time the prefill is predicted to end
    tm = prm.tbt
    seqs = req.sequences
    base = tm.base_s + tm.per_seq_s * seqs + tm.per_kv_token_s * n  # + this request
    per_seq = tm.per_seq_s
    arrive = now + ttft_p
    kv_need = n + req.max_tokens * seqs
    full_pull = tfix + loadable * tpb if loadable else 0.0
    best = None  # (score, d, tbt, pull, stall, busy)
    earliest_free = float("inf")
    for load_s, room, fin, iid, d in snap.decode_rows():
        if iid == p.instance_id:
            continue
        tbt = base + load_s
        done = bisect_right(fin, arrive) if fin and fin[0] <= arrive else 0
        tbt -= per_seq * done
        if tbt > tbt_slo or room < kv_need or not _fits(d, d.running - done, seqs):
            if fin and fin[0] < earliest_free:
                earliest_free = fin[0]
            continue
        pull = full_pull
        if local:
            hit = local.get(iid)
            if hit:
                pull = tfix + (loadable - hit) * tpb if hit < loadable else 0.0
        share = contention(p, d)
        stall = share * d.running * cost if share and d.running else 0.0
        # its last block waits for the prompts d is computing itself (finish first)
        busy = max(d.busy_until - (arrive + save + pull), 0.0)
        score = tbt + pull + stall + busy
        if best is None or score < best[0]:
            best = (score, d, tbt, pull, stall, busy)
    if best is None:
        return None, earliest_free
    _, d, tbt, pull, stall, busy = best
    ttft = ttft_p + save + pull + busy + tbt
    return Route(prefill_id=p.instance_id, decode_id=d.instance_id, cached_blocks=cached,
                 uncached_tokens=n - cached * bs, prefill_s=cost, predicted_ttft_s=ttft,
                 predicted_tbt_s=tbt, cost_s=ttft + stall_p + stall), earliest_free


def _local(snap: ClusterSnapshot, req: RouteRequest, tbt_slo: float
           ) -> tuple[Route | None, float]:
    """The cheapest decode instance computing the prompt itself, or None; and the earliest
    predicted finish on one that was too loaded."""
    prm = snap.params
    now = snap.now
    n = req.num_prompt_tokens
    local = req.match.local
    best: Route | None = None
    earliest_free = float("inf")
    costs: dict[int, float] = {}
    for d in snap.decode():
        bs = d.block_size
        loadable = loadable_blocks(n, bs)
        pool = min(req.match.pool, loadable)
        hit = min(local.get(d.instance_id, 0), loadable) if local else 0
        running = d.running - bisect_right(d.finishes, now)
        tbt = prm.tbt.predict(running + req.sequences, d.kv_tokens + n)
        if tbt > tbt_slo or not _fits(d, running, req.sequences) or (
                d.kv_capacity_tokens and d.kv_tokens + n + req.max_tokens * req.sequences
                > d.kv_capacity_tokens):
            if d.finishes and d.finishes[0] < earliest_free:
                earliest_free = d.finishes[0]
            continue
        cached = max(hit, pool)
        cost = costs.get(cached)
        if cost is None:
            cost = costs[cached] = prm.prefill.predict(n - cached * bs, cached * bs)
        pull = prm.transfer_s_fixed + (pool - hit) * prm.transfer_s_per_block \
            if pool > hit else 0.0
        queue = max(d.busy_until - now, 0.0)
        cost = d.prefill_seconds(cost, now + queue + pull)
        ttft = queue + pull + cost
        total = ttft + max(running, 0) * cost
        if d.side:  # and its tokens come at about half speed: one TBT more each
            total = total * prm.side_cost + req.max_tokens * tbt
        if best is None or total < best.cost_s:
            best = Route(prefill_id=d.instance_id, decode_id=d.instance_id, cached_blocks=cached,
                         uncached_tokens=n - cached * bs, prefill_s=cost, predicted_ttft_s=ttft,
                         predicted_tbt_s=tbt, cost_s=total)
    return best, earliest_free


def _fits(d: InstanceLoad, running: int, sequences: int) -> bool:
    """`sequences` more fit in `d`'s batch beside the `running` it holds then: beyond its
    `max_seqs` they would wait in the engine's queue, unpriced."""
    return not d.max_seqs or running + sequences <= d.max_seqs


def _clamp(seconds: float) -> float:
    return min(max(seconds, _RETRY_MIN_S), _RETRY_MAX_S)
