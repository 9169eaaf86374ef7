"""Engine backed by vLLM (``AsyncLLM`` driven in-process; vLLM runs its engine core and model
worker as child processes).

With vLLM, encoder outputs do not pass through the worker: they move through vLLM's own EC
connector interface, implemented over the project's store (``shared.connectors``). So this
engine is :class:`FeaturesThroughConnector`:

* in an encoder worker (``ec_role="ec_producer"``) vLLM runs encoder-only (no KV cache);
  :meth:`VllmEngine.produce` runs it on an image and the connector stores the output under the
  image's item hash;
* in a prefill worker (``ec_role="ec_consumer"``) :meth:`VllmEngine.generate` takes the images
  themselves; the connector prefetches each stored output, and an item that is missing or fails
  validation is encoded by vLLM locally, so a request always completes;
* without a role (``agg``) it is a plain vLLM engine.

E|P|D (:class:`KVConnectorHandoff`): a prefill worker's engine is also a KV producer and a decode
worker's a KV consumer: :meth:`VllmEngine.prefill_for_handoff` computes the prompt and has the KV
connector store its KV cache; :meth:`VllmEngine.generate_from_handoff` loads it (or prefills
again when it is unusable) and decodes. What passes between engine and connectors is typed in
:mod:`shared.connectors.params`.

The image's content hash is passed as vLLM's multimodal uuid, so vLLM's ``mm_hash`` - the
connector's identifier - is the project's item hash and the keys line up with the API's.

Threads and loops: the ``AsyncLLM`` lives on one private event loop thread (so one engine can
serve callers on several event loops, and vLLM's own output handling never waits for a
caller). The public API is async: a request runs as a task on the vLLM loop that forwards each
``RequestOutput`` to the caller's loop (``call_soon_threadsafe`` into an ``asyncio.Queue``).
Closing a token iterator early aborts the request in vLLM. Concurrent requests are batched by
vLLM itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, PrefillSettings, WorkerSettings
from shared.connectors.params import (
    KVHandoff,
    KVHandoffRequest,
    MalformedParams,
    ec_items_of,
    ec_sources_of,
    kv_source_of,
)
from shared.engines.base import (
    ConnectorItem,
    Engine,
    FeaturesThroughConnector,
    GenerationStats,
    KVConnectorHandoff,
    MediaImage,
    MediaVideo,
    Prompt,
    RawPrompt,
    SamplingParams,
    TokenEvent,
    VideoFrames,
)
from shared.engines.grammar import vllm_structured_outputs
from shared.engines.prompts import (
    chat_parts,
    check_media,
    check_placeholder_tokens,
    render_chat_prompt,
    validate_params,
)
from shared.errors import EngineError, InvalidRequest
from shared.families import VIDEO_FAMILIES, check_family
from shared.identity import ModelIdentity
from shared.protocol import MediaKind, TokenLogprob
from shared.topology import Role

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECTOR_CLASS = "S3ECConnector"
CONNECTOR_MODULE = "shared.connectors.s3_ec"
KV_CONNECTOR_CLASS = "S3KVConnector"
KV_CONNECTOR_MODULE = "shared.connectors.s3_kv"
#: worker role -> vLLM EC role (``Role.AGG``: a plain engine)
EC_ROLES: dict[Role, str] = {
    Role.ENCODER: "ec_producer",
    Role.PD: "ec_consumer",
    Role.PREFILL: "ec_consumer",
    Role.DECODE: "ec_consumer",
}
#: worker role -> vLLM KV role (E|P|D: the KV cache moves through the KV connector and the store)
KV_ROLES: dict[Role, str] = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}
#: vLLM's CPU backend accepts a KV connector only with this block size (16 fails: "No common block size")
CPU_KV_CONNECTOR_BLOCK_SIZE = 32
#: A vLLM engine's prompt-token budget per step on CPUs (``EPD_VLLM_MAX_NUM_BATCHED_TOKENS`` unset;
#: vLLM's own CPU default is 2048-4096): measured in docs/performance.md (P4, P10 on 2026-12-02).
CPU_MAX_NUM_BATCHED_TOKENS = 256
_EVENT_TIMEOUT_S = 600.0
_END = object()
#: vLLM binds its engine's IPC sockets at ``<VLLM_RPC_BASE_PATH>/<uuid4>``, and a Unix socket's path
#: holds at most 107 bytes (``sockaddr_un.sun_path``): the folder may take what a slash and a
#: 36-character uuid leave (a deeper one failed vLLM's start: "ipc path ... is longer than 107").
MAX_RPC_DIR_BYTES = 107 - 1 - 36


def vllm_rpc_dir(work_dir: Path) -> Path:
    """The folder for vLLM's IPC sockets: ``<work_dir>/rpc`` when its sockets' paths fit a Unix
    socket address, else a folder of this user's in the temporary directory named after
    ``work_dir`` (the same one for every process of one work dir). Pure: creates nothing."""
    preferred = Path(work_dir).resolve() / "rpc"
    if len(os.fsencode(preferred)) <= MAX_RPC_DIR_BYTES:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"epd-vllm-rpc-{os.getuid()}-{digest}"


def _make_private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or accept it when it is already a folder of this user's that
    no one else can write: a shared temporary directory must not let another user plant the
    sockets' folder (or a link in its place)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise EngineError(
            f"{path} (vLLM's IPC socket folder) is not a folder of this user's that only it can write; "
            "remove it, or set EPD_VLLM_DIR to a shorter path so the sockets live under it"
        )


#: No phoning home, no hub: models are local folders (defaults; a value already set stays).
OFFLINE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


#: the families whose vLLM processor reads which frames of the source a video's are (Qwen3-VL: each
#: temporal patch's time, ``frames_indices / fps``, written into the prompt)
VIDEO_SOURCE_FAMILIES = ("qwen3_vl",)


def sampled_video_metadata(video: VideoFrames, *, source: bool = False) -> dict[str, Any]:
    """vLLM's metadata of already-sampled frames (what its loader returns beside them): every
    frame kept (no sampling again), at the sampled rate - so the processor's ``sampled_fps``
    (``len(indices) / total * fps``) is the rate the frames stand for. ``source``: the loader's
    own metadata instead - the source's rate and frame count, the sampled frames' indices in it
    (:class:`InvalidRequest` for frames without them)."""
    if source:
        if video.indices is None or video.source_fps is None or video.total_frames is None:
            raise InvalidRequest(
                "this model writes each video frame's time into the prompt: the video's frame indices in its "
                "source are needed (frames stored without them cannot be served)",
                param="messages",
            )
        # (vLLM's Qwen3-VL loader takes an unknown source rate for 24 fps, as transformers' processor)
        fps = video.source_fps if video.source_fps > 0 else 24.0
        return {
            "total_num_frames": int(video.total_frames),
            "fps": float(fps),
            "duration": video.total_frames / fps,
            "video_backend": "opencv",
            "frames_indices": [int(i) for i in video.indices],
            "do_sample_frames": False,
        }
    n = int(video.frames.shape[0])
    return {
        "total_num_frames": n,
        "fps": float(video.fps),
        "duration": n / video.fps if video.fps > 0 else 0.0,
        "video_backend": "opencv",
        "frames_indices": list(range(n)),
        "do_sample_frames": False,
    }


def vllm_folders(work_dir: Path) -> dict[str, str]:
    """The environment variables that point vLLM's (and torch's) caches, compile artefacts and IPC
    sockets at folders under ``work_dir``, the folders created. The sockets go to
    :func:`vllm_rpc_dir` (outside ``work_dir`` only when it is too deep for a socket address)."""
    work_dir = Path(work_dir).resolve()
    wanted = {
        "VLLM_CACHE_ROOT": work_dir / "cache",
        "VLLM_CONFIG_ROOT": work_dir / "config",
        "VLLM_ASSETS_CACHE": work_dir / "assets",
        "VLLM_RPC_BASE_PATH": vllm_rpc_dir(work_dir),
        "TORCHINDUCTOR_CACHE_DIR": work_dir / "inductor",
        "TRITON_CACHE_DIR": work_dir / "triton",
    }
    for path in wanted.values():
        if path.is_relative_to(work_dir):
            path.mkdir(parents=True, exist_ok=True)
        else:
            _make_private_dir(path)
            log.info("vLLM's IPC sockets go to %s: %s is too deep for a socket address", path, work_dir)
    return {name: str(path) for name, path in wanted.items()}


def configure_vllm_environment(work_dir: Path) -> dict[str, str]:
    """Point vLLM's files at ``work_dir`` (``EPD_VLLM_DIR``; :func:`vllm_folders`) and set
    :data:`OFFLINE_ENV`. Environment variables are vLLM's and torch's only interface for these and
    vLLM's child processes inherit them, so they are set here, the folders overriding inherited
    values (torch itself fills in ``TORCHINDUCTOR_CACHE_DIR`` with /tmp/torchinductor_<user> the
    first time anything asks). Call before vLLM is imported. Returns what it applied."""
    applied = vllm_folders(work_dir)
    os.environ.update(applied)
    for name, value in OFFLINE_ENV.items():
        applied[name] = os.environ.setdefault(name, value)
    return applied


def connector_extra_config(settings: WorkerSettings) -> dict[str, Any]:
    """``ec_connector_extra_config`` and ``kv_connector_extra_config`` for a worker: its store
    settings group's dump (credentials stay in the env; the EC connector's objects are bounded by
    ``EPD_MAX_EC_OBJECT_BYTES``, the KV connector's by ``EPD_MAX_KV_OBJECT_BYTES``), its worker id,
    and its NATS for the EC connector's part in the EC lifecycle (invalidations, use records)."""
    return {
        **settings.store.connector_dump(),
        "producer_id": settings.worker_id,
        "nats_url": settings.nats.nats_url,
        "subject_prefix": settings.nats.subject_prefix,
        "stream_replicas": settings.nats.stream_replicas,
        "nats_ping_interval_s": settings.nats.nats_ping_interval_s,
        "nats_max_outstanding_pings": settings.nats.nats_max_outstanding_pings,
        # (absolute: vLLM's processes may run elsewhere than this one's working directory)
        **{
            name: str(path.resolve())
            for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key")
            if (path := getattr(settings.nats, name)) is not None
        },
    }


