"""vllm-router (vllm-project/router) with its default policy, `cache_aware`, re-implemented for
the simulator in its P/D mode (`--vllm-pd-disaggregation --prefill ... --decode ...`).

Source (vllm-project/router, Apache-2.0):
- `src/policies/cache_aware.rs` @ 2f2db0d9a6d075496b8327dfd1aac56d57eb27e7: imbalanced when
  `max_load - min_load > balance_abs_threshold` and `max_load > min_load *
  balance_rel_threshold` over the workers' loads: then the least-loaded worker. Otherwise the
  approximate tree's match rate (matched / input characters): above `cache_threshold`, the
  tenant of the deepest matched node (the tree's last tenant there, `src/tree.rs` @
  1dbe5075a346c64679563def84d2d691be690d39); at or below it, the least-loaded worker (the first
  of equals, Rust's `min_by_key`). Every choice is inserted into the tree for the chosen
  worker. The tree evicts each tenant's least recently used leaves past `max_tree_size`.
- `src/main.rs` @ 811db12b00e93791d4d65c7a2738df170ed6e97a: defaults `--policy cache_aware`,
  `--cache-threshold 0.3`, `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`,
  `--max-tree-size 67108864` (characters); prefill and decode policies default to the main
  policy, one instance each (so one tree per role).
- `src/routers/http/vllm_pd_router.rs` @ 9da0ea11e02ffdda2d2b2f9716b5a9e61b669877
  (`process_vllm_two_stage_request`): the prefill worker's load counts the request from
  dispatch to the end of its prefill (`max_tokens=1`), the decode worker's from then to the
  decode response; the KV goes prefill to decode directly (NIXL), and the decode computes
  what did not arrive.

The decode load is modelled as a non-streaming client sees it (until the response ends): with
streaming the count drops when the response headers arrive, every decode load reads 0 and the
decode choice degenerates to the first worker for every unmatched prompt; we simulate the
kinder case. Tree sizes are in blocks at 4 characters per token. Aggregated workers (its
regular mode): one policy over all workers, prefill and decode on the one it picks.
"""

from __future__ import annotations

from conductor.scheduler import ClusterSnapshot, InstanceLoad, Route, RouteRequest
from simulator.peers.base import ApproxTree, Counter, PeerRouter, route

CHARS_PER_TOKEN = 4


class CacheAware:
    """One `CacheAwarePolicy` instance (its tree and thresholds) over one worker list."""

    def __init__(self, cache_threshold: float, balance_abs: int, balance_rel: float,
                 tree_blocks: int | None) -> None:
        self.threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.tree = ApproxTree(tree_blocks, shared=False)

    def select(self, workers: tuple[InstanceLoad, ...], hashes: tuple[int, ...],
               load: Counter) -> InstanceLoad:
        loads = [load.of(w.instance_id) for w in workers]
        lo, hi = min(loads), max(loads)
        least = workers[loads.index(lo)]
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            chosen = least
        else:
            ids = [w.instance_id for w in workers]
            depth, holders, _ = self.tree.deepest(hashes, ids)
            rate = depth / len(hashes) if hashes else 0.0
            if rate > self.threshold:
                tenant = self.tree.last_tenant(holders, hashes, depth)
                chosen = workers[ids.index(tenant)]
            else:
                chosen = least
        self.tree.insert(hashes, chosen.instance_id)
        return chosen


class VllmRouter(PeerRouter):
    name = "vllm_router"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_tree_chars: int | None = 67_108_864) -> None:
        super().__init__()
        self.knobs = (cache_threshold, balance_abs, balance_rel)
        self.max_tree_chars = max_tree_chars
        self.prefill_policy: CacheAware | None = None
        self.decode_policy: CacheAware | None = None
        self.load = Counter()
        self._decode: dict[int, str] = {}
        """seq -> its decode worker, counted once its prefill ends (P/D mode only)"""

    def _policies(self, block_size: int) -> tuple[CacheAware, CacheAware]:
        if self.prefill_policy is None or self.decode_policy is None:
            chars = self.max_tree_chars
            blocks = None if chars is None else chars // (CHARS_PER_TOKEN * block_size)
            self.prefill_policy = CacheAware(*self.knobs, blocks)
            self.decode_policy = CacheAware(*self.knobs, blocks)
        return self.prefill_policy, self.decode_policy

    def prefilled(self, seq: int) -> None:
        d = self._decode.pop(seq, None)
        if d is not None:
            self.load.release(seq)
            self.load.add(seq, d)

    def finished(self, seq: int) -> None:
        self.load.release(seq)

    def __call__(self, snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
        prefills, decodes = snap.prefill(), snap.decode()
        if not prefills or not decodes:
            return None
        hashes = req.block_hashes
        prefill_policy, decode_policy = self._policies(prefills[0].block_size)
        if prefills[0].can_decode():  # regular mode: counted until the response ends
            w = prefill_policy.select(prefills, hashes, self.load)
            self.load.add(req.seq, w.instance_id)
            return route(snap, req, w, w)
        p = prefill_policy.select(prefills, hashes, self.load)
        d = decode_policy.select(decodes, hashes, self.load)
        self.load.add(req.seq, p.instance_id)
        self._decode[req.seq] = d.instance_id
        return route(snap, req, p, d)
