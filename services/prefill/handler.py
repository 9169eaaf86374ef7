"""Prefill worker, ``pd`` role (E|PD): GenerationJob -> encoder outputs -> prefill + decode -> tokens.

Where each image's features come from, in order:

1. this worker's in-memory cache (``local_cache``);
2. the EC store. The worker subscribes to the item's ``ec.ready`` / ``ec.failed`` events *before*
   looking in the store, so an encoder finishing in between cannot be missed;
3. if the object is not there yet, the ready event (waiting up to ``ec_wait_s``) then the store;
4. else, and on any failed load (corrupt, other fingerprint, store down, encoder gave up),
   the worker encodes the image itself from the stored image bytes and writes the result back
   (repairing a bad object). The reason is logged and counted
   (``epd:ec_lookups_total{source="recomputed",reason=...}``).

Tokens go to ``<prefix>.tokens.<request_id>`` as ``TokenChunk`` messages numbered by ``seq``; a
redelivered job regenerates from the start (same seed, same tokens) with a higher ``attempt`` and
the API forwards only what it has not sent yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import OrderedDict

from shared import metrics, protocol
from shared.config import PrefillSettings
from shared.ecstore.factory import ec_store_from_settings
from shared.ecstore.format import ECValidationError, MissReason
from shared.ecstore.store import ECStore
from shared.ecstore.tensors import ec_object_to_encoded, encoded_to_extra, tensor_to_raw
from shared.encoding import encode_image_bytes, load_engine, media_limits
from shared.engines.base import EncodedImage, Engine, GenerationStats, SamplingParams
from shared.errors import DeadlineExceeded, EPDError, InvalidRequest, MediaMissing, StoreError
from shared.protocol import ECFailed, ErrorEvent, FinalResult, GenerationJob, ImageRef, TokenChunk
from shared.worker import Handler, Verdict, WorkerContext

log = logging.getLogger(__name__)

_DONE = object()


class FeatureCache:
    """A byte-bounded LRU of encoder outputs, by item hash."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, EncodedImage] = OrderedDict()

    @staticmethod
    def _size(item: EncodedImage) -> int:
        return item.features.numel() * item.features.element_size()

    def get(self, key: str) -> EncodedImage | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: EncodedImage) -> None:
        size = self._size(item)
        if size > self.max_bytes or key in self._items:
            return
        self._items[key] = item
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= self._size(old)


def request_seed(request_id: str, seed: int | None) -> int:
    """The seed used for sampling: the client's, else one derived from the request id, so a
    redelivered job samples the same tokens it already streamed."""
    return seed if seed is not None else zlib.crc32(request_id.encode())


