"""Model-side helpers shared by the encoder and prefill workers (synchronous; engine thread)."""

from __future__ import annotations

import logging
import time

from shared.config import CommonSettings
from shared.engines import make_engine
from shared.engines.base import EncodedImage, Engine
from shared.errors import InvalidImage
from shared.media import MediaLimits, decode_image

log = logging.getLogger(__name__)


def load_engine(settings: CommonSettings) -> Engine:
    model_dir = settings.require_model_path()
    started = time.perf_counter()
    engine = make_engine(
        settings.engine,
        model_dir,
        dtype=settings.dtype,
        threads=settings.torch_threads,
        model_id=settings.served_model_name(),
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
