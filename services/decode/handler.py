"""Decode worker (E|P|D): DecodeJob -> the prefilled request's KV -> decode -> tokens.

Per job:

1. Refuse a job of another model (its ``model_fingerprint`` is not this worker's): an
   ``ErrorEvent`` (``model_mismatch``) - prefill and decode workers must run the same model -
   and its KV object is deleted (no worker will read it). Same for a job whose deadline passed.
2. Decode with the strategy chosen in ``setup`` from the engine's capability:

   * :class:`KVObjectDecode` (:class:`KVStateHandoff` engines): load the KV object
     (``shared.store.kv``: validated schema, model fingerprint, request, attempt, layout,
     sha256, size bound) and continue from it in the engine's batch. Missing or unusable
     (or its state does not fit the model: ``KVStateMismatch``) -> **re-prefill**: the original
     ``GenerationJob`` goes back to the prefill workers with ``reprefill + 1`` (at most
     ``EPD_MAX_REPREFILLS`` times, then an ``ErrorEvent`` ``kv_unavailable``), the bad object
     is deleted, and this job is acked. A store that is down is retried first.
   * :class:`KVConnectorDecode` (:class:`KVConnectorHandoff` engines, vLLM): the engine's KV
     connector loads the KV object (validated: checksum, model version, request, prompt token
     ids, layout) and the engine continues from it; when it is missing or unusable the engine
     prefills the request again itself (it has the prompt and the images), so there is no
     re-prefill round trip. The engine samples every output token, seeded as in an aggregated
     run.

3. Stream every token as a ``TokenChunk`` whose ``seq`` continues after the tokens prefill
   emitted; the last one is followed by the ``FinalResult`` (whole completion: prefill's tokens
   + ours).
4. Delete the KV object and ack. A request that ends in an error (``on_terminal``) gets an
   ``ErrorEvent`` and its KV object is deleted too.

A worker that dies mid-request never acks: JetStream redelivers the job after
``EPD_ACK_WAIT_S`` and the next worker decodes again from the KV object - the same state, the
same sampling RNG state - so it re-emits the same tokens under the same ``seq`` numbers, which
the API drops as duplicates, and the request completes.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from shared import metrics, protocol
from shared.config import DecodeSettings
from shared.connectors.params import KVHandoff
from shared.engines import base
from shared.engines.base import Engine, GenerationStats, KVStateMismatch
from shared.errors import DeadlineExceeded, EPDError, KVUnavailable, ModelMismatch
from shared.metrics import JobOutcome
from shared.model_worker import ModelHandler, job_prompt, sampling_params
from shared.protocol import DecodeJob, ECSource, FinalResult, SamplingSpec, Timing, recomputed
from shared.store.ec import ECStore
from shared.store.format import MissReason, ObjectValidationError
from shared.store.kv import KVObject, KVStore, kv_prefix
from shared.token_stream import TokenOutput
from shared.topology import Role, Service
from shared.worker import Delivery, Reject, Retry, WorkerContext

log = logging.getLogger(__name__)


class KVUnusable(Exception):
    """The KV object cannot be decoded from: re-prefill the request."""

    def __init__(self, reason: MissReason, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Decoded:
    """What a decode strategy produced, for the FinalResult."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    kv_source: str
    timings: dict[str, float] = field(default_factory=dict)


class DecodeStrategy(abc.ABC):
    def __init__(self, handler: DecodeHandler):
        self.handler = handler

    @abc.abstractmethod
    async def decode(self, job: DecodeJob, delivery: Delivery, out: TokenOutput) -> Decoded:
        """Stream the request's remaining tokens through ``out``. Raises :class:`KVUnusable`
        to send the request back to prefill."""


