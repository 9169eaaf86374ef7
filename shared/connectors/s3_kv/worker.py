"""The KV connector's worker side (vLLM's model-runner process): writes the blocks of a
completed prompt as one KV object (synchronously, in ``wait_for_save`` of the step that completes
the prompt), and copies validated tensors into a loading request's blocks (``start_load_kv``),
reporting any block it could not write so vLLM recomputes it."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from shared.connectors.s3_kv.layout import LAYER_PREFIX, blocks_for, paged_kv_tensors
from shared.connectors.s3_kv.metadata import KVLoad, KVSave, S3KVMetadata, S3KVWorkerMetadata
from shared.store.format import MissReason
from shared.store.kv import KVStore
from shared.store.tensors import raw_to_tensor

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger(__name__)


class KVWorker:
    """Worker-side half of :class:`~shared.connectors.s3_kv.S3KVConnector`."""

    def __init__(self, *, store: KVStore, block_size: int):
        self.store = store
        self.block_size = block_size
        self._layers: dict[str, torch.Tensor] = {}
        self._invalid_blocks: set[int] = set()
        self._load_failures: dict[str, str] = {}
        self._lock = threading.Lock()

    # -- loading ---------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, meta: S3KVMetadata) -> None:
        if not meta.loads:
            return
        layers = {
            name: layer.kv_cache
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None
        }
        for load in meta.loads:
            try:
                self._inject(load, layers)
            except Exception as exc:  # noqa: BLE001 - vLLM recomputes the blocks we report
                first = load.start // self.block_size
                last = (load.end - 1) // self.block_size
                with self._lock:
                    self._invalid_blocks.update(load.block_ids[first : last + 1])
                    self._load_failures[load.req_id] = MissReason.SHAPE_MISMATCH.value
                log.error(
                    "loading the KV of %s failed (%s: %s): vLLM recomputes it", load.req_id, type(exc).__name__, exc
                )

    def _inject(self, load: KVLoad, layers: dict[str, torch.Tensor]) -> None:
        """Copy whole blocks: a block's slice of the paged cache is self-contained whatever the
        backend's layout inside it (the CPU backend keeps a head's K rows, then its V rows, in
        one block), so whole blocks are what can be moved without knowing that layout."""
        names = {n[len(LAYER_PREFIX) :] for n in load.tensors if n.startswith(LAYER_PREFIX)}
        missing = sorted(set(layers) - names)
        if missing:
            raise ValueError(f"object lacks layers {missing[:3]}")
        index = list(blocks_for(load.start, load.end, self.block_size))
        if index[-1] >= len(load.block_ids):
            raise ValueError(f"request has {len(load.block_ids)} blocks, the load needs {index[-1] + 1}")
        staged = []
        for name, kv_layer in layers.items():  # check every layer before writing any
            raw = load.tensors[LAYER_PREFIX + name]
            src = raw_to_tensor(raw.data, raw.dtype, raw.shape)
            if tuple(src.shape[1:]) != tuple(kv_layer.shape[1:]) or src.shape[0] <= index[-1]:
                raise ValueError(
                    f"layer {name}: object blocks {tuple(src.shape)} vs cache blocks "
                    f"{tuple(kv_layer.shape[1:])}, need block {index[-1]}"
                )
            dst = torch.tensor([load.block_ids[i] for i in index], dtype=torch.long, device=kv_layer.device)
            staged.append((kv_layer, dst, src[index[0] : index[-1] + 1]))
        for kv_layer, dst, src in staged:
            kv_layer[dst] = src.to(device=kv_layer.device, dtype=kv_layer.dtype)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> S3KVWorkerMetadata | None:
        with self._lock:
            if not self._load_failures:
                return None
            failures, self._load_failures = self._load_failures, {}
        return S3KVWorkerMetadata(load_failures=failures)

    # -- saving ----------------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: S3KVMetadata) -> None:
        if meta.saves:
            self._layers[layer_name] = kv_layer  # read after the forward, in wait_for_save

    def wait_for_save(self, meta: S3KVMetadata) -> None:
        if not meta.saves:
            return
        layers, self._layers = self._layers, {}
        for save in meta.saves:
            started = time.perf_counter()
            try:
                blob = self._encode(save, layers)
                self.store.put(save.key, blob)
            except Exception as exc:  # noqa: BLE001 - a failed save must not crash the engine
                log.error(
                    "KV save of %s failed: %s: %s (the decode side will prefill again)",
                    save.key,
                    type(exc).__name__,
                    exc,
                )
                continue
            log.info(
                "KV saved %s (%d tokens, %d bytes) in %.1f ms",
                save.key,
                len(save.token_ids),
                len(blob),
                (time.perf_counter() - started) * 1e3,
            )

    def _encode(self, save: KVSave, layers: dict[str, torch.Tensor]) -> bytes:
        tensors, state_metadata = paged_kv_tensors(save.token_ids, save.block_ids, layers, self.block_size)
        _, blob = self.store.encode(save.request, save.attempt, tensors, state_metadata, {})
        return blob
