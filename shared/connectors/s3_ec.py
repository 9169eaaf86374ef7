"""``MinioECConnector``: a vLLM EC connector over the project's S3 / MinIO EC store.

Any vLLM 0.32 server can use it, with no epd-serve service running::

    --ec-transfer-config '{"ec_connector": "MinioECConnector",
                           "ec_connector_module_path": "shared.connectors.s3_ec",
                           "ec_role": "ec_producer",            # or "ec_consumer"
                           "ec_connector_extra_config": {"endpoint": "minio:9000", "bucket": "epd"}}'

Objects are written and read through :class:`shared.store.ec.ECStore`: the same key scheme
(``<namespace>/<encoder fingerprint>/<identifier>``), object format and validation as every other
component. The identifier is vLLM's ``mm_hash`` of the item; epd-serve's workers pass the image's
content hash as the multimodal uuid so that it equals the project's item hash. vLLM's mm_hash does
not know the model version, so the key's version part is the encoder fingerprint computed from the
model folder vLLM actually loaded (``vllm_config.model_config.model``) and its dtype: a store
shared by two model versions never serves one's outputs to the other.

How vLLM 0.32's scheduler drives a connector (read from ``vllm/v1/core/sched/scheduler.py``), and
what this one does at each point:

1. ``ensure_cache_available(request, num_computed_tokens)`` is called for every request with
   multimodal items *before* its encoder inputs are considered, each time the scheduler looks at
   it (waiting and running). ``False`` skips the request for this step. Here: for each item not yet
   covered by computed tokens, the connector starts a background prefetch (existence check with a
   short-lived cache, GET, full validation, shape check against the request's placeholder) and
   defers the request until the prefetch has *decided*: bytes validated and held locally, or a
   miss / failure, in which case the item is encoded locally. The engine step never waits on the
   network.
2. ``has_cache_item(identifier)`` is called in ``_try_schedule_encoder_inputs`` for an item that is
   not in vLLM's own encoder cache. ``True`` commits the item as an external load *in this very
   step*: the worker must put the tensor into the encoder cache before ``_gather_mm_embeddings``
   of the same step. So it answers from local state only: True iff validated bytes are held.
3. ``update_state_after_alloc`` (same pass) -> ``build_connector_meta`` ships the held bytes to the
   worker, whose ``start_load_caches`` turns them into the encoder-cache tensor (no network).
4. ``take_unavailable_requests()`` is drained in ``update_from_output``; vLLM *fails* those
   requests (``FINISHED_ERROR``, "re-issuing the request re-runs the encode"). There is no way
   back once an item is committed, so a fetch or validation failure is never reported there: the
   prefetch decides before the commit and the request falls back to local encoding (its pixels
   are in the request). Only a request that carries no local input for an unobtainable item (not
   the case for epd-serve or plain image requests) is reported as unavailable.

Producer side: ``save_caches`` writes each encoder output right after it is computed (in the
worker's step, synchronously: a dedicated encoder instance has nothing else to do, and the
request only finishes after the step, so a finished producer request means the object is stored).
``start_save_caches`` re-saves items a repeated request found already in vLLM's encoder cache
when their object is gone from the store.

Counters (hits, misses, fallbacks by reason, bytes, fetch/save latency) travel as vLLM
``ECConnectorStats`` to the front-end process: logged as "EC Transfer metrics" and exported to
Prometheus as ``epd:ec_connector_*`` by :meth:`MinioECConnector.build_prom_metrics`. Worker-side
counters of a consumer ride back on ``ECConnectorWorkerMetadata``; a producer's cannot: in vLLM
0.32's V1 model runner the encoder-only path returns an output without the EC connector part, so
each save is logged instead (the epd-serve encoder worker counts its own encodes).

Importable only where vLLM is installed; nothing imports this module eagerly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

from shared.store.format import ECObject, ECValidationError, MissReason
from shared.store.ec import ECStore
from shared.store.tensors import raw_to_tensor, tensor_to_raw
from shared.fingerprint import encoder_fingerprint
from shared.store.objects import ObjectStore, make_object_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

ENGINE_NAME = "vllm"
#: Keys of ``ec_transfer_params`` this connector returns in a finished request's output.
PARAMS_SOURCES = "epd_ec_sources"  # consumer: {identifier: "store" | "recomputed:<reason>" | "engine_cache"}
PARAMS_ITEMS = "epd_ec_items"  # producer: {identifier: {"key": ..., "n_tokens": ...}}

# An identifier becomes one key segment: no '/', no leading dot, bounded.
_IDENTIFIER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:=+-]{0,254}$")
_MAX_LATENCY_SAMPLES = 1000  # per stats interval


def valid_identifier(identifier: str) -> bool:
    return isinstance(identifier, str) and bool(_IDENTIFIER.match(identifier)) and ".." not in identifier


# -- configuration --------------------------------------------------------------------------------
def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "0", "false", "no"):
        return value.strip().lower() in ("1", "true", "yes")
    raise ValueError(f"{name} must be a boolean, got {value!r}")


def _as_number(name: str, value: Any, kind: type, minimum: float) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return number


@dataclasses.dataclass(frozen=True)
class MinioECConfig:
    """``ec_connector_extra_config`` of :class:`MinioECConnector` (and ``kv_connector_extra_config``
    of :class:`shared.connectors.s3_kv.MinioKVConnector`: same store, same keys).

    Credentials are never in the config: ``access_key_env`` / ``secret_key_env`` name the
    environment variables that hold them (read once, in each vLLM process, never logged).
    """

    endpoint: str = "127.0.0.1:9000"
    bucket: str = "epd"
    namespace: str = "epd"
    secure: bool = False
    region: str | None = None
    access_key_env: str = "EPD_S3_ACCESS_KEY"
    secret_key_env: str = "EPD_S3_SECRET_KEY"
    #: "s3" (MinIO / any S3) or "fs" (a local folder ``fs_root``, for single-host set-ups).
    backend: str = "s3"
    fs_root: str = ""
    #: largest EC object a consumer reads
    max_object_bytes: int = 512 * 1024**2
    #: how long an existence-check answer (HEAD) is reused
    exists_ttl_s: float = 2.0
    #: a prefetch still running after this long is given up: the item is encoded locally
    fetch_timeout_s: float = 30.0
    fetch_threads: int = 4
    #: validated objects kept in the scheduler process after use (LRU), so a repeated item is
    #: not fetched again; objects waiting for their request are held regardless
    local_cache_bytes: int = 256 * 1024**2
    #: written into each object's metadata (default: vllm-<host>-<pid>)
    producer_id: str = ""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None,
                   section: str = "ec_connector_extra_config") -> "MinioECConfig":
        """Parse and check a connector's extra config (``section`` names it in error messages)."""
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"unknown {section} key(s) {unknown}; known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = fields[name].default
            if isinstance(default, bool):
                values[name] = _as_bool(f"{section}.{name}", value)
            elif isinstance(default, int):
                values[name] = _as_number(f"{section}.{name}", value, int, 0 if name == "local_cache_bytes" else 1)
            elif isinstance(default, float):
                values[name] = _as_number(f"{section}.{name}", value, float, 0.0)
            elif value is None and name == "region":
                values[name] = None
            elif not isinstance(value, str):
                raise ValueError(f"{section}.{name} must be a string, got {value!r}")
            else:
                values[name] = value
        config = cls(**values)
        if not config.namespace or any(c in config.namespace for c in "/.*> "):
            raise ValueError(f"{section}.namespace {config.namespace!r} must be non-empty "
                             "and contain no '/', '.', '*', '>' or spaces")
        if config.backend not in ("s3", "fs"):
            raise ValueError(f"{section}.backend must be 's3' or 'fs', got {config.backend!r}")
        if config.backend == "fs" and not config.fs_root:
            raise ValueError(f"{section}.fs_root is required with backend 'fs'")
        return config

    def object_store(self) -> ObjectStore:
        """The object store this config points at (credentials read from the named env vars)."""
        if self.backend == "fs":
            return make_object_store("fs", root=Path(self.fs_root))
        access_key = os.environ.get(self.access_key_env, "")
        secret_key = os.environ.get(self.secret_key_env, "")
        if not access_key or not secret_key:
            raise ValueError(
                f"epd-serve vLLM connector: set the S3 credentials in ${self.access_key_env} and "
                f"${self.secret_key_env} (names from the connector's extra config access_key_env / "
                "secret_key_env)"
            )
        return make_object_store(
            "s3", endpoint=self.endpoint, access_key=access_key, secret_key=secret_key,
            bucket=self.bucket, secure=self.secure, region=self.region,
        )

    @property
    def producer(self) -> str:
        return self.producer_id or f"vllm-{socket.gethostname()}-{os.getpid()}"

    def make_store(self, fingerprint: str) -> ECStore:
        """The EC store this config points at."""
        return ECStore(
            self.object_store(),
            namespace=self.namespace,
            fingerprint=fingerprint,
            producer=self.producer,
            max_object_bytes=self.max_object_bytes,
        )


