"""SMG (smg-project/smg, the SGLang router's successor) with its default policy, `cache_aware`,
re-implemented for the simulator in its P/D mode.

Source (smg-project/smg, Apache-2.0, @ f8daa8835a8b4419b53125a837aaab2b3ce895c3):
- `model_gateway/src/policies/cache_aware.rs` (`select_worker`, `select_worker_with_text`,
  `select_matched_candidate`, `argmax_with_random_ties`, `gate_selected_candidate`): per
  request, the least-loaded worker is the minimum of (load, processed, index). The
  approximate tree's match rate (matched / input characters) above `cache_threshold`: among
  the tenants holding the deepest matched node, the least loaded (ties drawn uniformly);
  at or below it: the least-loaded worker. The chosen candidate then passes a spill gate:
  if its load exceeds both `balance_rel_threshold` times the healthy workers' mean load and
  the mean plus `balance_abs_threshold`, the least-loaded worker takes the request instead.
  The KV-usage triggers (`balance_token_usage_threshold`, `overload_token_usage_threshold`)
  are off by default (1.0). Every choice is inserted into the tree for the chosen worker.
- `model_gateway/src/main.rs`: defaults `--policy cache_aware`, `--cache-threshold 0.3`,
  `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`, `--max-tree-size 67108864`
  (characters of the whole tree, all workers together; `crates/kv_index/src/string_tree.rs`
  `evict_tenant_by_size` evicts least recently used tenant leaves until the tree fits).
- `model_gateway/src/routers/factory.rs` (`create_pd_router`): the prefill and decode
  policies default to the main one, one instance each (one tree per role).
- `model_gateway/src/routers/http/pd_router.rs`: both workers' load guards are taken at
  dispatch and dropped when the response ends (prefill and decode requests go out together,
  SGLang's bootstrap rendezvous), so a prefill worker counts its requests until they finish.

The older sgl-router rule (imbalanced fleet-wide when max - min > 64 and max > 1.5 min) is
what `simulator.peers.vllm_router` implements. Tree sizes are in blocks at 4 characters per
token. Aggregated workers (its regular mode): one policy over all workers.
"""

from __future__ import annotations

from conductor.scheduler import ClusterSnapshot, InstanceLoad, Route, RouteRequest
from simulator.peers.base import ApproxTree, Counter, PeerRouter, pick_tied, route

CHARS_PER_TOKEN = 4


class CacheAware:
    """One SMG `CacheAwarePolicy` instance (its tree and thresholds) over one worker list."""

    def __init__(self, cache_threshold: float, balance_abs: int, balance_rel: float,
                 tree_blocks: int | None) -> None:
        self.threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.tree = ApproxTree(tree_blocks, shared=True)

    def select(self, workers: tuple[InstanceLoad, ...], hashes: tuple[int, ...],
               load: Counter, seq: int, salt: int) -> InstanceLoad:
        ids = [w.instance_id for w in workers]
        loads = [load.of(i) for i in ids]
        least = min(range(len(workers)),
                    key=lambda n: (loads[n], load.processed.get(ids[n], 0), n))
        avg = sum(loads) / len(loads)
        depth, holders, _ = self.tree.deepest(hashes, ids)
        rate = depth / len(hashes) if hashes else 0.0
        if rate > self.threshold:
            low = min(load.of(t) for t in holders)
            tied = [workers[ids.index(t)] for t in holders if load.of(t) == low]
            n = ids.index(pick_tied(tied, seq, salt).instance_id)
            if loads[n] > avg * self.balance_rel and loads[n] > avg + self.balance_abs:
                n = least
        else:
            n = least
        self.tree.insert(hashes, ids[n])
        return workers[n]


class SmgRouter(PeerRouter):
    name = "smg"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_tree_chars: int | None = 67_108_864) -> None:
        super().__init__()
        self.knobs = (cache_threshold, balance_abs, balance_rel)
        self.max_tree_chars = max_tree_chars
        self.prefill_policy: CacheAware | None = None
        self.decode_policy: CacheAware | None = None
        self.load = Counter()

    def _policies(self, block_size: int) -> tuple[CacheAware, CacheAware]:
        if self.prefill_policy is None or self.decode_policy is None:
            chars = self.max_tree_chars
            blocks = None if chars is None else chars // (CHARS_PER_TOKEN * block_size)
            self.prefill_policy = CacheAware(*self.knobs, blocks)
            self.decode_policy = CacheAware(*self.knobs, blocks)
        return self.prefill_policy, self.decode_policy

    def finished(self, seq: int) -> None:
        self.load.release(seq)

    def __call__(self, snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
        prefills, decodes = snap.prefill(), snap.decode()
        if not prefills or not decodes:
            return None
        hashes = req.block_hashes
        prefill_policy, decode_policy = self._policies(prefills[0].block_size)
        if prefills[0].can_decode():  # regular mode
            w = prefill_policy.select(prefills, hashes, self.load, req.seq, 0)
            self.load.add(req.seq, w.instance_id)
            return route(snap, req, w, w)
        p = prefill_policy.select(prefills, hashes, self.load, req.seq, 0)
        d = decode_policy.select(decodes, hashes, self.load, req.seq, 1)
        self.load.add(req.seq, p.instance_id)
        self.load.add(req.seq, d.instance_id)
        return route(snap, req, p, d)
