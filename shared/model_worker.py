"""What the model workers (encoder, prefill, decode) share: :class:`ModelHandler`, the handler
base that owns an engine and the EC store of its encoder fingerprint, plus the request-side
helpers they all need (stored images checked against their item hash, sampling settings)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

import msgspec

from shared.config import EngineSettings, MediaSettings, ModelSettings, WorkerSettings
from shared.engines import check_role, engine_class, load_engine
from shared.engines.base import (
    ChatPrompt,
    ConnectorItem,
    Engine,
    Prompt,
    RawPrompt,
    SamplingParams,
    VideoFrames,
    connector_item,
    join_video_media,
)
from shared.errors import EngineError, InvalidImage, InvalidVideo, MediaMissing
from shared.media import MediaLimits, decode_image
from shared.protocol import MediaKind
from shared.store.format import ObjectValidationError, decode_video_frames_with_source
from shared.topology import Role, service_of
from shared.worker import Handler, WorkerContext

if TYPE_CHECKING:
    from PIL import Image

    from shared.identity import ModelIdentity
    from shared.protocol import GenerationJob, ImageRef, SamplingSpec
    from shared.store.ec import ECStore
    from shared.store.kv import KVStore

log = logging.getLogger(__name__)


def exit_unless_engine_fits(model: ModelSettings, role: Role) -> None:
    """Start-up, before anything is loaded: exit with a clear message when ``model.engine``
    cannot play ``role`` (``shared.engines.check_role``)."""
    try:
        check_role(engine_class(model.engine), role)
    except EngineError as exc:
        raise SystemExit(f"{service_of(role)} worker: {exc}") from None


def bind_cpus_or_exit(runtime: EngineSettings) -> None:
    """Start-up, before anything is loaded: bind the process to ``EPD_CPU_CORES`` and lower its
    priority by ``EPD_CPU_NICE`` (``shared.cpus``)."""
    from shared.cpus import bind_process, lower_priority

    try:
        bind_process(runtime.cpu_cores)
    except ValueError as exc:
        raise SystemExit(f"worker: {exc}") from None
    lower_priority(runtime.cpu_nice)


def media_limits(media: MediaSettings) -> MediaLimits:
    return MediaLimits(max_image_bytes=media.max_image_bytes, max_pixels=media.max_image_pixels)


def video_from_bytes(data: bytes, item_hash: str) -> VideoFrames:
    """A video's stored sampled frames, checked to be the item (its id) and intact (its checksum)."""
    import numpy as np

    try:
        frames, fps, source = decode_video_frames_with_source(data, item_hash=item_hash)
    except ObjectValidationError as exc:
        raise InvalidVideo(f"stored video frames of item {item_hash[:12]} are not usable: {exc}") from None
    array = np.frombuffer(frames.data, dtype=np.uint8).reshape(frames.shape)
    if source is None:
        return VideoFrames(frames=array, fps=fps)
    return VideoFrames(
        frames=array, fps=fps, indices=source.indices, source_fps=source.fps, total_frames=source.total_frames
    )


def image_from_bytes(data: bytes, item_hash: str, limits: MediaLimits) -> Image.Image:
    """Decode stored image bytes, checking they are the item they claim to be."""
    image, content_hash, _fmt = decode_image(data, limits)
    if content_hash != item_hash:
        raise InvalidImage(f"stored image hashes to {content_hash[:12]}, expected item {item_hash[:12]}")
    return image


def sampling_params(spec: SamplingSpec, *, seed: int | None) -> SamplingParams:
    """The engine's sampling settings for a job's wire ``SamplingSpec``: every field carried over by
    name (a field ``SamplingParams`` lacks is a TypeError here, never dropped), with ``seed`` the one
    the job runs with (``protocol.effective_seed``, or the seed a handed-off decode state carries)."""
    fields = msgspec.structs.asdict(spec)
    fields.update(
        seed=seed,
        stop=tuple(spec.stop),
        logit_bias=tuple(spec.logit_bias),
        stop_token_ids=tuple(spec.stop_token_ids),
    )
    return SamplingParams(**fields)


def job_prompt(job: GenerationJob) -> Prompt:
    """What the engine takes as a job's prompt: its chat ``messages`` (a :class:`ChatPrompt`
    when the request gave ``tools``: the chat template renders them), or for a completions
    request (``job.prompt`` set) a :class:`RawPrompt` - text used verbatim, or token ids."""
    if job.prompt is None:
        if job.tools:
            return ChatPrompt(messages=job.messages, tools=tuple(json.loads(t) for t in job.tools))
        return job.messages
    if isinstance(job.prompt, str):
        return RawPrompt(text=job.prompt)
    return RawPrompt(token_ids=tuple(job.prompt))


