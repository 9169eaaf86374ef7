"""``MinioKVConnector``: a vLLM KV connector that hands a prefilled request's KV cache from a
prefill instance to a decode instance through the project's S3 / MinIO store (E|P|D on vLLM).

Any vLLM 0.32 server can use it::

    --kv-transfer-config '{"kv_connector": "MinioKVConnector",
                           "kv_connector_module_path": "shared.connectors.s3_kv",
                           "kv_role": "kv_producer",              # prefill; "kv_consumer": decode
                           "kv_connector_extra_config": {"endpoint": "minio:9000", "bucket": "epd"}}'

The hand-off goes through vLLM's ``kv_transfer_params`` (the same fields vLLM's P/D proxies pass
between instances):

* prefill request: ``{"do_remote_decode": true, "epd_kv_request": <id>, "epd_kv_attempt": <n>}``
  (both ``epd_kv_*`` optional: vLLM's request id and 0). When the prompt has been computed the
  connector writes every prompt token's K/V of every layer as one KV object and the finished
  request's ``kv_transfer_params`` say where: ``{"do_remote_prefill": true, "epd_kv_key": ...,
  "epd_kv_request": ..., "epd_kv_attempt": ..., "epd_kv_tokens": <prompt tokens>}``;
* decode request (same prompt, same images): exactly those params. The connector loads the object
  and vLLM computes only the last prompt token (whose logits give the first output token) and
  then decodes. Its finished output carries ``{"epd_kv_source": "store" | "recomputed:<reason>"}``.

Objects are KV objects of :mod:`shared.store.kv` (schema ``epd-kv-v1``, the same format code
and validation as everything else in the store): key ``<namespace>/kv/<model fingerprint>/
<request>-<attempt>``, where the model fingerprint covers every weight, the config, tokenizer,
template, dtype and engine of the folder vLLM loaded - a decode instance running other weights
never reads the object. Tensors: ``kv.<layer name>`` (``[tokens, *per-token slot shape]`` of
vLLM's paged cache) and ``token_ids`` (I64); state: engine, block size, token count, per-layer
slot shape and dtype.

When the decode side decides (vLLM 0.32 scheduler, ``get_num_new_matched_tokens``): it answers
"not yet" (``None``) while a background thread fetches and validates the object (sha256, schema,
fingerprint, request and attempt, the token ids against the request's own prompt, layer names,
slot shapes and dtype against this engine's cache). Only validated tensors held in the scheduler
process are committed as external tokens; any miss or failed check answers 0 and vLLM prefills the
request itself - the request is prefilled again, never decoded on wrong state. The tensors ride to
the worker in the connector metadata and are written into the allocated blocks in
``start_load_kv``; a failure there (not expected after validation) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those blocks (``kv_load_failure_policy``
"recompute", vLLM's default).

The producer writes synchronously in ``wait_for_save`` of the step that completes the prompt, so
when the prefill request's output arrives the object is stored (or the save failed: logged; the
decode side then finds no object and prefills again). Objects are deleted by their reader (the
epd-serve decode worker) and swept by age (``KVStore.sweep``).

Importable only where vLLM is installed; nothing imports this module eagerly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from shared.store.format import MissReason, ObjectValidationError, RawTensor
from shared.store.kv import KVObject, KVStore
from shared.store.tensors import raw_to_tensor, safetensors_dtype, tensor_to_raw
from shared.connectors.s3_ec import (
    ENGINE_NAME,
    MinioECConfig,
    _inherit_vllm_log_handlers,
    dtype_name,
    resolve_model_dir,
)
from shared.fingerprint import model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: kv_transfer_params fields
PARAM_KEY = "epd_kv_key"
PARAM_REQUEST = "epd_kv_request"
PARAM_ATTEMPT = "epd_kv_attempt"
PARAM_TOKENS = "epd_kv_tokens"
PARAM_SOURCE = "epd_kv_source"
#: ``state_metadata["schema"]`` of a vLLM paged-KV object (the transformers engine writes others)
STATE_SCHEMA = "vllm-paged-kv-v1"
_LAYER_PREFIX = "kv."


def vllm_model_fingerprint(model_config: Any) -> str:
    """The KV key version of the model vLLM loaded (same function the epd-serve workers use)."""
    model_dir = resolve_model_dir(str(model_config.model), getattr(model_config, "revision", None))
    return model_fingerprint(model_dir, dtype=dtype_name(model_config.dtype), engine=ENGINE_NAME)


def _blocks_for(start: int, end: int, block_size: int) -> range:
    """Indexes (within a request) of the blocks holding tokens ``start .. end-1``."""
    return range(start // block_size, -(-end // block_size))


# -- scheduler -> worker metadata -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVSave:
    req_id: str
    key: str
    request: str
    attempt: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KVLoad:
    req_id: str
    #: validated tensors (``kv.<layer>``), the request's first ``start .. end-1`` tokens are loaded
    tensors: dict[str, RawTensor]
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclasses.dataclass
class MinioKVMetadata(KVConnectorMetadata):
    saves: list[KVSave] = dataclasses.field(default_factory=list)
    loads: list[KVLoad] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MinioKVWorkerMetadata(KVConnectorWorkerMetadata):
    #: vLLM request id -> why loading its KV into the cache failed (vLLM recomputes it)
    load_failures: dict[str, str] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "MinioKVWorkerMetadata":
        merged = dict(self.load_failures)
        merged.update(getattr(other, "load_failures", {}) or {})
        return MinioKVWorkerMetadata(load_failures=merged)


@dataclasses.dataclass
class _Fetch:
    key: str
    future: concurrent.futures.Future
    started: float


@dataclasses.dataclass(frozen=True)
class _Decided:
    """The consumer's decision for a request: validated tensors, or why not."""

    tensors: dict[str, RawTensor] | None
    num_tokens: int
    reason: str = ""