class PrefillHandler(Handler):
    role = "prefill"
    stream_attr = "stream_generate"
    durable = protocol.CONSUMER_PREFILL

    def __init__(self, settings: PrefillSettings, engine: Engine | None = None, store: ECStore | None = None):
        super().__init__()
        self.settings = settings
        self.engine = engine
        self.store = store
        self.cache = FeatureCache(settings.local_cache_bytes)
        self.limits = media_limits(settings)
        self.ctx: WorkerContext | None = None

    @property
    def fingerprint(self) -> str:
        return self.engine.encoder_fingerprint if self.engine else ""

    async def setup(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        if self.engine is None:
            self.engine = await self.run_compute(load_engine, self.settings)
        if self.store is None:
            self.store = await asyncio.to_thread(ec_store_from_settings, self.settings, self.engine.encoder_fingerprint)

    # -- job -------------------------------------------------------------------------------
    async def handle(self, delivery) -> Verdict:
        try:
            job = protocol.decode(delivery.data, GenerationJob)
        except protocol.ProtocolError as exc:
            metrics.GENERATION_JOBS.labels("bad_message").inc()
            return Verdict.term(f"undecodable generation job: {exc}")
        if delivery.published_at:
            metrics.QUEUE_SECONDS.labels("generate").observe(max(0.0, time.time() - delivery.published_at))
        if time.time() > job.deadline:
            await self._error(job, "deadline_exceeded", "request deadline passed before a worker took it", 504)
            metrics.GENERATION_JOBS.labels("expired").inc()
            return Verdict.term("deadline passed")
        try:
            await self._generate(job, delivery.num_delivered)
        except InvalidRequest as exc:
            await self._error(job, exc.code, exc.message, exc.http_status)
            metrics.GENERATION_JOBS.labels("rejected").inc()
            return Verdict.term(exc.message)
        except Exception as exc:
            transient = isinstance(exc, StoreError)
            if transient and not delivery.is_last_attempt:
                metrics.GENERATION_JOBS.labels("retried").inc()
                return Verdict.nak(1.0 * delivery.num_delivered, str(exc))
            log.error("generation failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, EPDError))
            code = exc.code if isinstance(exc, EPDError) else "engine_error"
            status = exc.http_status if isinstance(exc, EPDError) else 500
            await self._error(job, code, f"{type(exc).__name__}: {exc}", status)
            metrics.GENERATION_JOBS.labels("failed").inc()
            return Verdict.term(str(exc))
        metrics.GENERATION_JOBS.labels("ok").inc()
        return Verdict.ack()

    async def _generate(self, job: GenerationJob, attempt: int) -> None:
        assert self.ctx is not None and self.engine is not None
        t0 = time.perf_counter()
        distinct = {ref.item_hash: ref for ref in job.images}
        resolved = await asyncio.gather(*(self.resolve_image(ref, job.request_id) for ref in distinct.values()))
        by_hash = dict(zip(distinct, resolved))
        images = [by_hash[ref.item_hash][0] for ref in job.images]
        sources = {h: src for h, (_, src) in by_hash.items()}
        t_features = time.perf_counter()

        sp = job.sampling
        params = SamplingParams(
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            seed=request_seed(job.request_id, sp.seed),
            stop=tuple(sp.stop),
            ignore_eos=sp.ignore_eos,
        )
        stats = GenerationStats()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            try:
                for event in self.engine.generate(job.messages, images, params, stats):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if time.time() > job.deadline:  # nobody is waiting any more: free the engine
                        raise DeadlineExceeded("request deadline passed during generation")
            except BaseException as exc:  # re-raised on the event loop side
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        compute = asyncio.ensure_future(self.run_compute(produce))
        subject = self.ctx.subjects.tokens(job.request_id)
        token_ids: list[int] = []
        text_parts: list[str] = []
        finish_reason = "length"
        first_token_at = None
        while True:
            event = await queue.get()
            if event is _DONE:
                break
            if isinstance(event, BaseException):
                await compute
                raise event
            if first_token_at is None:
                first_token_at = time.perf_counter()
            chunk = TokenChunk(
                request_id=job.request_id, attempt=attempt, seq=len(token_ids),
                token_ids=(event.token_id,), text=event.text,
            )
            token_ids.append(event.token_id)
            text_parts.append(event.text)
            if event.finish_reason:
                finish_reason = event.finish_reason
            await self.ctx.publisher.publish(subject, chunk, request_id=job.request_id)
        await compute
        t_end = time.perf_counter()
        final = FinalResult(
            request_id=job.request_id,
            attempt=attempt,
            token_ids=tuple(token_ids),
            text="".join(text_parts),
            finish_reason=finish_reason,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            timings={
                "features_s": t_features - t0,
                "prefill_s": stats.prefill_s,
                "decode_s": stats.decode_s,
                "first_token_s": (first_token_at - t0) if first_token_at else 0.0,
                "total_s": t_end - t0,
            },
            ec_sources=sources,
            worker=self.settings.worker_id,
        )
        await self.ctx.publisher.publish(subject, final, request_id=job.request_id)
        log.info(
            "done: %d prompt + %d completion tokens, finish=%s, features %.3fs, total %.3fs, sources=%s",
            stats.prompt_tokens, stats.completion_tokens, finish_reason, t_features - t0, t_end - t0, sources,
        )

    # -- encoder outputs -------------------------------------------------------------------
    async def resolve_image(self, ref: ImageRef, request_id: str) -> tuple[EncodedImage, str]:
        """Features for one image and where they came from ("local_cache", "store", "recomputed:<reason>")."""
        assert self.ctx is not None and self.store is not None
        cached = self.cache.get(ref.item_hash)
        if cached is not None:
            metrics.EC_LOOKUPS.labels("local_cache", "hit", "").inc()
            return cached, "local_cache"

        reason = MissReason.NOT_FOUND
        sub = None
        if self.ctx.nc is not None:
            sub = await self.ctx.nc.subscribe(self.ctx.subjects.ec_any(self.fingerprint, ref.item_hash))
        try:
            try:
                return await self._from_store(ref, request_id), "store"
            except ECValidationError as exc:
                reason = exc.reason
            if reason is MissReason.NOT_FOUND and ref.encode_queued and sub is not None and self.settings.ec_wait_s > 0:
                reason = await self._wait_for_encoder(sub, ref)
                if reason is None:
                    try:
                        return await self._from_store(ref, request_id), "store"
                    except ECValidationError as exc:
                        reason = exc.reason
        finally:
            if sub is not None:
                await sub.unsubscribe()

        log.warning("encoding %s locally: %s", ref.item_hash[:12], reason.value)
        item = await self._encode_locally(ref, request_id)
        metrics.EC_LOOKUPS.labels("recomputed", "hit", reason.value).inc()
        return item, f"recomputed:{reason.value}"

    async def _from_store(self, ref: ImageRef, request_id: str) -> EncodedImage:
        obj = await asyncio.to_thread(self.store.load, ref.item_hash, request_id=request_id)
        item = ec_object_to_encoded(obj)
        self.cache.put(ref.item_hash, item)
        return item

    async def _wait_for_encoder(self, sub, ref: ImageRef) -> MissReason | None:
        """None when the encoder announced the object; else why we stopped waiting."""
        deadline = time.monotonic() + self.settings.ec_wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except asyncio.TimeoutError:  # nats.errors.TimeoutError subclasses it
                break
            try:
                event = protocol.decode(msg.data)
            except protocol.ProtocolError:
                continue
            if isinstance(event, ECFailed):
                log.warning("encoder gave up on %s: %s: %s", ref.item_hash[:12], event.code, event.message)
                return MissReason.ENCODER_FAILED
            return None
        return MissReason.TIMEOUT

    async def _encode_locally(self, ref: ImageRef, request_id: str) -> EncodedImage:
        data = await asyncio.to_thread(self.store.get_media, ref.media_key)
        if data is None:
            raise MediaMissing(f"image {ref.item_hash[:12]} is not in the store (key {ref.media_key})")
        item = await self.run_compute(encode_image_bytes, self.engine, data, ref.item_hash, self.limits)
        self.cache.put(ref.item_hash, item)
        raw, dtype, shape = tensor_to_raw(item.features)
        try:  # write back: repairs a corrupt / missing object for the next request
            await asyncio.to_thread(self.store.save, ref.item_hash, raw, dtype=dtype, shape=shape,
                                    extra=encoded_to_extra(item))
        except StoreError as exc:
            log.warning("could not write back %s: %s", ref.item_hash[:12], exc)
        return item

    async def _error(self, job: GenerationJob, code: str, message: str, status: int) -> None:
        assert self.ctx is not None
        event = ErrorEvent(request_id=job.request_id, code=code, message=message, stage="prefill", http_status=status)
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), event, request_id=job.request_id)
