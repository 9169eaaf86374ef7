"""The one consumer-loop shape every worker uses.

A worker is a :class:`Handler` (``setup`` / ``handle`` / ``on_terminal`` / ``close``) plus
:class:`WorkerRunner`, which owns NATS, signals and settings.

**Outcomes by exception** (FastStream's ``NackMessage`` / ``RejectMessage``, arq's ``Retry``):
``handle(job, delivery)`` returning means the job is done (ack). Otherwise it raises

* :class:`Retry` - try again after ``delay_s`` (``nak``);
* :class:`Reject` - the job cannot succeed: end the request with ``error`` (``term``);
* anything else - transient unless it is a non-transient :class:`~shared.errors.EPDError`
  (those end the request like a ``Reject``): an unexpected exception or a
  :class:`~shared.errors.StoreError` or :class:`~shared.errors.ServiceUnavailable` is retried.

**Cancellation** (``shared.cancellation``): a job whose request was cancelled is dropped when
taken (:meth:`Handler.ended`; a first delivery by the cancellations the runner heard, without
a JetStream read when it heard them all since the job was published), and a running one is
stopped (its task is cancelled, which closes the engine's generation) when the cancellation
arrives; both are acked, counted in ``epd:requests_cancelled_total{stage}`` and cleaned up by
:meth:`Handler.on_cancelled`. A job
taken after its request already ended (its final result or error is published: the ack of the
delivery that finished it was lost, e.g. in a NATS failover) is acked without running too,
counted as ``already_done`` and cleaned up the same way.

A retry at the last delivery (``num_delivered >= max_deliver``) ends the request too. Ending a
request is one place, :func:`settle`: it calls the handler's :meth:`Handler.on_terminal` once
(the encoder publishes ``ECFailed``, generating workers an ``ErrorEvent`` on the token subject)
and terminates the message. A message that does not decode as the handler's ``job_type`` is
terminated without an event (there is no request to tell). :func:`settle` needs no broker:
tests drive handlers through it.

The runner:

* durable pull consumer, ``fetch`` one message at a time while there is free capacity: up to
  ``concurrency`` jobs held, or, for a handler with an :class:`~shared.admission.Admission`
  (generating workers), while fewer jobs are working than the engine has slots (jobs that wait
  for their inputs do not count);
* a core-NATS subscription to every cancellation, which cancels the task of a running job of
  that request (unless the handler's jobs run to the end: ``stops_when_cancelled``);
* each message handled in its own task, with ``in_progress`` sent every ``ack_wait /``
  :data:`KEEP_ALIVES_PER_ACK_WAIT` so long work is not redelivered while it is still running,
  while the job of a worker that died is redelivered one ack wait (``EPD_ACK_WAIT_S``, 4 s) after
  its last sign of life;
* liveness: every 2 s a JetStream round trip to its consumer; only when it answers, a heartbeat
  on core NATS (the API's ``/health`` lists live workers) and the health file ``epd healthcheck``
  reads; a worker that cannot reach its consumer for ``EPD_UNREACHABLE_EXIT_S`` exits with
  :data:`EXIT_UNREACHABLE` (its supervisor restarts it);
* trace headers on everything a handler publishes for a job (``Epd-Stage``, ``Epd-Started-At``,
  ``Epd-Received-At``; ``shared.jetstream.set_trace``), the request id on every log line, the
  ``epd:requests_in_flight{service=...}`` gauge, and consumer lag (``epd:consumer_num_pending``)
  from the liveness round trip;
* SIGTERM / SIGINT (a scale-down): stop fetching at once (an outstanding pull is given up, and a
  job the server delivered to it meanwhile is handed back with a ``nak``, so another worker takes
  it now, not after the ack wait); hand back the jobs held but not started (``Delivery.start``:
  waiting for an engine slot, an encoder's pixels or their inputs) and move the jobs routed to
  this worker to the shared queue; heartbeats say "draining" (no new route, and a draining encoder
  counts as gone once it has no job left); finish the started jobs (up to ``EPD_DRAIN_S``), close.

**Routed jobs** (``shared.routed_jobs``): the runner is given its routing strategy once, when it is
built (:class:`~shared.routed_jobs.RoutedJobs` for a handler with ``routable``, else
:class:`~shared.routed_jobs.SharedQueueOnly`). With routed jobs, beside the shared consumer the
runner pulls from the worker's own consumer of the jobs the API routed to it, within the same room
(a routed job may be taken while a pull on the shared queue is outstanding: at most one job over,
which waits for an engine slot in the admission queue); the strategy claims each routed job before
it runs (a job claimed elsewhere, which the API sent to the shared queue meanwhile, is acked and
dropped), and the claim is marked done once the job is settled. A handler that finds its claim
taken over before it sends its result raises :class:`Superseded` (acked, nothing sent).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from nats.aio.client import Client as NATS

from shared import metrics, protocol
from shared.admission import Admission
from shared.cancellation import Ended, RequestRecords, cancelled_request_id
from shared.config import WorkerSettings, retired_settings_in
from shared.errors import EPDError, ServiceUnavailable, StoreError, WorkerFailed
from shared.health import HealthFile
from shared.heap import freeze_startup_heap
from shared.jetstream import (
    TRACE_HEADERS,
    JetStreamPublisher,
    Publisher,
    close_connection,
    confirm_subscriptions,
    connect,
    ensure_topology,
    set_trace,
)
from shared.logs import REQUEST_ID
from shared.metrics import JobOutcome
from shared.protocol import Subjects, WorkerHeartbeat, WorkQueue
from shared.routed_jobs import RouteClaim, RoutedJobs, SharedQueueOnly, WorkerRouting
from shared.topology import Role, Service

log = logging.getLogger(__name__)

#: How often a worker proves it can pull (a JetStream round trip), then beats and refreshes its
#: health file and the consumer lag gauges (``WorkerRunner._liveness``).
HEARTBEAT_INTERVAL_S = 2.0
#: Exit code of a worker that could not reach its consumer for ``EPD_UNREACHABLE_EXIT_S``.
EXIT_UNREACHABLE = 3
#: ``in_progress`` beats a running job sends per ack wait: a live worker's job is redelivered only if
#: its event loop sends none of them for (1 - 1/this) of an ack wait (3 s of the default 4 s); the
#: engines compute in threads or processes of their own, off the loop (tests/test_failover.py
#: holds it with both cores busy).
KEEP_ALIVES_PER_ACK_WAIT = 4
#: Errors that say nothing about the job (the store or NATS is down): retried like unexpected exceptions.
TRANSIENT_ERRORS: tuple[type[EPDError], ...] = (StoreError, ServiceUnavailable)


# -- outcomes ---------------------------------------------------------------------------------
class Retry(Exception):
    """Try the job again after ``delay_s`` (None: 1 s per delivery so far). At the last delivery
    the request ends with ``error`` (default: :class:`~shared.errors.WorkerFailed`)."""

    def __init__(self, delay_s: float | None, reason: str, *, error: EPDError | None = None):
        super().__init__(reason)
        self.delay_s = delay_s
        self.reason = reason
        self.error = error


class Reject(Exception):
    """The job cannot succeed: end its request with ``error`` (``message`` overrides its text)
    and terminate the message. ``outcome`` labels the handler's job counter."""

    def __init__(self, error: EPDError, *, message: str | None = None, outcome: JobOutcome = JobOutcome.FAILED):
        super().__init__(error.message if message is None else message)
        self.error = error
        self.message = error.message if message is None else message
        self.outcome = outcome


