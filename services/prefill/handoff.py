"""What a generating worker does after the features: one :class:`HandOff` per worker, chosen in
``setup`` from the role and the engine's capability.

* :class:`NoHandOff` (roles ``pd``, ``agg``): generate here, streaming every token.
* :class:`KVObjectHandOff` (role ``prefill``, :class:`KVStateHandoff` engines): prefill, stream
  the first token, write the decode state (KV cache, last token, positions / M-RoPE delta,
  sampling RNG state, tokens so far) as a KV object (``shared.store.kv``) and publish a
  ``DecodeJob`` for the decode workers. If the state cannot be handed off (over
  ``EPD_MAX_KV_OBJECT_BYTES``, store down, job too large for NATS) the worker decodes the
  request itself, as ``pd`` would (logged, counted in ``epd:kv_handoffs_total``). A request that
  finishes with its first token never leaves.
* :class:`KVConnectorHandOff` (role ``prefill``, :class:`KVConnectorHandoff` engines, vLLM): the
  engine computes the prompt and its KV connector stores the KV cache
  (``shared.connectors.s3_kv``); the decode worker's engine loads it and samples *every* output
  token (this worker streams none), so sampling draws exactly as in an aggregated run.

The ``DecodeJob`` is built in one place, :meth:`HandOff.decode_job`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared import metrics, protocol
from shared.engines import base
from shared.engines.base import ConnectorItem, EncodedImage, Engine, GenerationStats, Prompt, SamplingParams
from shared.errors import EngineError, StoreError
from shared.logs import plain
from shared.metrics import KVHandoffOutcome
from shared.protocol import DecodeJob, ECSource, GenerationJob, Timing
from shared.store.kv import KVStore
from shared.store.objects import ObjectTooLarge
from shared.token_stream import TokenOutput
from shared.worker import WorkerContext

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generation job in a worker: its inputs, what it streamed and when things happened."""

    job: GenerationJob
    #: the job's chat messages, or its completions prompt (``shared.model_worker.job_prompt``)
    prompt: Prompt
    images: Sequence[EncodedImage | ConnectorItem]
    params: SamplingParams
    out: TokenOutput
    #: item hash -> where its features came from
    sources: dict[str, str]
    #: ``time.perf_counter()`` when the job started, when its features were ready and when it got
    #: an engine slot (``shared.admission``)
    t0: float
    t_features: float
    t_admitted: float
    stats: GenerationStats = field(default_factory=GenerationStats)

    async def stream(self, events) -> None:
        """Stream ``events`` (an engine iterator) to the client until the request's deadline."""
        await self.out.stream(events, deadline=self.job.deadline)

    def take_engine_sources(self) -> None:
        """Where the engine says each item's features came from (a connector engine reports it
        after generating) over the provisional sources: a stolen item stays "stolen" (the engine
        saw a miss in the store, by design); a segmented video's source becomes each of its
        segments' (the engine saw the video, whose object was joined from theirs)."""
        reported = dict(self.stats.extra.get("ec_sources") or {})
        for ref in self.job.images:
            if ref.segments and ref.item_hash in reported:
                source = reported.pop(ref.item_hash)
                reported.update(dict.fromkeys((seg.item_hash for seg in ref.segments), source))
        self.sources.update({h: src for h, src in reported.items() if self.sources.get(h) != ECSource.STOLEN})


class HandOff(abc.ABC):
    def __init__(self, engine: Engine, ctx: WorkerContext, worker_id: str):
        self.engine = engine
        self.ctx = ctx
        self.worker_id = worker_id

    @abc.abstractmethod
    async def run(self, gen: Generation) -> bool:
        """Generate ``gen``: True when a decode worker now owns the request, False when this
        worker finished it (the caller then publishes the FinalResult)."""

    async def generate_here(self, gen: Generation) -> None:
        await gen.stream(self.engine.generate(gen.prompt, gen.images, gen.params, gen.stats))


class NoHandOff(HandOff):
    async def run(self, gen: Generation) -> bool:
        await self.generate_here(gen)
        return False


class KVHandOff(HandOff):
    """A hand-off to the decode workers: a KV object under this worker's model fingerprint and
    a ``DecodeJob`` pointing at it."""

    def __init__(self, engine: Engine, ctx: WorkerContext, worker_id: str, kv_store: KVStore):
        super().__init__(engine, ctx, worker_id)
        self.kv_store = kv_store

    def decode_job(self, gen: Generation, *, kv_key: str, kv_nbytes: int, timings: dict[str, float]) -> DecodeJob:
        """The request's ``DecodeJob``, after the tokens ``gen.out`` streamed."""
        job = gen.job
        return DecodeJob(
            request_id=job.request_id,
            kv_key=kv_key,
            kv_attempt=job.reprefill,
            kv_nbytes=kv_nbytes,
            model_fingerprint=self.kv_store.fingerprint,
            sampling=job.sampling,
            deadline=job.deadline,
            created_at=time.time(),
            emitted=len(gen.out.token_ids),
            emitted_text=gen.out.text,
            prompt_tokens=gen.stats.prompt_tokens,
            generation=job,
            timings=timings,
            ec_sources=gen.sources,
            prefill_worker=self.worker_id,
        )

    async def publish(self, decode_job: DecodeJob) -> None:
        """Hand the request to the decode workers."""
        await self.ctx.publisher.publish(
            self.ctx.subjects.decode_jobs,
            decode_job,
            request_id=decode_job.request_id,
            msg_id=f"{decode_job.request_id}-decode-{decode_job.kv_attempt}",
        )
        metrics.KV_HANDOFFS.labels(KVHandoffOutcome.HANDED_OFF).inc()


