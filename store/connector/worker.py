"""The connector's worker side (in the process that owns the paged KV cache): registers the
cache with the pool, hands planned saves to the saver and loads to the loader, and reports
what finished. Nothing here blocks the forward pass, except that a step after a preemption
waits for the pool calls that may still read the preempted requests' blocks.

No pool call outlives the blocks it reads or writes, and nothing here gives up on one after
a while: a request's saves are reported done (vLLM then frees its blocks) only once no save
and no call given up on (`store.connector.fences`) can still read them; a load is reported
(vLLM may then free the request's blocks, if it was aborted meanwhile, or kept no valid
block) only once none of its reads can still write them; and vLLM, which frees a preempted
request's blocks at once and may give them to another request in that very step, learns of
the preemption in `handle_preemptions`, before that step's forward pass and loads: that
waits until no save of the request can still read them, however long it takes. Both waits
are counted (`TransferStats.held_*`)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

import structlog
import torch

from store.connector.data import LoadResult, PoolConnectorMetadata, PoolWorkerMetadata
from store.connector.fences import RequestFences
from store.connector.loader import Loader
from store.connector.saver import Saver
from store.connector.settings import ConnectorSettings, SharedPool, kv_cache_in_shared_memory
from store.kv_transfer import BlockLayout, KVTransfer, block_dim

log = structlog.get_logger(__name__)

STILL_WAITING_LOG_S = 5.0
"""A step waiting for a preempted request's pool calls says so this often (and keeps waiting)."""


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, pool: SharedPool, saves: bool) -> None:
        self.settings = settings
        self.pool = pool
        self.saves = saves
        self.transfer: KVTransfer | None = None
        self.saver: Saver | None = None
        self.loader: Loader | None = None
        self.fences = RequestFences(self._held_for_abandoned_call)
        self._saving: set[str] = set()
        """Requests with saves submitted whose end is not reported yet: the scheduler side
        delays freeing them once finished, until `get_finished` reports them."""
        self._finishing: set[str] = set()
        """Of `_saving`, those finished."""
        self._loading: set[str] = set()
        """Requests with a load submitted and not reported yet."""
        self._cancelled: set[str] = set()
        """Of `_loading`, those finished meanwhile: vLLM frees them as their load reports."""
        self._withheld: dict[str, LoadResult] = {}
        """Finished loads not reported yet: a read of theirs given up on can still write."""
        self._invalid: set[int] = set()
        self._loads: dict[str, LoadResult] = {}

    def mem_pool_context(self) -> AbstractContextManager | None:
        """With `store_client`: vLLM allocates the KV cache (one CPU int8 buffer,
        `vllm.v1.worker.utils.allocate_kv_cache`) in shared memory of the store client, the only
        memory a Mooncake dummy client can register. Without a pool: vLLM's own allocation (and
        the cache cannot be registered: every load falls back to recompute)."""
        if not self.settings.store_client:
            return None
        pool = self.pool.get()
        if pool is None:
            return None
        return kv_cache_in_shared_memory(pool)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        layout = BlockLayout.of(list(kv_caches.values()), num_blocks)
        self.transfer = KVTransfer(layout, self.pool.get,
                                   staging_blocks=self.settings.load_staging_blocks,
                                   checksum=self.settings.checksum)
        self.transfer.connect()  # join the pool and register the cache now, not mid-request
        self.loader = Loader(self.transfer, self.settings.load_poll_s, self.fences)
        if self.saves:
            self.saver = Saver(self.transfer, self.fences)
        first = next(iter(kv_caches.values()))
        log.info("kv_caches_registered", layers=len(kv_caches), shape=tuple(first.shape),
                 block_dim=block_dim(first, layout.num_blocks), device=layout.device,
                 block_bytes=layout.block_nbytes, pieces_per_block=len(layout.ranges(0)),
                 checksum=self.settings.checksum)

    def start_load_kv(self, meta: PoolConnectorMetadata) -> None:
        """Hand this step's loads to the loader (after the forward pass was launched)."""
        if self.loader is None:
            return
        self._loading.update(job.request_id for job in meta.loads)
        # finished before their load reported: vLLM frees them as it does, and only then. A
        # load reported already (in the output vLLM took this abort before) frees them there.
        self._forget(meta.cancelled - self._loading)
        self._cancelled |= meta.cancelled & self._loading
        self.loader.cancel(meta.cancelled)
        self.loader.submit(meta.loads)

    def wait_for_save(self, meta: PoolConnectorMetadata) -> None:
        """Hands this step's saves to the saver thread and returns: the forward pass never
        waits for the pool."""
        # Every request with saves planned is one the scheduler delays: it must be reported.
        self._saving.update(s.request_id for s in meta.saves)
        if not meta.saves or self.saver is None:
            return
        if self.transfer is not None and self.transfer.layout.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the blocks must be computed
        self.saver.submit(list(meta.saves))

    def handle_preemptions(self, meta: PoolConnectorMetadata) -> None:
        """vLLM has freed the preempted requests' blocks and may write them in this step:
        first, every save that may still read them ends, however long that takes."""
        busy = {r for r in meta.preempted if self._touched(r)}
        if not busy:
            return
        t0 = time.monotonic()
        while not self._ended(busy, STILL_WAITING_LOG_S):
            log.warning("kv_preempt_waiting_for_pool", requests=sorted(busy),
                        waited_s=round(time.monotonic() - t0, 1))
        seconds = time.monotonic() - t0
        if self.transfer is not None:
            self.transfer.count_held(seconds, preempted=True)
        log.info("kv_preempt_waited", requests=sorted(busy), waited_s=round(seconds, 4))

    def _touched(self, request_id: str) -> bool:
        """A save, or a pool call given up on, may still read or write its blocks."""
        return ((self.saver is not None and self.saver.pending(request_id) > 0)
                or self.fences.held(request_id))

    def _ended(self, request_ids: set[str], timeout: float) -> bool:
        """Whether the requests' saves, then the calls given up on that they left, ended
        within `timeout` (a save gives up on its call before it counts as done)."""
        deadline = time.monotonic() + timeout
        saved = self.saver is None or self.saver.wait_idle(request_ids, timeout)
        return saved and self.fences.wait(request_ids, max(deadline - time.monotonic(), 0.0))

    def _held_for_abandoned_call(self, seconds: float) -> None:
        if self.transfer is not None:
            self.transfer.count_held(seconds, preempted=False)

    def _forget(self, request_ids: set[str]) -> None:
        """Requests vLLM frees on their load's report: never to be reported as saved."""
        self._saving -= request_ids
        self._finishing -= request_ids

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are done, requests whose loads are done), each once no pool
        call can touch the request's blocks any more. A finished load's failed blocks go out
        through `invalid_blocks` no later than the step that reports it."""
        self._finishing |= (finished_req_ids & self._saving) - self._cancelled
        sent = {r for r in self._finishing if not self._touched(r)}
        self._finishing -= sent
        self._saving -= sent
        received: set[str] = set()
        if self.loader is not None:
            loads, invalid = self.loader.take_finished()
            self._invalid |= invalid
            self._withheld.update(loads)
            received = {r for r in self._withheld if not self._touched(r)}
            for rid in received:
                self._loads[rid] = self._withheld.pop(rid)
            self._loading -= received
            self._forget(received & self._cancelled)
            self._cancelled -= received
        return sent or None, received or None

    def invalid_blocks(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def worker_meta(self) -> PoolWorkerMetadata | None:
        if self.transfer is None:
            return None
        loads, self._loads = self._loads, {}
        return PoolWorkerMetadata(loads, self.transfer.snapshot())

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.stop()
        if self.saver is not None:
            self.saver.wait_idle(None, self.settings.op_timeout_s)
            self.saver.stop()