class Superseded(Exception):
    """Another worker runs this routed job now (its claim was taken over, ``shared.routed_jobs``):
    drop it without sending anything (ack)."""


#: The reason of a :class:`Settlement` of a job a stopping worker gave back before starting it.
HANDED_BACK = "handed back: the worker is stopping"


class Action(enum.Enum):
    ACK = "ack"
    NAK = "nak"
    TERM = "term"


@dataclass(frozen=True)
class Settlement:
    """What :func:`settle` decided for a message (the runner applies it to the NATS message)."""

    action: Action
    delay_s: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Delivery:
    """A message as a handler sees it: payload plus delivery facts."""

    data: bytes
    subject: str
    headers: dict[str, str]
    num_delivered: int
    max_deliver: int
    published_at: float | None = None
    #: Set by the runner when the job's request is cancelled while the job runs.
    cancel: JobCancel = field(default_factory=lambda: JobCancel())
    #: A routed job's claim, won by this worker (``shared.routed_jobs``); None for the shared queue's jobs.
    claim: RouteClaim | None = None

    @property
    def is_last_attempt(self) -> bool:
        return self.num_delivered >= self.max_deliver

    def start(self) -> None:
        """The handler's mark that the job's work begins (an engine slot granted, an encode
        begun): from now on a stopping worker finishes the job (within ``EPD_DRAIN_S``); until
        then it hands the job back to the queue for another worker (``JobCancel.hand_back``)."""
        self.cancel.started = True

    @property
    def request_id(self) -> str:
        return self.headers.get(protocol.HDR_REQUEST_ID, "-")

    @property
    def backoff_s(self) -> float:
        """The default retry delay: 1 s per delivery so far."""
        return 1.0 * self.num_delivered


