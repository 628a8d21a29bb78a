"""The connector's worker side (in the process that owns the paged KV cache): registers the
cache with the pool, hands planned saves to the saver and loads to the loader, and reports
what finished. Nothing here blocks the forward pass, except that a preempted request's saves
(and pool calls given up on that may still touch its blocks) are finished before vLLM frees
its blocks."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import replace

import structlog
import torch

from store.connector.data import LoadResult, PoolConnectorMetadata, PoolWorkerMetadata
from store.connector.fences import RequestFences
from store.connector.loader import Loader
from store.connector.saver import Saver
from store.connector.settings import ConnectorSettings, SharedPool, kv_cache_in_shared_memory
from store.kv_transfer import BlockLayout, KVTransfer, block_dim

log = structlog.get_logger(__name__)

_PREEMPT_WAIT_S = 30.0


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, pool: SharedPool, saves: bool) -> None:
        self.settings = settings
        self.pool = pool
        self.saves = saves
        self.transfer: KVTransfer | None = None
        self.saver: Saver | None = None
        self.loader: Loader | None = None
        self._saving: set[str] = set()
        """Requests with saves submitted and not yet reported finished."""
        self.fences = RequestFences()
        self._fenced: set[str] = set()
        """Requests whose load reported `fenced`: the scheduler side delays freeing them."""
        self._cancelled: set[str] = set()
        """Requests aborted while their load ran whose load has not reported yet."""
        self._withheld: dict[str, LoadResult] = {}
        """Loads with calls the pool gave up on, reported only once none of those can write:
        the request's blocks are freed as the load reports (an aborted request's, and one's
        that kept no valid block: `LoadResult.valid_blocks`)."""
        self._finishing: set[str] = set()
        self._invalid: set[int] = set()
        self._loads: dict = {}

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
        # a withheld load reports once safe, aborted or not: no cancel to remember for it
        self._cancelled |= meta.cancelled - self._withheld.keys()
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
        """A preempted request's blocks are freed at once: finish its saves first."""
        busy = meta.preempted & (self._saving | self._fenced)
        if not busy:
            return
        deadline = time.monotonic() + _PREEMPT_WAIT_S
        saved = self.saver is None or self.saver.wait_idle(busy, _PREEMPT_WAIT_S)
        if not (saved and self.fences.wait(busy, max(deadline - time.monotonic(), 0.0))):
            log.error("kv_save_preempt_wait_timeout", requests=sorted(busy))

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are done, requests whose loads are done). A finished load's
        failed blocks go out through `invalid_blocks` in the same step."""
        self._finishing |= finished_req_ids & (self._saving | self._fenced)
        sent = None
        if self._finishing:
            saver = self.saver
            done = {r for r in self._finishing if (saver is None or not saver.pending(r))
                    and not self.fences.held(r)}
            self._finishing -= done
            self._saving -= done
            self._fenced -= done
            sent = done or None
        received = None
        if self.loader is not None:
            loads, invalid = self.loader.take_finished()
            self._invalid |= invalid
            for rid, result in loads.items():
                if result.fenced and (rid in self._cancelled or not result.valid_blocks):
                    # vLLM frees the blocks as this reports (`Scheduler.finish_requests`,
                    # `_update_waiting_for_remote_kv`): not while a given-up read can land
                    self._withheld[rid] = result
                else:
                    if result.fenced:
                        self._fenced.add(rid)
                    self._loads[rid] = result
            self._cancelled -= loads.keys()
            safe = {r for r in self._withheld if not self.fences.held(r)}
            for rid in safe:  # nothing can write its blocks any more: not fenced now
                self._loads[rid] = replace(self._withheld.pop(rid), fenced=False)
            received = (loads.keys() - self._withheld.keys()) | safe or None
        return sent, received

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
