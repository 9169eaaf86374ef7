"""The delivery supervisor: fails jobs that exhausted their deliveries, once per job.

A job whose workers keep dying (crash, OOM kill, ack wait passed) is delivered ``EPD_MAX_DELIVER``
times; then JetStream gives up on it and publishes a MAX_DELIVERIES advisory (when a worker next
pulls after the last delivery's ack wait: tests/test_max_deliveries.py). The supervisor turns that
advisory into the request's terminal event, so the client gets a clear error instead of waiting
for its deadline:

* a ``GenerationJob`` / ``DecodeJob`` -> an ``ErrorEvent`` (``worker_failed``, HTTP 502) on the
  request's tokens subject;
* an ``EncodeJob`` -> ``ECFailed`` (``max_deliveries``) for its item, which a prefill worker waiting
  for the encoder takes as "encode locally" instead of waiting out ``EPD_EC_WAIT_S``.

Every API process runs one, in the queue group ``protocol.QUEUE_SUPERVISOR``: NATS hands each
advisory to one member, so N API replicas publish one event, not N. The event also carries a
``Nats-Msg-Id`` derived from the job's stream sequence, so a second copy (a supervisor outside the
group, an advisory seen twice) is dropped by the stream's duplicate window. A generation / decode
job whose request already ended (its result or a cancellation is recorded,
``shared.cancellation.RequestRecords``) is not reported: the client has its answer.
"""

from __future__ import annotations

import json
import logging
import time

from nats.aio.client import Client as NATS

from shared import protocol
from shared.cancellation import RequestRecords
from shared.errors import WorkerFailed
from shared.jetstream import Publisher
from shared.protocol import DecodeJob, ECFailed, EncodeJob, GenerationJob, Subjects

log = logging.getLogger(__name__)


class DeliverySupervisor:
    """Subscribes to the MAX_DELIVERIES advisories of the work consumers (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        publisher: Publisher,
        *,
        max_deliver: int,
        queue: str = protocol.QUEUE_SUPERVISOR,
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.publisher = publisher
        self.max_deliver = max_deliver
        self.queue = queue
        self.records = RequestRecords(self.js, subjects)
        self._subs: list = []

    def advisory_subjects(self) -> list[str]:
        return [
            self.subjects.max_deliveries_advisory(stream, consumer)
            for stream, consumer in (
                # the shared consumer and every worker's routed one (``shared.routed_jobs``)
                (self.subjects.stream_generate, "*"),
                (self.subjects.stream_decode, protocol.CONSUMER_DECODE),
                (self.subjects.stream_encode, protocol.CONSUMER_ENCODER),
            )
        ]

    async def start(self) -> None:
        for subject in self.advisory_subjects():
            self._subs.append(await self.nc.subscribe(subject, queue=self.queue, cb=self._on_advisory))

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection is closing anyway
                log.debug("unsubscribe: %s", exc)
        self._subs.clear()

    async def _on_advisory(self, msg) -> None:
        try:
            advisory = json.loads(msg.data)
            stream, seq = advisory["stream"], advisory["stream_seq"]
            raw = await self.js.get_msg(stream, seq)
            job = protocol.decode(raw.data or b"")
        except Exception as exc:  # noqa: BLE001 - a bad advisory must not stop the supervisor
            log.warning("could not read max-deliveries advisory: %s", exc)
            return
        msg_id = f"max-deliveries-{stream}-{seq}"
        if isinstance(job, (GenerationJob, DecodeJob)):
            # Deliveries that ran out after the request ended (acks lost in a NATS failover, the
            # redeliveries then failed or timed out): nothing failed that anyone waits on.
            ended = await self.records.ended(job.request_id)
            if ended is not None:
                log.info(
                    "a job of %s ran out of deliveries after its request ended (%s): not reported",
                    job.request_id,
                    ended,
                )
                return
            stage, what = ("decode", "decode") if isinstance(job, DecodeJob) else ("prefill", "generation")
            event = protocol.error_event(
                job.request_id,
                stage,
                WorkerFailed(f"the {what} job failed {self.max_deliver} times (workers crashed or timed out)"),
            )
            await self.publisher.publish(
                self.subjects.tokens(job.request_id), event, request_id=job.request_id, msg_id=msg_id
            )
            log.warning("%s job of %s failed %d times: request failed", what, job.request_id, self.max_deliver)
        elif isinstance(job, EncodeJob):
            failed = ECFailed(
                request_id=job.request_id,
                item_hash=job.image.item_hash,
                fingerprint=job.fingerprint,
                code="max_deliveries",
                message=f"encode job failed {self.max_deliver} times",
                created_at=time.time(),
            )
            await self.publisher.publish(
                self.subjects.ec_failed(job.fingerprint, job.image.item_hash),
                failed,
                request_id=job.request_id,
                msg_id=msg_id,
            )
            log.warning(
                "encode job of item %s failed %d times: reported failed", job.image.item_hash[:12], self.max_deliver
            )