class JobCancel:
    """The runner's request to stop one running job because its request was cancelled: the
    job's task is cancelled (which closes the engine's generation) until :func:`settle` saw it."""

    #: Python 3.11's ``asyncio.wait_for`` (nats-py awaits every publish's ack with it) swallows a
    #: cancellation that lands as its inner future completes: the task is cancelled again after
    #: this long until the job has seen one.
    RECANCEL_S = 0.05

    def __init__(self) -> None:
        self.requested = False
        self.seen = False
        #: The worker is stopping and the job has not started (:meth:`Delivery.start`): it is
        #: stopped and handed back to the queue (``nak`` now), not acked.
        self.handing_back = False
        #: Set by :meth:`Delivery.start`: the job's work began (an engine slot, an encode), so a
        #: stopping worker finishes it instead of handing it back.
        self.started = False
        self._task: asyncio.Task | None = None

    def bind(self, task: asyncio.Task) -> None:
        self._task = task

    def request(self) -> None:
        self.requested = True
        self._cancel_task()

    def hand_back(self) -> bool:
        """The worker is stopping: stop the job and give it back to its queue, unless it has
        started (then it is finished within the drain). True when it is being handed back."""
        if self.started or self.seen or self.requested or self._task is None or self._task.done():
            return False
        self.handing_back = True
        self._cancel_task()
        return True

    def _cancel_task(self) -> None:
        if self.seen or self._task is None or self._task.done():
            return
        if self.handing_back and not self.requested and self.started:
            return  # (a re-cancel after the job started: it runs to its end now)
        self._task.cancel()
        asyncio.get_running_loop().call_later(self.RECANCEL_S, self._cancel_task)


@dataclass
class WorkerContext:
    """What the runner hands a handler at set-up."""

    settings: WorkerSettings
    subjects: Subjects
    publisher: Publisher
    nc: NATS | None = None


class Handler(abc.ABC):
    """One worker's job logic. ``setup`` once, then ``handle`` per job (concurrently, one task
    each), ``on_terminal`` when a job's request ends in an error, ``close`` at the end."""

    #: The service process this handler runs in: the word of its heartbeats, health file and
    #: metrics (``epd healthcheck --role``).
    service: ClassVar[Service]
    #: What the worker does (shared.topology.Role); picks its strategies and engine checks.
    role: Role
    #: The message type consumed (``protocol.decode`` target), and its stream and durable consumer.
    job_type: ClassVar[type[Any]]
    queue: ClassVar[WorkQueue]
    durable: ClassVar[str] = ""
    #: The handler's job counter (label ``outcome``): the runner counts ``bad_message``,
    #: ``retried`` and terminal outcomes; the handler counts its successes.
    jobs_metric: ClassVar[Any] = None

    #: Whether a running job is stopped when its request is cancelled (the encoder's jobs are
    #: shared by every request with the same image, and short: they run to the end).
    stops_when_cancelled: ClassVar[bool] = True
    #: Whether the API may route jobs to this worker (``shared.routing``): picks the runner's routing
    #: strategy (``shared.routed_jobs``), which also consumes the worker's routed subject; the runner
    #: sets ``routed`` once it does.
    routable: ClassVar[bool] = False
    routed: bool = False

    in_flight: int = 0
    #: Set in ``setup`` by a handler that sizes its work from its engine (``shared.admission``;
    #: generating workers: jobs waiting for inputs take no slot): the runner then fetches by it
    #: instead of its fixed ``concurrency``.
    admission: Admission | None = None

    @abc.abstractmethod
    async def setup(self, ctx: WorkerContext) -> None:
        """Load the model, connect to the store. Called once before consuming."""

    @abc.abstractmethod
    async def handle(self, job: Any, delivery: Delivery) -> None:
        """Handle one job; return when it is done, or raise (:class:`Retry`, :class:`Reject`,
        anything else). Must be idempotent: delivery is at least once."""

    async def on_terminal(self, job: Any, error: EPDError, message: str) -> None:
        """The job's request ends with ``error`` (``message`` is the text to send): tell whoever
        waits. Called once per ended job, by :func:`settle`."""

    async def ended(self, job: Any, records: RequestRecords) -> Ended | None:
        """Whether the job's request is over when the job is taken (None: run it): by default,
        when it was cancelled or its final result / error event is already published."""
        return await records.ended(job.request_id)

    async def on_cancelled(self, job: Any) -> None:
        """The job was dropped or stopped because its request was cancelled or had already
        ended: release what it holds."""

    async def close(self) -> None:
        """Release what ``setup`` built."""

    def heartbeat(self, settings: WorkerSettings) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            role=self.service.value,
            worker_id=settings.worker_id,
            fingerprint=getattr(self, "fingerprint", ""),
            model=settings.model.served_model_name(),
            engine=settings.model.engine,
            in_flight=self.in_flight,
            sent_at=time.time(),
        )


