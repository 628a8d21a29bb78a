"""llm-d's inference scheduler (the endpoint picker, EPP), re-implemented for the simulator with
its default scorer mix.

Source (llm-d/llm-d-router, Apache-2.0, @ ebab687927f5331c1b39defcb579a07951bce56c):
- `pkg/epp/config/loader/defaults.go` (`loadDefaultConfig`): one profile of three weighted
  scorers, queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3, and the
  max-score picker (ties drawn uniformly).
- `pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go`: `(maxQ - q) / (maxQ -
  minQ)` over the engines' `WaitingQueueSize` (1 for all when equal).
- `.../scorer/kvcacheutilization/kvcache_utilization.go`: `1 - KVCacheUsagePercent`.
- `.../scorer/prefix/plugin.go` (default matchLengthWeight 0): matched blocks / prompt
  blocks, from the approximate prefix producer
  `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/`: an LRU index of
  the blocks routed to each server (capacity per server: the engine's KV cache blocks, by
  autotune), updated after each decision for the chosen endpoint and, in P/D, the prefill one.
- P/D: `.../profilehandler/disagg/` with `prefix_based_pd_decider.go`: the decode profile runs
  first; the prefill profile runs only when the prompt's tokens not cached on the chosen
  decode endpoint reach `nonCachedTokens` (16 in `deploy/config/pd-epp-config.yaml`; the
  decider's own default, 0, disables P/D). Each profile here scores with the default mix
  above (that sample config uses prefix 2 and queue 1 instead).

Metrics (queue, KV usage) are scraped from the engines, here without the scrape interval's
staleness. Blocks are the simulator's, not llm-d's 64-token hashing blocks.
"""

from __future__ import annotations

from conductor.scheduler import ClusterSnapshot, InstanceLoad, Route, RouteRequest
from simulator.peers.base import EngineMetrics, PeerRouter, pick_tied, route
from simulator.pool import BlockCache


class LlmdRouter(PeerRouter):
    name = "llm_d"

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 prefix_weight: float = 3.0, non_cached_tokens: int = 16) -> None:
        super().__init__()
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self.non_cached_tokens = non_cached_tokens
        self.index: dict[str, BlockCache] = {}
        """server -> the LRU of blocks routed to it (the approximate prefix producer)"""

    def _server(self, iid: str, metrics: EngineMetrics | None) -> BlockCache:
        cache = self.index.get(iid)
        if cache is None:
            cap = metrics.cache_blocks if metrics is not None and metrics.cache_blocks else 31250
            cache = self.index[iid] = BlockCache(cap)
        return cache

    def _pick(self, pool: tuple[InstanceLoad, ...], req: RouteRequest,
              metrics: dict[str, EngineMetrics], salt: int) -> tuple[InstanceLoad, int]:
        """The max-score endpoint of one profile, and its prefix match in blocks."""
        wq, wkv, wp = self.weights
        queues = [metrics[i.instance_id].waiting for i in pool]
        lo, hi = min(queues), max(queues)
        total = len(req.block_hashes)
        scores, matches = [], []
        for i, q in zip(pool, queues, strict=True):
            m = metrics[i.instance_id]
            match = self._server(i.instance_id, m).match(req.block_hashes)
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            prefix = match / total if total else 0.0
            scores.append(wq * queue + wkv * (1.0 - m.kv_usage) + wp * prefix)
            matches.append(match)
        best = max(scores)
        tied = [n for n, s in enumerate(scores) if s == best]
        n = tied[0] if len(tied) == 1 else pool.index(
            pick_tied([pool[t] for t in tied], req.seq, salt))
        return pool[n], matches[n]

    def __call__(self, snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
        prefills, decodes = snap.prefill(), snap.decode()
        if not decodes:
            return None
        metrics = dict(self.metrics())
        d, match = self._pick(decodes, req, metrics, 1)
        hashes = req.block_hashes
        if d.can_prefill():  # aggregated endpoints: the single default profile
            self._server(d.instance_id, metrics[d.instance_id]).insert(hashes)
            return route(snap, req, d, d)
        uncached = req.num_prompt_tokens - match * d.block_size
        if self.non_cached_tokens == 0 or req.num_prompt_tokens < self.non_cached_tokens \
                or uncached < self.non_cached_tokens or not prefills:
            self._server(d.instance_id, metrics[d.instance_id]).insert(hashes)
            return route(snap, req, d, d)
        p, _ = self._pick(prefills, req, metrics, 0)
        self._server(d.instance_id, metrics[d.instance_id]).insert(hashes)
        self._server(p.instance_id, metrics[p.instance_id]).insert(hashes)
        return route(snap, req, p, d)