def check_sampling(params: SamplingParams, *, vocab_size: int, max_logprobs: int) -> None:
    """Raise :class:`InvalidRequest` (naming the parameter) for the settings vLLM would refuse,
    before a request reaches it: vLLM's own refusal surfaces only once the request runs, without a
    parameter name (``validate_params`` covers the fields every engine checks). ``vocab_size`` is
    the model's logits width (vLLM's bound for token ids); ``max_logprobs`` vLLM's
    ``max_logprobs`` (-1: the vocabulary)."""

    def number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value > hi or value < lo or (lo_open and value == lo):
            span = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise InvalidRequest(f"{name} must be a number in {span}", param=name)

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def token_ids(name: str, ids: Sequence[Any]) -> None:
        bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                f"{name} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}", param=name
            )

    number("temperature", params.temperature, 0.0, 2.0)
    if not is_int(params.top_k) or params.top_k < 0:
        raise InvalidRequest("top_k must be an integer >= 0 (0: all tokens)", param="top_k")
    number("min_p", params.min_p, 0.0, 1.0)
    number("presence_penalty", params.presence_penalty, -2.0, 2.0)
    number("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    number("repetition_penalty", params.repetition_penalty, 0.0, math.inf, lo_open=True)
    token_ids("logit_bias", [tid for tid, _ in params.logit_bias])
    for _, bias in params.logit_bias:
        number("logit_bias", bias, -100.0, 100.0)
    if not is_int(params.min_tokens) or params.min_tokens < 0:
        raise InvalidRequest("min_tokens must be an integer >= 0", param="min_tokens")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})", param="min_tokens"
        )
    token_ids("stop_token_ids", params.stop_token_ids)
    if params.logprobs is not None:
        limit = vocab_size if max_logprobs < 0 else max_logprobs
        if not is_int(params.logprobs) or not 0 <= params.logprobs <= limit:
            raise InvalidRequest(f"logprobs must be an integer in [0, {limit}]", param="logprobs")


