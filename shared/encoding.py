"""Model-side helpers shared by the encoder and prefill workers: engine loading, image encoding
(synchronous, engine thread) and :class:`ModelHandler`, the handler base that owns both."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING

from shared.config import CommonSettings
from shared.engines import engine_class, make_engine
from shared.engines.base import EncodedImage, Engine, MediaImage, SamplingParams
from shared.errors import EngineError, InvalidImage, MediaMissing
from shared.media import MediaLimits, decode_image
from shared.worker import Handler, WorkerContext

if TYPE_CHECKING:
    from shared.store.ec import ECStore
    from shared.protocol import ImageRef, SamplingSpec

log = logging.getLogger(__name__)


def load_engine(settings: CommonSettings, *, role: str = "") -> Engine:
    """The engine of ``settings.engine``; ``role`` ("encoder", "pd", "agg", ...) lets an engine
    pick its part (vLLM: EC producer for "encoder", EC consumer for "pd")."""
    model_dir = settings.require_model_path()
    started = time.perf_counter()
    engine = make_engine(
        settings.engine,
        model_dir,
        dtype=settings.dtype,
        threads=settings.torch_threads,
        model_id=settings.served_model_name(),
        **engine_class(settings.engine).options_from_settings(settings, role=role),
    )
    log.info(
        "engine %s loaded %s in %.2fs (encoder fingerprint %s)",
        settings.engine, model_dir, time.perf_counter() - started, engine.encoder_fingerprint,
    )
    return engine


def media_limits(settings: CommonSettings) -> MediaLimits:
    return MediaLimits(max_image_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels)


def encode_image_bytes(engine: Engine, data: bytes, item_hash: str, limits: MediaLimits) -> EncodedImage:
    """Decode stored image bytes, check they are the item they claim to be, run the encoder."""
    image, content_hash, _fmt = decode_image(data, limits)
    if content_hash != item_hash:
        raise InvalidImage(f"stored image hashes to {content_hash[:12]}, expected item {item_hash[:12]}")
    return engine.encode([image])[0]


def media_image_from_bytes(data: bytes, item_hash: str, limits: MediaLimits) -> MediaImage:
    """Decode stored image bytes for a connector engine, checking they are the item they claim to be."""
    image, content_hash, _fmt = decode_image(data, limits)
    if content_hash != item_hash:
        raise InvalidImage(f"stored image hashes to {content_hash[:12]}, expected item {item_hash[:12]}")
    return MediaImage(image=image, item_hash=item_hash)


def sampling_params(spec: "SamplingSpec", *, seed: int | None) -> SamplingParams:
    """The engine's sampling settings for a job's wire ``SamplingSpec``; ``seed`` is the one the
    job runs with (``protocol.effective_seed``, or the seed a handed-off decode state carries)."""
    return SamplingParams(
        max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, seed=seed,
        stop=tuple(spec.stop), ignore_eos=spec.ignore_eos,
    )


#: Engines whose decode state can be handed from a prefill worker to a decode worker (E|P|D).
KV_HANDOFF_ENGINES = frozenset({"transformers", "vllm"})


def require_kv_handoff_engine(engine: str, role: str) -> None:
    """Refuse, at start-up, a prefill/decode split on an engine that cannot hand off its KV cache."""
    if engine not in KV_HANDOFF_ENGINES:
        raise EngineError(
            f"the {engine!r} engine cannot run the {role!r} role: E|P|D hands the KV cache from prefill to "
            f"decode workers through the object store, which only these engines do: "
            f"{', '.join(sorted(KV_HANDOFF_ENGINES))} (see README, 'E|P|D topology'). Use one of them for "
            "E|P|D, or the e-pd topology with this engine."
        )


class ModelHandler(Handler):
    """A worker handler with an engine and the EC store of that engine's encoder fingerprint.

    Both are built in :meth:`setup` unless given (tests pass a shared engine and a store); an
    engine built here is closed in :meth:`close` (vLLM stops its engine processes then)."""

    def __init__(self, settings: CommonSettings, engine: Engine | None = None, store: "ECStore | None" = None):
        super().__init__()
        self.settings = settings
        self.engine = engine
        self.store = store
        self.limits = media_limits(settings)
        self.ctx: WorkerContext | None = None
        self._owned_engine: Engine | None = None

    @property
    def fingerprint(self) -> str:
        return self.engine.encoder_fingerprint if self.engine else ""

    @property
    def engine_role(self) -> str:
        """The part the engine plays for this worker (see :func:`load_engine`)."""
        return self.role

    async def setup(self, ctx: WorkerContext) -> None:
        from shared.store.factory import ec_store_from_settings

        self.ctx = ctx
        if self.engine is None:
            self.engine = await self.run_compute(functools.partial(load_engine, self.settings, role=self.engine_role))
            self._owned_engine = self.engine
        if self.store is None:
            self.store = await asyncio.to_thread(ec_store_from_settings, self.settings, self.engine.encoder_fingerprint)

    async def media_bytes(self, ref: "ImageRef") -> bytes:
        """A request's stored image bytes. Raises MediaMissing when they are gone."""
        assert self.store is not None
        data = await asyncio.to_thread(self.store.get_media, ref.media_key)
        if data is None:
            raise MediaMissing(f"image {ref.item_hash[:12]} is not in the store (key {ref.media_key})")
        return data

    async def media_image(self, ref: "ImageRef") -> MediaImage:
        """A request's image from the store, checked against its item hash (connector engines
        take images, not features). Raises MediaMissing when it is gone."""
        data = await self.media_bytes(ref)
        return await asyncio.to_thread(media_image_from_bytes, data, ref.item_hash, self.limits)

    async def close(self) -> None:
        await super().close()
        if self._owned_engine is not None:
            await asyncio.to_thread(self._owned_engine.close)

