"""Typed settings read from ``EPD_*`` environment variables: per-concern groups, composed per service.

A group is one concern (NATS, the object store, the model, the engine, media limits, the EC janitor)
and reads its own variables; each service's settings class holds only the groups it needs
(the API has no vLLM knobs, a worker no janitor knobs) plus its own fields. The variable
names are flat and stable: every field reads ``EPD_<FIELD NAME>`` (``NatsSettings.nats_url`` reads
``EPD_NATS_URL``), whichever group it is in.

Each service builds its settings once in ``main()`` and passes them (or the group a function needs)
down; nothing below reads the environment. Secrets are ``SecretStr`` so they never show up in reprs
or logs. ``ApiSettings(nats_url=...)`` (flat keyword arguments, as tests and tools write them) hands
each argument to the group that owns it; the rest comes from the environment.

Each setting is documented by the docstring under it (``Field`` carries only its constraints): that
text is its row of docs/configuration.md and its line of .env.example (``epd config docs``).
"""

from __future__ import annotations

import enum
import socket
import ssl
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, NamedTuple

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from shared.logs import LogFormat
from shared.topology import PREFILL_SERVICE_ROLES, Role, Topology

#: every setting reads the variable ENV_PREFIX + its field name in upper case
ENV_PREFIX = "EPD_"


def env_var(field: str) -> str:
    """The environment variable of the setting ``field`` (``s3_access_key`` -> ``EPD_S3_ACCESS_KEY``)."""
    return ENV_PREFIX + field.upper()


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


CSV = Annotated[tuple[str, ...], NoDecode]


def _shown(value: object) -> object:
    """A value for an error message: an enum member as its plain value."""
    return str(value) if isinstance(value, str) else value


# Closed sets of values a setting takes (StrEnum, as ``Role`` and ``Topology``: a member is its value
# in env variables, fingerprints and log lines). ``LogFormat`` is ``shared.logs``' own.
class EngineKind(enum.StrEnum):
    """The model engines (``EPD_ENGINE``); ``shared.engines.ENGINES`` maps each to its class."""

    TRANSFORMERS = "transformers"
    VLLM = "vllm"


class StoreBackend(enum.StrEnum):
    """Where the object store keeps its objects (``EPD_STORE_BACKEND``)."""

    #: MinIO or any S3 server
    S3 = "s3"
    #: a local folder (``EPD_STORE_FS_ROOT``)
    FS = "fs"


class RoutingMode(enum.StrEnum):
    """Where the API sends generation jobs (``EPD_ROUTING``; ``shared.routing``)."""

    #: a request with images to the generating worker that holds them, weighed against load
    AFFINITY = "affinity"
    #: every job on the shared queue: whichever worker is free takes it
    SHARED = "shared"


def one_of(kind: type[enum.StrEnum], what: str) -> Callable[[object], object]:
    """A before-validator of a setting that takes a value of ``kind``: anything else is refused with
    the values it may take (``unknown engine 'onnx'; supported: transformers, vllm``)."""

    def check(v: object) -> object:
        if v not in tuple(kind):
            raise ValueError(f"unknown {what} {_shown(v)!r}; supported: {', '.join(kind)}")
        return v

    return check


def no_separators(v: str) -> str:
    """A subject prefix or key namespace: non-empty, none of NATS' or the store's separators."""
    if not v or any(c in v for c in "/.*> "):
        raise ValueError("must be non-empty and contain no '/', '.', '*', '>' or spaces")
    return v


#: What a deployment's stop grace period adds to ``EPD_DRAIN_S``: the process's own shutdown after
#: its drain (closing the engine, the NATS connection) before the orchestrator's SIGKILL.
GRACE_MARGIN_S = 15


