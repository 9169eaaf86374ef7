"""Helpers shared by the vLLM end-to-end tests (engines and stack)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.engines.base import GenerationStats, MediaImage, SamplingParams
from shared.media import content_hash_of
from shared.store.objects import S3ObjectStore
from tests.stackutil import engine_messages, noise_image, require_vllm_tier

#: Where tests leave fault instructions for tests.vllm_faults.FaultInjectingECConnector.
FAULT_DIR_ENV = "EPD_TEST_EC_FAULT_DIR"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CASES = [
    ("non-square", "Describe the image.", [(11, (64, 48))]),
    ("square", "What color dominates?", [(12, (56, 56))]),
    ("two-images", "Compare these two images.", [(14, (56, 84)), (15, (84, 56))]),
]


def media(seed: int, size: tuple[int, int]) -> MediaImage:
    """A deterministic noise image with its content hash (the item hash the API computes)."""
    image = noise_image(seed, size)
    return MediaImage(image=image, item_hash=content_hash_of(image))


async def generate(engine, text: str, items: list[MediaImage]) -> tuple[list[int], GenerationStats]:
    """Greedy token ids of one user turn (images first, then ``text``) and the engine's stats."""
    stats = GenerationStats()
    events = [e async for e in engine.generate(engine_messages(text, len(items)), items, GREEDY, stats)]
    assert events[-1].finish_reason == "length"
    return [e.token_id for e in events], stats


def s3_connector_config(s3_server, *, namespace: str, ak_env: str, sk_env: str) -> dict:
    """A fresh bucket and the connector extra config pointing at it; the credentials go into the
    environment variables the config names (vLLM's processes inherit them)."""
    os.environ[ak_env], os.environ[sk_env] = s3_server.access_key, s3_server.secret_key
    bucket = f"{namespace}-{uuid.uuid4().hex[:10]}"
    S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket).ensure_bucket()
    return {
        "endpoint": s3_server.endpoint,
        "bucket": bucket,
        "namespace": namespace,
        "access_key_env": ak_env,
        "secret_key_env": sk_env,
    }


def close_engine(engine) -> None:
    """``await engine.aclose()`` from synchronous code (a fixture's teardown), in a thread of its
    own so it works whether or not an event loop runs in the caller's thread."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, engine.aclose()).result()


@contextlib.contextmanager
def started_engines(model_dir: Path, *options: dict) -> Iterator[tuple]:
    """One ``VllmEngine`` of ``model_dir`` per ``options`` dict (keyword arguments), started in
    parallel (one takes ~40 s here) and closed, last first, on exit. When one fails to start, the
    others are still waited for and closed before the error is raised: no engine is left behind."""
    from shared.engines.vllm_engine import VllmEngine

    require_vllm_tier("started_engines")
    started, error = [], None
    with ThreadPoolExecutor(len(options)) as pool:
        for future in [pool.submit(VllmEngine, model_dir, **kw) for kw in options]:
            try:
                started.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised once every engine is accounted for
                error = error or exc
    try:
        if error is not None:
            raise error
        yield tuple(started)
    finally:
        for engine in reversed(started):
            close_engine(engine)