class ModelHandler(Handler):
    """A worker handler with an engine and the EC store of that engine's encoder fingerprint.

    Both are built in :meth:`setup` unless given (tests pass a shared engine and a store); an
    engine built here (``shared.engines.load_engine`` for this handler's role) is closed in
    :meth:`close` (vLLM stops its engine processes then). Subclasses set ``role`` before
    ``setup`` and pick their strategies from the engine's capabilities in their own ``setup``:
    the engine has what the role needs (``shared.engines.check_role``)."""

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None, store: ECStore | None = None):
        self.settings = settings
        self.engine = engine
        self.store = store
        self.limits = media_limits(settings.media)
        self.ctx: WorkerContext | None = None
        self._owned_engine: Engine | None = None

    @property
    def identity(self) -> ModelIdentity:
        """What this worker serves: its engine's identity (``shared.identity``; set in :meth:`setup`)."""
        assert self.engine is not None, "the model identity is known once the engine is loaded"
        return self.engine.identity

    @property
    def fingerprint(self) -> str:
        return self.engine.identity.fingerprint if self.engine else ""

    def engine_capacity(self) -> str:
        """What the engine's capacity is derived from, for the start-up line (``Engine.capacity``)."""
        assert self.engine is not None
        return ", ".join(f"{k}={v}" for k, v in self.engine.capacity().items() if v is not None)

    async def model_kv_store(self) -> KVStore:
        """The KV store of this worker's model fingerprint (E|P|D prefill and decode workers: both
        sides must compute the same fingerprint, so both build it here)."""
        from shared.store.factory import open_stores

        identity, settings = self.identity, self.settings
        fp = await asyncio.to_thread(lambda: identity.model_fingerprint)  # reads every weight once
        stores = await asyncio.to_thread(
            lambda: open_stores(settings.store, producer=settings.worker_id, kv_fingerprint=fp, ensure_bucket=True)
        )
        return stores.kv_store()

    async def setup(self, ctx: WorkerContext) -> None:
        from shared.store.factory import open_stores

        self.ctx = ctx
        if self.engine is None:
            self.engine = await asyncio.to_thread(load_engine, self.settings, self.role)
            self._owned_engine = self.engine
        else:  # (load_engine checks before loading)
            check_role(type(self.engine), self.role)
        if self.store is None:
            settings, fingerprint = self.settings, self.identity.fingerprint
            stores = await asyncio.to_thread(
                lambda: open_stores(
                    settings.store,
                    producer=settings.worker_id,
                    ec_fingerprint=fingerprint,
                    max_media_bytes=settings.media.max_stored_media_bytes,
                    ensure_bucket=True,
                )
            )
            self.store = stores.ec_store()

    async def media_bytes(self, ref: ImageRef) -> bytes:
        """A request's stored image bytes. Raises MediaMissing when they are gone."""
        assert self.store is not None
        data = await asyncio.to_thread(self.store.get_media, ref.media_key)
        if data is None:
            raise MediaMissing(f"image {ref.item_hash[:12]} is not in the store (key {ref.media_key})")
        return data

    async def image(self, ref: ImageRef) -> Image.Image:
        """A request's image from the store, checked against its item hash. Raises MediaMissing
        when it is gone, InvalidImage when it is not the item."""
        data = await self.media_bytes(ref)
        return await asyncio.to_thread(image_from_bytes, data, ref.item_hash, self.limits)

    async def media(self, ref: ImageRef) -> Image.Image | VideoFrames:
        """A request's media item from the store: an image (:meth:`image`), or a video's sampled
        frames (validated against its item and checksum). Raises MediaMissing when it is gone,
        InvalidImage / InvalidVideo when it is not the item."""
        if ref.kind != MediaKind.VIDEO:
            return await self.image(ref)
        data = await self.media_bytes(ref)
        return await asyncio.to_thread(video_from_bytes, data, ref.item_hash)

    async def connector_media(self, ref: ImageRef) -> ConnectorItem:
        """A request's media item as :class:`FeaturesThroughConnector` engines take it: an image, a
        video's frames, or a segmented video's segments' frames joined under the video's item."""
        if ref.segments:
            parts = await asyncio.gather(*(self.connector_media(seg) for seg in ref.segments))
            return join_video_media(parts, ref)
        return connector_item(await self.media(ref), ref.item_hash)

    async def close(self) -> None:
        if self._owned_engine is not None:
            await self._owned_engine.aclose()