def batched_tokens(given: int | None, *, max_num_seqs: int, kv_role: str | None, on_cpu: bool) -> int | None:
    """vLLM's ``max_num_batched_tokens`` for an engine (None: vLLM's own default): ``given`` when
    set (EPD_VLLM_MAX_NUM_BATCHED_TOKENS); on a CPU without a KV hand-off, small steps of
    :data:`CPU_MAX_NUM_BATCHED_TOKENS` (at least one token per sequence)."""
    if given is None and on_cpu and not kv_role:
        # Small steps on a CPU: a burst's prompts are prefilled a few at a time, so the first ones
        # answer while the rest wait, instead of all of them at the end of one long step (P4 and
        # P10: burst image TTFT p50 -27..-45%, throughput +12%, outputs equal). Not with a KV
        # hand-off: its connector has not been checked with chunked prefills.
        return max(CPU_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
    return given


def _export_s3_credentials(extra_config: dict[str, Any], credentials: tuple[Any, Any]) -> None:
    """Export the S3 ``credentials`` (secret values) under the env names a connector's
    ``extra_config`` reads them from, where those are unset: vLLM's processes inherit them."""
    names = (
        extra_config.get("access_key_env", S3_ACCESS_KEY_ENV),
        extra_config.get("secret_key_env", S3_SECRET_KEY_ENV),
    )
    for env_name, secret in zip(names, credentials):
        value = secret.get_secret_value() if hasattr(secret, "get_secret_value") else str(secret)
        os.environ.setdefault(env_name, value)


class VllmEngine(Engine, FeaturesThroughConnector, KVConnectorHandoff):
    """A model folder served by vLLM, optionally as an EC producer or consumer and a KV producer
    or consumer."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        threads: int | None = None,
        model_id: str | None = None,
        ec_role: str | None = None,
        ec_extra_config: dict[str, Any] | None = None,
        kv_role: str | None = None,
        kv_extra_config: dict[str, Any] | None = None,
        s3_credentials: tuple[Any, Any] | None = None,
        connector: tuple[str, str] = (CONNECTOR_CLASS, CONNECTOR_MODULE),
        work_dir: str | Path = "var/vllm",
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        engine_args: dict[str, Any] | None = None,
        start_timeout_s: float = 900.0,
    ):
        """``threads`` is accepted for interface parity and ignored: vLLM binds its own worker
        threads (``VLLM_CPU_OMP_THREADS_BIND``). ``s3_credentials`` (secret values) are exported
        under the env names of ``ec_extra_config`` when those are unset, for vLLM's processes.
        ``connector`` (class name, module) may name a subclass of the project's connector."""
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise EngineError(f"no config.json in model folder {self.model_dir}")
        # before vLLM is started: vLLM loads many more families than are proven here
        self.arch: str = check_family(self.name, self.model_dir)
        if ec_role not in (None, "ec_producer", "ec_consumer", "ec_both"):
            raise EngineError(f"unknown vLLM EC role {ec_role!r}")
        if kv_role not in (None, "kv_producer", "kv_consumer"):
            raise EngineError(f"unknown vLLM KV role {kv_role!r}")
        self.dtype_name = dtype
        self.ec_role = ec_role
        #: an EC producer and consumer (``ec_both``): the connector stores what this engine encodes
        self.stores_encodes = ec_role == "ec_both"
        self.kv_role = kv_role
        self._model_id = model_id or self.model_dir.name
        self.env = configure_vllm_environment(Path(work_dir))
        if (ec_role or kv_role) and s3_credentials is not None:
            _export_s3_credentials(ec_extra_config or kv_extra_config or {}, s3_credentials)
        # vLLM's arguments before the processor: vLLM is imported before transformers loads the folder
        self.engine_args = self._vllm_engine_args(
            dtype=dtype,
            connector=connector,
            ec_extra_config=ec_extra_config,
            kv_extra_config=kv_extra_config,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            engine_args=engine_args,
        )
        self._load_processor()
        self._start(start_timeout_s)

    # -- start-up steps ---------------------------------------------------------------------
    def _load_processor(self) -> None:
        """The model folder's processor, tokenizer, placeholder token ids and chat template."""
        from transformers import AutoConfig, AutoProcessor

        config = AutoConfig.from_pretrained(self.model_dir)
        self.processor = AutoProcessor.from_pretrained(self.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = int(config.image_token_id)
        #: the video placeholder where this engine serves the family's video (shared.families.VIDEO_FAMILIES)
        self.video_token_id: int | None = (
            int(config.video_token_id) if self.arch in VIDEO_FAMILIES.get(self.name, ()) else None
        )
        self.chat_template = getattr(self.processor, "chat_template", None) or getattr(
            self.tokenizer, "chat_template", None
        )
        if not self.chat_template:
            raise EngineError(f"model folder {self.model_dir} has no chat template")

    def _vllm_engine_args(
        self,
        *,
        dtype: str,
        connector: tuple[str, str],
        ec_extra_config: dict[str, Any] | None,
        kv_extra_config: dict[str, Any] | None,
        enforce_eager: bool,
        max_model_len: int | None,
        kv_cache_gib: float,
        max_num_seqs: int,
        max_num_batched_tokens: int | None,
        engine_args: dict[str, Any] | None,
    ) -> Any:
        """vLLM's ``AsyncEngineArgs`` of this engine: its model, connectors and limits, then
        ``engine_args`` over them."""
        from vllm import AsyncEngineArgs
        from vllm.config import ECTransferConfig, KVTransferConfig, StructuredOutputsConfig

        ec_role, kv_role = self.ec_role, self.kv_role
        ec_transfer_config = None
        if ec_role:
            ec_transfer_config = ECTransferConfig(
                ec_connector=connector[0],
                ec_connector_module_path=connector[1],
                ec_role=ec_role,  # type: ignore[arg-type]  # a str __init__ checked to be one of these Literal roles
                ec_connector_extra_config=dict(ec_extra_config or {}),
            )
        kv_transfer_config = None
        if kv_role:
            kv_extra = kv_extra_config if kv_extra_config is not None else ec_extra_config
            kv_transfer_config = KVTransferConfig(
                kv_connector=KV_CONNECTOR_CLASS,
                kv_connector_module_path=KV_CONNECTOR_MODULE,
                kv_role=kv_role,  # type: ignore[arg-type]  # a str __init__ checked to be one of these Literal roles
                kv_connector_extra_config=dict(kv_extra or {}),
            )
        args: dict[str, Any] = dict(
            model=str(self.model_dir),
            served_model_name=[self._model_id],
            dtype=dtype,
            seed=0,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=int(kv_cache_gib * 1024**3),
            ec_transfer_config=ec_transfer_config,
            kv_transfer_config=kv_transfer_config,
            disable_log_stats=False,  # connector counters reach this process with the stats
            # xgrammar, as the transformers engine: a schema it refuses is refused (vLLM's "auto"
            # would fall back to another library and constrain differently)
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"),
        )
        from vllm.platforms import current_platform

        if kv_role and current_platform.is_cpu():
            args["block_size"] = CPU_KV_CONNECTOR_BLOCK_SIZE
        max_num_batched_tokens = batched_tokens(
            max_num_batched_tokens, max_num_seqs=max_num_seqs, kv_role=kv_role, on_cpu=current_platform.is_cpu()
        )
        if max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = max_num_batched_tokens
        args.update(engine_args or {})
        return AsyncEngineArgs(**args)

    def _start(self, start_timeout_s: float) -> None:
        """Start vLLM on its own event loop thread (blocking, up to ``start_timeout_s``) and take
        the model identity its connectors compute."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        started = time.perf_counter()
        try:
            self._llm = self._call(self._create(), timeout=start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        self.start_seconds = time.perf_counter() - started
        self.vllm_config = self._llm.vllm_config
        from shared.connectors.common import vllm_identity

        # The same identity the connectors build in vLLM's processes: one version for both sides.
        self._identity = vllm_identity(self.vllm_config.model_config, served_name=self._model_id)
        log.info(
            "vLLM engine %s (%s) started in %.1fs; encoder fingerprint %s",
            self.model_dir,
            self.ec_role or "plain",
            self.start_seconds,
            self._identity.fingerprint,
        )

    @classmethod
    def options_from_settings(cls, settings: WorkerSettings, *, role: Role) -> dict[str, Any]:
        ec_role = EC_ROLES.get(role)
        if role in (Role.PD, Role.PREFILL) and isinstance(settings, PrefillSettings) and settings.encode_steals:
            ec_role = "ec_both"  # it encodes what it steals: its connector stores that too
        kv_role = KV_ROLES.get(role)
        store, runtime = settings.store, settings.runtime
        return dict(
            ec_role=ec_role,
            kv_role=kv_role,
            ec_extra_config=connector_extra_config(settings) if ec_role else None,
            kv_extra_config=connector_extra_config(settings) if kv_role else None,
            s3_credentials=(store.s3_access_key, store.s3_secret_key) if (ec_role or kv_role) else None,
            work_dir=runtime.vllm_dir,
            enforce_eager=runtime.vllm_enforce_eager,
            max_model_len=settings.model.max_model_len,
            kv_cache_gib=runtime.vllm_kv_cache_gib,
            max_num_seqs=runtime.vllm_max_num_seqs,
            max_num_batched_tokens=runtime.vllm_max_num_batched_tokens,
            engine_args=dict(runtime.vllm_engine_args),
        )

    # -- loop plumbing ----------------------------------------------------------------------
    async def _create(self):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(self.engine_args)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Blocking: run ``coro`` on the vLLM loop (start-up only, off any event loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _on_vllm_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the vLLM loop and await it from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def _live_llm(self) -> Any:
        if self._llm is None:
            raise EngineError("the vLLM engine is closed")
        return self._llm

    # -- Engine API -------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    @property
    def max_running_requests(self) -> int:
        """vLLM's ``max_num_seqs``: its scheduler batches that many and its continuous batching
        and chunked prefill interleave them (past the KV cache it preempts, it does not fail)."""
        return int(self.vllm_config.scheduler_config.max_num_seqs)

    @property
    def prefill_tokens_per_step(self) -> int:
        """vLLM's ``max_num_batched_tokens``: its scheduler gives the running requests' chunks the
        step's budget first, the requests that came since get what is left."""
        return int(self.vllm_config.scheduler_config.max_num_batched_tokens)

    @property
    def encode_pixels_per_step(self) -> int | None:
        """vLLM's encoder compute budget a step (``max_num_encoder_input_tokens``, by default its
        ``max_num_batched_tokens``) in image tokens of ``(patch_size * spatial_merge_size) ** 2``
        pixels each; ``None`` for a vision config without both (its images are not sized in
        patches: LLaVA resizes every image)."""
        vision = getattr(self.vllm_config.model_config.hf_config, "vision_config", None)
        patch, merge = getattr(vision, "patch_size", None), getattr(vision, "spatial_merge_size", None)
        if not isinstance(patch, int) or not isinstance(merge, int):
            return None
        sched = self.vllm_config.scheduler_config
        tokens = getattr(sched, "max_num_encoder_input_tokens", None) or sched.max_num_batched_tokens
        return int(tokens) * (patch * merge) ** 2

    def capacity(self) -> dict[str, Any]:
        cache, sched = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        return {
            "max_running_requests": self.max_running_requests,
            "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            "max_model_len": self.vllm_config.model_config.max_model_len,
            "kv_cache_tokens": blocks * cache.block_size if blocks else None,
        }

    def render_prompt(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> str:
        """The chat template applied to ``messages`` and ``tools`` (one raw placeholder per image;
        vLLM expands it)."""
        return render_chat_prompt(self.processor, self.chat_template, messages, tools)

    def build_prompt(self, messages: Prompt, images: Sequence[ConnectorItem]) -> dict[str, Any]:
        """The vLLM prompt: rendered text, the images, and their item hashes as multimodal uuids;
        for a :class:`RawPrompt` (``/v1/completions``) its text as it is (vLLM's ``TextPrompt``: no
        chat template) or its token ids (a ``TokensPrompt``), never images.
        (A template render and a tokenizer call on the prompt text: cheap enough for the event loop.)"""
        if isinstance(messages, RawPrompt):
            return self._raw_prompt(messages, images)
        messages, tools = chat_parts(messages)
        for i, item in enumerate(images):
            if not isinstance(item, MediaImage | MediaVideo):
                raise InvalidRequest(f"images[{i}] is not a MediaImage ({type(item).__name__})")
        videos = [item for item in images if isinstance(item, MediaVideo)]
        if videos and self.video_token_id is None:
            raise InvalidRequest(f"this model ({self.arch}) takes no video on the vllm engine", param="messages")
        check_media(messages, [MediaKind.VIDEO if isinstance(i, MediaVideo) else MediaKind.IMAGE for i in images])
        text = self.render_prompt(messages, tools)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        stills = [item for item in images if isinstance(item, MediaImage)]
        check_placeholder_tokens(ids, self.image_token_id, len(stills))
        if self.video_token_id is not None:
            check_placeholder_tokens(ids, self.video_token_id, len(videos), "video")
        prompt: dict[str, Any] = {"prompt": text}
        data: dict[str, Any] = {}
        uuids: dict[str, Any] = {}
        if stills:
            data["image"] = [item.image for item in stills]
            uuids["image"] = [item.item_hash for item in stills]
        if videos:
            source = self.arch in VIDEO_SOURCE_FAMILIES
            data["video"] = [(v.video.frames, sampled_video_metadata(v.video, source=source)) for v in videos]
            uuids["video"] = [v.item_hash for v in videos]
        if data:
            prompt["multi_modal_data"] = data
            prompt["multi_modal_uuids"] = uuids
        return prompt

    def _raw_prompt(self, raw: RawPrompt, images: Sequence[ConnectorItem]) -> dict[str, Any]:
        """A completions prompt for vLLM. Refused (``param="prompt"``): images, neither or both of
        text and token ids, an empty prompt, token ids outside the vocabulary, an image placeholder
        token (no image can fill it)."""
        if images:
            raise InvalidRequest("a completions prompt takes no images", param="prompt")
        if (raw.text is None) == (raw.token_ids is None):
            raise InvalidRequest("a completions prompt is either text or token ids", param="prompt")
        if raw.text is not None:
            if not isinstance(raw.text, str) or not raw.text:
                raise InvalidRequest("prompt must be a non-empty string", param="prompt")
            ids = list(self.tokenizer(raw.text)["input_ids"])  # what vLLM will feed the model (special tokens added)
            prompt: dict[str, Any] = {"prompt": raw.text}
        else:
            ids = list(raw.token_ids or ())
            if not ids:
                raise InvalidRequest("prompt must hold at least one token id", param="prompt")
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}", param="prompt"
                )
            prompt = {"prompt_token_ids": ids}
        if self.image_token_id in ids or (self.video_token_id is not None and self.video_token_id in ids):
            raise InvalidRequest("a completions prompt must not contain image placeholder tokens", param="prompt")
        return prompt

    @property
    def vocab_size(self) -> int:
        """The model's logits width: vLLM's bound for token ids (prompt, logit_bias, stop_token_ids)."""
        return int(self.vllm_config.model_config.get_vocab_size())

    def sampling_params(
        self,
        params: SamplingParams,
        *,
        max_tokens: int | None = None,
        final_only: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ):
        """vLLM's ``SamplingParams`` for ``params``, every field mapped (refused with
        :class:`InvalidRequest` first when vLLM would refuse it). ``max_tokens`` overrides the
        request's (a hand-off prefill samples one token it does not use: its ``min_tokens`` is capped
        to fit and it asks for no logprobs). Greedy (``temperature == 0``) runs unseeded; vLLM then
        ignores ``top_k`` / ``top_p`` / ``min_p`` too, while penalties, ``logit_bias`` and
        ``min_tokens`` still shape the logits the argmax takes."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        validate_params(params)
        check_sampling(params, vocab_size=self.vocab_size, max_logprobs=int(self.vllm_config.model_config.max_logprobs))
        handoff_prefill = max_tokens is not None
        n_tokens = max_tokens if max_tokens is not None else params.max_tokens
        return VllmSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 is vLLM's "off" too
            min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias) or None,
            min_tokens=min(params.min_tokens, n_tokens),
            stop_token_ids=list(params.stop_token_ids) or None,
            logprobs=None if handoff_prefill else params.logprobs,
            max_tokens=n_tokens,
            seed=params.seed if params.temperature > 0 else None,
            stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
            skip_special_tokens=True,
            output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
            # vLLM hands these to its KV connector (how its own P/D proxies pass them)
            extra_args={"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None,
            # (not on a hand-off prefill: its one token is thrown away and the decode engine, which
            # samples every output token, starts the grammar from the beginning)
            structured_outputs=(
                vllm_structured_outputs(params.structured) if params.structured and not handoff_prefill else None
            ),
        )

    def token_logprob(self, token_id: int, position: Any, k: int) -> TokenLogprob:
        """One position of vLLM's sample logprobs (token id -> ``Logprob(logprob, rank,
        decoded_token)``: the sampled token and the ``k`` most likely) as a :class:`TokenLogprob`:
        the sampled token's logprob and the top ``k``, most likely first. Token text is vLLM's
        ``decoded_token`` (what its OpenAI server returns), ``tokenizer.decode([id])`` without one."""
        if not position or token_id not in position:
            raise EngineError(f"vLLM returned no logprob for the sampled token {token_id}")

        def text(tid: int, lp: Any) -> str:
            return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])

        chosen = position[token_id]
        # the sampled token comes first, then the top k (one entry when it is among them)
        ranked = sorted(position.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0, kv[0]))[:k]
        return TokenLogprob(
            token_id=int(token_id),
            token=text(token_id, chosen),
            logprob=float(chosen.logprob),
            top=tuple((int(tid), text(tid, lp), float(lp.logprob)) for tid, lp in ranked),
        )

    async def _pump(self, prompt: dict[str, Any], sp: Any, request_id: str, post: Callable[[Any], None]) -> None:
        """vLLM loop: run one request, forwarding each output (then ``_END`` or the error)."""
        try:
            async for output in self._live_llm().generate(prompt, sp, request_id):
                post(output)
        except asyncio.CancelledError:  # the caller stopped reading; AsyncLLM.generate aborted it
            raise
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's side
            post(exc)
        else:
            post(_END)

    async def _outputs(self, prompt: dict[str, Any], sp: Any) -> AsyncGenerator[Any, None]:
        """The RequestOutputs of one request, on the caller's loop. Closing this iterator before
        the request finished (or cancelling the task that reads it) aborts it in vLLM."""
        self._live_llm()
        request_id = f"epd-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def post(item: Any) -> None:  # vLLM loop -> caller's loop
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody reads any more
                pass

        pump = asyncio.run_coroutine_threadsafe(self._pump(prompt, sp, request_id, post), self._loop)
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(outputs.get(), timeout=_EVENT_TIMEOUT_S)
                except TimeoutError:
                    raise EngineError(f"vLLM produced nothing for {_EVENT_TIMEOUT_S:.0f}s") from None
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    error = _translate(item)
                    if error is item:
                        raise item
                    raise error from item
                yield item
        finally:
            if not finished:  # the caller stopped early (closed, cancelled, error): free vLLM's slot
                pump.cancel()
                await self._abort(request_id)

    async def _abort(self, request_id: str) -> None:
        llm = self._llm
        if llm is None:
            return
        try:
            await asyncio.wait_for(self._on_vllm_loop(llm.abort(request_id)), timeout=10)
        except Exception as exc:  # noqa: BLE001 - best effort (the request may have just finished)
            log.debug("abort of %s failed: %s", request_id, exc)

    async def generate(  # type: ignore[override]  # media images only: vLLM encodes them (or its connector loads their features)
        self,
        messages: Prompt,
        images: Sequence[ConnectorItem],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Prefill + decode in vLLM; ``images`` are :class:`MediaImage` items (the connector
        loads their stored encoder outputs or vLLM encodes them); ``messages`` may be a
        :class:`RawPrompt` (no images). Fills ``stats.extra["ec_sources"]`` with where each item's
        features came from (connector's report). With ``params.logprobs`` set each event carries
        its :class:`TokenLogprob`."""
        async with contextlib.aclosing(self._token_events(messages, images, params, stats, None)) as events:
            async for event in events:
                yield event

    async def generate_from_handoff(
        self,
        messages: Prompt,
        images: Sequence[ConnectorItem],
        params: SamplingParams,
        handoff: KVHandoff,
        stats: GenerationStats | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """KV consumer engines (E|P|D decode): ``generate`` with the prompt's KV cache loaded
        from ``handoff`` (what :meth:`prefill_for_handoff` returned for the same messages and
        images) instead of computed; ``stats.extra["kv_source"]`` says what happened ("store",
        or "recomputed:<reason>" when vLLM had to prefill again)."""
        if self.kv_role != "kv_consumer":
            raise EngineError(f"loading a handed-off KV cache needs a KV consumer engine (role {self.kv_role!r})")
        async with contextlib.aclosing(self._token_events(messages, images, params, stats, handoff)) as events:
            async for event in events:
                yield event

    async def _token_events(
        self,
        messages: Prompt,
        images: Sequence[ConnectorItem],
        params: SamplingParams,
        stats: GenerationStats | None,
        handoff: KVHandoff | None,
    ) -> AsyncGenerator[TokenEvent, None]:
        prompt = self.build_prompt(messages, images)
        sp = self.sampling_params(params, kv_transfer_params=handoff.to_params() if handoff else None)
        t0 = time.perf_counter()
        first_at: float | None = None
        # Each token goes out as soon as vLLM hands it over (holding one back to mark the last
        # cost every request a decode step of TTFT): vLLM delivers the token of the finishing step
        # in the finished output, so that one carries ``finish_reason``. Text that comes without a
        # token rides on the next token.
        carry = ""
        n_out = 0
        async with contextlib.aclosing(self._outputs(prompt, sp)) as outputs:
            async for output in outputs:
                completion = output.outputs[0]
                if stats is not None and output.prompt_token_ids is not None:
                    stats.prompt_tokens = len(output.prompt_token_ids)
                new_ids = list(completion.token_ids)
                if new_ids and first_at is None:
                    first_at = time.perf_counter()
                reason = None
                if output.finished:
                    reason = completion.finish_reason
                    if reason not in ("stop", "length"):
                        raise EngineError(f"vLLM finished the request with {reason!r}")
                    if stats is not None:
                        now = time.perf_counter()
                        stats.prefill_s = (first_at or now) - t0
                        stats.decode_s = now - (first_at or now)
                        sources = ec_sources_of(output.ec_transfer_params)
                        if sources:
                            stats.extra["ec_sources"] = sources
                        if items := ec_items_of(output.ec_transfer_params):  # (an EC producer too: ec_both)
                            stats.extra["ec_items"] = {h: int(v.get("n_tokens", 0)) for h, v in items.items()}
                        if handoff is not None:
                            stats.extra["kv_source"] = kv_source_of(output.kv_transfer_params)
                        if output.num_cached_tokens is not None:  # prompt tokens its prefix cache had
                            stats.extra["cached_tokens"] = int(output.num_cached_tokens)
                if not new_ids:
                    carry += completion.text or ""
                    if output.finished:
                        if n_out:
                            log.warning(
                                "vLLM finished (%s) without a token in its last output: %r dropped", reason, carry
                            )
                        return
                    continue
                n_out += len(new_ids)
                if stats is not None:
                    stats.completion_tokens = n_out
                positions = completion.logprobs  # delta output: one position per new token, in order
                if params.logprobs is not None and (positions is None or len(positions) != len(new_ids)):
                    raise EngineError(
                        f"vLLM returned {0 if positions is None else len(positions)} logprob positions "
                        f"for {len(new_ids)} tokens"
                    )
                for i, token_id in enumerate(new_ids):
                    last = i == len(new_ids) - 1
                    text = carry + (completion.text or "") if last else ""
                    if last:
                        carry = ""
                    logprob = None
                    if params.logprobs is not None:
                        logprob = self.token_logprob(int(token_id), positions[i], params.logprobs)
                    yield TokenEvent(int(token_id), text, finish_reason=reason if last else None, logprob=logprob)
                if output.finished:
                    return
        raise EngineError("vLLM ended the request without a final output")

    async def _final_output(self, prompt: dict[str, Any], sp: Any) -> Any:
        """The last RequestOutput of a ``final_only`` request (None when vLLM sent none)."""
        final = None
        async with contextlib.aclosing(self._outputs(prompt, sp)) as outputs:
            async for output in outputs:
                final = output
        return final

    async def prefill_for_handoff(
        self,
        messages: Prompt,
        images: Sequence[ConnectorItem],
        params: SamplingParams,
        *,
        request_name: str,
        attempt: int,
        stats: GenerationStats | None = None,
    ) -> KVHandoff:
        """KV producer engines (E|P|D prefill): compute the prompt and have the KV connector
        store its KV cache as the KV object of (``request_name``, ``attempt``). Returns where it
        is, for a decode engine's :meth:`generate_from_handoff`. vLLM samples one token to finish
        the request; it is not used: the decode engine computes the last prompt token again and
        samples every output token itself, so seeded sampling draws exactly as in an aggregated
        run, and the penalties, ``logit_bias``, ``min_tokens`` and ``stop_token_ids`` count the
        completion's tokens from its first one, as there (the decode engine has the whole prompt for
        the repetition penalty)."""
        if self.kv_role != "kv_producer":
            raise EngineError(f"prefill_for_handoff() needs a KV producer engine (role {self.kv_role!r})")
        prompt = self.build_prompt(messages, images)
        ask = KVHandoffRequest(request_name, attempt).to_params()
        sp = self.sampling_params(params, max_tokens=1, final_only=True, kv_transfer_params=ask)
        t0 = time.perf_counter()
        final = await self._final_output(prompt, sp)
        if final is None or not final.finished:
            raise EngineError("vLLM ended the prefill request without a final output")
        try:
            handoff = KVHandoff.from_params(final.kv_transfer_params)
        except MalformedParams as exc:
            raise EngineError(f"vLLM's KV connector reported an unusable KV object for {request_name}: {exc}") from exc
        if handoff is None:
            raise EngineError(
                f"vLLM's KV connector reported no KV object for {request_name} (params {final.kv_transfer_params})"
            )
        if stats is not None:
            stats.prompt_tokens = len(final.prompt_token_ids or ())
            stats.prefill_s = time.perf_counter() - t0
            sources = ec_sources_of(final.ec_transfer_params)
            if sources:
                stats.extra["ec_sources"] = sources
            if items := ec_items_of(final.ec_transfer_params):  # (an EC producer too: ec_both)
                stats.extra["ec_items"] = {h: int(v.get("n_tokens", 0)) for h, v in items.items()}
            if final.num_cached_tokens is not None:  # prompt tokens its prefix cache had
                stats.extra["cached_tokens"] = int(final.num_cached_tokens)
        return handoff

    async def produce(self, images: Sequence[ConnectorItem]) -> list[int]:
        """Encoder-only producer: encode each image (or video); the connector stores the output
        under its item hash before vLLM finishes the request. Returns the token count per item."""
        if self.ec_role not in ("ec_producer", "ec_both"):
            raise EngineError(f"produce() needs an EC producer engine (role {self.ec_role!r})")
        sp = self.sampling_params(SamplingParams(max_tokens=1, temperature=0.0), final_only=True)
        counts = []
        for item in images:  # one request per image: per-item results, errors stay per image
            part = "video" if isinstance(item, MediaVideo) else "image"
            messages = [{"role": "user", "content": [{"type": part}]}]
            final = await self._final_output(self.build_prompt(messages, [item]), sp)
            info = ec_items_of(final.ec_transfer_params if final is not None else None).get(item.item_hash)
            if not info:
                raise EngineError(f"vLLM producer reported no EC item for {item.item_hash[:12]}")
            counts.append(int(info["n_tokens"]))
        return counts

    async def num_unfinished_requests(self) -> int:
        """Requests vLLM is still working on (0 when idle: nothing left behind)."""
        llm = self._live_llm()

        async def count() -> int:
            return llm.get_num_unfinished_requests()

        return await self._on_vllm_loop(count())

    async def aclose(self) -> None:
        """Stop vLLM's engine processes and the private loop."""
        llm, self._llm = self._llm, None
        if llm is not None and self._loop.is_running():

            async def shutdown() -> None:
                llm.shutdown()

            try:
                await asyncio.wait_for(self._on_vllm_loop(shutdown()), timeout=60)
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("vLLM shutdown: %s", exc)
        await asyncio.to_thread(self._stop_loop)


#: what a context-length refusal adds: where the length comes from
CONTEXT_SOURCE = (
    "the maximum model length is EPD_MAX_MODEL_LEN (epd up --max-model-len) where set, else the model's "
    "max_position_embeddings"
)


def _translate(exc: BaseException) -> BaseException:
    """vLLM's errors as typed project errors: bad requests -> InvalidRequest, the rest -> EngineError."""
    from vllm.exceptions import VLLMValidationError

    if isinstance(exc, (InvalidRequest, EngineError)):
        return exc
    if isinstance(exc, (VLLMValidationError, ValueError)):
        message = f"vLLM rejected the request: {exc}"
        if "maximum model length" in message or "maximum context length" in message:
            message += f" ({CONTEXT_SOURCE})"
        return InvalidRequest(message, param=getattr(exc, "parameter", None))
    if isinstance(exc, asyncio.CancelledError):
        return EngineError("vLLM request was cancelled")
    return EngineError(f"vLLM failed: {type(exc).__name__}: {exc}")
