"""NVIDIA Dynamo's KV router, re-implemented for the simulator (its default configuration).

Source (ai-dynamo/dynamo, Apache-2.0):
- `lib/kv-router/src/scheduling/selector/default.rs` @ a4bdb9bfa1eed0afd4d67331f0938f9d5e3b58ed
  (`DefaultWorkerScorer::worker_logit`, `softmax_sample_index`): per worker,

      logit = prefill_load_scale * max(raw_prefill_blocks - overlap_credit_blocks, 0)
              + decode_blocks + decode_active_request_weight * active_requests
      raw_prefill_blocks = (active_prefill_tokens + uncached + cached) / block_size
      overlap_credit_blocks = overlap_score_credit * device_overlap_blocks
      decode_blocks = the worker's active blocks + this request's blocks

  lowest logit wins at temperature 0 (ties drawn uniformly); above 0, softmax over the
  min-max-normalised logits divided by the temperature.
- `lib/kv-router/src/scheduling/config.rs`, `KvRouterConfig::default()`, in the version that
  defines `overlap_score_credit_decay` (which the selector above reads): overlap_score_credit
  1.0, overlap_score_credit_decay 0.0, prefill_load_scale 1.0, router_temperature 0.0,
  shared_cache_multiplier 0.0, router_track_output_blocks false, router_queue_threshold None,
  conditional_disagg_enabled false; decode_active_request_weight 0.0. (Earlier versions:
  0243c51bb6e8958be89df4978b5761677c9adc23 defaulted router_queue_threshold to 16, a queue in
  the router, not modelled here; c2f2e1aa80696a009f8bdbf31629f829eb32f313 had
  `overlap_score_weight` 1.0, the same cost.)
- Disaggregated serving: a prefill router picks the prefill worker with the cost above; the
  decode router forces `overlap_score_credit = 0` per request, so it picks the decode worker
  with the fewest active blocks (the comment in `worker_logit`: "Decode routers normally force
  `overlap_score_credit=0` through the per-request override, which preserves load-only disagg
  routing").

Active load is the router's own ledger (`ActiveSequences`): a request's uncached tokens count
as prefill tokens on its prefill worker until its first token, and its prompt blocks as active
blocks on each worker it was sent to until that worker is done with it (prefill end for the
prefill worker, completion for the decode worker). Overlap is the KV index's device match (the
index here is fed by the engines' cache events, as Dynamo's is). Aggregated (colocated)
workers: one router, the same cost, prefill and decode on the worker it picks.

Simplifications: both workers are chosen at arrival (Dynamo 0.9+ routes the decode after the
prefill returns); no host/disk tiers (the simulated engines have one cache each).
"""

from __future__ import annotations

import math

from conductor.scheduler import ClusterSnapshot, InstanceLoad, Route, RouteRequest
from conductor.scheduler import loadable_blocks as _loadable
from simulator.peers.base import PeerRouter, draw, pick_tied, route


class DynamoRouter(PeerRouter):
    name = "dynamo"

    def __init__(self, overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0,
                 router_temperature: float = 0.0,
                 decode_active_request_weight: float = 0.0) -> None:
        super().__init__()
        self.credit = overlap_score_credit
        self.scale = prefill_load_scale
        self.temperature = router_temperature
        self.per_request = decode_active_request_weight
        self.prefill_tokens: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self._held: dict[int, list[tuple[str, int, int, bool]]] = {}
        """seq -> (worker, prefill tokens, blocks, released at prefill end)"""

    # ---------------------------------------------------------------- ledger

    def _add(self, seq: int, worker: str, tokens: int, blocks: int, until_prefill: bool) -> None:
        self.prefill_tokens[worker] = self.prefill_tokens.get(worker, 0) + tokens
        self.blocks[worker] = self.blocks.get(worker, 0) + blocks
        self.requests[worker] = self.requests.get(worker, 0) + 1
        self._held.setdefault(seq, []).append((worker, tokens, blocks, until_prefill))

    def _release(self, seq: int, at_prefill: bool) -> None:
        keep = []
        for worker, tokens, blocks, until_prefill in self._held.pop(seq, ()):
            self.prefill_tokens[worker] -= tokens  # the first token ends the prefill
            tokens = 0
            if until_prefill or not at_prefill:
                self.blocks[worker] -= blocks
                self.requests[worker] -= 1
            else:
                keep.append((worker, tokens, blocks, until_prefill))
        if keep:
            self._held[seq] = keep

    def prefilled(self, seq: int) -> None:
        self._release(seq, at_prefill=True)

    def finished(self, seq: int) -> None:
        self._release(seq, at_prefill=False)

    # ---------------------------------------------------------------- cost

    def _logit(self, w: InstanceLoad, req: RouteRequest, credit: float, blocks: int,
               track_prefill: bool) -> float:
        iid = w.instance_id
        decode = self.blocks.get(iid, 0) + blocks + self.per_request * self.requests.get(iid, 0)
        if not track_prefill:
            overlap = credit * min(req.match.local.get(iid, 0), blocks)
            return max(decode - overlap, 0.0) if credit > 0 else decode
        bs = w.block_size
        raw = (self.prefill_tokens.get(iid, 0) + req.num_prompt_tokens) / bs
        overlap = credit * min(req.match.local.get(iid, 0),
                               _loadable(req.num_prompt_tokens, bs))
        return self.scale * max(raw - overlap, 0.0) + decode

    def _select(self, workers: tuple[InstanceLoad, ...], req: RouteRequest, credit: float,
                blocks: int, track_prefill: bool, salt: int) -> InstanceLoad:
        logits = [self._logit(w, req, credit, blocks, track_prefill) for w in workers]
        if self.temperature <= 0:
            low = min(logits)
            return pick_tied([w for w, x in zip(workers, logits, strict=True) if x == low],
                             req.seq, salt)
        lo, hi = min(logits), max(logits)
        if lo == hi:
            return pick_tied(workers, req.seq, salt)
        scale = -1.0 / ((hi - lo) * self.temperature)
        weights = [math.exp((x - lo) * scale) for x in logits]
        u = (draw(req.seq, salt + 7) % 1_000_003) / 1_000_003 * sum(weights)
        for w, p in zip(workers, weights, strict=True):
            u -= p
            if u <= 0:
                return w
        return workers[-1]

    def __call__(self, snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
        prefills, decodes = snap.prefill(), snap.decode()
        if not prefills or not decodes:
            return None
        bs = prefills[0].block_size
        blocks = -(-req.num_prompt_tokens // bs)
        seq = req.seq
        if prefills[0].can_decode():  # aggregated: one router over workers that do both
            w = self._select(prefills, req, self.credit, blocks, True, 0)
            r = route(snap, req, w, w)
            self._add(seq, w.instance_id, r.uncached_tokens, blocks, False)
            return r
        p = self._select(prefills, req, self.credit, blocks, True, 0)
        d = self._select(decodes, req, 0.0, blocks, False, 1)
        r = route(snap, req, p, d)
        self._add(seq, p.instance_id, r.uncached_tokens, blocks, True)
        self._add(seq, d.instance_id, 0, blocks, False)
        return r
