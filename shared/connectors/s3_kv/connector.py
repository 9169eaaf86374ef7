"""``S3KVConnector``: the class vLLM loads. A role-routed shell (one instance per vLLM process):
the scheduler role builds a :class:`KVScheduler`, the worker role a :class:`KVWorker`, and each
of vLLM's calls goes to the side it belongs to."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from shared.connectors.common import ConnectorConfig, inherit_vllm_log_handlers, vllm_identity
from shared.connectors.s3_kv.metadata import S3KVMetadata, S3KVWorkerMetadata
from shared.connectors.s3_kv.scheduler import KVScheduler
from shared.connectors.s3_kv.worker import KVWorker
from shared.store.tensors import safetensors_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class S3KVConnector(KVConnectorBase_V1):
    """vLLM KV connector over the epd-serve KV store (see :mod:`shared.connectors.s3_kv`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]  # vLLM always passes one
        inherit_vllm_log_handlers()
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, "kv_connector_extra_config")
        if vllm_config.model_config.use_mla:
            raise ValueError("S3KVConnector does not support MLA attention models")
        self.is_producer = bool(transfer.is_kv_producer)
        self.is_consumer = bool(transfer.is_kv_consumer)
        self.block_size = int(vllm_config.cache_config.block_size)
        #: the model vLLM loaded (built once per process side); its model fingerprint keys the store
        self.identity = vllm_identity(vllm_config.model_config)
        self.fingerprint = self.identity.model_fingerprint
        self.store = self.config.kv_store(self.fingerprint)
        self.connector_scheduler: KVScheduler | None = None
        self.connector_worker: KVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self._make_scheduler()
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self._make_worker()
        else:
            raise ValueError(f"unknown KVConnectorRole {role}")
        log.info(
            "S3KVConnector (%s, %s): model fingerprint %s, block size %d",
            role.name,
            transfer.kv_role,
            self.fingerprint,
            self.block_size,
        )

    # -- construction seams ------------------------------------------------------------------------
    def _make_scheduler(self) -> KVScheduler:
        return KVScheduler(
            config=self.config,
            store=self.store,
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            block_size=self.block_size,
            layout=self._expected_layout() if self.is_consumer else None,
        )

    def _make_worker(self) -> KVWorker:
        return KVWorker(store=self.store, block_size=self.block_size)

    def _expected_layout(self) -> dict[str, tuple[int, str]] | None:
        """Layer name -> (values per block, safetensors dtype) of this engine's paged cache; None
        when the cache spec is of a kind this cannot read (the worker still checks every block's
        shape against the cache itself). The block's exact shape depends on the attention backend
        - ``[kv_heads, block_size, 2 * head_size]`` on the CPU."""

        def layout_of(spec: Any) -> tuple[int, str]:  # an attention spec; other kinds raise AttributeError
            return 2 * spec.num_kv_heads * spec.head_size * self.block_size, safetensors_dtype(spec.dtype)

        try:
            return {
                name: layout_of(group.kv_cache_spec)
                for group in self._kv_cache_config.kv_cache_groups
                for name in group.layer_names
            }
        except Exception as exc:  # noqa: BLE001 - unknown spec types
            log.debug("no expected KV layout: %s", exc)
            return None

    def _scheduler(self) -> KVScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self.connector_scheduler

    def _worker(self) -> KVWorker:
        assert self.connector_worker is not None, "a worker-side call on a scheduler-side connector"
        return self.connector_worker

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler().update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, S3KVWorkerMetadata):
            self._scheduler().update_worker_output(meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    # -- worker side -------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, S3KVMetadata):
            self._worker().start_load_kv(forward_context, meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, S3KVMetadata):
            self._worker().save_kv_layer(layer_name, kv_layer, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, S3KVMetadata):
            self._worker().wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors() if self.connector_worker else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.connector_worker.build_connector_worker_meta() if self.connector_worker else None

    # -- both --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
