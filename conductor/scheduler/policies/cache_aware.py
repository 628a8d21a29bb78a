"""cache_aware, after SGLang's router: the best local cache match unless load is imbalanced.

Per pool (prefill, then decode): load is imbalanced when `max - min > balance_abs` and
`max > balance_rel * min` (requests in flight). Balanced: the instance with the longest local
match if it covers more than `cache_threshold` of the prompt's blocks, else the one whose
cache holds the least (spreading new prefixes). Imbalanced: not the plain least loaded, which
throws locality away wholesale (sglang #32195), but the best match among the instances that
are themselves balanced against the least loaded one. Only local engine caches count: the
pool is what `kv_centric` adds.
"""

from __future__ import annotations

from conductor.scheduler.policies.estimate import describe, loadable_blocks
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    InstanceLoad,
    Route,
    RouteRequest,
    SchedulerParams,
)


def pick(instances: tuple[InstanceLoad, ...], req: RouteRequest, params: SchedulerParams
         ) -> InstanceLoad:
    local = req.match.local
    limit = loadable_blocks(req.num_prompt_tokens, instances[0].block_size)

    def hit(i: InstanceLoad) -> int:
        return min(local.get(i.instance_id, 0), limit)

    lo = min(i.in_flight for i in instances)
    hi = max(i.in_flight for i in instances)
    if hi - lo > params.balance_abs and hi > params.balance_rel * lo:
        near = [i for i in instances
                if i.in_flight - lo <= params.balance_abs or i.in_flight <= params.balance_rel * lo]
        return max(near, key=lambda i: (hit(i), -i.in_flight))
    best = max(instances, key=lambda i: (hit(i), -i.in_flight))
    blocks = len(req.block_hashes)
    if blocks and hit(best) / blocks > params.cache_threshold:
        return best
    return min(instances, key=lambda i: (i.cached_blocks, i.in_flight, i.instance_id))


def cache_aware(snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
    prefills, decodes = snap.prefill(), snap.decode()
    if not prefills or not decodes:
        return None
    return describe(snap, req, pick(prefills, req, snap.params), pick(decodes, req, snap.params))