class KVObjectDecode(DecodeStrategy):
    """Load the KV object the prefill worker wrote; the engine continues from it in its batch."""

    async def decode(self, job: DecodeJob, delivery: Delivery, out: TokenOutput) -> Decoded:
        h = self.handler
        engine: base.KVStateHandoff = h.engine  # type: ignore[assignment]  # the role check ensured the engine has this mixin
        assert h.kv_store is not None  # setup() opened it
        try:
            obj = await asyncio.to_thread(
                h.kv_store.load, job.kv_key, request_id=job.request_id, attempt=job.kv_attempt
            )
        except ObjectValidationError as exc:
            if exc.reason is MissReason.STORE_ERROR and not delivery.is_last_attempt:
                raise Retry(None, f"store unavailable: {exc}") from exc  # (then: re-prefill)
            raise KVUnusable(exc.reason, str(exc)) from exc
        self._check_sampling(job, obj)
        params = sampling_params(job.sampling, seed=obj.state.get("seed"))
        stats = GenerationStats()
        t0 = time.perf_counter()
        try:
            await out.stream(engine.decode(obj, params, stats), deadline=job.deadline, what="decoding")
        except KVStateMismatch as exc:
            raise KVUnusable(MissReason.SHAPE_MISMATCH, str(exc)) from exc
        t_end = time.perf_counter()
        emitted_ids = tuple(obj.state.get("output_ids", [])[: job.emitted])
        return Decoded(
            token_ids=emitted_ids + tuple(out.token_ids),
            text=job.emitted_text + out.text,
            prompt_tokens=job.prompt_tokens,
            kv_source=ECSource.STORE,
            timings={
                Timing.DECODE: t_end - t0,
                Timing.DECODE_FIRST_TOKEN: (out.first_token_at - t0) if out.first_token_at else 0.0,
                Timing.KV_BYTES: float(obj.nbytes),
                Timing.DECODE_BATCH_ROWS_MAX: float(stats.extra.get("decode_batch_rows_max", 0)),
            },
        )

    @staticmethod
    def _check_sampling(job: DecodeJob, obj: KVObject) -> None:
        try:
            sampling = msgspec.convert(obj.sampling, SamplingSpec)
        except msgspec.ValidationError as exc:
            raise KVUnusable(MissReason.CORRUPT, f"KV object sampling is malformed: {exc}") from exc
        if sampling != job.sampling:
            raise KVUnusable(MissReason.CORRUPT, f"KV object sampling {obj.sampling} does not match the job's")
        if int(obj.state.get("emitted", -1)) != job.emitted:
            raise KVUnusable(
                MissReason.CORRUPT, f"KV object emitted {obj.state.get('emitted')} tokens, the job says {job.emitted}"
            )


class KVConnectorDecode(DecodeStrategy):
    """The engine's KV connector loads the KV object (or the engine prefills again)."""

    async def decode(self, job: DecodeJob, delivery: Delivery, out: TokenOutput) -> Decoded:
        h = self.handler
        engine: base.KVConnectorHandoff = h.engine  # type: ignore[assignment]  # the role check ensured the engine has this mixin
        gen = job.generation
        images = await asyncio.gather(*(h.connector_media(ref) for ref in gen.images))
        params = sampling_params(job.sampling, seed=protocol.effective_seed(job.request_id, job.sampling.seed))
        handoff = KVHandoff(key=job.kv_key, request=job.request_id, attempt=job.kv_attempt)
        stats = GenerationStats()
        t0 = time.perf_counter()
        await out.stream(
            engine.generate_from_handoff(job_prompt(gen), list(images), params, handoff, stats),
            deadline=job.deadline,
            what="decoding",
        )
        t_end = time.perf_counter()
        kv_source = str(stats.extra.get("kv_source", ""))
        if kv_source != ECSource.STORE:
            metrics.REPREFILLS.labels(kv_source.removeprefix(recomputed("")) or "unknown").inc()
        return Decoded(
            token_ids=tuple(out.token_ids),
            text=out.text,
            prompt_tokens=stats.prompt_tokens,
            kv_source=kv_source,
            timings={
                Timing.DECODE: t_end - t0,
                Timing.DECODE_FIRST_TOKEN: (out.first_token_at - t0) if out.first_token_at else 0.0,
            },
        )