def grace_period_s(drain_s: float) -> int:
    """The stop grace period a deployment gives a process draining for ``drain_s`` (Compose's
    ``stop_grace_period``, Kubernetes' ``terminationGracePeriodSeconds``), whole seconds."""
    return int(-(-drain_s // 1)) + GRACE_MARGIN_S


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


# env_ignore_empty: an empty variable means "use the default", so docker-compose.yml can pass
# every setting through as ${EPD_X:-} and the defaults stay defined here only.
_ENV_CONFIG = SettingsConfigDict(
    env_prefix=ENV_PREFIX, extra="ignore", frozen=True, env_ignore_empty=True, use_attribute_docstrings=True
)


#: settings that are no longer read -> why: a worker that finds one set says so when it starts
#: (a variable left in a deployment is never silently ignored)
RETIRED_SETTINGS: dict[str, str] = {
    "EPD_BATCH_SIZE": "workers pull one job per pull request (nats-py's pull of several could hold a job "
    "that had arrived until an earlier, orphaned pull request expired, up to 1 s)",
    "EPD_VLLM_MAX_MODEL_LEN": "renamed EPD_MAX_MODEL_LEN (both engines and the API honour it)",
}


def retired_settings_in(environ: Mapping[str, str]) -> list[str]:
    """A line for each retired setting set (non-empty) in ``environ``: its name and why it went."""
    return [f"{name} is no longer read: {why}" for name, why in RETIRED_SETTINGS.items() if environ.get(name)]


class SettingsGroup(BaseSettings):
    """One concern's settings, read from ``EPD_<FIELD>`` variables (constructing one reads the environment)."""

    model_config = _ENV_CONFIG


# -- groups -----------------------------------------------------------------------------------------
class NatsSettings(SettingsGroup):
    """Where NATS is and the JetStream limits of the deployment's streams and consumers."""

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL; a comma-separated list seeds a cluster (any member works)."""
    nats_user: str | None = None
    """NATS user name (unset: no authentication)."""
    nats_password: SecretStr | None = None
    """NATS password (never logged)."""
    nats_tls_ca: Path | None = None
    """CA certificate file the NATS servers' certificates are verified against: TLS on the
    connection, from its first byte (`epd certs` writes a development one; unset: plaintext, or the
    system CAs for a `tls://` URL). The server's `tls` block needs `handshake_first: true`
    (nats-server 2.10.4+): a client that waited for the server's word that TLS is required would
    send its credentials in the clear to a server, or a man in the middle, that does not say so."""
    nats_tls_cert: Path | None = None
    """Client certificate file presented to NATS (mutual TLS; with `EPD_NATS_TLS_KEY`)."""
    nats_tls_key: Path | None = None
    """The client certificate's private key file."""
    subject_prefix: str = "epd"
    """Prefix of every subject and stream (one per deployment)."""
    stream_max_age_s: float = Field(24 * 3600, gt=0)
    """How long streams keep messages (replay window)"""
    stream_max_bytes: int = Field(1024**3, gt=0)
    """Size cap per stream (replay window)"""
    dup_window_s: float = Field(120, gt=0)
    """JetStream de-duplication window (<= max age)"""
    ack_wait_s: float = Field(4, gt=0)
    """Seconds before JetStream redelivers a job its worker has not acknowledged: a dead worker's job
    goes to another worker this long after its last sign of life. A running job's worker sends
    `in_progress` 4 times per ack wait, so a live one keeps its job unless its event loop is stalled
    for 3/4 of it (raise it where workers are starved for seconds)."""
    max_deliver: int = Field(3, ge=1)
    """Deliveries of a job before it ends with an error (502 `worker_failed`)."""
    stream_replicas: int = Field(1, ge=1, le=5)
    """JetStream replicas of every stream, consumer and KV bucket (3 on a 3- or 5-server NATS
    cluster; at most the cluster size: start-up refuses more)."""
    nats_ping_interval_s: float = Field(1.0, gt=0)
    """Seconds between the client's pings to its NATS server (a ping is a few bytes; the server
    answers it itself)."""
    nats_max_outstanding_pings: int = Field(2, ge=1)
    """Unanswered pings after which the client leaves its server (stalled) for another seed:
    a stall is noticed within about (this + 1) x `EPD_NATS_PING_INTERVAL_S`."""
    publish_retry_s: float = Field(10.0, ge=0)
    """How long a worker retries a deduplicated publish (a job, a final result) while JetStream
    has no leader (an election); the API retries a request's job until the request's deadline."""
    publish_try_s: float = Field(1.0, gt=0)
    """How long one try of a publish that is safe to repeat (a job, a final result, a token chunk)
    waits for JetStream's acknowledgement before it is sent again: a try lost to a stalled NATS
    server or a stream leader stepping down holds its request this long once the cluster serves
    again. A publish that is not safe to repeat waits 5 s, once."""

    _check_prefix = field_validator("subject_prefix")(no_separators)

    @model_validator(mode="after")
    def _client_cert_and_key(self) -> NatsSettings:
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("EPD_NATS_TLS_CERT and EPD_NATS_TLS_KEY go together (a client certificate and its key)")
        return self

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context of a connection to NATS (None: plaintext): the server verified against
        ``nats_tls_ca`` (the system CAs for a ``tls://`` URL without one), the client certificate
        presented when set."""
        if self.nats_tls_ca is None and self.nats_tls_cert is None and "tls://" not in self.nats_url:
            return None
        ctx = ssl.create_default_context(cafile=str(self.nats_tls_ca) if self.nats_tls_ca else None)
        if self.nats_tls_cert is not None and self.nats_tls_key is not None:
            ctx.load_cert_chain(str(self.nats_tls_cert), str(self.nats_tls_key))
        return ctx

    def tls_options(self) -> dict[str, Any]:
        """nats-py's connect options for :meth:`tls_context`: TLS from the first byte
        (``tls_handshake_first``; nats-py would otherwise start in plaintext and upgrade only when
        the server's INFO says ``tls_required`` - a plaintext server or a man in the middle that does
        not say it gets the CONNECT, credentials included, in the clear). Empty: plaintext."""
        ctx = self.tls_context()
        return {} if ctx is None else {"tls": ctx, "tls_handshake_first": True}


class StoreSettings(SettingsGroup):
    """The object store (MinIO / any S3, or a local folder) of EC objects, KV objects and images.

    Its dump without the credentials (:meth:`connector_dump`) is the vLLM connectors' extra
    config; the connectors validate it back with this model (:meth:`from_dump`)."""

    #: the credential fields: never in a dump; a vLLM process reads them from the environment
    SECRET_FIELDS: ClassVar[tuple[str, str]] = ("s3_access_key", "s3_secret_key")

    store_backend: StoreBackend = StoreBackend.S3
    """`s3` (MinIO or any S3 server) or `fs` (a local folder, `EPD_STORE_FS_ROOT`)."""
    s3_endpoint: str = "127.0.0.1:9000"
    """S3 endpoint, `host:port`."""
    s3_access_key: SecretStr = SecretStr("minioadmin")
    """S3 access key (never logged)."""
    s3_secret_key: SecretStr = SecretStr("minioadmin")
    """S3 secret key (never logged)."""
    s3_secure: bool = False
    """Talk TLS to the S3 endpoint (its certificate verified against `EPD_S3_TLS_CA`, else the system CAs)."""
    s3_tls_ca: Path | None = None
    """CA certificate file the S3 server's certificate is verified against (with `EPD_S3_SECURE=true`;
    `epd certs` writes a development one; unset: the system CAs)."""
    s3_region: str | None = None
    """S3 region (unset: the server's default)."""
    s3_bucket: str = "epd"
    """Bucket of EC and KV objects and images (created at start-up if missing)."""
    store_fs_root: Path = Path("var/store")
    """Folder of the `fs` store backend."""
    namespace: str = "epd"
    """Key prefix inside the bucket."""
    max_ec_object_bytes: int = Field(512 * 1024**2, gt=0)
    """Largest EC object a worker reads."""
    max_kv_object_bytes: int = Field(1024**3, gt=0)
    """Largest KV object written or read (E|P|D)"""

    _check_namespace = field_validator("namespace")(no_separators)
    _check_backend = field_validator("store_backend", mode="before")(one_of(StoreBackend, "store backend"))

    @model_validator(mode="after")
    def _ca_only_with_tls(self) -> StoreSettings:
        if self.s3_tls_ca is not None and not self.s3_secure and not self.s3_endpoint.lower().startswith("https://"):
            raise ValueError(
                "EPD_S3_TLS_CA is set but the store is reached in plaintext: set EPD_S3_SECURE=true (or unset the CA)"
            )
        return self

    def connector_dump(self) -> dict[str, Any]:
        """This group as JSON values, credentials left out and the paths (the `fs` root, the S3 CA)
        made absolute (another process may resolve relative paths elsewhere): a vLLM connector's
        extra config."""
        paths: dict[str, Any] = {"store_fs_root": self.store_fs_root.resolve()}
        if self.s3_tls_ca is not None:
            paths["s3_tls_ca"] = self.s3_tls_ca.resolve()
        resolved = self.model_copy(update=paths)
        return resolved.model_dump(mode="json", exclude=set(self.SECRET_FIELDS))

    @classmethod
    def from_dump(cls, values: Mapping[str, Any]) -> StoreSettings:
        """Validate ``values`` (e.g. :meth:`connector_dump`) without reading the environment:
        what is not given is the default."""
        return _StoreFromValues(**values)


class _StoreFromValues(StoreSettings):
    """:class:`StoreSettings` from given values only (no environment)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


#: the variables of the S3 credentials (spelled here only: derived from the fields)
S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV = (env_var(name) for name in StoreSettings.SECRET_FIELDS)


class ModelSettings(SettingsGroup):
    """Which model is served and how it is computed: what the encoder fingerprint is made of (every
    service must agree)."""

    model_path: Path | None = None
    """Local model folder in Hugging Face layout; nothing is downloaded (`epd up`: the tiny test model under `var/`)."""
    model_name: str | None = None
    """Model id served in `/v1/models` and expected in requests (unset: the folder name)."""
    engine: EngineKind = EngineKind.TRANSFORMERS
    """Model engine: `transformers` or `vllm` (part of the encoder fingerprint: every service must agree)."""
    dtype: str = "float32"
    """Compute dtype (part of the encoder fingerprint)."""
    max_model_len: int | None = Field(None, ge=16)
    """Context length served (vLLM's `--max-model-len`; `epd up --max-model-len`): prompt tokens + `max_tokens`
    of a request may not exceed it (400), in both engines and the API (unset: the model's `max_position_embeddings`
    in its `config.json`). It can only lower the model's."""

    _check_engine = field_validator("engine", mode="before")(one_of(EngineKind, "engine"))

    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model_path is not None:
            return Path(self.model_path).name
        return "epd-model"

    def require_model_path(self) -> Path:
        if self.model_path is None:
            raise ValueError(f"{env_var('model_path')} is not set (a local model folder)")
        path = Path(self.model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{env_var('model_path')}={path} is not a model folder (no config.json)")
        return path


class MediaSettings(SettingsGroup):
    """Limits on the images and videos a process decodes or stores, and how videos are sampled."""

    max_image_bytes: int = Field(20 * 1024**2, gt=0)
    """Per image, encoded."""
    max_image_pixels: int = Field(40_000_000, gt=0)
    """Per image, width x height."""
    max_video_bytes: int = Field(32 * 1024**2, gt=0)
    """Per video file, encoded."""
    max_video_duration_s: float = Field(300.0, gt=0)
    """Per video, from its frame count and rate."""
    max_video_total_frames: int = Field(18_000, gt=0)
    """Frames a video's container may hold."""
    max_video_frames: int = Field(64, gt=0)
    """Frames sampled from one video (what is stored and encoded; fewer: ask a lower fps)"""
    max_video_frame_pixels: int = Field(1280 * 720, gt=0)
    """Per video frame, width x height (checked from the header before decoding)"""
    video_segment_frames: int = Field(16, ge=0)
    """A video of more sampled frames is encoded in segments of this many (a multiple of the model's temporal patch),
    each its own encode job and EC object, so several encoders share one video and a clip that shares a segment with an
    earlier one reuses it (where the model's vision tower allows: docs/models.md); 0: every video encoded whole."""
    video_num_frames: int | None = Field(None, gt=0)
    """Frames sampled from a video when a request says nothing (unset: vLLM's default, 32)"""
    video_fps: float | None = Field(None, gt=0)
    """Frames a second sampled from a video when a request says nothing (unset: the loader's default)"""

    @property
    def max_stored_media_bytes(self) -> int:
        """The largest media object a worker reads back: an image file, or a video's sampled frames."""
        return max(self.max_image_bytes, self.max_video_frames * self.max_video_frame_pixels * 3 + 64 * 1024)


class EngineSettings(SettingsGroup):
    """How a worker runs its engine: threads, CPUs and the vLLM engine's knobs (workers only)."""

    torch_threads: int = Field(1, ge=1)
    """Torch threads per process; keep the same value in every stage for bit-identical output."""
    encode_batch_invariant: bool = True
    """Transformers engine: every image gets a vision-tower forward of its own, so its features never depend on what was
    encoded with it (bit-identical on any CPU); false: concurrent encodes share forwards (features may differ in the
    last bits by batch and CPU)"""
    cpu_cores: str | None = None
    """CPUs a worker binds itself (and vLLM's engine processes) to, Linux list syntax, e.g. 0-1 (unset: all); give the
    encoder and the PD worker disjoint lists on one host."""
    cpu_nice: int = Field(0, ge=0, le=19)
    """CPU priority a worker lowers itself (and vLLM's engine processes) to, as nice(1): 0 keeps it; 19 yields the cores
    to every normal process, e.g. a spare PD worker on the encoder's cores that generates only when the encoder leaves
    them idle."""
    vllm_dir: Path = Path("var/vllm")
    """vLLM engine (`EPD_ENGINE=vllm`): folder of its caches, compile artefacts and IPC sockets."""
    vllm_enforce_eager: bool = True
    """No torch.compile / CUDA graphs (fast start on CPU; false on GPUs)"""
    vllm_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size of a generating vLLM engine."""
    vllm_max_num_seqs: int = Field(16, ge=1)
    """Requests a vLLM engine batches together."""
    vllm_max_num_batched_tokens: int | None = Field(None, ge=1)
    """Prompt tokens a vLLM engine computes per step (longer prompts are chunked); unset: 256 on CPUs for engines
    without a KV hand-off (a burst's first tokens come sooner), else vLLM's default."""
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict)
    """More vLLM engine args (JSON), e.g. {"gpu_memory_utilization": 0.85}."""


class JanitorSettings(SettingsGroup):
    """The EC store's lifecycle policy (shared.ec_lifecycle.janitor). The janitor runs in the API
    processes (one at a time: a lease) when a bound or a TTL is set; `epd ec` reads it too."""

    ec_max_bytes: int | None = Field(None, gt=0)
    """Bound of the EC namespace in bytes (LRU eviction)"""
    ec_max_objects: int | None = Field(None, gt=0)
    """Bound of the EC namespace in objects."""
    ec_ttl_s: float | None = Field(None, gt=0)
    """EC objects unused this long are deleted (plus an S3 lifecycle rule as a backstop, EPD_EC_LIFECYCLE_RULE)"""
    ec_purge_retired_after_s: float | None = Field(None, ge=0)
    """Purge the EC objects of a fingerprint no worker served for this long."""
    ec_retired_after_s: float = Field(600, gt=0)
    """A fingerprint no worker heartbeats for this long is retired."""
    ec_janitor_interval_s: float = Field(15, gt=0)
    """Seconds between janitor passes."""
    ec_evict_grace_s: float = Field(60, ge=0)
    """Objects created or used this recently are never evicted for a bound (requests in flight)"""
    ec_reconcile_interval_s: float = Field(300, gt=0)
    """The janitor lists the store this often to index objects nobody announced."""
    ec_lifecycle_rule: bool = True
    """With EPD_EC_TTL_S, also set an S3 lifecycle expiration rule on the namespace (a backstop)"""


# -- services ---------------------------------------------------------------------------------------
def group_type(field: FieldInfo) -> type[SettingsGroup] | None:
    """The group class of a settings field that holds a group (None: a plain setting)."""
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, SettingsGroup) else None


class _OwnFieldsEnv(EnvSettingsSource):
    """The environment source of a service's own fields; its groups read their variables themselves
    (a group's attribute is no variable: ``EPD_MODEL`` is not JSON for ``model``)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if group_type(field) is not None:
            return None, field_name, False
        return super().get_field_value(field, field_name)


class EnvField(NamedTuple):
    """One setting of a service: its variable, the group attribute holding it (None: the service's
    own field), its field name and definition, and the class that declares it."""

    var: str
    group: str | None
    name: str
    field: FieldInfo
    owner: type[BaseSettings]


class ServiceSettings(BaseSettings):
    """What every process has: NATS, the store, its identity and logging. Subclasses add the groups
    they need (fields typed with a :class:`SettingsGroup`) and their own settings."""

    model_config = _ENV_CONFIG

    nats: NatsSettings = Field(default_factory=NatsSettings)
    """NATS and JetStream."""
    store: StoreSettings = Field(default_factory=StoreSettings)
    """The object store."""

    worker_id: str = Field(default_factory=default_worker_id)
    """Worker identity in EC object metadata and heartbeats (unset: host name + random suffix)."""
    log_level: str = "INFO"
    """Log level; every line carries the request id."""
    log_format: LogFormat = LogFormat.TEXT
    """`text` (one line, `[request_id=...]`) or `json` (one JSON object per line, for log shippers)."""
    ec_use_flush_s: float = Field(2.0, gt=0)
    """Uses of EC objects are written to the index in batches this often."""
    drain_s: float = Field(60, ge=0, le=3600)
    """On SIGTERM, how long the process finishes what it runs before it exits (workers: the jobs they started - the
    others go back to the queue at once; the API: its open requests); the deployments' stop grace period is this + 15 s
    (docker-compose.yml, deploy/kubernetes)"""

    _check_log_format = field_validator("log_format", mode="before")(one_of(LogFormat, "log format"))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _OwnFieldsEnv(settings_cls), dotenv_settings, file_secret_settings)

    @model_validator(mode="before")
    @classmethod
    def _flat_arguments_to_groups(cls, data: Any) -> Any:
        """``ApiSettings(nats_url=...)``: each flat argument goes to the group that owns it; every
        group is built here, so whatever is not given comes from its variables."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for attr, group in cls.groups().items():
            given = data.pop(attr, None)
            flat = {name: data.pop(name) for name in list(data) if name in group.model_fields}
            if isinstance(given, group) and not flat:
                data[attr] = given
                continue
            if isinstance(given, SettingsGroup):
                given = {name: getattr(given, name) for name in type(given).model_fields}
            data[attr] = group(**{**(given or {}), **flat})
        return data

    @classmethod
    def groups(cls) -> dict[str, type[SettingsGroup]]:
        """The groups of this service: attribute -> group class."""
        return {attr: g for attr, f in cls.model_fields.items() if (g := group_type(f)) is not None}

    @classmethod
    def env_fields(cls) -> dict[str, EnvField]:
        """Every setting of this service by field name, groups' fields included."""
        out: dict[str, EnvField] = {}
        for attr, field in cls.model_fields.items():
            group = group_type(field)
            rows = (
                [EnvField(env_var(n), attr, n, f, group) for n, f in group.model_fields.items()]
                if group is not None
                else [EnvField(env_var(attr), None, attr, field, cls)]
            )
            for row in rows:
                if row.name in out:
                    raise TypeError(f"{cls.__name__}: setting {row.name} is in two groups")
                out[row.name] = row
        return out

    def setting(self, name: str) -> Any:
        """The value of the setting ``name`` (a field of this service or of one of its groups)."""
        row = type(self).env_fields()[name]
        return getattr(getattr(self, row.group) if row.group else self, name)


class ApiSettings(ServiceSettings):
    """The API: HTTP, admission, image intake; the model it serves (no engine) and the EC janitor."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """The served model."""
    media: MediaSettings = Field(default_factory=MediaSettings)
    """Image limits."""
    janitor: JanitorSettings = Field(default_factory=JanitorSettings)
    """The EC store's lifecycle."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 8000
    """Listen port."""
    api_keys: CSV = ()
    """Comma-separated Bearer keys (unset: no authentication). When set, `/metrics` and `/debug/*` need a key too."""
    metrics_public: bool = False
    """With API keys set, `/metrics` asks for a key too unless this is on (a scraper on a private network)."""
    request_timeout_s: float = Field(300, gt=0)
    """Deadline for a whole request."""
    max_body_bytes: int = Field(64 * 1024**2, gt=0)
    """Request body limit."""
    max_images_per_request: int = Field(8, ge=0)
    """Images one request may carry (400 above)."""
    max_videos_per_request: int = Field(1, ge=0)
    """Videos one request may carry (400 above; each is sampled into up to `EPD_MAX_VIDEO_FRAMES` frames)."""
    max_tokens_limit: int | None = Field(None, ge=1)
    """Largest `max_tokens` a request may ask for (400 above; unset: the context length, `EPD_MAX_MODEL_LEN` or
    the model's)."""
    default_max_tokens: int = Field(256, ge=1)
    """`max_tokens` of a chat request that sets none, unless the model's generation config sets `max_new_tokens`."""
    generation_config: str = "auto"
    """Where a request's left-out sampling fields (temperature, top_p, top_k, min_p, the penalties, max_tokens) take
    their defaults from, as vLLM's `--generation-config`: `auto` (the model folder's `generation_config.json`, as a
    plain vLLM server does), `vllm` (none: OpenAI's defaults), or a folder holding a `generation_config.json`."""
    fetch_timeout_s: float = Field(10, gt=0)
    """Image URL fetch timeout (504 after it)."""
    allowed_origins: CSV = ()
    """CORS: comma-separated origins a browser page may call the API from (`*`: any; unset: none, no CORS
    headers; vLLM's `--allowed-origins`, whose default is `*`)."""
    allowed_methods: CSV = ("*",)
    """CORS: comma-separated methods allowed cross-origin (`*`: any; with `EPD_ALLOWED_ORIGINS` only)."""
    allowed_headers: CSV = ("*",)
    """CORS: comma-separated request headers allowed cross-origin (`*`: any; with `EPD_ALLOWED_ORIGINS` only)."""
    allow_credentials: bool = False
    """CORS: allow credentials (cookies, `Authorization`) cross-origin (with `EPD_ALLOWED_ORIGINS` only)."""
    tls_cert: Path | None = None
    """Certificate file (PEM, with its chain) the API serves HTTPS with, with `EPD_TLS_KEY` (both or neither;
    unset: plain HTTP - a TLS proxy in front, or `epd up --tls`)."""
    tls_key: Path | None = None
    """The API certificate's private key file (read at start-up, never logged; keep it mode 0600)."""
    tls_ca: Path | None = None
    """CA file the API's certificate is verified against by its health probe (`epd healthcheck --role api`),
    with `EPD_TLS_CERT` (unset: the system CAs)."""
    access_log: bool = True
    """One log line per HTTP request (method, path, status, duration; logger `epd.access`), as uvicorn's
    access log; off: none (vLLM's `--disable-uvicorn-access-log`)."""
    url_allow_networks: CSV = ()
    """Comma-separated CIDRs image URLs may resolve to although private or loopback."""
    url_allow_hosts: CSV = ()
    """Comma-separated host names allowed although they resolve to private addresses."""
    decode_pixel_budget: int | None = Field(None, ge=1)
    """Pixels the API process decodes at once, all requests together (~4 bytes a pixel of memory; unset: two images of
    EPD_MAX_IMAGE_PIXELS); images wait in arrival order, a larger one decodes alone."""
    worker_stale_s: float = Field(10, gt=0)
    """A worker is gone after this long without a heartbeat."""
    routing: RoutingMode = RoutingMode.SHARED
    """`affinity`: send a request with images to the generating worker that holds them (weighed against load;
    docs/architecture.md, cache-aware routing); `shared`: every job on the shared queue, whichever worker is free takes
    it."""
    _check_routing = field_validator("routing", mode="before")(one_of(RoutingMode, "routing"))
    routing_affinity_weight: float = Field(1.0, ge=0)
    """Affinity routing: score of a worker per fraction of the request's images it holds."""
    routing_load_weight: float = Field(1.0, ge=0)
    """Affinity routing: score taken off a worker per fraction of its engine slots in use."""
    routing_affinity_timeout_s: float = Field(2.0, gt=0)
    """A routed job no worker claimed within this long goes to the shared queue."""
    routing_takeover_s: float = Field(6.0, gt=0)
    """A routed worker whose heartbeat is this old is gone: its job (claimed or not) goes to the shared queue."""
    topology: Topology = Topology.E_PD
    """Deployment shape: `agg`, `e-pd` or `e-p-d`. The API reads only whether it has encoder workers: with `agg`
    it queues no encode jobs; `e-pd` and `e-p-d` differ in the workers only."""

    @field_validator("topology", mode="before")
    @classmethod
    def _known_topology(cls, v: object) -> object:
        if v not in tuple(Topology):
            raise ValueError(f"unknown topology {_shown(v)!r}; supported: {', '.join(Topology)}")
        return v

    _split = field_validator(
        "api_keys",
        "url_allow_networks",
        "url_allow_hosts",
        "allowed_origins",
        "allowed_methods",
        "allowed_headers",
        mode="before",
    )(_split_csv)

    @model_validator(mode="after")
    def _tls_files(self) -> ApiSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("EPD_TLS_CERT and EPD_TLS_KEY go together (the API's certificate and its key): set both")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("EPD_TLS_CA is the CA of the API's HTTPS certificate: set EPD_TLS_CERT / EPD_TLS_KEY too")
        return self

    @model_validator(mode="after")
    def _no_credentials_for_any_origin(self) -> ApiSettings:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError(
                "EPD_ALLOW_CREDENTIALS with EPD_ALLOWED_ORIGINS=* would let every web site call the API with its "
                "users' credentials: list the origins"
            )
        return self

    def decode_budget_pixels(self) -> int:
        """The decode budget in effect: ``decode_pixel_budget``, or two images of the largest size."""
        return self.decode_pixel_budget or 2 * self.media.max_image_pixels


class WorkerSettings(ServiceSettings):
    """What every model worker (encoder, prefill, decode) has: the model, its engine's knobs, image
    limits, and its process's health and metrics."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """The served model."""
    media: MediaSettings = Field(default_factory=MediaSettings)
    """Image limits."""
    runtime: EngineSettings = Field(default_factory=EngineSettings)
    """How the engine runs."""

    metrics_port: int | None = None
    """Workers: serve Prometheus `/metrics` on this port (unset: none; the API serves it on its own port)."""
    health_file: Path | None = None
    """Workers: heartbeat file for `epd healthcheck`, refreshed every 2 s after a JetStream round trip to the
    worker's consumer and removed when one fails (unset: none)."""
    unreachable_exit_s: float = Field(60, gt=0)
    """A worker that cannot reach its consumer this long exits (code 3) for its supervisor to restart it."""


#: an encoder worker's pixel budget when its engine's steps do not bound its encodes
UNBOUNDED_ENCODE_PIXEL_BUDGET = 16_000_000


class EncoderSettings(WorkerSettings):
    encode_jobs_in_flight: int | None = Field(None, ge=1)
    """Encode jobs an encoder worker holds at once (unset: the engine's batch, 16 by default; their encodes share
    forwards, within the pixel budget)"""
    encode_pixel_budget: int | None = Field(None, ge=1)
    """Image pixels an encoder worker holds at once (its jobs started, their images decoded); a larger image goes alone.
    Unset: two of its engine's encode steps (vLLM: 2 x its encoder budget a step, `max_num_batched_tokens` image tokens
    - 401,408 pixels, two 448x448 images, for Qwen2-VL on a CPU), so the jobs it has not started stay in the queue for
    another encoder or a stealing worker; 16,000,000 where the engine's steps do not bound it (transformers)"""

    def pixel_budget(self, pixels_per_step: int | None) -> int:
        """The budget in effect for an engine that encodes ``pixels_per_step`` a step (``None``: unbounded)."""
        if self.encode_pixel_budget is not None:
            return self.encode_pixel_budget
        return 2 * pixels_per_step if pixels_per_step else UNBOUNDED_ENCODE_PIXEL_BUDGET


class PrefillSettings(WorkerSettings):
    role: Role = Role.PD
    """`pd`: prefill and decode in one worker (E|PD); `prefill`: prefill, then hand off to decode workers (E|P|D);
    `agg`: encode, prefill and decode in process (the baseline)."""
    ec_wait_s: float = Field(30, ge=0)
    """Wait this long for an encoder before encoding locally."""
    encode_steals: int = Field(1, ge=0, le=64)
    """Queued encode jobs this worker may steal at once: after `EPD_ENCODE_STEAL_AFTER_S` without an encoder starting an
    item, while every live encoder is full (or none is alive), the worker's own engine encodes it, stores it and
    announces it (0: off; roles pd and prefill; docs/architecture.md, encode stealing)"""
    no_encoder_after_s: float = Field(6.0, gt=0)
    """With no encoder heartbeat for this long (one crashed or stalled; or none running), a job waiting for an encoder
    stops waiting and this worker encodes the image itself (an encoder stopped on purpose counts as gone at once; roles
    pd and prefill; encoders scaled to zero: docs/kubernetes.md)"""
    encode_steal_after_s: float = Field(0.2, ge=0)
    """How long a job waits for an encoder to start its item before this worker steals it (`EPD_ENCODE_STEALS`)"""
    max_concurrent_jobs: int | None = Field(None, ge=1)
    """Jobs in the engine at once; unset = the engine's own batch (vLLM max_num_seqs, transformers decode batch 16),
    printed at start-up."""
    long_prompt_tokens: int | None = Field(None, ge=0)
    """A prompt of more (estimated) tokens is long: at most two long prompts are in the engine and not yet prefilled
    (their first token not out), and shorter ones do not wait for them; unset = half the engine's step budget (vLLM
    max_num_batched_tokens / 2; no such rule for transformers, which prefills one prompt at a time itself), 0 = no such
    rule."""
    max_waiting_jobs: int = Field(64, ge=0)
    """Jobs held while they wait for image features (they take no engine slot)"""
    local_cache_bytes: int = Field(512 * 1024**2, ge=0)
    """In-memory encoder-output cache per worker (0: off)."""
    routing_advertised_items: int = Field(64, ge=0, le=4096)
    """Item hashes of its caches a worker advertises in each heartbeat for affinity routing (the most recently used; 17
    bytes each)"""

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, v: object) -> object:
        if v not in PREFILL_SERVICE_ROLES:
            raise ValueError(f"unknown prefill role {_shown(v)!r}; supported: {', '.join(PREFILL_SERVICE_ROLES)}")
        return v


class DecodeSettings(WorkerSettings):
    """Decode workers (E|P|D): pull decode jobs, load KV objects, batch decode steps."""

    max_batch_size: int = Field(16, ge=1)
    """Requests decoded together (one forward per step)"""
    max_reprefills: int = Field(2, ge=0)
    """Re-prefills of one request after unusable KV objects."""
    kv_ttl_s: float = Field(3600, gt=0)
    """KV objects older than this are swept (keep it above EPD_REQUEST_TIMEOUT_S)"""
    kv_sweep_interval_s: float = Field(300, ge=0)
    """0 = no sweeping from this worker."""


class ToolSettings(ServiceSettings):
    """The `epd` tools that talk to a running deployment (`epd replay`, `epd ec`, `epd plan --from-streams`):
    its NATS and store, and the EC lifecycle policy `epd ec` reports against."""

    janitor: JanitorSettings = Field(default_factory=JanitorSettings)
    """The EC store's lifecycle."""


#: the settings class of each service (``python -m services.<name>``)
SERVICE_SETTINGS: dict[str, type[ServiceSettings]] = {
    "api": ApiSettings,
    "encoder": EncoderSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
}
