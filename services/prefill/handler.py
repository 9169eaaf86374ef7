"""Prefill worker: GenerationJob -> encoder outputs -> prefill (+ decode) -> tokens.

Roles (``EPD_ROLE``):

* ``pd`` (E|PD): prefill and decode here, streaming every token.
* ``prefill`` (E|P|D): prefill, stream the first token, write the decode state (KV cache, last
  token, positions / M-RoPE delta, sampling RNG state, tokens so far) as a KV object
  (``shared.store.kv``) and publish a ``DecodeJob`` for the decode workers. If the state
  cannot be handed off (over ``EPD_MAX_KV_OBJECT_BYTES``, store down, job too large for NATS)
  the worker decodes the request itself, as ``pd`` would (logged, counted in
  ``epd:kv_handoffs_total``). A request that finishes with its first token never leaves.
* ``agg``: the baseline - encode + prefill + decode in this process; encoder outputs come from
  the local cache or local encoding, never from the store or an encoder worker.

Where each image's features come from, in order:

1. this worker's in-memory cache (``local_cache``);
2. the EC store. The worker subscribes to the item's ``ec.ready`` / ``ec.failed`` events *before*
   looking in the store, so an encoder finishing in between cannot be missed;
3. if the object is not there yet, the ready event (waiting up to ``ec_wait_s``) then the store;
4. else, and on any failed load (corrupt, other fingerprint, store down, encoder gave up),
   the worker encodes the image itself from the stored image bytes and writes the result back
   (repairing a bad object). The reason is logged and counted
   (``epd:ec_lookups_total{source="recomputed",reason=...}``).

With a connector engine (``EPD_ENGINE=vllm``) features never pass through this worker: it waits for
the encoder the same way (steps 2-3, existence check only), then hands vLLM the image with its item
hash; vLLM's EC connector (``shared.connectors.s3_ec``) loads the stored output or, on any
miss or failed validation, vLLM encodes the image itself. ``ec_sources`` then report what the
connector did (``store`` / ``recomputed:<reason>``). vLLM batches concurrent jobs itself.

Tokens go to ``<prefix>.tokens.<request_id>`` as ``TokenChunk`` messages numbered by ``seq``; a
redelivered job regenerates from the start (same seed, same tokens) with a higher ``attempt`` and
the API forwards only what it has not sent yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from shared import metrics, protocol
from shared.config import PrefillSettings
from shared.store.factory import kv_store_from_settings
from shared.store.kv import KVStore
from shared.store.format import ECValidationError, MissReason
from shared.store.ec import ECStore
from shared.store.tensors import ec_object_to_encoded, encoded_to_extra, tensor_to_raw
from shared.encoding import ModelHandler, encode_image_bytes, require_kv_handoff_engine, sampling_params
from shared.engines.base import EncodedImage, Engine, GenerationStats, MediaImage, SamplingParams
from shared.errors import DeadlineExceeded, EngineError, EPDError, InvalidRequest, StoreError
from shared.fingerprint import model_fingerprint
from shared.store.objects import ObjectTooLarge
from shared.protocol import DecodeJob, ECFailed, FinalResult, GenerationJob, ImageRef
from shared.token_stream import TokenOutput, stream_events
from shared.worker import Verdict, WorkerContext

log = logging.getLogger(__name__)

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


class PrefillHandler(ModelHandler):
    role = "prefill"
    stream_attr = "stream_generate"
    durable = protocol.CONSUMER_PREFILL

    def __init__(self, settings: PrefillSettings, engine: Engine | None = None, store: ECStore | None = None,
                 kv_store: KVStore | None = None):
        super().__init__(settings, engine, store)
        self.settings: PrefillSettings = settings
        self.kv_store = kv_store
        self.cache = FeatureCache(settings.local_cache_bytes)

    @property
    def engine_role(self) -> str:
        return self.settings.role

    async def setup(self, ctx: WorkerContext) -> None:
        if self.settings.role == "prefill":
            require_kv_handoff_engine(self.settings.engine, "prefill")
        await super().setup(ctx)
        if self.settings.role == "prefill" and self.kv_store is None:
            fp = await asyncio.to_thread(
                model_fingerprint, self.settings.require_model_path(), dtype=self.settings.dtype,
                engine=self.settings.engine,
            )
            self.kv_store = await asyncio.to_thread(kv_store_from_settings, self.settings, fp)
            log.info("role prefill: KV objects under model fingerprint %s", fp)

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
            await self._error(job, DeadlineExceeded("request deadline passed before a worker took it"))
            metrics.GENERATION_JOBS.labels("expired").inc()
            return Verdict.term("deadline passed")
        try:
            await self._generate(job, delivery.num_delivered)
        except InvalidRequest as exc:
            await self._error(job, exc)
            metrics.GENERATION_JOBS.labels("rejected").inc()
            return Verdict.term(exc.message)
        except Exception as exc:
            transient = isinstance(exc, StoreError)
            if transient and not delivery.is_last_attempt:
                metrics.GENERATION_JOBS.labels("retried").inc()
                return Verdict.nak(1.0 * delivery.num_delivered, str(exc))
            log.error("generation failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, EPDError))
            error = exc if isinstance(exc, EPDError) else EngineError(str(exc))
            await self._error(job, error, message=f"{type(exc).__name__}: {exc}")
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

        params = sampling_params(job.sampling, seed=protocol.effective_seed(job.request_id, job.sampling.seed))
        stats = GenerationStats()
        out = TokenOutput(self.ctx, job, attempt)
        if self.settings.role == "prefill":
            hand_off = self._hand_off_via_connector if self.engine.kv_via_connector else self._prefill_and_hand_off
            if await hand_off(job, images, params, stats, out, sources, t0, t_features):
                return
        else:
            await self._stream(out, lambda: self.engine.generate(job.messages, images, params, stats))
        if stats.extra.get("ec_sources"):  # connector engines report where each item's features came from
            sources.update(stats.extra["ec_sources"])
        t_end = time.perf_counter()
        final = FinalResult(
            request_id=job.request_id,
            attempt=attempt,
            token_ids=tuple(out.token_ids),
            text="".join(out.text_parts),
            finish_reason=out.finish_reason,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            timings={
                "features_s": t_features - t0,
                "prefill_s": stats.prefill_s,
                "decode_s": stats.decode_s,
                "first_token_s": (out.first_token_at - t0) if out.first_token_at else 0.0,
                "total_s": t_end - t0,
            },
            ec_sources=sources,
            worker=self.settings.worker_id,
        )
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), final, request_id=job.request_id)
        log.info(
            "done: %d prompt + %d completion tokens, finish=%s, features %.3fs, total %.3fs, sources=%s",
            stats.prompt_tokens, stats.completion_tokens, out.finish_reason, t_features - t0, t_end - t0, sources,
        )

    async def _stream(self, out: TokenOutput, make_events) -> None:
        # A concurrent engine (vLLM) batches requests itself: don't serialize them in the engine thread.
        await stream_events(out, make_events, asyncio.to_thread if self.engine.concurrent else self.run_compute)

    # -- E|P|D hand-off --------------------------------------------------------------------
    def _prefill_first(self, job: GenerationJob, images, params: SamplingParams, stats: GenerationStats):
        """Engine thread: prefill and the first token's event. Returns (state, event iterator, event)."""
        state = self.engine.prefill(job.messages, images, params, stats)
        events = self.engine.decode(state, params, stats)
        return state, events, next(events)

    def _encode_kv(self, job: GenerationJob, state) -> tuple[str, bytes]:
        """Engine thread: the decode state as a KV object (torch -> bytes)."""
        from shared.store.tensors import decode_state_to_raw

        tensors, meta = decode_state_to_raw(state)
        return self.kv_store.encode(job.request_id, job.reprefill, tensors, meta, protocol.to_builtins(job.sampling))

    async def _prefill_and_hand_off(self, job: GenerationJob, images, params: SamplingParams, stats: GenerationStats,
                                    out: TokenOutput, sources: dict[str, str], t0: float, t_features: float) -> bool:
        """Role ``prefill``. True when a decode worker now owns the request; False when this
        worker finished it (first token was the last, or the hand-off was impossible and the
        request was decoded here)."""
        assert self.ctx is not None and self.kv_store is not None
        state, events, first = await self.run_compute(self._prefill_first, job, images, params, stats)
        await out.publish(first)
        if first.finish_reason is not None:
            metrics.KV_HANDOFFS.labels("finished_in_prefill").inc()
            return False
        t_handoff = time.perf_counter()
        try:
            key, blob = await self.run_compute(self._encode_kv, job, state)
            decode_job = DecodeJob(
                request_id=job.request_id, kv_key=key, kv_attempt=job.reprefill, kv_nbytes=len(blob),
                model_fingerprint=self.kv_store.fingerprint, sampling=job.sampling, deadline=job.deadline,
                created_at=time.time(), emitted=len(out.token_ids), emitted_text="".join(out.text_parts),
                prompt_tokens=stats.prompt_tokens, generation=job,
                timings={"features_s": t_features - t0, "prefill_s": stats.prefill_s,
                         "first_token_s": (out.first_token_at or t_handoff) - t0},
                ec_sources=sources, prefill_worker=self.settings.worker_id,
            )
            limit = self.ctx.nc.max_payload if self.ctx.nc is not None else 1024 * 1024
            if len(protocol.encode(decode_job)) > limit:
                raise ValueError(f"decode job over the NATS payload limit of {limit} bytes")
            await asyncio.to_thread(self.kv_store.put, key, blob)
        except (ObjectTooLarge, StoreError, ValueError) as exc:
            reason = "too_large" if isinstance(exc, (ObjectTooLarge, ValueError)) else "store_error"
            log.warning("cannot hand off to a decode worker (%s: %s): decoding here", reason, exc)
            metrics.KV_HANDOFFS.labels(f"local_{reason}").inc()
            await self._stream(out, lambda: events)
            return False
        await self.ctx.publisher.publish(
            self.ctx.subjects.decode_jobs, decode_job, request_id=job.request_id,
            msg_id=f"{job.request_id}-decode-{job.reprefill}",
        )
        metrics.KV_HANDOFFS.labels("handed_off").inc()
        log.info(
            "handed off: %d prompt tokens, KV %s (%d bytes) in %.3fs, features %.3fs, prefill %.3fs, sources=%s",
            stats.prompt_tokens, key, len(blob), time.perf_counter() - t_handoff, t_features - t0, stats.prefill_s,
            sources,
        )
        return True

    async def _hand_off_via_connector(self, job: GenerationJob, images, params: SamplingParams,
                                      stats: GenerationStats, out: TokenOutput, sources: dict[str, str], t0: float,
                                      t_features: float) -> bool:
        """Role ``prefill`` on a KV-connector engine (vLLM): the engine computes the prompt and its
        KV connector stores the KV cache (``shared.connectors.s3_kv``); the decode
        worker's engine loads it and samples *every* output token (this worker streams none), so
        sampling draws exactly as in an aggregated run. True when a decode worker owns the
        request; False when this worker generated it (one-token requests, failed hand-off)."""
        assert self.ctx is not None and self.kv_store is not None
        if params.max_tokens <= 1:  # nothing to hand off: decoding here is the whole request
            metrics.KV_HANDOFFS.labels("finished_in_prefill").inc()
            await self._stream(out, lambda: self.engine.generate(job.messages, images, params, stats))
            return False
        expected_key = self.kv_store.key(job.request_id, job.reprefill)
        try:
            kv_params = await asyncio.to_thread(
                self.engine.prefill_for_handoff, job.messages, images, params,
                request_name=job.request_id, attempt=job.reprefill, stats=stats,
            )
            if kv_params.get("epd_kv_key") != expected_key:
                raise EngineError(f"the engine stored the KV under {kv_params.get('epd_kv_key')!r}, not "
                                  f"{expected_key!r}: prefill and decode would disagree on the model version")
        except EngineError as exc:
            log.warning("cannot hand off to a decode worker (%s): decoding here", exc)
            metrics.KV_HANDOFFS.labels("local_engine_error").inc()
            await self._stream(out, lambda: self.engine.generate(job.messages, images, params, stats))
            return False
        if stats.extra.get("ec_sources"):
            sources.update(stats.extra["ec_sources"])
        decode_job = DecodeJob(
            request_id=job.request_id, kv_key=expected_key, kv_attempt=job.reprefill, kv_nbytes=0,
            model_fingerprint=self.kv_store.fingerprint, sampling=job.sampling, deadline=job.deadline,
            created_at=time.time(), emitted=0, emitted_text="", prompt_tokens=stats.prompt_tokens, generation=job,
            timings={"features_s": t_features - t0, "prefill_s": stats.prefill_s},
            ec_sources=sources, prefill_worker=self.settings.worker_id,
        )
        await self.ctx.publisher.publish(
            self.ctx.subjects.decode_jobs, decode_job, request_id=job.request_id,
            msg_id=f"{job.request_id}-decode-{job.reprefill}",
        )
        metrics.KV_HANDOFFS.labels("handed_off").inc()
        log.info("handed off through the KV connector: %d prompt tokens, KV %s, features %.3fs, prefill %.3fs, "
                 "sources=%s", stats.prompt_tokens, expected_key, t_features - t0, stats.prefill_s, sources)
        return True

    # -- encoder outputs -------------------------------------------------------------------
    async def resolve_image(self, ref: ImageRef, request_id: str) -> tuple[EncodedImage | MediaImage, str]:
        """Features for one image and where they came from ("local_cache", "store", "recomputed:<reason>")."""
        assert self.ctx is not None and self.store is not None
        if self.engine is not None and self.engine.features_via_connector:
            return await self._resolve_for_connector(ref)
        cached = self.cache.get(ref.item_hash)
        if cached is not None:
            metrics.EC_LOOKUPS.labels("local_cache", "hit", "").inc()
            return cached, "local_cache"
        if self.settings.role == "agg":  # the baseline: no store, no encoder workers
            item = await self._encode_locally(ref, request_id, write_back=False)
            metrics.EC_LOOKUPS.labels("local", "hit", "").inc()
            return item, "local"

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

    async def _resolve_for_connector(self, ref: ImageRef) -> tuple[MediaImage, str]:
        """Connector engines (vLLM): the engine's EC connector loads the stored output itself and
        encodes the image when it cannot. Here, as on the transformers path, wait until the
        encoder has stored the item (or gave up, or ``ec_wait_s`` passed), then hand over the
        image. The source is provisional; the engine reports the real one after generating."""
        assert self.ctx is not None and self.store is not None
        if self.settings.role != "agg" and ref.encode_queued and self.ctx.nc is not None and self.settings.ec_wait_s > 0:
            sub = await self.ctx.nc.subscribe(self.ctx.subjects.ec_any(self.fingerprint, ref.item_hash))
            try:
                try:
                    stored = await asyncio.to_thread(self.store.exists, ref.item_hash)
                except StoreError as exc:
                    log.warning("existence check of %s failed (%s): not waiting", ref.item_hash[:12], exc)
                    stored = True
                if not stored:
                    reason = await self._wait_for_encoder(sub, ref)
                    if reason is not None:
                        log.warning("item %s not stored (%s): the engine encodes it", ref.item_hash[:12], reason.value)
            finally:
                await sub.unsubscribe()
        return await self.media_image(ref), "local" if self.settings.role == "agg" else "connector"

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

    async def _encode_locally(self, ref: ImageRef, request_id: str, *, write_back: bool = True) -> EncodedImage:
        data = await self.media_bytes(ref)
        item = await self.run_compute(encode_image_bytes, self.engine, data, ref.item_hash, self.limits)
        self.cache.put(ref.item_hash, item)
        if not write_back:
            return item
        raw, dtype, shape = tensor_to_raw(item.features)
        try:  # write back: repairs a corrupt / missing object for the next request
            await asyncio.to_thread(self.store.save, ref.item_hash, raw, dtype=dtype, shape=shape,
                                    extra=encoded_to_extra(item))
        except StoreError as exc:
            log.warning("could not write back %s: %s", ref.item_hash[:12], exc)
        return item

    async def _error(self, job: GenerationJob, error: EPDError, *, message: str | None = None) -> None:
        assert self.ctx is not None
        event = protocol.error_event(job.request_id, "prefill", error, message=message)
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), event, request_id=job.request_id)
