"""`PoolConnector`, the class vLLM instantiates: once with the scheduler role (beside vLLM's
scheduler) and once with the worker role (beside the paged KV cache). Each delegates to its
side (`scheduler.SchedulerSide`, `worker.WorkerSide`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from store.connector.data import PoolConnectorMetadata
from store.connector.scheduler import SchedulerSide
from store.connector.settings import ConnectorSettings, shared_pool
from store.connector.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class PoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        settings = ConnectorSettings.from_extra(dict(ktc.kv_connector_extra_config))
        pool = shared_pool(settings)
        saves, loads = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self.scheduler_side = SchedulerSide(settings, pool, vllm_config.cache_config.block_size,
                                            saves, loads)
        self.worker_side = WorkerSide(settings, pool, saves)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def stats(self) -> dict[str, int | float]:
        return self.scheduler_side.stats()

    # ------------------------------------------------------------------ worker side

    def _meta(self) -> PoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        return meta

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return self.worker_side.mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, PoolConnectorMetadata)
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.worker_meta()

    def shutdown(self) -> None:
        self.worker_side.shutdown()
