"""``S3ECConnector``: the class vLLM loads. A role-routed shell (one instance per vLLM process):
the scheduler role builds an :class:`ECScheduler`, the worker role an :class:`ECWorker`, and
each of vLLM's calls goes to the side it belongs to."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from shared.connectors.common import ConnectorConfig, inherit_vllm_log_handlers, vllm_identity
from shared.connectors.s3_ec.metadata import S3ECMetadata, S3ECWorkerMetadata
from shared.connectors.s3_ec.metrics import S3ECPromMetrics, S3ECStats, StatsRecorder
from shared.connectors.s3_ec.scheduler import ECScheduler
from shared.connectors.s3_ec.worker import ECWorker
from shared.families import feature_width

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class S3ECConnector(ECConnectorBase):
    """vLLM EC connector over the epd-serve EC store (see :mod:`shared.connectors.s3_ec`)."""

    #: the sides this connector builds (a subclass may name its own, e.g. to inject faults)
    scheduler_class: type[ECScheduler] = ECScheduler
    worker_class: type[ECWorker] = ECWorker

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        inherit_vllm_log_handlers()
        ec_config = vllm_config.ec_transfer_config
        self.config = ConnectorConfig.from_extra(ec_config.ec_connector_extra_config if ec_config else None)
        #: the model vLLM loaded (built once per process side); its encoder fingerprint keys the store
        self.identity = vllm_identity(vllm_config.model_config)
        self.fingerprint = self.identity.fingerprint
        self.store = self.config.ec_store(self.fingerprint)
        self.stats = StatsRecorder()
        self.connector_scheduler: ECScheduler | None = None
        self.connector_worker: ECWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self.connector_scheduler = self._make_scheduler(vllm_config)
        elif role == ECConnectorRole.WORKER:
            self.connector_worker = self._make_worker(vllm_config)
        else:
            raise ValueError(f"unknown ECConnectorRole {role}")
        log.info(
            "S3ECConnector %s (%s%s): store %s, keys %s",
            role.name.lower(),
            "producer" if self.is_producer else "",
            "consumer" if self.is_consumer else "",
            self.config.location,
            self.store.key("<identifier>"),
        )

    # -- construction seams ------------------------------------------------------------------------
    def _make_scheduler(self, vllm_config: VllmConfig) -> ECScheduler:
        return self.scheduler_class(
            config=self.config,
            store=self.store,
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            embed_width=feature_width(vllm_config.model_config.hf_config.to_dict()),
            stats=self.stats,
        )

    def _make_worker(self, vllm_config: VllmConfig) -> ECWorker:
        return self.worker_class(
            store=self.store, is_producer=self.is_producer, model_dtype=vllm_config.model_config.dtype, stats=self.stats
        )

    def _scheduler(self) -> ECScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self.connector_scheduler

    def _worker(self) -> ECWorker:
        assert self.connector_worker is not None, "a worker-side call on a scheduler-side connector"
        return self.connector_worker

    # -- scheduler side ----------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler().has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._scheduler().ensure_cache_available(request, num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler().take_unavailable_requests()

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._scheduler().update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, S3ECWorkerMetadata) and meta.stats:
            self._scheduler().update_worker_stats(meta.stats)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    # -- worker side -------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, S3ECMetadata):
            self._worker().start_load_caches(encoder_cache, meta)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        self._worker().save_caches(encoder_cache, mm_hash)

    def start_save_caches(self, **kwargs: Any) -> None:
        encoder_cache = kwargs.get("encoder_cache")
        meta = self._get_connector_metadata()
        if encoder_cache and isinstance(meta, S3ECMetadata):
            self._worker().start_save_caches(encoder_cache, meta)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return self.connector_worker.build_connector_worker_meta() if self.connector_worker is not None else None

    # -- both --------------------------------------------------------------------------------------
    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        return self.stats.take()

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return S3ECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return S3ECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