def _count(handler: Handler, outcome: JobOutcome) -> None:
    if handler.jobs_metric is not None:
        handler.jobs_metric.labels(outcome).inc()


async def _cancelled(handler: Handler, job: Any, how: str) -> Settlement:
    """A job of a cancelled request: release what it holds, count it, ack it (no redelivery)."""
    log.info("%s: its request was cancelled", how)
    _count(handler, JobOutcome.CANCELLED)
    metrics.REQUESTS_CANCELLED.labels(handler.service.value).inc()
    try:
        await handler.on_cancelled(job)
    except Exception:
        log.exception("clean-up of the cancelled job failed")
    return Settlement(Action.ACK, reason="cancelled")


async def _already_done(handler: Handler, job: Any, ended: Ended, delivery: Delivery) -> Settlement:
    """A job redelivered after its request ended: ack it without running (its ack was lost)."""
    log.info("job dropped: its request already ended (%s), delivery %d", ended, delivery.num_delivered)
    _count(handler, JobOutcome.ALREADY_DONE)
    try:
        await handler.on_cancelled(job)
    except Exception:
        log.exception("clean-up of the dropped job failed")
    return Settlement(Action.ACK, reason=f"already {ended}")


async def _ended(handler: Handler, job: Any, delivery: Delivery, records: RequestRecords) -> Ended | None:
    """Whether the job's request is over. A first delivery that the runner can stop has not run
    anywhere, so only a cancellation can have ended its request: when the runner heard every
    cancellation since before the job was published, that answers it without a JetStream read
    (a cancellation arriving later stops the running job). Otherwise :meth:`Handler.ended`."""
    if delivery.num_delivered == 1 and handler.stops_when_cancelled:
        heard = records.heard_cancelled(job.request_id, delivery.published_at)
        if heard is not None:
            return Ended.CANCELLED if heard else None
    return await handler.ended(job, records)


async def settle(handler: Handler, delivery: Delivery, records: RequestRecords | None = None) -> Settlement:
    """Decode the job, run the handler and turn its outcome into ack / nak / term, calling
    :meth:`Handler.on_terminal` once when the job's request ends in an error. With ``records``,
    a job whose request was cancelled or already ended is dropped before it runs; a job the
    runner cancels while it runs (``delivery.cancel``) is acked as cancelled."""
    try:
        job = protocol.decode(delivery.data, handler.job_type)
    except protocol.ProtocolError as exc:
        _count(handler, JobOutcome.BAD_MESSAGE)
        return Settlement(Action.TERM, reason=f"undecodable {handler.job_type.__name__}: {exc}")
    if delivery.published_at:
        metrics.QUEUE_SECONDS.labels(handler.queue).observe(max(0.0, time.time() - delivery.published_at))
    attempts = f"{delivery.num_delivered}/{delivery.max_deliver}"
    try:
        ended = await _ended(handler, job, delivery, records) if records is not None else None
        if ended is Ended.CANCELLED:
            return await _cancelled(handler, job, "job dropped")
        if ended is not None:
            return await _already_done(handler, job, ended, delivery)
        await handler.handle(job, delivery)
        return Settlement(Action.ACK)
    except asyncio.CancelledError:
        if delivery.cancel.handing_back and not delivery.cancel.requested:
            delivery.cancel.seen = True
            task = asyncio.current_task()
            while task is not None and task.cancelling():  # (one per repeated cancel)
                task.uncancel()
            log.info("job handed back: the worker is stopping and had not started it")
            return Settlement(Action.NAK, 0.0, HANDED_BACK)
        if not delivery.cancel.requested:
            raise  # shutdown: not acked, redelivered to another worker
        delivery.cancel.seen = True
        task = asyncio.current_task()
        while task is not None and task.cancelling():  # (one per repeated cancel)
            task.uncancel()
        return await _cancelled(handler, job, "job stopped")
    except Superseded as exc:
        log.info("routed job taken over by another worker: dropped (%s)", exc)
        _count(handler, JobOutcome.SUPERSEDED)
        return Settlement(Action.ACK, reason="superseded")
    except Reject as exc:
        reject = exc
    except Retry as exc:
        if not delivery.is_last_attempt:
            _count(handler, JobOutcome.RETRIED)
            delay = delivery.backoff_s if exc.delay_s is None else exc.delay_s
            return Settlement(Action.NAK, delay, exc.reason)
        error = exc.error or WorkerFailed(exc.reason)
        reject = Reject(error, message=f"gave up after {delivery.num_delivered} attempts: {exc.reason}")
    except Exception as exc:
        if isinstance(exc, EPDError) and not isinstance(exc, TRANSIENT_ERRORS):
            log.error("job failed: %s: %s", type(exc).__name__, exc.message)
            reject = Reject(exc, message=f"{type(exc).__name__}: {exc.message}")
        else:
            transient = isinstance(exc, TRANSIENT_ERRORS)
            log.warning("job failed (delivery %s): %s: %s", attempts, type(exc).__name__, exc, exc_info=not transient)
            if not delivery.is_last_attempt:
                _count(handler, JobOutcome.RETRIED)
                return Settlement(Action.NAK, delivery.backoff_s, f"{type(exc).__name__}: {exc}")
            error = exc if isinstance(exc, EPDError) else WorkerFailed(f"{type(exc).__name__}: {exc}")
            reject = Reject(
                error, message=f"gave up after {delivery.num_delivered} attempts: {type(exc).__name__}: {exc}"
            )
    _count(handler, reject.outcome)
    try:
        await handler.on_terminal(job, reject.error, reject.message)
    except Exception:  # nobody was told: leave the job to a redelivery (or the max-deliveries advisory)
        log.exception("could not report the end of the job")
        return Settlement(Action.NAK, delivery.backoff_s, "terminal event not sent")
    return Settlement(Action.TERM, reason=f"{reject.error.code}: {reject.message}")


