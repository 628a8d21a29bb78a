"""What the policies share: the predicted cost of running a request's prefill somewhere."""

from __future__ import annotations

from conductor.scheduler.snapshot import ClusterSnapshot, InstanceLoad, Route, RouteRequest


def loadable_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks an engine can take from a cache: never the one holding the prompt's last token,
    which it must compute to produce the first output token."""
    return max(num_tokens - 1, 0) // block_size


def prefill_cost(snap: ClusterSnapshot, req: RouteRequest, inst: InstanceLoad
                 ) -> tuple[int, int, float, float]:
    """(cached blocks, uncached tokens, compute seconds, TTFT seconds until its prefill ends)
    of prefilling on `inst`: its own cached prefix, or the pool's if longer (the connector
    pulls the difference), then the rest computed after the instance's queue drains."""
    p = snap.params
    b = inst.block_size
    loadable = loadable_blocks(req.num_prompt_tokens, b)
    local = min(req.match.local.get(inst.instance_id, 0), loadable)
    pool = min(req.match.pool, loadable)
    cached = max(local, pool)
    uncached = req.num_prompt_tokens - cached * b
    transfer = p.transfer_s_fixed + (pool - local) * p.transfer_s_per_block if pool > local else 0.0
    queue = max(inst.busy_until - snap.now, 0.0)
    compute = inst.prefill_seconds(p.prefill.predict(uncached, cached * b),
                                   snap.now + queue + transfer)
    return cached, uncached, compute, queue + compute + transfer


def describe(snap: ClusterSnapshot, req: RouteRequest, prefill: InstanceLoad,
             decode: InstanceLoad) -> Route:
    """A Route with the predictions filled in, for policies that choose by other means."""
    cached, uncached, compute, ttft = prefill_cost(snap, req, prefill)
    tbt = snap.params.tbt.predict(decode.running + req.sequences,
                                  decode.kv_tokens + req.num_prompt_tokens)
    return Route(prefill_id=prefill.instance_id, decode_id=decode.instance_id,
                 cached_blocks=cached, uncached_tokens=uncached, prefill_s=compute,
                 predicted_ttft_s=ttft + tbt, predicted_tbt_s=tbt)