@dataclasses.dataclass
class _Saving:
    key: str
    request: str
    attempt: int
    block_ids: list[int]


class MinioKVConnector(KVConnectorBase_V1):
    """vLLM KV connector over the epd-serve KV store (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _inherit_vllm_log_handlers()
        transfer = self._kv_transfer_config
        self.config = MinioECConfig.from_extra(transfer.kv_connector_extra_config, "kv_connector_extra_config")
        if vllm_config.model_config.use_mla:
            raise ValueError("MinioKVConnector does not support MLA attention models")
        self.is_producer = bool(transfer.is_kv_producer)
        self.is_consumer = bool(transfer.is_kv_consumer)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fingerprint = vllm_model_fingerprint(vllm_config.model_config)
        self._store = KVStore(
            self.config.object_store(), namespace=self.config.namespace, fingerprint=self.fingerprint,
            producer=self.config.producer, max_object_bytes=self.config.max_object_bytes,
        )
        # scheduler side
        self._saving: dict[str, _Saving] = {}  # producer: requests whose KV is written when their prompt is done
        self._saved: dict[str, dict[str, Any]] = {}  # producer: finished params per request
        self._fetches: dict[str, _Fetch] = {}
        self._decided: dict[str, _Decided] = {}
        self._load_start: dict[str, int] = {}  # tokens already computed when the load was offered
        self._need_load: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, "Request"] = {}  # producer: requests being saved (cached steps lack the prompt)
        self._sources: dict[str, str] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._layout: dict[str, tuple[int, str]] | None = None
        if role == KVConnectorRole.SCHEDULER and self.is_consumer:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.config.fetch_threads, "epd-kv-fetch")
            self._layout = self._expected_layout()  # what every fetched object is checked against
        # worker side
        self._layers: dict[str, torch.Tensor] = {}
        self._invalid_blocks: set[int] = set()
        self._load_failures: dict[str, str] = {}
        self._lock = threading.Lock()
        log.info("MinioKVConnector (%s, %s): model fingerprint %s, block size %d", role.name,
                 transfer.kv_role, self.fingerprint, self.block_size)

    # ============================== scheduler side ==============================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not (self.is_consumer and params.get("do_remote_prefill") and PARAM_KEY in params):
            return 0, False
        rid = request.request_id
        decided = self._decided.get(rid)
        if decided is None:
            decided = self._poll_fetch(request, params)
            if decided is None:
                return None, False  # ask again next step; the engine step never waits on the network
        if decided.tensors is None:
            return 0, False
        # Leave the last prompt token to be computed: its logits give the first output token.
        load_to = min(decided.num_tokens, len(request.prompt_token_ids or ()) - 1)
        if load_to <= num_computed_tokens:
            return 0, False
        self._load_start[rid] = num_computed_tokens
        return load_to - num_computed_tokens, False

    def _poll_fetch(self, request: "Request", params: dict[str, Any]) -> _Decided | None:
        rid = request.request_id
        fetch = self._fetches.get(rid)
        if fetch is None:
            try:
                key, name, attempt = self._parse_params(params, rid)
            except ValueError as exc:
                return self._decide(rid, _Decided(None, 0, f"{MissReason.ITEM_MISMATCH.value}"), str(exc))
            assert self._pool is not None
            prompt = tuple(request.prompt_token_ids or ())
            future = self._pool.submit(self._fetch_and_check, key, name, attempt, prompt)
            self._fetches[rid] = _Fetch(key, future, time.monotonic())
            return None
        if not fetch.future.done():
            if time.monotonic() - fetch.started < self.config.fetch_timeout_s:
                return None
            del self._fetches[rid]
            return self._decide(rid, _Decided(None, 0, MissReason.TIMEOUT.value), f"fetch of {fetch.key} too slow")
        del self._fetches[rid]
        try:
            tensors, n = fetch.future.result()
        except ObjectValidationError as exc:
            return self._decide(rid, _Decided(None, 0, exc.reason.value), exc.detail)
        except Exception as exc:  # noqa: BLE001 - any failure: prefill again
            return self._decide(rid, _Decided(None, 0, MissReason.STORE_ERROR.value), f"{type(exc).__name__}: {exc}")
        return self._decide(rid, _Decided(tensors, n), fetch.key)

    def _decide(self, rid: str, decided: _Decided, detail: str) -> _Decided:
        self._decided[rid] = decided
        if decided.tensors is None:
            self._sources[rid] = f"recomputed:{decided.reason}"
            log.warning("KV of %s unusable (%s: %s): vLLM prefills it again", rid, decided.reason, detail)
        else:
            self._sources[rid] = "store"
            log.info("KV of %s loaded from %s (%d tokens)", rid, detail, decided.num_tokens)
        return decided

    @staticmethod
    def _parse_params(params: dict[str, Any], rid: str) -> tuple[str, str, int]:
        """(key, request name, attempt) of a decode request's params (the key may be "" on the
        prefill side). Raises ValueError."""
        key = params.get(PARAM_KEY, "")
        name = params.get(PARAM_REQUEST, rid)
        attempt = params.get(PARAM_ATTEMPT, 0)
        if not isinstance(key, str) or not isinstance(name, str) or not isinstance(attempt, int):
            raise ValueError(f"malformed kv_transfer_params {params!r}")
        return key, name, attempt

    def _expected_layout(self) -> dict[str, tuple[int, str]] | None:
        """Layer name -> (values per block, safetensors dtype) of this engine's paged cache; None
        when the cache spec is of a kind this cannot read (the worker still checks every block's
        shape against the cache itself). The block's exact shape depends on the attention backend
        - ``[kv_heads, block_size, 2 * head_size]`` on the CPU."""
        try:
            return {
                name: (2 * group.kv_cache_spec.num_kv_heads * group.kv_cache_spec.head_size * self.block_size,
                       safetensors_dtype(group.kv_cache_spec.dtype))
                for group in self._kv_cache_config.kv_cache_groups
                for name in group.layer_names
            }
        except Exception as exc:  # noqa: BLE001 - unknown spec types
            log.debug("no expected KV layout: %s", exc)
            return None

    def _fetch_and_check(self, key: str, name: str, attempt: int, prompt: tuple[int, ...]) -> tuple[dict, int]:
        """Fetch thread: the validated tensors of ``key`` and how many leading prompt tokens they
        hold. Raises ObjectValidationError."""
        obj = self._store.load(key, request_id=name, attempt=attempt)
        return check_kv_object(obj, prompt, self.block_size, self._layout)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and rid in self._load_start:
            start = self._load_start.pop(rid)
            self._need_load[rid] = (start, start + num_external_tokens)
        if self.is_producer and params.get("do_remote_decode") and rid not in self._saving and rid not in self._saved:
            try:
                _, name, attempt = self._parse_params(params, rid)
                key = self._store.key(name, attempt)
            except ValueError as exc:
                log.warning("not storing the KV of %s: %s", rid, exc)
                return
            self._saving[rid] = _Saving(key, name, attempt, [])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = MinioKVMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            block_ids = list(new.block_ids[0])
            span = self._need_load.pop(rid, None)
            decided = self._decided.get(rid)
            if span is not None and decided is not None and decided.tensors is not None:
                meta.loads.append(KVLoad(rid, decided.tensors, tuple(block_ids), span[0], span[1]))
                self._decided[rid] = _Decided(None, decided.num_tokens, "")  # the tensors now ride the metadata
            saving = self._saving.get(rid)
            if saving is not None:
                saving.block_ids = block_ids
                self._maybe_save(meta, rid, saving, new.prompt_token_ids or [],
                                 new.num_computed_tokens + num_scheduled.get(rid, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            saving = self._saving.get(rid)
            if saving is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if rid in cached.resumed_req_ids:
                    saving.block_ids = list(new_blocks[0])
                else:
                    saving.block_ids.extend(new_blocks[0])
            request = self._requests.get(rid)
            prompt = (request.prompt_token_ids if request is not None else None) or []
            self._maybe_save(meta, rid, saving, prompt, cached.num_computed_tokens[i] + num_scheduled.get(rid, 0))
        return meta

    def on_new_request(self, request: "Request") -> None:
        # cached requests' scheduler data lacks the prompt: keep the request objects we save for
        if self.is_producer and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._requests[request.request_id] = request

    def _maybe_save(self, meta: MinioKVMetadata, rid: str, saving: _Saving, prompt: list[int], computed: int) -> None:
        if not prompt or computed < len(prompt):
            return  # the prompt is not complete yet (chunked prefill): save when it is
        meta.saves.append(KVSave(rid, saving.key, saving.request, saving.attempt, tuple(prompt),
                                 tuple(saving.block_ids)))
        del self._saving[rid]
        self._saved[rid] = {
            "do_remote_prefill": True, PARAM_KEY: saving.key, PARAM_REQUEST: saving.request,
            PARAM_ATTEMPT: saving.attempt, PARAM_TOKENS: len(prompt),
        }

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, MinioKVWorkerMetadata):
            for rid, reason in meta.load_failures.items():
                self._sources[rid] = f"recomputed:{reason}"

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        fetch = self._fetches.pop(rid, None)
        if fetch is not None:
            fetch.future.cancel()
        self._decided.pop(rid, None)
        self._need_load.pop(rid, None)
        self._load_start.pop(rid, None)
        self._saving.pop(rid, None)
        self._requests.pop(rid, None)
        params: dict[str, Any] = dict(self._saved.pop(rid, {}))
        source = self._sources.pop(rid, None)
        if source is not None:
            params[PARAM_SOURCE] = source
        return False, (params or None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ============================== worker side =================================================
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, MinioKVMetadata) or not meta.loads:
            return
        layers = {
            name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None
        }
        for load in meta.loads:
            try:
                self._inject(load, layers)
            except Exception as exc:  # noqa: BLE001 - vLLM recomputes the blocks we report
                first = load.start // self.block_size
                last = (load.end - 1) // self.block_size
                with self._lock:
                    self._invalid_blocks.update(load.block_ids[first:last + 1])
                    self._load_failures[load.req_id] = MissReason.SHAPE_MISMATCH.value
                log.error("loading the KV of %s failed (%s: %s): vLLM recomputes it", load.req_id,
                          type(exc).__name__, exc)

    def _inject(self, load: KVLoad, layers: dict[str, torch.Tensor]) -> None:
        """Copy whole blocks: a block's slice of the paged cache is self-contained whatever the
        backend's layout inside it (the CPU backend keeps a head's K rows, then its V rows, in
        one block), so whole blocks are what can be moved without knowing that layout."""
        names = {n[len(_LAYER_PREFIX):] for n in load.tensors if n.startswith(_LAYER_PREFIX)}
        missing = sorted(set(layers) - names)
        if missing:
            raise ValueError(f"object lacks layers {missing[:3]}")
        index = list(_blocks_for(load.start, load.end, self.block_size))
        if index[-1] >= len(load.block_ids):
            raise ValueError(f"request has {len(load.block_ids)} blocks, the load needs {index[-1] + 1}")
        staged = []
        for name, kv_layer in layers.items():  # check every layer before writing any
            raw = load.tensors[_LAYER_PREFIX + name]
            src = raw_to_tensor(raw.data, raw.dtype, raw.shape)
            if tuple(src.shape[1:]) != tuple(kv_layer.shape[1:]) or src.shape[0] <= index[-1]:
                raise ValueError(f"layer {name}: object blocks {tuple(src.shape)} vs cache blocks "
                                 f"{tuple(kv_layer.shape[1:])}, need block {index[-1]}")
            dst = torch.tensor([load.block_ids[i] for i in index], dtype=torch.long, device=kv_layer.device)
            staged.append((kv_layer, dst, src[index[0]:index[-1] + 1]))
        for kv_layer, dst, src in staged:
            kv_layer[dst] = src.to(device=kv_layer.device, dtype=kv_layer.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, MinioKVMetadata) and meta.saves:
            self._layers[layer_name] = kv_layer  # read after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, MinioKVMetadata) or not meta.saves:
            return
        layers, self._layers = self._layers, {}
        for save in meta.saves:
            started = time.perf_counter()
            try:
                blob = self._encode(save, layers)
                self._store.put(save.key, blob)
            except Exception as exc:  # noqa: BLE001 - a failed save must not crash the engine
                log.error("KV save of %s failed: %s: %s (the decode side will prefill again)", save.key,
                          type(exc).__name__, exc)
                continue
            log.info("KV saved %s (%d tokens, %d bytes) in %.1f ms", save.key, len(save.token_ids), len(blob),
                     (time.perf_counter() - started) * 1e3)

    def _encode(self, save: KVSave, layers: dict[str, torch.Tensor]) -> bytes:
        """The KV object of a request: every block holding its prompt, per layer. The last block
        may be partly filled; its other slots are never read (decode overwrites them)."""
        if not layers:
            raise ValueError("no attention layer was saved in this step")
        n = len(save.token_ids)
        index = list(_blocks_for(0, n, self.block_size))
        if index[-1] >= len(save.block_ids):
            raise ValueError(f"request has {len(save.block_ids)} blocks for {n} tokens")
        tensors: dict[str, RawTensor] = {}
        layout: dict[str, list[int]] = {}
        for name, kv_layer in sorted(layers.items()):
            blocks = torch.tensor([save.block_ids[i] for i in index], dtype=torch.long, device=kv_layer.device)
            tensors[_LAYER_PREFIX + name] = RawTensor(*tensor_to_raw(kv_layer[blocks]))
            layout[name] = list(kv_layer.shape[1:])
        tensors["token_ids"] = RawTensor(*tensor_to_raw(torch.tensor(save.token_ids, dtype=torch.int64)))
        state = {"engine": ENGINE_NAME, "num_tokens": n, "block_size": self.block_size, "block_shapes": layout}
        _, blob = self._store.encode(save.request, save.attempt, tensors,
                                     {"schema": STATE_SCHEMA, "state": json.dumps(state, sort_keys=True)}, {})
        return blob

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._lock:
            if not self._load_failures:
                return None
            failures, self._load_failures = self._load_failures, {}
        return MinioKVWorkerMetadata(load_failures=failures)


def check_kv_object(obj: KVObject, prompt: tuple[int, ...], block_size: int,
                    layout: dict[str, tuple[int, str]] | None) -> tuple[dict[str, RawTensor], int]:
    """Check a validated KV object against the request and this engine: its schema and block
    size, that its token ids are (a prefix of) the request's prompt, and its layers' block sizes
    and dtypes. Returns (layer tensors, number of tokens). Raises ObjectValidationError."""
    if obj.state_metadata.get("schema") != STATE_SCHEMA:
        raise ObjectValidationError(MissReason.SCHEMA_MISMATCH,
                                    f"decode state schema {obj.state_metadata.get('schema')!r} != {STATE_SCHEMA}")
    state = obj.state
    n = state.get("num_tokens")
    ids = obj.tensors.get("token_ids")
    if not isinstance(n, int) or n < 1 or ids is None or ids.dtype != "I64" or ids.shape != (n,):
        raise ObjectValidationError(MissReason.CORRUPT, "KV object token ids / count are malformed")
    if state.get("block_size") != block_size:
        raise ObjectValidationError(MissReason.SHAPE_MISMATCH,
                                    f"KV object block size {state.get('block_size')} != this engine's {block_size}")
    stored = raw_to_tensor(ids.data, ids.dtype, ids.shape).tolist()
    if n > len(prompt) or tuple(stored) != prompt[:n]:
        raise ObjectValidationError(MissReason.ITEM_MISMATCH, "KV object was computed for another prompt")
    n_blocks = -(-n // block_size)
    tensors = {name: t for name, t in obj.tensors.items() if name.startswith(_LAYER_PREFIX)}
    for name, t in tensors.items():
        if not t.shape or t.shape[0] != n_blocks:
            raise ObjectValidationError(MissReason.SHAPE_MISMATCH, f"{name} holds {t.shape} for {n_blocks} blocks")
    if layout is not None:
        have = {name[len(_LAYER_PREFIX):]: (math.prod(t.shape[1:]), t.dtype) for name, t in tensors.items()}
        if set(have) != set(layout):
            raise ObjectValidationError(MissReason.SHAPE_MISMATCH,
                                        f"layers {sorted(have)[:3]}... != this engine's {sorted(layout)[:3]}...")
        for name, expected in layout.items():
            if have[name] != expected:
                raise ObjectValidationError(MissReason.SHAPE_MISMATCH,
                                            f"layer {name}: (values per block, dtype) {have[name]} != {expected}")
    return tensors, n
