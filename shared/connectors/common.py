"""What both vLLM connectors (:mod:`shared.connectors.s3_ec`, :mod:`shared.connectors.s3_kv`)
share: their extra-config parsing, the store they build from it, the model identity (and its
fingerprints) of the folder vLLM loaded, and log routing in vLLM's processes.

No vLLM or torch import: the vLLM engine computes the same fingerprints through this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.identity import ModelIdentity
from shared.store.ec import ECStore
from shared.store.kv import KVStore
from shared.store.objects import ObjectStore, make_object_store

#: the ``engine`` part of every fingerprint the connectors compute
ENGINE_NAME = "vllm"


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
class ConnectorConfig:
    """``ec_connector_extra_config`` of :class:`~shared.connectors.s3_ec.S3ECConnector` and
    ``kv_connector_extra_config`` of :class:`~shared.connectors.s3_kv.S3KVConnector` (same store,
    same keys).

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
    #: largest object a connector writes or reads
    max_object_bytes: int = 512 * 1024**2
    #: how long an existence-check answer (HEAD) is reused
    exists_ttl_s: float = 2.0
    #: a prefetch still running after this long is given up: the item (prompt) is computed locally
    fetch_timeout_s: float = 30.0
    fetch_threads: int = 4
    #: validated objects kept in the scheduler process after use (LRU), so a repeated item is
    #: not fetched again; objects waiting for their request are held regardless
    local_cache_bytes: int = 256 * 1024**2
    #: written into each object's metadata (default: vllm-<host>-<pid>)
    producer_id: str = ""
    #: the deployment's NATS (EC connector: invalidations, use records; "": none) and subject prefix;
    #: ``nats_user_env`` / ``nats_password_env`` name the variables with its credentials (unset: none)
    nats_url: str = ""
    subject_prefix: str = "epd"
    nats_user_env: str = "EPD_NATS_USER"
    nats_password_env: str = "EPD_NATS_PASSWORD"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, section: str = "ec_connector_extra_config") -> ConnectorConfig:
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
            raise ValueError(
                f"{section}.namespace {config.namespace!r} must be non-empty "
                "and contain no '/', '.', '*', '>' or spaces"
            )
        if not config.subject_prefix or any(c in config.subject_prefix for c in "/.*> "):
            raise ValueError(
                f"{section}.subject_prefix {config.subject_prefix!r} must be non-empty "
                "and contain no '/', '.', '*', '>' or spaces"
            )
        if config.backend not in ("s3", "fs"):
            raise ValueError(f"{section}.backend must be 's3' or 'fs', got {config.backend!r}")
        if config.backend == "fs" and not config.fs_root:
            raise ValueError(f"{section}.fs_root is required with backend 'fs'")
        return config

    @property
    def producer(self) -> str:
        return self.producer_id or f"vllm-{socket.gethostname()}-{os.getpid()}"

    @property
    def location(self) -> str:
        """Where the store is, for logs."""
        return f"{self.endpoint} bucket {self.bucket}" if self.backend == "s3" else self.fs_root

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
            "s3",
            endpoint=self.endpoint,
            access_key=access_key,
            secret_key=secret_key,
            bucket=self.bucket,
            secure=self.secure,
            region=self.region,
        )

    def nats_credentials(self) -> tuple[str | None, str | None]:
        """NATS user and password from the named env vars (None, None: no authentication)."""
        return os.environ.get(self.nats_user_env) or None, os.environ.get(self.nats_password_env) or None

    def ec_store(self, fingerprint: str) -> ECStore:
        """The EC store of an encoder fingerprint."""
        return ECStore(
            self.object_store(),
            namespace=self.namespace,
            fingerprint=fingerprint,
            producer=self.producer,
            max_object_bytes=self.max_object_bytes,
        )

    def kv_store(self, fingerprint: str) -> KVStore:
        """The KV store of a model fingerprint."""
        return KVStore(
            self.object_store(),
            namespace=self.namespace,
            fingerprint=fingerprint,
            producer=self.producer,
            max_object_bytes=self.max_object_bytes,
        )


# -- model version --------------------------------------------------------------------------------
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
    except Exception as exc:  # any failure means: no local folder to version
        raise ValueError(f"epd-serve vLLM connector: cannot find a local folder for model {model!r}: {exc}") from exc


def vllm_identity(model_config: Any, served_name: str | None = None) -> ModelIdentity:
    """The identity of the model vLLM loaded (``vllm_config.model_config``): its local folder, its
    dtype, engine ``vllm``; ``served_name`` (default: vLLM's served model name). The vLLM engine and
    both connectors build it with this one function, so the versions agree on both sides. vLLM's
    mm_hash does not know the model version; the fingerprints do, so a store shared by two model
    versions never serves one's outputs to the other."""
    model_dir = resolve_model_dir(str(model_config.model), getattr(model_config, "revision", None))
    name = served_name or str(getattr(model_config, "served_model_name", None) or model_config.model)
    return ModelIdentity(model=name, model_path=model_dir, dtype=dtype_name(model_config.dtype), engine=ENGINE_NAME)


def vllm_encoder_fingerprint(model_config: Any) -> str:
    """The EC key version of the encoder outputs of the model vLLM loaded."""
    return vllm_identity(model_config).fingerprint


def vllm_model_fingerprint(model_config: Any) -> str:
    """The KV key version of the model vLLM loaded (same function the epd-serve workers use)."""
    return vllm_identity(model_config).model_fingerprint


# -- logs -----------------------------------------------------------------------------------------
def inherit_vllm_log_handlers() -> None:
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