class WorkerRunner:
    def __init__(
        self,
        handler: Handler,
        settings: WorkerSettings,
        *,
        concurrency: int = 1,
        drain_timeout_s: float | None = None,
        freeze_heap: bool = False,
        pull_timeout_s: float = 1.0,
        routing: WorkerRouting | None = None,
    ):
        self.handler = handler
        self.settings = settings
        #: Freeze the process's heap once the handler is set up (``shared.heap``): the process's
        #: own runner only (``run_worker``), never one in a test's process.
        self.freeze_heap = freeze_heap
        self.subjects = Subjects(settings.nats.subject_prefix)
        self.concurrency = concurrency
        #: how long a stop waits for the jobs in flight (``EPD_DRAIN_S`` unless given)
        self.drain_timeout_s = settings.drain_s if drain_timeout_s is None else drain_timeout_s
        #: how long one pull request waits for a job (then the loop checks its room and pulls again)
        self.pull_timeout_s = pull_timeout_s
        self.stopping = asyncio.Event()
        self._publisher: Publisher | None = None
        #: The process's exit code once ``run`` returns (``EXIT_UNREACHABLE``: lost its consumer).
        self.exit_code = 0
        self._tasks: set[asyncio.Task] = set()
        # Running jobs by request id (what a cancellation stops).
        self._running: dict[str, set[JobCancel]] = {}
        self._records: RequestRecords | None = None
        #: How this worker takes the jobs the API routes to it (``shared.routed_jobs``), chosen once:
        #: by the handler's ``routable`` unless given.
        self.routing: WorkerRouting = (
            routing
            if routing is not None
            else RoutedJobs(settings.nats, self.subjects, settings.worker_id)
            if handler.routable
            else SharedQueueOnly()
        )
        # Refreshed with every heartbeat while connected and consuming (``epd healthcheck``).
        self.health = HealthFile(settings.health_file) if settings.health_file else None

    @property
    def name(self) -> str:
        return self.handler.service.value

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            log.info("%s worker %s: stop requested, draining", self.name, self.settings.worker_id)
            self.stopping.set()

    async def run(self) -> None:
        nc = await connect(self.settings.nats, name=f"epd-{self.name}-{self.settings.worker_id}")
        js = nc.jetstream()
        try:
            stream = self.subjects.work_stream(self.handler.queue)
            await ensure_topology(js, self.settings.nats, self.subjects, nc=nc, consumer=(stream, self.handler.durable))
            publisher = self._publisher = JetStreamPublisher.for_settings(js, self.settings.nats)
            ctx = WorkerContext(self.settings, self.subjects, publisher, nc)
            await self.handler.setup(ctx)
            if self.freeze_heap:  # started: the engine is loaded
                freeze_startup_heap()
            self._records = RequestRecords(js, self.subjects, nc)
            cancel_sub = await nc.subscribe(self.subjects.cancel_all, cb=self._on_cancel)
            # Once the server has the subscription, every cancellation is heard (unconfirmed: never
            # trusted, every job reads its request's records).
            if await confirm_subscriptions(nc, what="cancellations"):
                self._records.listening()
            psub = await js.pull_subscribe_bind(durable=self.handler.durable, stream=stream)
            rsub = await self.routing.subscribe(js, stream, publisher)
            self.handler.routed = rsub is not None
            liveness = asyncio.create_task(self._liveness(nc, js, stream))
            log.info("%s worker %s consuming %s/%s", self.name, self.settings.worker_id, stream, self.handler.durable)
            try:
                await asyncio.gather(self._consume(psub), *([self._consume(rsub, routed=True)] if rsub else []))
            finally:
                if self.health is not None:  # not consuming any more: unhealthy while draining
                    self.health.remove()
                # Before the drain (which may take a while): the jobs not started go back to the
                # queue now, no pull of ours takes a job any more, a job delivered to the pull the
                # stop gave up goes back too, and the jobs routed to this worker go to the shared
                # queue - all taken by other workers at once, not after the ack wait.
                try:
                    self._hand_back_unstarted()
                    for sub in (psub, rsub):
                        if sub is not None:
                            await self._stop_pulling(sub)
                    await self.routing.hand_over()
                    await self._drain()
                finally:  # it beats "draining" until now: no takeover of the jobs this worker finishes
                    liveness.cancel()
                try:  # before the connection drains
                    await cancel_sub.unsubscribe()
                except Exception as exc:  # noqa: BLE001 - shutting down anyway
                    log.debug("unsubscribe: %s", exc)
        finally:
            await self.handler.close()
            await close_connection(nc)
            log.info("%s worker %s stopped", self.name, self.settings.worker_id)

    def _room(self) -> int:
        """Jobs to fetch now: up to ``concurrency`` held, or what the handler's admission allows."""
        admission = self.handler.admission
        if admission is not None:
            return admission.room_to_fetch(len(self._tasks))
        return self.concurrency - len(self._tasks)

    async def _consume(self, psub: Any, *, routed: bool = False) -> None:
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await self._consume_until_stopped(psub, stop, routed=routed)
        finally:
            stop.cancel()

    async def _fetch_one(self, psub: Any, stop: asyncio.Future) -> list[Any] | None:
        """One pull of one job (``pull_timeout_s``); None when a stop was asked meanwhile: the pull
        is given up at once, not waited out (a job the server sends to it still reaches the
        subscription's queue, which :meth:`_stop_pulling` hands back)."""
        fetch = asyncio.ensure_future(psub.fetch(1, timeout=self.pull_timeout_s))
        try:
            await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            fetch.cancel()
            raise
        if not fetch.done():
            fetch.cancel()
            await asyncio.wait({fetch})
            if fetch.cancelled() or fetch.exception() is not None:
                return None
        return list(fetch.result())  # (a job that came as the stop was asked is run, then drained)

    async def _consume_until_stopped(self, psub: Any, stop: asyncio.Future, *, routed: bool) -> None:
        failing = ""  # the fetch error being repeated (logged once until a fetch works again)
        admission = self.handler.admission
        while not self.stopping.is_set():
            free = self._room()
            if free <= 0:
                wake: set[asyncio.Future] = set(self._tasks)
                changed = asyncio.ensure_future(admission.changed()) if admission is not None else None
                if changed is not None:
                    wake.add(changed)
                wake.add(stop)
                try:
                    await asyncio.wait(wake, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if changed is not None:
                        changed.cancel()
                continue
            try:
                # One job per pull request. nats-py's pull of several (2.16; nats.py#933, #986),
                # once it has a job, waits for the rest until the server ends the pull request
                # the job came in on. After an idle pull two requests can be open (the client
                # gave up on one the server still held, and the next pull took that one's expiry
                # notice for its own and sent another), and a job landing in the one no pull is
                # waiting on then waits for its expiry (~430 ms for ~6% of the jobs sent after an
                # idle second; tests/test_worker_pull.py). A pull of one returns the first job it
                # receives; a burst costs a round trip per job, well under a millisecond each.
                fetched = await self._fetch_one(psub, stop)
            except TimeoutError:  # nothing to fetch (nats' TimeoutError is one too)
                fetched = []
            except Exception as exc:  # noqa: BLE001 - connection hiccup: keep the loop alive, nats reconnects
                error = f"{type(exc).__name__}: {exc}"
                if error != failing:
                    log.warning("fetch failed: %s (retrying every 0.5 s)", error)
                    failing = error
                await asyncio.sleep(0.5)
                continue
            if fetched is None:  # stopping
                return
            if failing:
                log.info("fetching again")
                failing = ""
            for msg in fetched:
                task = asyncio.create_task(self._process_routed(msg) if routed else self._process(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _stop_pulling(self, sub: Any) -> None:
        """Unsubscribe a pull subscription (the server then sends nothing more to it) and ``nak``
        the jobs it had received and no fetch took (delivered to the pull a stop gave up): another
        worker takes them at once instead of after the ack wait."""
        try:
            await sub.unsubscribe()
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.debug("unsubscribe: %s", exc)
        # nats-py keeps what a pull subscription received and no fetch took in its queue (no public
        # accessor): a status message (a pull's expiry) or a job.
        queue = getattr(getattr(sub, "_sub", None), "_pending_queue", None)
        while queue is not None and not queue.empty():
            msg = queue.get_nowait()
            if not msg.reply or (msg.headers or {}).get("Status"):
                continue
            try:
                await msg.nak()
                log.info("handed back a job fetched as the worker stopped")
            except Exception as exc:  # noqa: BLE001 - redelivered after the ack wait instead
                log.debug("nak of an unstarted job failed: %s", exc)

    def _hand_back_unstarted(self) -> None:
        """Stop every job that has not started (``Delivery.start``) and give it back: ``settle``
        naks it (a routed one goes to the shared queue: ``WorkerRouting.hand_back``)."""
        handed = sum(job.hand_back() for jobs in list(self._running.values()) for job in list(jobs))
        if handed:
            log.info("handing back %d job(s) not started", handed)

    async def _drain(self) -> None:
        if self._tasks:
            log.info("waiting for %d in-flight job(s)", len(self._tasks))
            done, pending = await asyncio.wait(self._tasks, timeout=self.drain_timeout_s)
            for task in pending:  # not acked: JetStream redelivers them to another worker
                task.cancel()

    async def _process_routed(self, msg: Any) -> None:
        """A routed job: run it like any other once the routing strategy won its claim."""
        claim = await self.routing.take(msg)
        if claim is not None:
            await self._process(msg, claim=claim)

    async def _process(self, msg: Any, claim: RouteClaim | None = None) -> None:
        meta = msg.metadata
        delivery = Delivery(
            data=msg.data,
            subject=msg.subject,
            headers=dict(msg.headers or {}),
            num_delivered=meta.num_delivered,
            max_deliver=self.settings.nats.max_deliver,
            published_at=meta.timestamp.timestamp() if meta.timestamp else None,
            claim=claim,
        )
        task = asyncio.current_task()
        assert task is not None
        delivery.cancel.bind(task)
        token = REQUEST_ID.set(delivery.request_id)
        if delivery.num_delivered > 1:
            log.warning(
                "job redelivered (delivery %d of at most %d): a worker that had it died, gave it back, or sent "
                "no in_progress for the ack wait (%.1fs)",
                delivery.num_delivered,
                delivery.max_deliver,
                self.settings.nats.ack_wait_s,
            )
        # Everything the handler publishes for this job says who published it, when this worker
        # took the job, and when the request reached the API (carried over from the job's headers).
        trace = set_trace(self.name, received_at=delivery.headers.get(protocol.HDR_RECEIVED_AT), started_at=time.time())
        ticker = asyncio.create_task(self._keep_alive(msg))
        self.handler.in_flight += 1
        in_flight = metrics.IN_FLIGHT.labels(self.name)
        in_flight.inc()
        running = self._running.setdefault(delivery.request_id, set())
        running.add(delivery.cancel)
        try:
            try:
                settlement = await settle(self.handler, delivery, self._records)
            finally:  # no cancellation while acking: a job cancelled now is dropped when redelivered
                delivery.cancel.seen = True
                running.discard(delivery.cancel)
                if not running:
                    self._running.pop(delivery.request_id, None)
            ticker.cancel()
            if claim is not None and settlement.action is not Action.NAK:
                await claim.finish()
            if claim is not None and settlement.reason == HANDED_BACK:
                await self.routing.hand_back(msg, claim)
            elif settlement.action is Action.ACK:
                await msg.ack()
            elif settlement.action is Action.NAK:
                log.info("nak (%s), redeliver in %.1fs", settlement.reason, settlement.delay_s or 0)
                await msg.nak(delay=settlement.delay_s)
            else:
                log.warning("term: %s", settlement.reason)
                await msg.term()
        except Exception:
            log.exception("could not settle message")
        finally:
            ticker.cancel()
            self.handler.in_flight -= 1
            in_flight.dec()
            TRACE_HEADERS.reset(trace)
            REQUEST_ID.reset(token)

    async def _on_cancel(self, msg: Any) -> None:
        """A request was cancelled: stop this worker's running jobs of it (``settle`` acks them)."""
        request_id = cancelled_request_id(msg.subject)
        if self._records is not None:
            self._records.heard(request_id)
        jobs = self._running.get(request_id)
        if not jobs or not self.handler.stops_when_cancelled:
            return
        token = REQUEST_ID.set(request_id)
        try:
            log.info("request cancelled: stopping %d running job(s)", len(jobs))
        finally:
            REQUEST_ID.reset(token)
        for job in list(jobs):
            job.request()

    async def _keep_alive(self, msg: Any) -> None:
        interval = max(0.1, self.settings.nats.ack_wait_s / KEEP_ALIVES_PER_ACK_WAIT)
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except Exception as exc:  # noqa: BLE001 - keep extending; the next call may succeed
                log.debug("in_progress failed: %s", exc)

    async def _liveness(self, nc: NATS, js: Any, stream: str) -> None:
        """Prove every ``HEARTBEAT_INTERVAL_S`` that this worker can still pull: a JetStream API
        round trip to its own durable consumer (``consumer_info``; a core-NATS ``flush`` is not
        enough: nats-py skips its round trip while reconnecting, and a flush that timed out during
        a stall killed nats-py's read loop for good). While the round trip answers: publish the
        heartbeat the API's ``/health`` counts, refresh the health file, update the consumer lag
        gauges. While it does not: neither (the worker drops out of ``/health`` and ``epd
        healthcheck`` fails); after ``EPD_UNREACHABLE_EXIT_S`` without an answer the worker stops
        with exit code :data:`EXIT_UNREACHABLE`, for its supervisor to restart it."""
        subject = self.subjects.heartbeat(self.name)
        pending = metrics.CONSUMER_PENDING.labels(stream, self.handler.durable)
        ack_pending = metrics.CONSUMER_ACK_PENDING.labels(stream, self.handler.durable)
        last_ok = time.monotonic()
        failing_since: float | None = None
        while True:
            try:
                info = await js.consumer_info(stream, self.handler.durable, timeout=HEARTBEAT_INTERVAL_S)
            except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types (timeout, no responders, closed)
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning(
                        "cannot reach consumer %s/%s (%s: %s): unhealthy until it answers",
                        stream,
                        self.handler.durable,
                        type(exc).__name__,
                        exc,
                    )
                    if self.health is not None:
                        self.health.remove()
                if now - last_ok >= self.settings.unreachable_exit_s:
                    log.error(
                        "consumer %s/%s unreachable for %.0fs: stopping (exit code %d) for a restart",
                        stream,
                        self.handler.durable,
                        now - last_ok,
                        EXIT_UNREACHABLE,
                    )
                    self.exit_code = EXIT_UNREACHABLE
                    self.request_stop()
                    return
            else:
                last_ok = time.monotonic()
                if failing_since is not None:
                    log.info(
                        "consumer %s/%s reachable again after %.1fs",
                        stream,
                        self.handler.durable,
                        last_ok - failing_since,
                    )
                    failing_since = None
                pending.set(info.num_pending or 0)
                ack_pending.set(info.num_ack_pending or 0)
                heartbeat = self.handler.heartbeat(self.settings)
                if self.stopping.is_set():
                    heartbeat = msgspec.structs.replace(heartbeat, draining=True, free_slots=0)
                try:
                    await nc.publish(subject, protocol.encode(heartbeat))
                except Exception as exc:  # noqa: BLE001 - a lost heartbeat is harmless; the next one follows
                    log.debug("heartbeat not published: %s", exc)
                if self.health is not None and not self.stopping.is_set():
                    try:
                        self.health.write(
                            role=self.name, worker_id=self.settings.worker_id, in_flight=self.handler.in_flight
                        )
                    except OSError as exc:  # e.g. a full disk: unhealthy, not dead
                        log.warning("cannot write the health file %s: %s", self.health.path, exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def run_worker(handler: Handler, settings: WorkerSettings, **runner_kwargs: Any) -> None:
    """Process entry point: run until SIGTERM/SIGINT, then drain. Exits non-zero when the worker
    stopped because it lost its consumer (``EXIT_UNREACHABLE``)."""
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr="0.0.0.0")

    for line in retired_settings_in(os.environ):
        log.warning(line)

    async def main() -> int:
        runner = WorkerRunner(handler, settings, freeze_heap=True, **runner_kwargs)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.request_stop)
        await runner.run()
        return runner.exit_code

    exit_code = asyncio.run(main())
    if exit_code:
        sys.exit(exit_code)
