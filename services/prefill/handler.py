"""Prefill worker: GenerationJob -> encoder outputs -> prefill (+ decode) -> tokens.

One handler for the three roles of the prefill service (``EPD_ROLE``), assembled in ``setup``
from two strategies chosen by the role and the engine's capabilities (``shared.engines.base``):

===========  =====================================  ==================================
role         feature source (:mod:`.features`)      hand-off (:mod:`.handoff`)
===========  =====================================  ==================================
``pd``       cache -> store -> encoder -> local     none: prefill + decode here (E|PD)
``prefill``  cache -> store -> encoder -> local     KV object or KV connector (E|P|D)
``agg``      cache -> local (no store, no encoder)  none (the baseline)
===========  =====================================  ==================================

(A :class:`FeaturesThroughConnector` engine takes images instead: wait for the encoder, then the
engine's EC connector loads the stored output.)

Tokens go to ``<prefix>.tokens.<request_id>`` as ``TokenChunk`` messages numbered by ``seq``; a
redelivered job regenerates from the start (same seed, same tokens) with a higher ``attempt`` and
the API forwards only what it has not sent yet. A request this worker finishes ends with a
``FinalResult``; one that fails with an ``ErrorEvent`` (``on_terminal``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

import msgspec

from services.prefill.features import (
    ENCODER_STALE_S,
    ConnectorFeatures,
    EncoderFleet,
    EncoderWait,
    FeatureCache,
    FeatureSource,
    LocalFeatures,
    Stealer,
    StoredFeatures,
)
from services.prefill.handoff import Generation, HandOff, KVConnectorHandOff, KVObjectHandOff, NoHandOff
from shared import metrics, protocol
from shared.admission import LONG_PROMPTS_AT_ONCE, Admission, long_prompt_tokens
from shared.config import PrefillSettings, WorkerSettings
from shared.engines import base
from shared.engines.base import ConnectorItem, EncodedImage, Engine, MediaVideo
from shared.engines.prompts import image_token_estimate, prompt_cost
from shared.errors import DeadlineExceeded, EPDError, InvalidRequest
from shared.logs import plain
from shared.metrics import JobOutcome
from shared.model_worker import ModelHandler, job_prompt, sampling_params
from shared.protocol import ECSource, FinalResult, GenerationJob, Timing, WorkerHeartbeat
from shared.routed_jobs import RouteClaim
from shared.routing import RecentItems, advertised
from shared.store.ec import ECStore
from shared.store.kv import KVStore
from shared.token_stream import TokenOutput
from shared.topology import Role, Service
from shared.worker import Delivery, Reject, Superseded, WorkerContext

log = logging.getLogger(__name__)


def _image_tokens(item: EncodedImage | ConnectorItem) -> int:
    if isinstance(item, EncodedImage):
        return item.n_tokens
    if isinstance(item, MediaVideo):  # (an estimate: a temporal patch of two frames, each an image's tokens)
        n, height, width = item.video.frames.shape[:3]
        return max(1, n // 2) * image_token_estimate(width, height)
    return image_token_estimate(item.image.width, item.image.height)


class PrefillHandler(ModelHandler):
    service = Service.PREFILL
    job_type = GenerationJob
    queue = protocol.WorkQueue.GENERATE
    durable = protocol.CONSUMER_PREFILL
    jobs_metric = metrics.GENERATION_JOBS
    routable = True

    def __init__(
        self,
        settings: PrefillSettings,
        engine: Engine | None = None,
        store: ECStore | None = None,
        kv_store: KVStore | None = None,
    ):
        super().__init__(settings, engine, store)
        self.settings: PrefillSettings = settings
        self.role = settings.role
        self.kv_store = kv_store
        self.cache = FeatureCache(settings.local_cache_bytes)
        self.features: FeatureSource | None = None
        self.handoff: HandOff | None = None
        #: the encoders' heartbeats (roles pd and prefill): whether they are the bound, or gone
        self.fleet: EncoderFleet | None = None
        #: the items this worker's jobs used, most recent first: what it advertises when its engine
        #: keeps the features itself (vLLM's encoder and prefix caches; ``shared.routing``)
        self.recent_items = RecentItems(settings.routing_advertised_items)
        #: jobs taken and not yet answered (their result or hand-off not sent): the heartbeat's load.
        #: Not the runner's ``in_flight``, which holds a job until it is acked - a heartbeat that
        #: counted a job the API already saw end would make the worker look busy to the router.
        self.generating = 0

    async def setup(self, ctx: WorkerContext) -> None:
        await super().setup(ctx)
        assert self.engine is not None and self.store is not None
        if self.role is not Role.AGG:
            self.fleet = EncoderFleet(self.fingerprint, ENCODER_STALE_S, absent_s=self.settings.no_encoder_after_s)
            await self.fleet.listen(ctx)
        self.features = self._feature_source(ctx, await self._stealer(ctx))
        self.handoff = await self._handoff(ctx)
        self.admission = self._admission()
        log.info("role %s: %s, %s", self.role, type(self.features).__name__, type(self.handoff).__name__)

    def _admission(self) -> Admission:
        """Engine slots from the engine (``EPD_MAX_CONCURRENT_JOBS`` overrides) and the size of a
        long prompt (two at a time into the engine) from its step budget (``EPD_LONG_PROMPT_TOKENS``
        overrides), printed with what they came from; room for ``EPD_MAX_WAITING_JOBS`` jobs waiting
        for their features."""
        assert self.engine is not None
        slots = self.settings.max_concurrent_jobs or self.engine.max_running_requests
        configured = self.settings.long_prompt_tokens
        long_prompt = long_prompt_tokens(configured, self.engine.prefill_tokens_per_step)
        log.info(
            "admission: %d job(s) in the engine at once (%s; engine: %s), %s, up to %d more waiting for image features",
            slots,
            "EPD_MAX_CONCURRENT_JOBS" if self.settings.max_concurrent_jobs else "from the engine",
            self.engine_capacity(),
            "prompts of any length side by side"
            if long_prompt is None
            else f"prompts over {long_prompt} tokens {LONG_PROMPTS_AT_ONCE} at a time ("
            + ("EPD_LONG_PROMPT_TOKENS" if configured else "half a step")
            + ")",
            self.settings.max_waiting_jobs,
        )
        return Admission(slots, self.settings.max_waiting_jobs, long_prompt)

    async def _stealer(self, ctx: WorkerContext) -> Stealer | None:
        """Encode stealing (``EPD_ENCODE_STEALS``; roles pd and prefill), listening to the encoders'
        heartbeats from now on, or None."""
        assert self.store is not None  # setup() checked
        if self.role is Role.AGG or not self.settings.encode_steals:
            return None
        if isinstance(self.engine, base.FeaturesThroughConnector) and not self.engine.stores_encodes:
            log.warning("EPD_ENCODE_STEALS ignored: this engine does not store what it encodes")
            return None
        assert self.fleet is not None  # (setup listens first)
        s = self.settings
        return Stealer(ctx, self.store, self.fingerprint, s.encode_steals, s.encode_steal_after_s, self.fleet)

    def _feature_source(self, ctx: WorkerContext, stealer: Stealer | None) -> FeatureSource:
        assert self.store is not None  # setup() checked
        encoder = None
        if self.role is not Role.AGG:
            encoder = EncoderWait(ctx, self.fingerprint, self.settings.ec_wait_s, self.store, self.fleet)
        if isinstance(self.engine, base.FeaturesThroughConnector):
            return ConnectorFeatures(self.media, self.store, encoder, stealer)
        engine = cast(base.FeaturesThroughWorker, self.engine)  # (the role's engine check passed)
        if encoder is None:
            return LocalFeatures(engine, self.cache, self.media)
        return StoredFeatures(engine, self.cache, self.media, self.store, encoder, stealer)

    async def _handoff(self, ctx: WorkerContext) -> HandOff:
        worker_id = self.settings.worker_id
        assert self.engine is not None  # setup() checked
        if self.role is not Role.PREFILL:
            return NoHandOff(self.engine, ctx, worker_id)
        if self.kv_store is None:
            self.kv_store = await self.model_kv_store()
        log.info("role prefill: KV objects under model fingerprint %s", self.kv_store.fingerprint)
        if isinstance(self.engine, base.KVConnectorHandoff):
            return KVConnectorHandOff(self.engine, ctx, worker_id, self.kv_store)
        return KVObjectHandOff(self.engine, ctx, worker_id, self.kv_store)  # base.KVStateHandoff

    def heartbeat(self, settings: WorkerSettings) -> WorkerHeartbeat:
        """With what routing needs (``shared.routing``): slots, free slots, the items it holds."""
        hb = super().heartbeat(settings)
        if not self.routed or self.admission is None:
            return hb
        k = self.settings.routing_advertised_items
        # a feature cache (transformers): what it holds; else the engine's caches: what was used last
        held = self.cache.recent() if isinstance(self.features, LocalFeatures) else self.recent_items.recent()
        return msgspec.structs.replace(
            hb,
            routable=True,
            slots=self.admission.slots,
            free_slots=max(0, self.admission.slots - max(0, self.generating - self.admission.waiting_jobs)),
            items=advertised(held, k),
        )

    # -- job -------------------------------------------------------------------------------
    async def handle(self, job: GenerationJob, delivery: Delivery) -> None:
        if time.time() > job.deadline:
            raise Reject(
                DeadlineExceeded("request deadline passed before a worker took it"), outcome=JobOutcome.EXPIRED
            )
        answered = False

        def answering() -> None:  # the result goes out now: no longer load
            nonlocal answered
            if not answered:
                answered = True
                self.generating -= 1

        self.generating += 1
        try:
            await self._generate(
                job, delivery.num_delivered, claim=delivery.claim, answering=answering, start=delivery.start
            )
        except InvalidRequest as exc:  # the client's error: its own message
            raise Reject(exc, outcome=JobOutcome.REJECTED) from exc
        finally:
            answering()
            if self.features is not None:  # items it stole and did not announce (it failed or stopped first)
                await self.features.settle(job.request_id, None)
        metrics.GENERATION_JOBS.labels(JobOutcome.OK).inc()

    async def _generate(
        self,
        job: GenerationJob,
        attempt: int,
        *,
        claim: RouteClaim | None = None,
        answering: Callable[[], None] | None = None,
        start: Callable[[], None] | None = None,
    ) -> None:
        """Features (waiting for them holds no engine slot), then an engine slot (the cheapest
        prompt first), then generate or hand off (``shared.admission``). ``start`` is called as
        the slot is granted (``Delivery.start``: until then a stopping worker hands the job back)."""
        assert self.ctx is not None and self.features is not None and self.handoff is not None
        assert self.admission is not None
        t0 = time.perf_counter()
        # the items to resolve: each image or video, or a segmented video's segments
        distinct = {ref.item_hash: ref for ref in job.stored_items}
        resolved: list[tuple[EncodedImage | ConnectorItem, str]] = []
        if distinct:
            async with self.admission.waiting():
                resolved = await asyncio.gather(
                    *(self.features.resolve(ref, job.request_id) for ref in distinct.values())
                )
        by_hash = dict(zip(distinct, resolved))
        for item_hash in distinct:
            self.recent_items.used(item_hash)
        # (a segmented video: its segments' items joined by the feature source)
        images = [
            by_hash[ref.item_hash][0]
            if not ref.segments
            else await self.features.join(ref, [by_hash[seg.item_hash][0] for seg in ref.segments], job.request_id)
            for ref in job.images
        ]
        t_features = time.perf_counter()
        prompt = job_prompt(job)
        announce_steals: Callable[[], Awaitable[None]] | None = None
        if any(src == ECSource.STOLEN for _, src in resolved):
            # the engine encoded (and its connector stored) the stolen items before the first token
            announce_steals = functools.partial(self.features.settle, job.request_id, None)

        async with self.admission.slot(prompt_cost(prompt, [_image_tokens(item) for item in images])) as slot:
            if start is not None:
                start()

            async def first_token() -> None:  # the prompt is prefilled: room for the next one's
                slot.prefilled()
                if announce_steals is not None:
                    await announce_steals()

            gen = Generation(
                job=job,
                prompt=prompt,
                images=images,
                params=sampling_params(job.sampling, seed=protocol.effective_seed(job.request_id, job.sampling.seed)),
                out=TokenOutput(self.ctx, job.request_id, attempt, on_first_token=first_token),
                sources={h: src for h, (_, src) in by_hash.items()},
                t0=t0,
                t_features=t_features,
                t_admitted=time.perf_counter(),
            )
            handed_off = await self.handoff.run(gen)
            await self.features.settle(job.request_id, gen.stats)  # (no first token: announced now)
            if "cached_tokens" in gen.stats.extra:  # an engine with a prefix cache (vLLM) says how much it held
                metrics.PREFIX_CACHE_TOKENS.labels(metrics.PrefixCacheKind.QUERY).inc(gen.stats.prompt_tokens)
                metrics.PREFIX_CACHE_TOKENS.labels(metrics.PrefixCacheKind.HIT).inc(gen.stats.extra["cached_tokens"])
            if handed_off:
                return  # a decode worker owns the request now
            if claim is not None and not await claim.held():
                raise Superseded(f"{job.request_id}: another worker took the routed job over")
            if answering is not None:
                answering()
            await self._final(gen)

    async def _final(self, gen: Generation) -> None:
        assert self.ctx is not None
        job, out, stats = gen.job, gen.out, gen.stats
        gen.take_engine_sources()
        t_end = time.perf_counter()
        final = FinalResult(
            request_id=job.request_id,
            attempt=out.attempt,
            token_ids=tuple(out.token_ids),
            text=out.text,
            finish_reason=out.finish_reason,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            timings={
                Timing.FEATURES: gen.t_features - gen.t0,
                Timing.ADMISSION: gen.t_admitted - gen.t_features,
                Timing.PREFILL: stats.prefill_s,
                Timing.DECODE: stats.decode_s,
                Timing.FIRST_TOKEN: (out.first_token_at - gen.t0) if out.first_token_at else 0.0,
                Timing.TOTAL: t_end - gen.t0,
            },
            ec_sources=gen.sources,
            worker=self.settings.worker_id,
        )
        await out.end(final)
        log.info(
            "done: %d prompt + %d completion tokens, finish=%s, features %.3fs, total %.3fs, sources=%s",
            stats.prompt_tokens,
            stats.completion_tokens,
            out.finish_reason,
            gen.t_features - gen.t0,
            t_end - gen.t0,
            plain(gen.sources),
        )

    async def close(self) -> None:
        if self.features is not None:
            try:
                await self.features.close()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway: the next janitor pass sees colder objects
                log.warning("could not close the EC lifecycle: %s", exc)
        await super().close()

    async def on_terminal(self, job: GenerationJob, error: EPDError, message: str) -> None:
        assert self.ctx is not None
        event = protocol.error_event(job.request_id, Service.PREFILL, error, message=message)
        await self.ctx.publisher.publish(self.ctx.subjects.tokens(job.request_id), event, request_id=job.request_id)