# -- model version ----------------------------------------------------------------------------------
def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling of ``EPD_DTYPE``)."""
    return str(dtype).removeprefix("torch.")


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local folder vLLM loaded ``model`` from: the path itself, or the Hugging Face cache
    snapshot of a hub name (looked up offline; nothing is downloaded)."""
    path = Path(model)
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any failure means: no local folder to version
        raise ValueError(f"MinioECConnector: cannot find a local folder for model {model!r}: {exc}") from exc


def vllm_encoder_fingerprint(model_config: Any) -> str:
    """The EC key version of the encoder outputs of the model vLLM loaded (see module docstring)."""
    model_dir = resolve_model_dir(str(model_config.model), getattr(model_config, "revision", None))
    return encoder_fingerprint(model_dir, dtype=dtype_name(model_config.dtype), engine=ENGINE_NAME)


# -- stats ------------------------------------------------------------------------------------------
# Stats are a flat dict (sent from the engine-core process to the front-end as plain data):
#   "lookup|<outcome>|<reason>": count   outcome in hit / miss / fallback / unavailable
#   "bytes|get" / "bytes|put": bytes     "count|<name>": count
#   "seconds|fetch" / "seconds|save": [latency samples]
@dataclasses.dataclass
class MinioECStats(ECConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, amount: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + amount

    def sample(self, key: str, value: float) -> None:
        samples = self.data.setdefault(key, [])
        if len(samples) < _MAX_LATENCY_SAMPLES:
            samples.append(value)

    def aggregate(self, other: ECConnectorStats) -> "MinioECStats":
        for key, value in (other.data or {}).items():
            if isinstance(value, list):
                room = _MAX_LATENCY_SAMPLES - len(self.data.setdefault(key, []))
                self.data[key].extend(value[:max(0, room)])
            else:
                self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in sorted(self.data.items()):
            name = key.replace("|", "_").rstrip("_")
            if isinstance(value, list):
                if value:
                    out[f"{name}_avg_ms"] = round(1e3 * sum(value) / len(value), 3)
                    out[f"{name}_n"] = len(value)
            else:
                out[name] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


class MinioECPromMetrics(ECConnectorPromMetrics):
    """``epd:ec_connector_*`` Prometheus metrics in the vLLM front-end process."""

    _lock = threading.Lock()
    _shared: dict[str, Any] = {}

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        with self._lock:  # one set per process, however many engines it creates
            if not self._shared:
                self._shared.update(
                    lookups=self._counter_cls(
                        "epd:ec_connector_lookups_total",
                        "EC connector lookups per request item: hit (loaded from the store), miss (not "
                        "stored), fallback (stored but unusable: encoded locally), unavailable (failed), "
                        "engine_cache (vLLM still had it).",
                        labelnames=names + ["outcome", "reason"],
                    ),
                    bytes=self._counter_cls(
                        "epd:ec_connector_bytes_total", "EC object bytes moved by the connector.",
                        labelnames=names + ["direction"],
                    ),
                    seconds=self._histogram_cls(
                        "epd:ec_connector_seconds",
                        "EC connector latency: fetch (existence check + GET + validation) and save.",
                        labelnames=names + ["op"],
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                    ),
                )
        self._metrics = self._shared

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, value in transfer_stats_data.items():
            parts = key.split("|")
            if parts[0] == "lookup" and len(parts) == 3:
                self._metrics["lookups"].labels(*base, parts[1], parts[2]).inc(value)
            elif parts[0] == "bytes" and len(parts) == 2:
                self._metrics["bytes"].labels(*base, parts[1]).inc(value)
            elif parts[0] == "seconds" and len(parts) == 2:
                for sample in value:
                    self._metrics["seconds"].labels(*base, parts[1]).observe(sample)


# -- scheduler -> worker metadata -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ECLoad:
    """A validated encoder output to put into the worker's encoder cache."""

    identifier: str
    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass
class MinioECMetadata(ECConnectorMetadata):
    loads: list[ECLoad] = dataclasses.field(default_factory=list)
    #: producer: items of the requests scheduled for the first time in this step
    save_candidates: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MinioECWorkerMetadata(ECConnectorWorkerMetadata):
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> "MinioECWorkerMetadata":
        merged = MinioECStats(data=dict(self.stats))
        merged.aggregate(MinioECStats(data=getattr(other, "stats", {}) or {}))
        return MinioECWorkerMetadata(stats=merged.data)


# -- scheduler-side state ---------------------------------------------------------------------------
@dataclasses.dataclass
class _Held:
    """A validated object held in the scheduler process."""

    obj: ECObject
    pinned_by: set[str] = dataclasses.field(default_factory=set)  # request ids told "ready"

    @property
    def nbytes(self) -> int:
        return len(self.obj.data)


@dataclasses.dataclass(frozen=True)
class _FetchResult:
    identifier: str
    obj: ECObject | None
    reason: MissReason | None
    existed: bool  # the existence check said yes (so a failure is a fallback, not a miss)
    seconds: float
    detail: str = ""


def _inherit_vllm_log_handlers() -> None:
    """In vLLM's spawned engine processes only vLLM's own logger has handlers: route this
    package's records there too, so connector logs show up next to vLLM's."""
    ours = logging.getLogger("shared")
    if logging.getLogger().handlers or ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


class MinioECConnector(ECConnectorBase):
    """vLLM EC connector over the epd-serve EC store (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        _inherit_vllm_log_handlers()
        ec_config = vllm_config.ec_transfer_config
        self.config = MinioECConfig.from_extra(ec_config.ec_connector_extra_config if ec_config else None)
        model_config = vllm_config.model_config
        self.fingerprint = vllm_encoder_fingerprint(model_config)
        self._store = self.config.make_store(self.fingerprint)
        if role == ECConnectorRole.SCHEDULER and self.is_producer:
            self._store.store.ensure_bucket()
        self._model_dtype = model_config.dtype
        self._embed_width = int(model_config.get_inputs_embeds_size())
        self._stats = MinioECStats()
        self._stats_lock = threading.Lock()
        # scheduler side (consumer)
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._inflight: dict[str, tuple[concurrent.futures.Future, float]] = {}
        self._waiters: dict[str, set[str]] = {}
        self._decided: dict[tuple[str, str], str] = {}  # (request id, identifier) -> "store" | "<outcome>:<reason>"
        self._results: dict[tuple[str, str], tuple[str, str]] = {}  # failed fetch -> (outcome, reason) per waiter
        self._exists: dict[str, tuple[bool, float]] = {}
        self._loads: dict[str, ECLoad] = {}
        self._sources: dict[str, dict[str, str]] = {}
        self._unavailable: set[str] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if role == ECConnectorRole.SCHEDULER and self.is_consumer:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.config.fetch_threads, thread_name_prefix="ec-prefetch"
            )
        # worker side
        self._device: Any = None
        log.info(
            "MinioECConnector %s (%s%s): store %s bucket %s, keys %s",
            role.name.lower(), "producer" if self.is_producer else "",
            "consumer" if self.is_consumer else "", self.config.endpoint if self.config.backend == "s3"
            else self.config.fs_root, self.config.bucket, self._store.key("<identifier>"),
        )

    # ============================== scheduler side ==============================================
    def has_cache_item(self, identifier: str) -> bool:
        """True iff validated bytes for ``identifier`` are held here (no network: vLLM commits
        the item as an external load in the same step)."""
        return self.is_consumer and identifier in self._held

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return True
        self._collect_finished_fetches()
        now = time.monotonic()
        pending = False
        rid = request.request_id
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already in the KV cache
            ident = feature.identifier
            if (rid, ident) in self._decided:
                continue
            result = self._results.pop((rid, ident), None)
            if result is not None:
                self._decide(request, feature, *result)
            elif not valid_identifier(ident):
                self._decide(request, feature, "miss", "bad_identifier")
            elif ident in self._held:
                self._admit_held(request, feature)
            elif ident in self._inflight:
                future, started = self._inflight[ident]
                if now - started > self.config.fetch_timeout_s:
                    self._decide(request, feature, "fallback", MissReason.TIMEOUT.value)
                else:
                    self._waiters.setdefault(ident, set()).add(rid)
                    pending = True
            else:
                known = self._exists.get(ident)
                fresh = known is not None and now - known[1] < self.config.exists_ttl_s
                if fresh and not known[0]:
                    self._decide(request, feature, "miss", MissReason.NOT_FOUND.value)
                else:
                    assert self._pool is not None
                    future = self._pool.submit(self._fetch, ident, bool(fresh and known[0]))
                    self._inflight[ident] = (future, now)
                    self._waiters.setdefault(ident, set()).add(rid)
                    pending = True
            if rid in self._unavailable:
                return False
        # (also when every item was decided in an earlier call: until vLLM takes the request
        # through take_unavailable_requests it must not be admitted without its input)
        return not pending and rid not in self._unavailable

    def _admit_held(self, request: "Request", feature: Any) -> None:
        ident = feature.identifier
        held = self._held[ident]
        want = feature.mm_position.get_num_embeds()
        if held.obj.shape[0] != want:
            # Another item under the same identifier (a reused uuid): never load it for this request.
            log.warning(
                "request %s: EC object %s has %d rows, the prompt has %d placeholders: encoding locally",
                request.request_id, ident, held.obj.shape[0], want,
            )
            if not held.pinned_by:
                self._held.pop(ident, None)
            self._decide(request, feature, "fallback", MissReason.SHAPE_MISMATCH.value)
            return
        held.pinned_by.add(request.request_id)
        self._held.move_to_end(ident)
        self._decided[(request.request_id, ident)] = "store"

    def _decide(self, request: "Request", feature: Any, outcome: str, reason: str) -> None:
        """The item will not come from the store: vLLM encodes it locally (its pixels are in the
        request); without local input the request is reported unavailable."""
        rid = request.request_id
        data = feature.data
        if data is None or all(getattr(elem, "data", None) is None for elem in data.values()):
            self._unavailable.add(rid)
            self._decided[(rid, feature.identifier)] = f"unavailable:{reason}"
            self._stats_add(f"lookup|unavailable|{reason}")
            log.error("request %s: no EC object for %s (%s) and no local input: failing it",
                      rid, feature.identifier, reason)
            return
        self._decided[(rid, feature.identifier)] = f"{outcome}:{reason}"
        self._stats_add(f"lookup|{outcome}|{reason}")
        if outcome == "fallback":
            log.warning("request %s: EC object %s unusable (%s): encoding locally", rid, feature.identifier, reason)

    def _fetch(self, identifier: str, known_to_exist: bool) -> _FetchResult:
        """Background thread: existence check (unless a fresh answer said yes), GET, validation."""
        started = time.perf_counter()
        existed = known_to_exist
        try:
            if not existed:
                existed = self._store.exists(identifier)
                if not existed:
                    return _FetchResult(identifier, None, MissReason.NOT_FOUND, False, time.perf_counter() - started)
            obj = self._load_item(identifier)
            if obj.shape[1] % self._embed_width:
                raise ECValidationError(
                    MissReason.SHAPE_MISMATCH, f"feature width {obj.shape[1]} vs the model's {self._embed_width}"
                )
            return _FetchResult(identifier, obj, None, True, time.perf_counter() - started)
        except ECValidationError as exc:
            return _FetchResult(identifier, None, exc.reason, existed, time.perf_counter() - started, exc.detail)
        except Exception as exc:  # noqa: BLE001 - a store outage is a fallback, never an engine crash
            return _FetchResult(identifier, None, MissReason.STORE_ERROR, existed, time.perf_counter() - started,
                                f"{type(exc).__name__}: {exc}")

    def _load_item(self, identifier: str) -> ECObject:
        """GET + validate one object (ECStore.load). A seam for tests that inject store faults."""
        return self._store.load(identifier)

    def _collect_finished_fetches(self) -> None:
        now = time.monotonic()
        for ident in [i for i, (f, _) in self._inflight.items() if f.done()]:
            future, _ = self._inflight.pop(ident)
            result: _FetchResult = future.result()
            waiters = self._waiters.pop(ident, set())
            self._stats_sample("seconds|fetch", result.seconds)
            if result.obj is not None:
                self._exists[ident] = (True, now)
                self._held[ident] = _Held(result.obj)
                self._held.move_to_end(ident)
                self._stats_add("bytes|get", len(result.obj.data))
                continue  # each waiter is admitted (shape-checked, pinned) on its next call
            self._exists[ident] = (result.existed, now)
            if result.existed:
                log.warning("EC object %s failed after the existence check said yes: %s %s",
                            ident, result.reason.value, result.detail)
            outcome = "fallback" if result.existed else "miss"
            for rid in waiters:  # decided on each waiter's next call, where its item is at hand
                self._results[(rid, ident)] = (outcome, result.reason.value)
        if len(self._exists) > 65536:  # bounded: drop stale answers
            cutoff = now - self.config.exists_ttl_s
            self._exists = {k: v for k, v in self._exists.items() if v[1] >= cutoff}

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        feature = request.mm_features[index]
        ident = feature.identifier
        rid = request.request_id
        if not self.is_consumer:
            return
        sources = self._sources.setdefault(rid, {})
        held = self._held.get(ident)
        if held is not None:
            self._loads[ident] = ECLoad(ident, held.obj.data, held.obj.dtype, held.obj.shape)
            held.pinned_by.discard(rid)
            sources[ident] = "store"
            self._stats_add("lookup|hit|")  # counted when vLLM really takes it from the store
        else:
            decided = self._decided.get((rid, ident), "miss:not_found")
            sources[ident] = "recomputed:" + decided.partition(":")[2]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        meta = MinioECMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        if self.is_producer:
            for new_req in scheduler_output.scheduled_new_reqs:
                for feature in new_req.mm_features or ():
                    meta.save_candidates.append(feature.identifier)
        self._evict()
        return meta

    def _evict(self) -> None:
        total = sum(h.nbytes for h in self._held.values())
        for ident in list(self._held):
            if total <= self.config.local_cache_bytes:
                break
            held = self._held[ident]
            if not held.pinned_by:
                total -= held.nbytes
                del self._held[ident]

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, MinioECWorkerMetadata) and meta.stats:
            with self._stats_lock:
                self._stats.aggregate(MinioECStats(data=meta.stats))

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for feature in request.mm_features:
            self._decided.pop((rid, feature.identifier), None)
            self._results.pop((rid, feature.identifier), None)
            held = self._held.get(feature.identifier)
            if held is not None:
                held.pinned_by.discard(rid)
            waiters = self._waiters.get(feature.identifier)
            if waiters is not None:
                waiters.discard(rid)
        self._unavailable.discard(rid)
        params: dict[str, Any] = {}
        if self.is_consumer:
            sources = self._sources.pop(rid, {})
            for feature in request.mm_features:
                if feature.identifier not in sources:  # vLLM had it (encoder or prefix cache)
                    sources[feature.identifier] = "engine_cache"
                    self._stats_add("lookup|engine_cache|")
            if sources:
                params[PARAMS_SOURCES] = sources
        if self.is_producer and request.mm_features:
            params[PARAMS_ITEMS] = {
                f.identifier: {"key": self._store.key(f.identifier), "n_tokens": f.mm_position.get_num_embeds()}
                for f in request.mm_features
                if valid_identifier(f.identifier)
            }
        return False, (params or None)

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, MinioECStats()
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return MinioECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MinioECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ============================== worker side =================================================
    def _target_device(self) -> Any:
        if self._device is None:
            from vllm.platforms import current_platform

            device = current_platform.device_type
            if current_platform.is_cuda_alike():
                device = f"{device}:{current_platform.current_device()}"
            self._device = torch.device(device)
        return self._device

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, MinioECMetadata):
            return
        for load in meta.loads:
            if load.identifier in encoder_cache:
                continue
            tensor = raw_to_tensor(load.data, load.dtype, load.shape)
            encoder_cache[load.identifier] = tensor.to(device=self._target_device(), dtype=self._model_dtype)
            self._stats_add("count|loads")

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self.is_producer and mm_hash in encoder_cache:
            self._save(mm_hash, encoder_cache[mm_hash])

    def start_save_caches(self, **kwargs: Any) -> None:
        """Items of newly scheduled requests that vLLM already holds in its encoder cache are not
        encoded again, so ``save_caches`` will not fire for them: store them if the store lost them."""
        if not self.is_producer:
            return
        encoder_cache = kwargs.get("encoder_cache")
        meta = self._get_connector_metadata()
        if not encoder_cache or not isinstance(meta, MinioECMetadata):
            return
        for ident in dict.fromkeys(meta.save_candidates):
            if ident in encoder_cache and valid_identifier(ident):
                try:
                    stored = self._store.exists(ident)
                except Exception as exc:  # noqa: BLE001
                    log.warning("EC existence check of %s failed: %s", ident, exc)
                    stored = False
                if not stored:
                    self._save(ident, encoder_cache[ident])

    def _save(self, identifier: str, tensor: torch.Tensor) -> None:
        if not valid_identifier(identifier):
            log.warning("not storing encoder output: identifier %r cannot be an EC key", identifier[:80])
            self._stats_add("count|save_skipped")
            return
        started = time.perf_counter()
        try:
            raw, dtype, shape = tensor_to_raw(tensor)
            key, nbytes = self._store.save(identifier, raw, dtype=dtype, shape=shape, extra={"engine": ENGINE_NAME})
        except Exception as exc:  # noqa: BLE001 - a failed save must not crash the engine
            self._stats_add("count|save_failures")
            log.error("EC save of %s failed: %s: %s", identifier, type(exc).__name__, exc)
            return
        seconds = time.perf_counter() - started
        self._stats_add("bytes|put", nbytes)
        self._stats_sample("seconds|save", seconds)
        # INFO per item: vLLM 0.32 drops a producer's worker-side stats (see the module docstring).
        log.info("EC saved %s (%d bytes) in %.1f ms", key, nbytes, seconds * 1e3)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, MinioECStats()
        return MinioECWorkerMetadata(stats=stats.data)

    # ============================== helpers =====================================================
    def _stats_add(self, key: str, amount: float = 1) -> None:
        with self._stats_lock:
            self._stats.add(key, amount)

    def _stats_sample(self, key: str, value: float) -> None:
        with self._stats_lock:
            self._stats.sample(key, value)