class DecodeHandler(ModelHandler):
    """Engine and EC store (connector engines read the request's images from it) come from
    :class:`ModelHandler`; the KV store is this worker's own."""

    service = Service.DECODE
    role = Role.DECODE
    job_type = DecodeJob
    queue = protocol.WorkQueue.DECODE
    durable = protocol.CONSUMER_DECODE

    def __init__(
        self,
        settings: DecodeSettings,
        engine: Engine | None = None,
        kv_store: KVStore | None = None,
        store: ECStore | None = None,
    ):
        super().__init__(settings, engine, store)
        self.settings: DecodeSettings = settings
        self.kv_store = kv_store
        self.model_fingerprint = ""
        self.strategy: DecodeStrategy | None = None
        self._sweeper: asyncio.Task | None = None

    async def setup(self, ctx: WorkerContext) -> None:
        await super().setup(ctx)
        if self.kv_store is None:
            self.kv_store = await self.model_kv_store()
        self.model_fingerprint = self.kv_store.fingerprint
        if isinstance(self.engine, base.KVConnectorHandoff):
            self.strategy = KVConnectorDecode(self)
        else:  # base.KVStateHandoff (the role's engine check passed)
            self.strategy = KVObjectDecode(self)
        if self.settings.kv_sweep_interval_s > 0:
            self._sweeper = asyncio.create_task(self._sweep_forever())
        log.info(
            "decode worker ready: model fingerprint %s, max batch %d, %s",
            self.model_fingerprint,
            self.settings.max_batch_size,
            type(self.strategy).__name__,
        )

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await super().close()

    # -- job -------------------------------------------------------------------------------
    async def handle(self, job: DecodeJob, delivery: Delivery) -> None:
        assert self.ctx is not None and self.strategy is not None
        if job.model_fingerprint != self.model_fingerprint:
            raise Reject(
                ModelMismatch(
                    f"the request was prefilled by model {job.model_fingerprint} but this decode worker runs "
                    f"{self.model_fingerprint}: prefill and decode workers must serve the same model"
                )
            )
        if time.time() > job.deadline:
            raise Reject(
                DeadlineExceeded("request deadline passed before a decode worker took it"), outcome=JobOutcome.EXPIRED
            )
        delivery.start()  # a decode job joins the engine's batch at once (one held per batch row)
        out = TokenOutput(self.ctx, job.request_id, delivery.num_delivered, first_seq=job.emitted)
        try:
            decoded = await self.strategy.decode(job, delivery, out)
        except KVUnusable as exc:
            await self._reprefill(job, exc.reason, str(exc))
            return
        await self._final(job, out, decoded)
        await self._delete(job.kv_key)

    async def _final(self, job: DecodeJob, out: TokenOutput, decoded: Decoded) -> None:
        assert self.ctx is not None
        timings = {**job.timings, **decoded.timings}
        final = FinalResult(
            request_id=job.request_id,
            attempt=out.attempt,
            token_ids=decoded.token_ids,
            text=decoded.text,
            finish_reason=out.finish_reason,
            prompt_tokens=decoded.prompt_tokens,
            completion_tokens=len(decoded.token_ids),
            timings=timings,
            ec_sources=dict(job.ec_sources),
            worker=self.settings.worker_id,
            kv_source=decoded.kv_source,
        )
        await out.end(final)
        log.info(
            "done: %d completion tokens (%d here), finish=%s, decode %.3fs, kv=%s",
            len(decoded.token_ids),
            len(out.token_ids),
            out.finish_reason,
            timings.get(Timing.DECODE, 0.0),
            decoded.kv_source,
        )

    async def on_terminal(self, job: DecodeJob, error: EPDError, message: str) -> None:
        """An ErrorEvent for the client; the request is over, so no worker will read its KV object."""
        assert self.ctx is not None
        event = protocol.error_event(job.request_id, Service.DECODE, error, message=message)
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), event, request_id=job.request_id)
        await self._delete(job.kv_key)

    async def on_cancelled(self, job: DecodeJob) -> None:
        """The request was cancelled: no worker will read its KV object."""
        await self._delete(job.kv_key)

    # -- re-prefill and clean-up -----------------------------------------------------------
    async def _reprefill(self, job: DecodeJob, reason: MissReason, detail: str) -> None:
        """Send the request back to prefill (bounded), or end it with a clear error."""
        assert self.ctx is not None
        gen = job.generation
        if gen.reprefill >= self.settings.max_reprefills:
            raise Reject(
                KVUnavailable(
                    f"the request's KV state was unusable ({reason.value}: {detail}) "
                    f"after {gen.reprefill} re-prefill(s)"
                )
            )
        await self._delete(job.kv_key)
        again = msgspec.structs.replace(gen, reprefill=gen.reprefill + 1, created_at=time.time())
        await self.ctx.publisher.publish(
            self.ctx.subjects.generate_jobs,
            again,
            request_id=job.request_id,
            msg_id=f"{job.request_id}-reprefill-{again.reprefill}",
        )
        metrics.REPREFILLS.labels(reason.value).inc()
        log.warning(
            "KV object %s unusable (%s): re-prefill %d of at most %d",
            job.kv_key,
            reason.value,
            again.reprefill,
            self.settings.max_reprefills,
        )

    async def _delete(self, key: str) -> None:
        """Delete a job's KV object (of any model fingerprint); a key outside this namespace's KV
        objects - the job is not trusted on the paths that do not load it - is left alone."""
        assert self.kv_store is not None  # setup() opened it
        if not key.startswith(kv_prefix(self.kv_store.namespace)):
            log.warning("not deleting %s: not a KV object key", key)
            return
        try:
            await asyncio.to_thread(self.kv_store.delete, key)
        except (EPDError, ValueError) as exc:  # the sweeper removes it later
            log.warning("could not delete KV object %s: %s", key, exc)

    async def _sweep_forever(self) -> None:
        assert self.kv_store is not None  # setup() opened it
        while True:
            await asyncio.sleep(self.settings.kv_sweep_interval_s)
            try:
                await asyncio.to_thread(self.kv_store.sweep, self.settings.kv_ttl_s)
            except Exception as exc:  # noqa: BLE001 - keep sweeping; the store may come back
                log.warning("kv sweep failed: %s", exc)