class KVObjectHandOff(KVHandOff):
    engine: base.KVStateHandoff  # type: ignore[assignment]  # a mixin: the Engine also hands off KV state

    async def run(self, gen: Generation) -> bool:
        job = gen.job
        prefilled = await self.engine.prefill(
            gen.prompt,
            gen.images,  # type: ignore[arg-type]  # encoded: this engine's features come through the worker
            gen.params,
            gen.stats,
        )
        try:
            await gen.out.publish(prefilled.first)
            if prefilled.first.finish_reason is not None:
                metrics.KV_HANDOFFS.labels(KVHandoffOutcome.FINISHED_IN_PREFILL).inc()
                return False
            t_handoff = time.perf_counter()
            try:
                tensors, meta = await prefilled.export()
                key, blob = await asyncio.to_thread(
                    self.kv_store.encode,
                    job.request_id,
                    job.reprefill,
                    tensors,
                    meta,
                    protocol.to_builtins(job.sampling),
                )
                decode_job = self.decode_job(
                    gen,
                    kv_key=key,
                    kv_nbytes=len(blob),
                    timings={
                        Timing.FEATURES: gen.t_features - gen.t0,
                        Timing.ADMISSION: gen.t_admitted - gen.t_features,
                        Timing.PREFILL: gen.stats.prefill_s,
                        Timing.FIRST_TOKEN: (gen.out.first_token_at or t_handoff) - gen.t0,
                    },
                )
                limit = self.ctx.nc.max_payload if self.ctx.nc is not None else 1024 * 1024
                if len(protocol.encode(decode_job)) > limit:
                    raise ValueError(f"decode job over the NATS payload limit of {limit} bytes")
                await asyncio.to_thread(self.kv_store.put, key, blob)
            except (ObjectTooLarge, StoreError, ValueError) as exc:
                too_large = isinstance(exc, (ObjectTooLarge, ValueError))
                reason = "too_large" if too_large else "store_error"
                log.warning("cannot hand off to a decode worker (%s: %s): decoding here", reason, exc)
                metrics.KV_HANDOFFS.labels(
                    KVHandoffOutcome.LOCAL_TOO_LARGE if too_large else KVHandoffOutcome.LOCAL_STORE_ERROR
                ).inc()
                await gen.stream(prefilled.continue_here())
                return False
        finally:
            await prefilled.release()
        await gen.out.flush()  # the first token is stored before the decode worker streams the next
        await self.publish(decode_job)
        log.info(
            "handed off: %d prompt tokens, KV %s (%d bytes) in %.3fs, features %.3fs, prefill %.3fs, sources=%s",
            gen.stats.prompt_tokens,
            key,
            len(blob),
            time.perf_counter() - t_handoff,
            gen.t_features - gen.t0,
            gen.stats.prefill_s,
            plain(gen.sources),
        )
        return True


class KVConnectorHandOff(KVHandOff):
    engine: base.KVConnectorHandoff  # type: ignore[assignment]  # a mixin: the Engine also hands off via its connector

    async def run(self, gen: Generation) -> bool:
        job = gen.job
        if gen.params.max_tokens <= 1:  # nothing to hand off: decoding here is the whole request
            metrics.KV_HANDOFFS.labels(KVHandoffOutcome.FINISHED_IN_PREFILL).inc()
            await self.generate_here(gen)
            return False
        expected_key = self.kv_store.key(job.request_id, job.reprefill)
        try:
            handoff = await self.engine.prefill_for_handoff(
                gen.prompt,
                gen.images,  # type: ignore[arg-type]  # media images: the connector engine encodes or loads them
                gen.params,
                request_name=job.request_id,
                attempt=job.reprefill,
                stats=gen.stats,
            )
            if handoff.key != expected_key:
                raise EngineError(
                    f"the engine stored the KV under {handoff.key!r}, not {expected_key!r}: prefill "
                    "and decode would disagree on the model version"
                )
        except EngineError as exc:
            log.warning("cannot hand off to a decode worker (%s): decoding here", exc)
            metrics.KV_HANDOFFS.labels(KVHandoffOutcome.LOCAL_ENGINE_ERROR).inc()
            await self.generate_here(gen)
            return False
        gen.take_engine_sources()
        await self.publish(
            self.decode_job(
                gen,
                kv_key=handoff.key,
                kv_nbytes=0,
                timings={
                    Timing.FEATURES: gen.t_features - gen.t0,
                    Timing.ADMISSION: gen.t_admitted - gen.t_features,
                    Timing.PREFILL: gen.stats.prefill_s,
                },
            )
        )
        log.info(
            "handed off through the KV connector: %d prompt tokens, KV %s, features %.3fs, prefill %.3fs, sources=%s",
            gen.stats.prompt_tokens,
            handoff.key,
            gen.t_features - gen.t0,
            gen.stats.prefill_s,
            plain(gen.sources),
        )
        return True
