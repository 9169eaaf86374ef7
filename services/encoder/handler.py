"""Encoder worker: EncodeJob -> vision encoder -> versioned EC object in the store -> ECReady.

How the features get into the store depends on the engine (:class:`FeatureProducer`, chosen
once in ``setup``): the worker stores what ``engine.encode`` returns
(:class:`WorkerStoresFeatures`, for :class:`~shared.engines.base.FeaturesThroughWorker` engines),
or the engine's own EC connector stores them while ``engine.produce`` runs and the worker
announces the object once the store has it (:class:`ConnectorStoresFeatures`, for
:class:`~shared.engines.base.FeaturesThroughConnector` engines: vLLM).

Idempotent: a valid object already stored for the job's key is announced again, not recomputed.
A job that cannot succeed (bad image, wrong model version, missing media) is answered with an
``ECFailed`` event and terminated, so prefill workers stop waiting and encode locally or fail
the request. Transient failures (store down, engine failure) are retried with a delay up to
``max_deliver``; the last attempt publishes ``ECFailed`` (``Handler.on_terminal``). A job of a
cancelled request is dropped when no other request waits on it (``ECFailed`` ``cancelled``);
once started it runs to the end.

Encode stealing (``shared.ec_lifecycle.claims``): right before encoding, the worker claims the
item; when a generating worker stole it first (its engine encodes it, it announces the object),
the job is acked without encoding (outcome ``stolen``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from shared import metrics, protocol
from shared.admission import Admission
from shared.cancellation import Ended, RequestRecords
from shared.config import EncoderSettings, WorkerSettings
from shared.decode_budget import DecodeBudget
from shared.ec_lifecycle.claims import EncodeClaims
from shared.engines import base
from shared.engines.base import Engine
from shared.errors import EngineError, EPDError, StoreError
from shared.metrics import JobOutcome
from shared.model_worker import ModelHandler
from shared.protocol import ECFailed, ECReady, EncodeJob, WorkerHeartbeat
from shared.store.ec import ECStore
from shared.store.format import ObjectValidationError
from shared.topology import Role, Service
from shared.worker import Delivery, Reject, Retry, WorkerContext

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)


class FingerprintMismatch(EPDError):
    """An encode job for another model version (e.g. during a rollout)."""

    code = "fingerprint_mismatch"


class FeatureProducer(abc.ABC):
    """Encodes one image into the store. Returns (feature tokens, stored bytes)."""

    def __init__(self, engine: Engine, store: ECStore):
        self.engine = engine
        self.store = store

    @abc.abstractmethod
    async def produce(self, item_hash: str, image: Image.Image | base.VideoFrames) -> tuple[int, int]: ...


class WorkerStoresFeatures(FeatureProducer):
    """The engine returns the features; the worker stores them."""

    engine: base.FeaturesThroughWorker  # type: ignore[assignment]  # a mixin: the Engine also returns features

    async def produce(self, item_hash: str, image: Image.Image | base.VideoFrames) -> tuple[int, int]:
        from shared.engines.ec_objects import encoded_to_extra
        from shared.store.tensors import tensor_to_raw

        encoded = await base.encode_item(self.engine, image)
        raw, dtype, shape = tensor_to_raw(encoded.features)
        _key, nbytes = await asyncio.to_thread(
            self.store.save, item_hash, raw, dtype=dtype, shape=shape, extra=encoded_to_extra(encoded)
        )
        return shape[0], nbytes


class ConnectorStoresFeatures(FeatureProducer):
    """The engine's EC connector stores the features while the engine encodes; announce the
    object only once the store has it."""

    engine: base.FeaturesThroughConnector  # type: ignore[assignment]  # a mixin: the Engine also stores features itself

    async def produce(self, item_hash: str, image: Image.Image | base.VideoFrames) -> tuple[int, int]:
        (n_tokens,) = await self.engine.produce([base.connector_item(image, item_hash)])
        info = await asyncio.to_thread(self.store.stored, item_hash)
        if info is None:  # e.g. the store was down during the save: retried, then ECFailed
            raise StoreError(f"the engine's EC connector did not store item {item_hash[:12]}")
        return n_tokens, info.size


class EncoderHandler(ModelHandler):
    service = Service.ENCODER
    role = Role.ENCODER
    job_type = EncodeJob
    queue = protocol.WorkQueue.ENCODE
    durable = protocol.CONSUMER_ENCODER
    jobs_metric = metrics.ENCODE_JOBS
    # One encode job serves every request with the same image: it runs to the end once started.
    stops_when_cancelled = False

    def __init__(self, settings: EncoderSettings, engine: Engine | None = None, store: ECStore | None = None):
        super().__init__(settings, engine, store)
        self.settings: EncoderSettings = settings
        self.producer: FeatureProducer | None = None
        self.pixel_budget: DecodeBudget | None = None  # (setup: it may follow the engine's steps)
        self.claims: EncodeClaims | None = None

    async def setup(self, ctx: WorkerContext) -> None:
        await super().setup(ctx)
        assert self.engine is not None and self.store is not None
        if isinstance(self.engine, base.FeaturesThroughConnector):
            self.producer = ConnectorStoresFeatures(self.engine, self.store)
        else:  # (base.FeaturesThroughWorker: the role's engine check passed)
            self.producer = WorkerStoresFeatures(self.engine, self.store)
        # Jobs held at once: as many as the engine batches (their encodes share its forwards), all
        # working (an encode job waits for nothing), within the pixel budget whatever the count.
        jobs = self.settings.encode_jobs_in_flight or self.engine.max_running_requests
        self.admission = Admission(jobs, max_waiting=0)
        step_pixels = self.engine.encode_pixels_per_step
        self.pixel_budget = DecodeBudget(self.settings.pixel_budget(step_pixels))
        if ctx.nc is not None:
            try:
                self.claims = await EncodeClaims.open(ctx.nc.jetstream(), ctx.subjects, self.settings.nats)
            except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types; without claims it encodes every job
                log.warning("encode claims unavailable (%s: %s): every job is encoded here", type(exc).__name__, exc)
        log.info(
            "encoder: up to %d jobs at once (%s), their images within %d pixels (%s); engine: %s",
            jobs,
            "EPD_ENCODE_JOBS_IN_FLIGHT" if self.settings.encode_jobs_in_flight else "from the engine",
            self.pixel_budget.capacity,
            "EPD_ENCODE_PIXEL_BUDGET"
            if self.settings.encode_pixel_budget
            else f"two engine steps of {step_pixels}"
            if step_pixels
            else "no engine step bound",
            self.engine_capacity(),
        )

    def heartbeat(self, settings: WorkerSettings) -> WorkerHeartbeat:
        """With its slots and how many are free: generating workers steal encodes only while every
        encoder's are full (``services.prefill.features.EncoderFleet``)."""
        hb = super().heartbeat(settings)
        if self.admission is None:
            return hb
        slots = self.admission.slots
        return msgspec.structs.replace(hb, slots=slots, free_slots=max(0, slots - self.in_flight))

    async def handle(self, job: EncodeJob, delivery: Delivery) -> None:
        if job.fingerprint != self.fingerprint:
            # This worker must not produce another model version's features. Tell the waiters
            # so they encode with their own model.
            raise Reject(FingerprintMismatch(f"worker fingerprint {self.fingerprint} != job {job.fingerprint}"))
        assert self.store is not None and self.producer is not None and self.pixel_budget is not None  # (setup)
        item = job.image.item_hash
        if await self._announced_stored(job):
            return

        # Decoded images held at once are bounded by pixels, however many jobs are in flight.
        claim = await self.pixel_budget.acquire(job.image.width * job.image.height * max(1, job.image.frames))
        delivery.start()  # (until its pixels were granted a stopping encoder hands the job back)
        try:
            if (stealer := await self._claim(job)) is not None:
                log.info("item %s stolen by %s: not encoding", item[:12], stealer)
                metrics.ENCODE_JOBS.labels(JobOutcome.STOLEN).inc()
                return
            # A job can wait long for the budget (a burst of videos): a worker that stole the item
            # meanwhile may have stored it and released its claim - look again before encoding.
            if await self._announced_stored(job):
                if self.claims is not None:
                    await self.claims.release(job.fingerprint, item)
                return
            image = await self.media(job.image)  # MediaMissing / InvalidImage: the job cannot succeed
            started_at = time.time()
            started = time.perf_counter()
            try:
                n_tokens, nbytes = await self.producer.produce(item, image)
            except EngineError as exc:  # may be this worker's (out of memory): let another one try
                raise Retry(None, f"engine failed: {exc.message}", error=exc) from exc
            del image
        finally:
            self.pixel_budget.release(claim)
        encode_s = time.perf_counter() - started
        metrics.ENCODE_SECONDS.observe(encode_s)
        log.info(
            "encoded %s: %d tokens, %d bytes, %.3fs (attempt %d)",
            item[:12],
            n_tokens,
            nbytes,
            encode_s,
            delivery.num_delivered,
        )
        await self._ready(job, n_tokens, nbytes, encode_s, started_at=started_at)
        metrics.ENCODE_JOBS.labels(JobOutcome.ENCODED).inc()
        if self.claims is not None:
            await self.claims.release(job.fingerprint, item)

    async def _announced_stored(self, job: EncodeJob) -> bool:
        """When the item's EC object is stored (and valid), announce it instead of encoding: True."""
        assert self.store is not None
        item = job.image.item_hash
        if not await asyncio.to_thread(self.store.exists, item):
            return False
        try:
            existing = await asyncio.to_thread(self.store.load, item, request_id=job.request_id)
        except ObjectValidationError:
            return False  # invalid object: recompute and overwrite it
        log.info("item %s already stored by %s: announcing, not recomputing", item[:12], existing.producer)
        await self._ready(job, existing.n_tokens, len(existing.data), 0.0)
        metrics.ENCODE_JOBS.labels(JobOutcome.ALREADY_STORED).inc()
        return True

    async def _claim(self, job: EncodeJob) -> str | None:
        """Claim the item before encoding it: the stealer's worker id when a generating worker
        took it first, else None (encode; also when the claims cannot be reached)."""
        if self.claims is None:
            return None
        try:
            held = await self.claims.for_encoder(job.fingerprint, job.image.item_hash, self.settings.worker_id)
        except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types: encode (a duplicate at worst)
            log.warning("could not claim %s (%s: %s): encoding", job.image.item_hash[:12], type(exc).__name__, exc)
            return None
        return held.owner if held is not None else None

    async def ended(self, job: EncodeJob, records: RequestRecords) -> Ended | None:
        """Dropped only when its request was cancelled and no other live request waits on it
        (``shared.cancellation``); encode jobs are shared, so a completed request does not end
        its item's job (a redelivered one finds its EC object stored and only announces it)."""
        if not await records.is_cancelled(job.request_id):
            return None
        if await records.wanted_elsewhere(job.fingerprint, job.image.item_hash, job.request_id):
            return None
        return Ended.CANCELLED

    async def on_cancelled(self, job: EncodeJob) -> None:
        # A request that wanted the image after all (it raced the check) encodes it locally now
        # instead of waiting for an ECReady that will not come.
        await self._failed(job, "cancelled", "the encode job was dropped: its request was cancelled")

    async def on_terminal(self, job: EncodeJob, error: EPDError, message: str) -> None:
        log.warning("encode job for %s failed: %s: %s", job.image.item_hash[:12], error.code, message)
        await self._failed(job, error.code, message)

    async def _failed(self, job: EncodeJob, code: str, message: str) -> None:
        assert self.ctx is not None
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

    async def _ready(
        self, job: EncodeJob, n_tokens: int, nbytes: int, encode_s: float, *, started_at: float = 0.0
    ) -> None:
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
