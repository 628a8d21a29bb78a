"""The connector's scheduler side (in vLLM's engine core, beside its scheduler): which of a
request's blocks to load from the pool and which to save, by the chained block hashes of
`store.block_hash` (the scheme the conductor's index uses too).

Loads are asynchronous (`get_num_new_matched_tokens` answers `(tokens, True)`): the request
waits in WAITING_FOR_REMOTE_KVS while the worker side's loader fills its blocks, and the
running batch keeps stepping. How many blocks to load:

- a request that carries `kv_transfer_params["pool_wait"] = {"blocks": K, "wait_s": W}` (the
  conductor sets it) is promised its first K blocks without asking the pool: they are there
  or a prefill elsewhere is writing them, and the loader waits up to W seconds for them;
- any other request asks the pool which prefix it holds now (one `batch_is_exist`).

Saves: only the blocks this engine computes, i.e. from the first block after the prefix that
came from its own cache or the pool, never what it loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from store.block_hash import block_key, extend_hashes
from store.connector.data import (
    BlockTransfer,
    LoadJob,
    LoadResult,
    LookupStats,
    PoolConnectorMetadata,
    PoolWorkerMetadata,
)
from store.connector.settings import ConnectorSettings, SharedPool
from store.kv_transfer import TransferStats
from store.pool import PoolError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)


@dataclass
class _Tracked:
    """Scheduler-side view of one request."""

    request: Request
    hashes: list[int]
    """Chained hashes of the request's full blocks known so far: the prompt's, then those
    its generated tokens filled (when saving them)."""
    keys: list[str]
    prompt_blocks: int
    """Full blocks of the prompt: `keys[:prompt_blocks]`."""
    block_ids: list[int] = field(default_factory=list)
    started: bool = False
    """Scheduled for computation once: `saved_blocks` starts at what it did not compute."""
    saved_blocks: int = 0
    """Blocks before this one are saved, planned, or were not computed here."""
    planned: int = 0
    saved_generated: int = 0
    load_from_block: int = 0
    """First block of the external hit: the block-aligned local hit vLLM reported."""
    wait_s: float = 0.0
    loading: int = 0
    """Blocks handed to the loader (0: none)."""
    load: LoadResult | None = None


def pool_wait(request: Request) -> tuple[int, float] | None:
    """The conductor's promise: (blocks, seconds to wait for them), if it made one."""
    params = getattr(request, "kv_transfer_params", None) or {}
    hint = params.get("pool_wait")
    if not isinstance(hint, dict):
        return None
    try:
        return max(int(hint.get("blocks", 0)), 0), max(float(hint.get("wait_s", 0.0)), 0.0)
    except (TypeError, ValueError):
        return None


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, pool: SharedPool, block_size: int,
                 saves: bool, loads: bool) -> None:
        self.settings = settings
        self.pool = pool
        self.block_size = block_size
        self.saves = saves
        self.loads = loads
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadJob] = []
        self._cancelled: set[str] = set()
        self.lookup = LookupStats()
        self.worker_stats = TransferStats()

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            hashes = extend_hashes(None, request.prompt_token_ids or [], self.block_size,
                                   request.cache_salt)
            keys = [block_key(self.settings.namespace, h) for h in hashes]
            tracked = self._tracked[request.request_id] = _Tracked(
                request=request, hashes=hashes, keys=keys, prompt_blocks=len(keys))
        return tracked

    # ------------------------------------------------------------------ loads

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        if not self.loads or tracked.loading:
            # one load per request: after a failed one vLLM asks again (its blocks are to be
            # recomputed), and a second promise would fail the same way, forever
            return 0, False
        # vLLM must compute at least the prompt's last token: never load the block holding it.
        usable = (request.num_prompt_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        tracked.load_from_block = first
        if usable <= first:
            return 0, False
        hint = pool_wait(request)
        if hint is not None:
            blocks, tracked.wait_s = hint
            hit = max(min(blocks, usable) - first, 0)
            if hit:
                self.lookup.lookups += 1
                self.lookup.lookup_blocks_hit += hit
            return hit * self.block_size, hit > 0
        tracked.wait_s = 0.0
        hit = self._lookup(request.request_id, tracked.keys[first:usable])
        return hit * self.block_size, hit > 0

    def _lookup(self, request_id: str, keys: list[str]) -> int:
        """How long a prefix of `keys` the pool holds now."""
        self.lookup.lookups += 1
        pool = self.pool.get()
        if pool is None or not pool.healthy():
            self.lookup.lookup_unavailable += 1
            return 0
        try:
            present = pool.exists(keys)
        except PoolError as e:
            log.warning("pool_lookup_failed", request_id=request_id, error=str(e))
            self.lookup.lookup_unavailable += 1
            return 0
        hit = next((i for i, ok in enumerate(present) if not ok), len(present))
        self.lookup.lookup_blocks_hit += hit
        if hit < len(keys):
            self.lookup.lookup_misses += 1
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._track(request)
        block_ids = list(blocks.get_block_ids()[0])
        tracked.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        first = tracked.load_from_block
        count = num_external_tokens // self.block_size
        tracked.loading = count
        self._pending_loads.append(LoadJob(
            request_id=request.request_id, keys=tuple(tracked.keys[first:first + count]),
            block_ids=tuple(block_ids[first:first + count]), wait_s=tracked.wait_s))

    # ------------------------------------------------------------------ saves

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolConnectorMetadata:
        meta = PoolConnectorMetadata(loads=self._pending_loads, cancelled=self._cancelled,
                                     preempted=set(scheduler_output.preempted_req_ids or ()))
        self._pending_loads, self._cancelled = [], set()
        if not self.saves:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            if not tracked.started:
                tracked.started = True
                tracked.saved_blocks = max(tracked.saved_blocks,
                                           new.num_computed_tokens // self.block_size)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._plan_save(meta, new.req_id, tracked, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_save(meta, req_id, tracked, done)
        return meta

    def _extend(self, tracked: _Tracked, done_tokens: int) -> None:
        """Hash the blocks generated tokens filled, up to `done_tokens` and the token ids known
        (with async scheduling the last sampled token may not be in `all_token_ids` yet)."""
        tokens = tracked.request.all_token_ids
        full = min(done_tokens, len(tokens)) // self.block_size
        have = len(tracked.hashes)
        if full <= have:
            return
        new = extend_hashes(tracked.hashes[-1] if tracked.hashes else None,
                            tokens[have * self.block_size : full * self.block_size],
                            self.block_size, tracked.request.cache_salt)
        tracked.hashes.extend(new)
        tracked.keys.extend(block_key(self.settings.namespace, h) for h in new)

    def _plan_save(self, meta: PoolConnectorMetadata, req_id: str, tracked: _Tracked,
                   done_tokens: int) -> None:
        """Save the full blocks whose every token is computed by the end of this step: the
        prompt's, then (`save_generated`) those generated tokens filled, near the prompt."""
        if self.settings.save_generated:
            self._extend(tracked, done_tokens)
        upto = min(done_tokens // self.block_size, len(tracked.keys), len(tracked.block_ids))
        lo = tracked.saved_blocks
        if upto <= lo:
            return
        split = min(max(lo, tracked.prompt_blocks), upto)
        if split > lo:
            meta.saves.append(BlockTransfer(request_id=req_id,
                                            keys=tuple(tracked.keys[lo:split]),
                                            block_ids=tuple(tracked.block_ids[lo:split])))
        if upto > split:
            near = tracked.keys[tracked.prompt_blocks - 1] if tracked.prompt_blocks else None
            meta.saves.append(BlockTransfer(request_id=req_id,
                                            keys=tuple(tracked.keys[split:upto]),
                                            block_ids=tuple(tracked.block_ids[split:upto]),
                                            generated=True, near=near))
            tracked.saved_generated += upto - split
        tracked.planned += upto - lo
        tracked.saved_blocks = upto

    # ------------------------------------------------------------------ results

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, PoolWorkerMetadata):
            return
        self.worker_stats = meta.stats
        for req_id, result in meta.loads.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.load = result

    def stats(self) -> dict[str, int | float]:
        """Scheduler lookups plus the worker's transfer counters (as of its last step)."""
        return {**asdict(self.lookup), **asdict(self.worker_stats)}

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Delays freeing the blocks of a request with saves planned: the worker reports it in
        `get_finished` once they are written (or given up) and no pool call given up on can
        still read them. A request finished while its load has not reported (aborted) lets the
        loader stop waiting; vLLM frees its blocks as the load reports, and only then, so the
        worker never reports its saves (`cancelled`)."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        loading = bool(tracked.loading) and tracked.load is None
        if loading:
            self._cancelled.add(request.request_id)

        load = tracked.load
        loaded = load.loaded if load else 0
        failed = load.failed if load else 0
        params: dict[str, Any] = {
            "pool_blocks_saved": tracked.planned,
            "pool_blocks_saved_generated": tracked.saved_generated,
            "pool_blocks_loaded": loaded,
            "pool_blocks_load_failed": failed,
            "pool_blocks_in_pool": min(tracked.saved_blocks, tracked.prompt_blocks),
            "pool_stats": self.stats(),
        }
        if load is not None:
            params["pool_times"] = {"wait_s": load.wait_s, "load_s": load.load_s,
                                    "blocks": loaded}
        return self.saves and tracked.planned > 0 and not loading, params
