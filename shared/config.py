"""Typed settings, one class per service, read from ``EPD_*`` environment variables.

Each service builds its settings once in ``main()`` and passes them down; nothing below reads
the environment. Secrets are ``SecretStr`` so they never show up in reprs or logs.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.topology import PREFILL_SERVICE_ROLES, Role, Topology


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


CSV = Annotated[tuple[str, ...], NoDecode]


def _shown(value: object) -> object:
    """A value for an error message: an enum member as its plain value."""
    return str(value) if isinstance(value, str) else value


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class CommonSettings(BaseSettings):
    """Settings every service shares: where NATS and the store are, which model, stream limits."""

    # env_ignore_empty: an empty variable means "use the default", so docker-compose.yml can pass
    # every setting through as ${EPD_X:-} and the defaults stay defined here only.
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore", frozen=True, env_ignore_empty=True)

    # NATS / JetStream
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    subject_prefix: str = "epd"
    stream_max_age_s: float = Field(24 * 3600, gt=0, description="how long streams keep messages (replay window)")
    stream_max_bytes: int = Field(1024**3, gt=0, description="size cap per stream")
    dup_window_s: float = Field(120, gt=0, description="JetStream de-duplication window (<= max age)")
    ack_wait_s: float = Field(30, gt=0)
    max_deliver: int = Field(3, ge=1)
    stream_replicas: int = Field(1, ge=1, le=5, description="JetStream replicas per stream (3 on a NATS cluster)")

    # Object store (MinIO / any S3)
    store_backend: str = "s3"
    s3_endpoint: str = "127.0.0.1:9000"
    s3_access_key: SecretStr = SecretStr("minioadmin")
    s3_secret_key: SecretStr = SecretStr("minioadmin")
    s3_secure: bool = False
    s3_region: str | None = None
    s3_bucket: str = "epd"
    store_fs_root: Path = Path("var/store")
    namespace: str = "epd"
    max_ec_object_bytes: int = Field(512 * 1024**2, gt=0)
    max_kv_object_bytes: int = Field(1024**3, gt=0, description="largest KV object written or read (E|P|D)")
    max_image_bytes: int = Field(20 * 1024**2, gt=0, description="per image, encoded")
    max_image_pixels: int = Field(40_000_000, gt=0, description="per image, width x height")

    # Model / engine
    model_path: Path | None = None
    model_name: str | None = None
    engine: str = "transformers"
    dtype: str = "float32"
    torch_threads: int = Field(1, ge=1, description="same value in every stage for bit-identical output")
    #: CPUs a worker binds itself to (Linux list syntax, e.g. ``0-1``; unset = all), vLLM's engine
    #: processes too (``shared.cpus``): give the encoder and the PD worker disjoint lists on one host.
    cpu_cores: str | None = Field(None, description="CPU ids this worker runs on, e.g. 0-1 (unset: all)")
    # vLLM engine (EPD_ENGINE=vllm): its caches, compile artefacts and IPC sockets go under vllm_dir.
    vllm_dir: Path = Path("var/vllm")
    vllm_enforce_eager: bool = Field(True, description="no torch.compile / CUDA graphs (fast start on CPU)")
    vllm_max_model_len: int | None = Field(None, ge=16)
    vllm_kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size of a generating vLLM engine")
    vllm_max_num_seqs: int = Field(16, ge=1, description="requests a vLLM engine batches together")
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict, description="more vLLM engine args (JSON)")

    worker_id: str = Field(default_factory=default_worker_id)
    log_level: str = "INFO"
    #: "text" (one line, ``[request_id=...]``) or "json" (one JSON object per line, for log shippers).
    log_format: str = Field("text", pattern="^(text|json)$")
    metrics_port: int | None = None
    # Workers: heartbeat file refreshed while connected and consuming (``epd healthcheck``).
    health_file: Path | None = None
    unreachable_exit_s: float = Field(60, gt=0, description="a worker that cannot reach its consumer this long "
                                                           "exits (code 3) for its supervisor to restart it")

    # EC store lifecycle (shared.store.ec_index, shared.store.janitor). The janitor runs in the API
    # processes (one at a time: a lease) when a bound or a TTL is set; every process records uses.
    ec_max_bytes: int | None = Field(None, gt=0, description="bound of the EC namespace in bytes (LRU eviction)")
    ec_max_objects: int | None = Field(None, gt=0, description="bound of the EC namespace in objects")
    ec_ttl_s: float | None = Field(None, gt=0, description="EC objects unused this long are deleted")
    ec_purge_retired_after_s: float | None = Field(
        None, ge=0, description="purge the EC objects of a fingerprint no worker served for this long")
    ec_retired_after_s: float = Field(600, gt=0, description="a fingerprint no worker heartbeats for this long "
                                                             "is retired")
    ec_janitor_interval_s: float = Field(15, gt=0, description="seconds between janitor passes")
    ec_evict_grace_s: float = Field(60, ge=0, description="objects created or used this recently are never "
                                                          "evicted for a bound (requests in flight)")
    ec_reconcile_interval_s: float = Field(300, gt=0, description="the janitor lists the store this often to "
                                                                  "index objects nobody announced")
    ec_use_flush_s: float = Field(2.0, gt=0, description="uses of EC objects are written to the index in "
                                                         "batches this often")
    ec_lifecycle_rule: bool = Field(True, description="with EPD_EC_TTL_S, also set an S3 lifecycle expiration "
                                                      "rule on the namespace (a backstop)")

    @field_validator("namespace", "subject_prefix")
    @classmethod
    def _no_separators(cls, v: str) -> str:
        if not v or any(c in v for c in "/.*> "):
            raise ValueError("must be non-empty and contain no '/', '.', '*', '>' or spaces")
        return v

    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model_path is not None:
            return Path(self.model_path).name
        return "epd-model"

    def require_model_path(self) -> Path:
        if self.model_path is None:
            raise ValueError("EPD_MODEL_PATH is not set (a local model folder)")
        path = Path(self.model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"EPD_MODEL_PATH={path} is not a model folder (no config.json)")
        return path


class ApiSettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: CSV = ()
    #: With API keys set, /metrics asks for a key too unless this is on (a scraper on a private network).
    metrics_public: bool = False
    request_timeout_s: float = Field(300, gt=0, description="deadline for a whole request")
    max_body_bytes: int = Field(64 * 1024**2, gt=0)
    max_images_per_request: int = Field(8, ge=0)
    max_tokens_limit: int = Field(4096, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    fetch_timeout_s: float = Field(10, gt=0)
    url_allow_networks: CSV = ()
    url_allow_hosts: CSV = ()
    #: Pixels the API process decodes at once, all requests together (memory: ~4 bytes a pixel);
    #: unset = room for two images of ``max_image_pixels``. A larger image still decodes, alone.
    decode_pixel_budget: int | None = Field(None, ge=1, description="pixels decoded at once in the API process")
    worker_stale_s: float = Field(10, gt=0, description="a worker is gone after this long without a heartbeat")
    #: Deployment shape. The API reads only ``TOPOLOGIES[topology].uses_encoder``: without
    #: encoder workers (agg) it queues no encode jobs. e-pd / e-p-d differ in the workers only.
    topology: Topology = Topology.E_PD

    @field_validator("topology", mode="before")
    @classmethod
    def _known_topology(cls, v: object) -> object:
        if v not in tuple(Topology):
            raise ValueError(f"unknown topology {_shown(v)!r}; supported: {', '.join(Topology)}")
        return v

    _split = field_validator("api_keys", "url_allow_networks", "url_allow_hosts", mode="before")(_split_csv)

    def decode_budget_pixels(self) -> int:
        """The decode budget in effect: ``decode_pixel_budget``, or two images of the largest size."""
        return self.decode_pixel_budget or 2 * self.max_image_pixels


class EncoderSettings(CommonSettings):
    batch_size: int = Field(4, ge=1, description="encode jobs fetched per pull")
    encode_jobs_in_flight: int | None = Field(None, ge=1, description="encode jobs an encoder worker holds at once "
                                              "(unset: the engine's batch, 16 by default; their "
                                              "encodes share forwards, within the pixel budget)")
    encode_pixel_budget: int = Field(16_000_000, ge=1, description="image pixels an encoder worker holds decoded at "
                                                                   "once; a larger image goes alone")


class PrefillSettings(CommonSettings):
    #: One of ``PREFILL_SERVICE_ROLES``: pd (E|PD), prefill (E|P|D), agg (baseline); see :class:`Role`.
    role: Role = Role.PD
    ec_wait_s: float = Field(30, ge=0, description="wait this long for an encoder before encoding locally")
    max_concurrent_jobs: int | None = Field(None, ge=1, description="jobs in the engine at once; unset = the "
                                            "engine's own batch (vLLM max_num_seqs, transformers decode batch 16)")
    max_waiting_jobs: int = Field(64, ge=0, description="jobs held while they wait for image features (they take "
                                                        "no engine slot)")
    local_cache_bytes: int = Field(512 * 1024**2, ge=0)

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, v: object) -> object:
        if v not in PREFILL_SERVICE_ROLES:
            raise ValueError(f"unknown prefill role {_shown(v)!r}; supported: {', '.join(PREFILL_SERVICE_ROLES)}")
        return v


class DecodeSettings(CommonSettings):
    """Decode workers (E|P|D): pull decode jobs, load KV objects, batch decode steps."""

    max_batch_size: int = Field(16, ge=1, description="requests decoded together (one forward per step)")
    max_reprefills: int = Field(2, ge=0, description="re-prefills of one request after unusable KV objects")
    kv_ttl_s: float = Field(3600, gt=0, description="KV objects older than this are swept")
    kv_sweep_interval_s: float = Field(300, ge=0, description="0 = no sweeping from this worker")
