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

The three searches (`kv_prefill`, `kv_decode`, `kv_local`) return what pricing every instance
would and price only those a lower bound kept from `orders.Orders` does not rule out; the
per-instance prices are in `kv_price`.
"""

from __future__ import annotations

from conductor.scheduler.policies.kv_decode import choose_decode
from conductor.scheduler.policies.kv_local import choose_local
from conductor.scheduler.policies.kv_prefill import choose_prefill
from conductor.scheduler.policies.kv_price import Prices
from conductor.scheduler.snapshot import ClusterSnapshot, Reject, Route, RouteRequest

_RETRY_MIN_S = 1.0
_RETRY_MAX_S = 60.0
_INF = float("inf")


def kv_centric(snap: ClusterSnapshot, req: RouteRequest) -> Route | Reject | None:
    prefills, decodes = snap.prefill(), snap.decode()
    if not decodes:
        return None
    prm = snap.params
    ttft_slo = prm.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s
    tbt_slo = prm.tbt_slo_s if req.tbt_slo_s is None else req.tbt_slo_s
    pairs = any(p.instance_id != d.instance_id for p in prefills for d in decodes[:2])
    pr = Prices(snap, req, tbt_slo)
    routes: list[Route] = []
    apart = None  # the prefill instance of a disaggregated route that found no decode one
    if pairs and prm.disaggregate != "never":
        route, apart = _disaggregated(pr)
        if route is not None:
            routes.append(route)
    local = prm.disaggregate != "always" or not pairs
    if local:
        # a local route is chosen over a disaggregated one within the SLO only if it costs less
        cap = routes[0].cost_s if routes and routes[0].predicted_ttft_s <= ttft_slo else _INF
        route = choose_local(pr, cap)
        if route is not None:
            routes.append(route)
    if not routes:
        earliest_free = _earliest_finish(snap, None if local else apart)
        wait = earliest_free - snap.now if earliest_free != _INF else _RETRY_MIN_S
        return Reject(f"no decode instance is predicted to keep TBT within {tbt_slo:.3f}s "
                      "with free KV and batch room for this request", _clamp(wait))
    best = min(routes, key=lambda r: r.cost_s)
    fast = [r for r in routes if r.predicted_ttft_s <= ttft_slo]
    if not fast:
        late = best.predicted_ttft_s - ttft_slo
        return Reject(f"predicted TTFT {best.predicted_ttft_s:.3f}s exceeds the SLO "
                      f"{ttft_slo:.3f}s on every instance", _clamp(late))
    return min(fast, key=lambda r: r.cost_s)


def _disaggregated(pr: Prices) -> tuple[Route | None, str | None]:
    """The best pair p != d, or None and the prefill instance p it was sought for."""
    n, bs, loadable, tpb, tfix = pr.n, pr.bs, pr.loadable, pr.tpb, pr.tfix
    rank_p, _, _, p, cached, cost, ttft_p = choose_prefill(pr)
    stall_p = rank_p - ttft_p
    computed = max(loadable - cached, 0)
    save = tfix + computed * tpb if computed else 0.0
    best = choose_decode(pr, p, pr.now + ttft_p, save, cost)
    if best is None:
        return None, p.instance_id
    _, _, d, tbt, pull, stall, busy = best
    ttft = ttft_p + save + pull + busy + tbt
    return Route(prefill_id=p.instance_id, decode_id=d.instance_id, cached_blocks=cached,
                 uncached_tokens=n - cached * bs, prefill_s=cost, predicted_ttft_s=ttft,
                 predicted_tbt_s=tbt, cost_s=ttft + stall_p + stall), None


def _earliest_finish(snap: ClusterSnapshot, apart: str | None) -> float:
    """The first predicted finish on a decode instance (other than `apart`): when one that
    was too loaded for the request frees a slot (for Retry-After)."""
    skip = snap.decode_position(apart) if apart is not None else None
    for first, pos in snap.orders().decode_first:
        if pos != skip:
            return first
    return _INF


def _clamp(seconds: float) -> float:
    return min(max(seconds, _RETRY_MIN_S), _RETRY_MAX_S)
