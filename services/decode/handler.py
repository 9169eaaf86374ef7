"""Decode worker (E|P|D): DecodeJob -> KV object -> batched decode -> tokens.

Per job:

1. Refuse a job of another model (its ``model_fingerprint`` is not this worker's): an
   ``ErrorEvent`` (``model_mismatch``) - prefill and decode workers must run the same model -
   and its KV object is deleted (no worker will read it).
2. Load the KV object (``shared.store.kv``: validated schema, model fingerprint, request,
   attempt, layout, sha256, size bound). Missing or unusable -> **re-prefill**: the original
   ``GenerationJob`` goes back to the prefill workers with ``reprefill + 1`` (at most
   ``EPD_MAX_REPREFILLS`` times, then an ``ErrorEvent`` ``kv_unavailable``), the bad object
   is deleted, and this job is acked. A store that is down is retried first (nak).
3. Join the batch (:mod:`services.decode.batcher`); stream every token as a ``TokenChunk``
   whose ``seq`` continues after the tokens prefill emitted; the last one is followed by the
   ``FinalResult`` (whole completion: prefill's tokens + ours).
4. Delete the KV object and ack.

A worker that dies mid-request never acks: JetStream redelivers the job after
``EPD_ACK_WAIT_S`` and the next worker decodes again from the KV object - the same state, the
same sampling RNG state - so it re-emits the same tokens under the same ``seq`` numbers, which
the API drops as duplicates, and the request completes.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from shared import metrics, protocol
from shared.config import DecodeSettings
from shared.store.factory import kv_store_from_settings
from shared.store.format import MissReason, ObjectValidationError
from shared.store.kv import KVObject, KVStore, kv_prefix
from shared.store.ec import ECStore
from shared.encoding import ModelHandler, require_kv_handoff_engine, sampling_params
from shared.engines.base import Engine, GenerationStats, TokenEvent
from shared.errors import DeadlineExceeded, EPDError, KVUnavailable, ModelMismatch, StoreError
from shared.fingerprint import model_fingerprint
from shared.protocol import DecodeJob, FinalResult, SamplingSpec, TokenChunk
from shared.token_stream import TokenOutput, stream_events
from shared.worker import Delivery, Verdict, WorkerContext

log = logging.getLogger(__name__)


class KVUnusable(Exception):
    """The KV object validated but does not fit (sampling spec or model shapes disagree)."""


class DecodeHandler(ModelHandler):
    """Engine and EC store (connector engines read the request's images from it) come from
    :class:`ModelHandler`; the KV store is this worker's own."""

    role = "decode"
    stream_attr = "stream_decode"
    durable = protocol.CONSUMER_DECODE

    def __init__(self, settings: DecodeSettings, engine: Engine | None = None, kv_store: KVStore | None = None,
                 store: ECStore | None = None):
        super().__init__(settings, engine, store)
        self.settings: DecodeSettings = settings
        self.kv_store = kv_store
        self.batcher = None
        self.model_fingerprint = ""
        self._sweeper: asyncio.Task | None = None

    async def setup(self, ctx: WorkerContext) -> None:
        require_kv_handoff_engine(self.settings.engine, "decode")
        await super().setup(ctx)
        if self.kv_store is None:
            fp = await asyncio.to_thread(
                model_fingerprint, self.settings.require_model_path(), dtype=self.settings.dtype,
                engine=self.settings.engine,
            )
            self.kv_store = await asyncio.to_thread(kv_store_from_settings, self.settings, fp)
        self.model_fingerprint = self.kv_store.fingerprint
        if not self.engine.kv_via_connector:  # (vLLM loads the KV itself and batches concurrent requests)
            from services.decode.batcher import DecodeBatcher
            from shared.engines.transformers_batch import BatchDecoder

            decoder = BatchDecoder(self.engine, max_batch=self.settings.max_batch_size)
            self.batcher = DecodeBatcher(decoder, self.run_compute,
                                         step_delay_s=self.settings.fault_decode_step_delay_s)
        if self.settings.kv_sweep_interval_s > 0:
            self._sweeper = asyncio.create_task(self._sweep_forever())
        log.info("decode worker ready: model fingerprint %s, max batch %d", self.model_fingerprint,
                 self.settings.max_batch_size)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await super().close()

    # -- job -------------------------------------------------------------------------------
    async def handle(self, delivery: Delivery) -> Verdict:
        try:
            job = protocol.decode(delivery.data, DecodeJob)
        except protocol.ProtocolError as exc:
            return Verdict.term(f"undecodable decode job: {exc}")
        if delivery.published_at:
            metrics.QUEUE_SECONDS.labels("decode").observe(max(0.0, time.time() - delivery.published_at))
        if job.model_fingerprint != self.model_fingerprint:
            await self._error(job, ModelMismatch(
                f"the request was prefilled by model {job.model_fingerprint} but this decode worker runs "
                f"{self.model_fingerprint}: prefill and decode workers must serve the same model"))
            await self._delete(job.kv_key)  # the request is over: no worker will read its KV object
            return Verdict.term("model fingerprint mismatch")
        if time.time() > job.deadline:
            await self._error(job, DeadlineExceeded("request deadline passed before a decode worker took it"))
            await self._delete(job.kv_key)
            return Verdict.term("deadline passed")
        if self.engine is not None and self.engine.kv_via_connector:
            return await self._handle_via_connector(job, delivery)

        try:
            obj = await asyncio.to_thread(
                self.kv_store.load, job.kv_key, request_id=job.request_id, attempt=job.kv_attempt
            )
            self._check_sampling(job, obj)
        except (ObjectValidationError, KVUnusable) as exc:
            reason = exc.reason if isinstance(exc, ObjectValidationError) else MissReason.CORRUPT
            if reason is MissReason.STORE_ERROR and not delivery.is_last_attempt:
                return Verdict.nak(1.0 * delivery.num_delivered, f"store unavailable: {exc}")
            await self._reprefill(job, reason, str(exc))
            return Verdict.ack()
        try:
            await self._decode(job, obj, delivery.num_delivered)
        except KVUnusable as exc:
            await self._reprefill(job, MissReason.SHAPE_MISMATCH, str(exc))
            return Verdict.ack()
        except asyncio.TimeoutError:
            await self._error(job, DeadlineExceeded("request deadline passed during decoding"))
            await self._delete(job.kv_key)
            return Verdict.term("deadline passed")
        except EPDError as exc:
            log.error("decode failed: %s: %s", exc.code, exc.message)
            await self._error(job, exc, message=f"{type(exc).__name__}: {exc.message}")
            await self._delete(job.kv_key)
            return Verdict.term(exc.message)
        await self._delete(job.kv_key)
        return Verdict.ack()

    def _check_sampling(self, job: DecodeJob, obj: KVObject) -> None:
        try:
            sampling = msgspec.convert(obj.sampling, SamplingSpec)
        except msgspec.ValidationError as exc:
            raise KVUnusable(f"KV object sampling is malformed: {exc}") from exc
        if sampling != job.sampling:
            raise KVUnusable(f"KV object sampling {obj.sampling} does not match the job's")
        if int(obj.state.get("emitted", -1)) != job.emitted:
            raise KVUnusable(f"KV object emitted {obj.state.get('emitted')} tokens, the job says {job.emitted}")

    async def _decode(self, job: DecodeJob, obj: KVObject, attempt: int) -> None:
        assert self.ctx is not None and self.batcher is not None
        params = sampling_params(job.sampling, seed=obj.state.get("seed"))
        engine = self.engine

        def make_state():  # engine thread
            from shared.store.tensors import kv_object_to_state

            try:
                return kv_object_to_state(obj, engine.config)
            except EPDError as exc:  # the object is valid but does not fit this model
                raise KVUnusable(str(exc)) from exc

        t0 = time.perf_counter()
        subject = self.ctx.subjects.tokens(job.request_id)
        key = (job.request_id, attempt)
        queue = self.batcher.submit(key, make_state, params)
        seq = job.emitted
        token_ids: list[int] = []
        texts: list[str] = [job.emitted_text]
        finish = "length"
        first_at = None
        try:
            while True:
                left = job.deadline - time.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                item = await asyncio.wait_for(queue.get(), timeout=left)
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, TokenEvent)
                if first_at is None:
                    first_at = time.perf_counter()
                chunk = TokenChunk(request_id=job.request_id, attempt=attempt, seq=seq, token_ids=(item.token_id,),
                                   text=item.text)
                await self.ctx.publisher.publish(subject, chunk, request_id=job.request_id)
                seq += 1
                token_ids.append(item.token_id)
                texts.append(item.text)
                if item.finish_reason is not None:
                    finish = item.finish_reason
                    break
        finally:
            self.batcher.cancel(key)  # no-op once finished; frees the row on timeout / cancellation
        t_end = time.perf_counter()
        all_ids = tuple(obj.state.get("output_ids", [])[: job.emitted]) + tuple(token_ids)
        timings = dict(job.timings)
        timings.update({
            "decode_s": t_end - t0,
            "decode_first_token_s": (first_at - t0) if first_at else 0.0,
            "kv_bytes": float(obj.nbytes),
            "decode_batch_rows_max": float(self.batcher.decoder.max_rows_seen),
        })
        final = FinalResult(
            request_id=job.request_id, attempt=attempt, token_ids=all_ids, text="".join(texts),
            finish_reason=finish, prompt_tokens=job.prompt_tokens, completion_tokens=len(all_ids),
            timings=timings, ec_sources=dict(job.ec_sources), worker=self.settings.worker_id, kv_source="store",
        )
        await self.ctx.publisher.publish(subject, final, request_id=job.request_id)
        log.info("done: %d completion tokens (%d here), finish=%s, decode %.3fs, KV %d bytes", len(all_ids),
                 len(token_ids), finish, t_end - t0, obj.nbytes)

    # -- connector engines (vLLM) -------------------------------------------------------------
    async def _handle_via_connector(self, job: DecodeJob, delivery: Delivery) -> Verdict:
        """The engine's KV connector loads the KV object (validated: checksum, model version,
        request, prompt token ids, layout) and vLLM continues from it; when the object is missing
        or unusable vLLM prefills the request again itself (it has the prompt and the images), so
        there is no re-prefill round trip here. The engine samples every output token, seeded as
        in an aggregated run."""
        assert self.ctx is not None and self.store is not None
        gen = job.generation
        try:
            images = await asyncio.gather(*(self.media_image(ref) for ref in gen.images))
        except StoreError as exc:
            if not delivery.is_last_attempt:
                return Verdict.nak(1.0 * delivery.num_delivered, f"store unavailable: {exc}")
            await self._error(job, exc)
            await self._delete(job.kv_key)  # the request is over
            return Verdict.term(exc.message)
        except EPDError as exc:
            await self._error(job, exc)
            await self._delete(job.kv_key)
            return Verdict.term(exc.message)
        params = sampling_params(job.sampling, seed=protocol.effective_seed(job.request_id, job.sampling.seed))
        kv_params = {"do_remote_prefill": True, "epd_kv_key": job.kv_key, "epd_kv_request": job.request_id,
                     "epd_kv_attempt": job.kv_attempt}
        stats = GenerationStats()
        out = TokenOutput(self.ctx, gen, delivery.num_delivered)
        t0 = time.perf_counter()
        try:
            await stream_events(out, lambda: self.engine.generate(gen.messages, list(images), params, stats,
                                                                   kv_params=kv_params), asyncio.to_thread)
        except EPDError as exc:
            log.error("decode failed: %s: %s", exc.code, exc.message)
            await self._error(job, exc, message=f"{type(exc).__name__}: {exc.message}")
            await self._delete(job.kv_key)
            return Verdict.term(exc.message)
        t_end = time.perf_counter()
        kv_source = str(stats.extra.get("kv_source", ""))
        if kv_source != "store":
            metrics.REPREFILLS.labels(kv_source.removeprefix("recomputed:") or "unknown").inc()
        timings = dict(job.timings)
        timings.update({"decode_s": t_end - t0,
                        "decode_first_token_s": (out.first_token_at - t0) if out.first_token_at else 0.0})
        final = FinalResult(
            request_id=job.request_id, attempt=delivery.num_delivered, token_ids=tuple(out.token_ids),
            text="".join(out.text_parts), finish_reason=out.finish_reason, prompt_tokens=stats.prompt_tokens,
            completion_tokens=len(out.token_ids), timings=timings, ec_sources=dict(job.ec_sources),
            worker=self.settings.worker_id, kv_source=kv_source,
        )
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), final, request_id=job.request_id)
        log.info("done: %d completion tokens, finish=%s, decode %.3fs, kv=%s", len(out.token_ids), out.finish_reason,
                 t_end - t0, kv_source)
        await self._delete(job.kv_key)
        return Verdict.ack()

    # -- failure paths -----------------------------------------------------------------------
    async def _reprefill(self, job: DecodeJob, reason: MissReason, detail: str) -> None:
        """Send the request back to prefill (bounded), or end it with a clear error."""
        assert self.ctx is not None
        await self._delete(job.kv_key)
        gen = job.generation
        if gen.reprefill >= self.settings.max_reprefills:
            await self._error(job, KVUnavailable(
                f"the request's KV state was unusable ({reason.value}: {detail}) after {gen.reprefill} re-prefill(s)"))
            return
        again = msgspec.structs.replace(gen, reprefill=gen.reprefill + 1, created_at=time.time())
        await self.ctx.publisher.publish(
            self.ctx.subjects.generate_jobs, again, request_id=job.request_id,
            msg_id=f"{job.request_id}-reprefill-{again.reprefill}",
        )
        metrics.REPREFILLS.labels(reason.value).inc()
        log.warning("KV object %s unusable (%s): re-prefill %d of at most %d", job.kv_key, reason.value,
                    again.reprefill, self.settings.max_reprefills)

    async def _error(self, job: DecodeJob, error: EPDError, *, message: str | None = None) -> None:
        assert self.ctx is not None
        event = protocol.error_event(job.request_id, "decode", error, message=message)
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), event, request_id=job.request_id)

    async def _delete(self, key: str) -> None:
        """Delete a job's KV object (of any model fingerprint); a key outside this namespace's KV
        objects - the job is not trusted on the paths that do not load it - is left alone."""
        if not key.startswith(kv_prefix(self.kv_store.namespace)):
            log.warning("not deleting %s: not a KV object key", key)
            return
        try:
            await asyncio.to_thread(self.kv_store.delete, key)
        except (StoreError, ValueError) as exc:  # the sweeper removes it later
            log.warning("could not delete KV object %s: %s", key, exc)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.kv_sweep_interval_s)
            try:
                await asyncio.to_thread(self.kv_store.sweep, self.settings.kv_ttl_s)
            except Exception as exc:  # keep sweeping; the store may come back
                log.warning("kv sweep failed: %s", exc)
