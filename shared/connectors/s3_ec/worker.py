"""The EC connector's worker side (vLLM's model-runner process).

Consumer: puts the validated bytes the scheduler shipped into the encoder cache (no network).
Producer: writes each encoder output right after it is computed (in the worker's step,
synchronously: a dedicated encoder instance has nothing else to do, and the request only
finishes after the step, so a finished producer request means the object is stored), and
re-saves items a repeated request found in vLLM's encoder cache when the store lost them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from shared.connectors.common import ENGINE_NAME
from shared.connectors.s3_ec.metadata import S3ECMetadata, S3ECWorkerMetadata
from shared.connectors.s3_ec.metrics import Event, StatsRecorder, Timing, Transfer
from shared.connectors.s3_ec.state import valid_identifier
from shared.store.ec import ECStore
from shared.store.tensors import raw_to_tensor, tensor_to_raw

log = logging.getLogger(__name__)


class ECWorker:
    """Worker-side half of :class:`~shared.connectors.s3_ec.S3ECConnector`."""

    def __init__(self, *, store: ECStore, is_producer: bool, model_dtype: Any, stats: StatsRecorder):
        self.store = store
        self.is_producer = is_producer
        self._model_dtype = model_dtype
        self._stats = stats
        self._device: torch.device | None = None

    def _target_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform

            device = current_platform.device_type
            if current_platform.is_cuda_alike():
                device = f"{device}:{current_platform.current_device()}"
            self._device = torch.device(device)
        return self._device

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: S3ECMetadata) -> None:
        for load in meta.loads:
            if load.identifier in encoder_cache:
                continue
            tensor = raw_to_tensor(load.data, load.dtype, load.shape)
            encoder_cache[load.identifier] = tensor.to(device=self._target_device(), dtype=self._model_dtype)
            with self._stats.record() as stats:
                stats.count(Event.LOADS)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if self.is_producer and mm_hash in encoder_cache:
            self._save(mm_hash, encoder_cache[mm_hash])

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor], meta: S3ECMetadata) -> None:
        """Items of newly scheduled requests that vLLM already holds in its encoder cache are not
        encoded again, so ``save_caches`` will not fire for them: store them if the store lost them."""
        if not self.is_producer:
            return
        for ident in dict.fromkeys(meta.save_candidates):
            if ident in encoder_cache and valid_identifier(ident):
                try:
                    stored = self.store.exists(ident)
                except Exception as exc:  # noqa: BLE001 - an existence check failure only means: not stored
                    log.warning("EC existence check of %s failed: %s", ident, exc)
                    stored = False
                if not stored:
                    self._save(ident, encoder_cache[ident])

    def _save(self, identifier: str, tensor: torch.Tensor) -> None:
        if not valid_identifier(identifier):
            log.warning("not storing encoder output: identifier %r cannot be an EC key", identifier[:80])
            with self._stats.record() as stats:
                stats.count(Event.SAVE_SKIPPED)
            return
        started = time.perf_counter()
        try:
            raw, dtype, shape = tensor_to_raw(tensor)
            key, nbytes = self.store.save(identifier, raw, dtype=dtype, shape=shape, extra={"engine": ENGINE_NAME})
        except Exception as exc:  # noqa: BLE001 - a failed save must not crash the engine
            with self._stats.record() as stats:
                stats.count(Event.SAVE_FAILURES)
            log.error("EC save of %s failed: %s: %s", identifier, type(exc).__name__, exc)
            return
        seconds = time.perf_counter() - started
        with self._stats.record() as stats:
            stats.add_bytes(Transfer.PUT, nbytes)
            stats.observe(Timing.SAVE, seconds)
        # INFO per item: vLLM 0.32 drops a producer's worker-side stats (see the package docstring).
        log.info("EC saved %s (%d bytes) in %.1f ms", key, nbytes, seconds * 1e3)

    def build_connector_worker_meta(self) -> S3ECWorkerMetadata | None:
        stats = self._stats.take()
        return S3ECWorkerMetadata(stats=stats.data) if stats is not None else None
