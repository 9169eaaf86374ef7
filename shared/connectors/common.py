"""What both vLLM connectors (:mod:`shared.connectors.s3_ec`, :mod:`shared.connectors.s3_kv`)
share: their extra-config parsing, the store they build from it, the model identity (and its
fingerprints) of the folder vLLM loaded, and log routing in vLLM's processes.

No vLLM or torch import: the vLLM engine computes the same fingerprints through this module.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from shared.config import (
    S3_ACCESS_KEY_ENV,
    S3_SECRET_KEY_ENV,
    EngineKind,
    NatsSettings,
    StoreBackend,
    StoreSettings,
    env_var,
    no_separators,
)
from shared.identity import ModelIdentity
from shared.store.ec import ECStore
from shared.store.factory import open_stores
from shared.store.kv import KVStore

#: the ``engine`` part of every fingerprint the connectors compute
ENGINE_NAME = EngineKind.VLLM


# -- configuration --------------------------------------------------------------------------------
#: keys of hand-written extra configs from before the store settings group (docs/vllm.md then):
#: each names a :class:`StoreSettings` field (``max_object_bytes``: both object bounds)
LEGACY_STORE_KEYS = {
    "endpoint": ("s3_endpoint",),
    "bucket": ("s3_bucket",),
    "secure": ("s3_secure",),
    "region": ("s3_region",),
    "backend": ("store_backend",),
    "fs_root": ("store_fs_root",),
    "max_object_bytes": ("max_ec_object_bytes", "max_kv_object_bytes"),
}
#: the store settings an extra config may carry: the group's fields but its credentials
STORE_KEYS = tuple(name for name in StoreSettings.model_fields if name not in StoreSettings.SECRET_FIELDS)


class ConnectorConfig(BaseModel):
    """``ec_connector_extra_config`` of :class:`~shared.connectors.s3_ec.S3ECConnector` and
    ``kv_connector_extra_config`` of :class:`~shared.connectors.s3_kv.S3KVConnector` (same keys):
    the store settings group's dump (:meth:`StoreSettings.connector_dump`, validated back with
    :class:`StoreSettings`) plus the connector's own keys below.

    Credentials are never in the config: ``access_key_env`` / ``secret_key_env`` name the
    environment variables that hold them (read once, in each vLLM process, never logged).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: where the store is and the object bounds (the EC connector reads ``max_ec_object_bytes``,
    #: the KV connector ``max_kv_object_bytes``); what the extra config does not set is the default
    store: StoreSettings = Field(default_factory=lambda: StoreSettings.from_dump({}))
    access_key_env: str = S3_ACCESS_KEY_ENV
    secret_key_env: str = S3_SECRET_KEY_ENV
    #: how long an existence-check answer (HEAD) is reused
    exists_ttl_s: float = Field(2.0, ge=0)
    #: a prefetch still running after this long is given up: the item (prompt) is computed locally
    fetch_timeout_s: float = Field(30.0, ge=0)
    fetch_threads: int = Field(4, ge=1)
    #: validated objects kept in the scheduler process after use (LRU), so a repeated item is
    #: not fetched again; objects waiting for their request are held regardless
    local_cache_bytes: int = Field(256 * 1024**2, ge=0)
    #: written into each object's metadata (default: vllm-<host>-<pid>)
    producer_id: str = ""
    #: the deployment's NATS (EC connector: invalidations, use records; "": none) and subject prefix;
    #: ``nats_user_env`` / ``nats_password_env`` name the variables with its credentials (unset: none)
    nats_url: str = ""
    subject_prefix: str = "epd"
    nats_user_env: str = env_var("nats_user")
    nats_password_env: str = env_var("nats_password")
    #: replicas of the EC index bucket, should the connector be the one creating it (the
    #: deployment's ``EPD_STREAM_REPLICAS``), and the client's pings (``EPD_NATS_PING_INTERVAL_S``,
    #: ``EPD_NATS_MAX_OUTSTANDING_PINGS``): a stalled server is left for another seed
    stream_replicas: int = Field(1, ge=1, le=5)
    nats_ping_interval_s: float = Field(2.0, gt=0)
    nats_max_outstanding_pings: int = Field(2, ge=1)
    #: TLS to that NATS (the deployment's ``EPD_NATS_TLS_CA`` / ``_CERT`` / ``_KEY``, absolute paths)
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None

    _check_prefix = field_validator("subject_prefix")(no_separators)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, section: str = "ec_connector_extra_config") -> ConnectorConfig:
        """Parse and check a connector's extra config (``section`` names it in error messages)."""
        values = dict(extra or {})
        store: dict[str, Any] = {}
        for key in list(values):
            for name in LEGACY_STORE_KEYS.get(key, (key,)):
                if name in STORE_KEYS:
                    store.setdefault(name, values[key])
            if key in LEGACY_STORE_KEYS or key in STORE_KEYS:
                del values[key]
        own = set(cls.model_fields) - {"store"}
        unknown = sorted(set(values) - own)
        if unknown:
            raise ValueError(f"unknown {section} key(s) {unknown}; known: {sorted(own | set(STORE_KEYS))}")
        try:
            config = cls(store=StoreSettings.from_dump(store), **values)
        except ValidationError as exc:
            raise ValueError(f"invalid {section}: {exc}") from None
        if config.store.store_backend is StoreBackend.FS and "store_fs_root" not in store:
            raise ValueError(f"{section}.store_fs_root is required with store_backend 'fs'")
        return config

    @property
    def producer(self) -> str:
        return self.producer_id or f"vllm-{socket.gethostname()}-{os.getpid()}"

    @property
    def location(self) -> str:
        """Where the store is, for logs."""
        store = self.store
        return (
            f"{store.s3_endpoint} bucket {store.s3_bucket}"
            if store.store_backend is StoreBackend.S3
            else str(store.store_fs_root)
        )

    def store_with_credentials(self) -> StoreSettings:
        """The store group with the S3 credentials read from the named env vars (``fs``: none needed)."""
        if self.store.store_backend is StoreBackend.FS:
            return self.store
        access_key = os.environ.get(self.access_key_env, "")
        secret_key = os.environ.get(self.secret_key_env, "")
        if not access_key or not secret_key:
            raise ValueError(
                f"epd-serve vLLM connector: set the S3 credentials in ${self.access_key_env} and "
                f"${self.secret_key_env} (names from the connector's extra config access_key_env / "
                "secret_key_env)"
            )
        return self.store.model_copy(
            update={"s3_access_key": SecretStr(access_key), "s3_secret_key": SecretStr(secret_key)}
        )

    def nats_credentials(self) -> tuple[str | None, str | None]:
        """NATS user and password from the named env vars (None, None: no authentication)."""
        return os.environ.get(self.nats_user_env) or None, os.environ.get(self.nats_password_env) or None

    def nats_tls_options(self) -> dict[str, Any]:
        """nats-py's TLS options for ``nats_url`` (``NatsSettings.tls_options``: TLS from the first
        byte, verified against ``nats_tls_ca``; empty: plaintext)."""
        return NatsSettings(
            nats_url=self.nats_url or "nats://127.0.0.1:4222",
            nats_tls_ca=self.nats_tls_ca,
            nats_tls_cert=self.nats_tls_cert,
            nats_tls_key=self.nats_tls_key,
        ).tls_options()

    def ec_store(self, fingerprint: str) -> ECStore:
        """The EC store of an encoder fingerprint."""
        return open_stores(self.store_with_credentials(), producer=self.producer, ec_fingerprint=fingerprint).ec_store()

    def kv_store(self, fingerprint: str) -> KVStore:
        """The KV store of a model fingerprint."""
        return open_stores(self.store_with_credentials(), producer=self.producer, kv_fingerprint=fingerprint).kv_store()


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
