"""Encoder worker: EncodeJob -> vision encoder -> versioned EC object in the store -> ECReady.

With a connector engine (``EPD_ENGINE=vllm``) the engine runs as an encoder-only EC producer and
its own EC connector writes the object; the worker announces it once the store has it.

Idempotent: a valid object already stored for the job's key is announced again, not recomputed.
A job that cannot succeed (bad image, wrong model version, missing media) is answered with an
``ECFailed`` event and terminated, so prefill workers stop waiting and encode locally or fail
the request. Transient failures (store down) are retried with a delay up to ``max_deliver``;
the last attempt publishes ``ECFailed``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared import metrics, protocol
from shared.config import EncoderSettings
from shared.store.format import ECValidationError
from shared.store.ec import ECStore
from shared.store.tensors import encoded_to_extra, tensor_to_raw
from shared.encoding import ModelHandler, encode_image_bytes, media_image_from_bytes
from shared.engines.base import Engine
from shared.errors import EPDError, InvalidImage, MediaMissing, StoreError
from shared.protocol import ECFailed, ECReady, EncodeJob
from shared.worker import Verdict

log = logging.getLogger(__name__)


class EncoderHandler(ModelHandler):
    role = "encoder"
    stream_attr = "stream_encode"
    durable = protocol.CONSUMER_ENCODER

    def __init__(self, settings: EncoderSettings, engine: Engine | None = None, store: ECStore | None = None):
        super().__init__(settings, engine, store)
        self.settings: EncoderSettings = settings

    async def handle(self, delivery) -> Verdict:
        try:
            job = protocol.decode(delivery.data, EncodeJob)
        except protocol.ProtocolError as exc:
            metrics.ENCODE_JOBS.labels("bad_message").inc()
            return Verdict.term(f"undecodable encode job: {exc}")
        if delivery.published_at:
            metrics.QUEUE_SECONDS.labels("encode").observe(max(0.0, time.time() - delivery.published_at))

        if job.fingerprint != self.fingerprint:
            # A job for another model version (e.g. during a rollout): this worker must not
            # produce it. Tell the waiters so they encode with their own model.
            await self._failed(job, "fingerprint_mismatch", f"worker fingerprint {self.fingerprint} != job {job.fingerprint}")
            return Verdict.term("fingerprint mismatch")
        try:
            return await self._encode(job, delivery.num_delivered)
        except (InvalidImage, MediaMissing) as exc:
            await self._failed(job, exc.code, exc.message)
            metrics.ENCODE_JOBS.labels("failed").inc()
            return Verdict.term(exc.message)
        except Exception as exc:
            transient = isinstance(exc, StoreError)
            log.warning("encode of %s failed (%s): %s", job.image.item_hash[:12], type(exc).__name__, exc,
                        exc_info=not transient)
            if delivery.is_last_attempt:
                code = exc.code if isinstance(exc, EPDError) else "encoder_error"
                await self._failed(job, code, f"gave up after {delivery.num_delivered} attempts: {exc}")
                metrics.ENCODE_JOBS.labels("failed").inc()
                return Verdict.term(str(exc))
            metrics.ENCODE_JOBS.labels("retried").inc()
            return Verdict.nak(1.0 * delivery.num_delivered, str(exc))

    async def _encode(self, job: EncodeJob, attempt: int) -> Verdict:
        assert self.store is not None and self.engine is not None and self.ctx is not None
        item = job.image.item_hash
        existing = None
        if await asyncio.to_thread(self.store.exists, item):
            try:
                existing = await asyncio.to_thread(self.store.load, item, request_id=job.request_id)
            except ECValidationError:
                pass  # invalid object: recompute and overwrite it
        if existing is not None:
            log.info("item %s already stored by %s: announcing, not recomputing", item[:12], existing.producer)
            await self._ready(job, existing.n_tokens, len(existing.data), 0.0)
            metrics.ENCODE_JOBS.labels("already_stored").inc()
            return Verdict.ack()

        data = await asyncio.to_thread(self.store.get_media, job.image.media_key)
        if data is None:
            raise MediaMissing(f"image {item[:12]} is not in the store (key {job.image.media_key})")
        started_at = time.time()
        if self.engine.features_via_connector:
            return await self._produce(job, data, attempt, started_at)
        started = time.perf_counter()
        encoded = await self.run_compute(self._compute, data, item)
        encode_s = time.perf_counter() - started
        metrics.ENCODE_SECONDS.observe(encode_s)
        raw, dtype, shape = tensor_to_raw(encoded.features)
        _key, nbytes = await asyncio.to_thread(
            self.store.save, item, raw, dtype=dtype, shape=shape, extra=encoded_to_extra(encoded)
        )
        log.info("encoded %s: %d tokens, %d bytes, %.3fs (attempt %d)", item[:12], shape[0], nbytes, encode_s, attempt)
        await self._ready(job, shape[0], nbytes, encode_s, started_at=started_at)
        metrics.ENCODE_JOBS.labels("encoded").inc()
        return Verdict.ack()

    async def _produce(self, job: EncodeJob, data: bytes, attempt: int, started_at: float) -> Verdict:
        """Connector engines (vLLM): the engine's own EC connector writes the object while it
        encodes; announce it only once the store has it."""
        assert self.store is not None and self.engine is not None
        item = job.image.item_hash
        started = time.perf_counter()
        run = asyncio.to_thread if self.engine.concurrent else self.run_compute
        n_tokens = await run(self._compute, data, item)
        encode_s = time.perf_counter() - started
        metrics.ENCODE_SECONDS.observe(encode_s)
        info = None
        if await asyncio.to_thread(self.store.exists, item):
            info = await asyncio.to_thread(self.store.store.stat, self.store.key(item))
        if info is None:  # e.g. the store was down during the save: retried, then ECFailed
            raise StoreError(f"the {self.engine.name} engine's EC connector did not store item {item[:12]}")
        log.info("encoded %s via the %s connector: %d tokens, %d bytes, %.3fs (attempt %d)",
                 item[:12], self.engine.name, n_tokens, info.size, encode_s, attempt)
        await self._ready(job, n_tokens, info.size, encode_s, started_at=started_at)
        metrics.ENCODE_JOBS.labels("encoded").inc()
        return Verdict.ack()

    def _compute(self, data: bytes, item_hash: str):
        if self.settings.fault_encode_delay_s:
            log.warning("fault injection: sleeping %.1fs before encoding %s", self.settings.fault_encode_delay_s,
                        item_hash[:12])
            time.sleep(self.settings.fault_encode_delay_s)
        if self.engine.features_via_connector:  # -> token count; the connector stores the output
            return self.engine.produce([media_image_from_bytes(data, item_hash, self.limits)])[0]
        return encode_image_bytes(self.engine, data, item_hash, self.limits)

    async def _ready(self, job: EncodeJob, n_tokens: int, nbytes: int, encode_s: float, *,
                     started_at: float = 0.0) -> None:
        assert self.ctx is not None
        event = ECReady(
            request_id=job.request_id,
            item_hash=job.image.item_hash,
            fingerprint=job.fingerprint,
            ec_key=job.ec_key,
            n_tokens=n_tokens,
            nbytes=nbytes,
            producer=self.settings.worker_id,
            encode_s=encode_s,
            created_at=time.time(),
            encode_started_at=started_at,
        )
        await self.ctx.publisher.publish(
            self.ctx.subjects.ec_ready(job.fingerprint, job.image.item_hash), event, request_id=job.request_id
        )

    async def _failed(self, job: EncodeJob, code: str, message: str) -> None:
        assert self.ctx is not None
        log.warning("encode job for %s failed: %s: %s", job.image.item_hash[:12], code, message)
        event = ECFailed(
            request_id=job.request_id,
            item_hash=job.image.item_hash,
            fingerprint=job.fingerprint,
            code=code,
            message=message,
            created_at=time.time(),
        )
        await self.ctx.publisher.publish(
            self.ctx.subjects.ec_failed(job.fingerprint, job.image.item_hash), event, request_id=job.request_id
        )
