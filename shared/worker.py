"""The one consumer-loop shape every worker uses.

A worker is a :class:`Handler` (``setup`` / ``handle`` / ``on_terminal`` / ``close``) plus
:class:`WorkerRunner`, which owns NATS, signals and settings.

**Outcomes by exception** (FastStream's ``NackMessage`` / ``RejectMessage``, arq's ``Retry``):
``handle(job, delivery)`` returning means the job is done (ack). Otherwise it raises

* :class:`Retry` - try again after ``delay_s`` (``nak``);
* :class:`Reject` - the job cannot succeed: end the request with ``error`` (``term``);
* anything else - transient unless it is a non-transient :class:`~shared.errors.EPDError`
  (those end the request like a ``Reject``): an unexpected exception or a
  :class:`~shared.errors.StoreError` is retried.

A retry at the last delivery (``num_delivered >= max_deliver``) ends the request too. Ending a
request is one place, :func:`settle`: it calls the handler's :meth:`Handler.on_terminal` once
(the encoder publishes ``ECFailed``, generating workers an ``ErrorEvent`` on the token subject)
and terminates the message. A message that does not decode as the handler's ``job_type`` is
terminated without an event (there is no request to tell). :func:`settle` needs no broker:
tests drive handlers through it.

The runner:

* durable pull consumer, ``fetch`` up to ``batch`` messages while there is free capacity;
* each message handled in its own task, with ``in_progress`` sent every ``ack_wait / 3`` so
  long work is not redelivered while it is still running;
* a heartbeat on core NATS every 2 s (the API's ``/health`` lists live workers), and the
  health file ``epd healthcheck`` reads;
* trace headers on everything a handler publishes for a job (``Epd-Stage``, ``Epd-Started-At``,
  ``Epd-Received-At``; ``shared.jetstream.set_trace``), the request id on every log line, the
  ``epd:requests_in_flight{service=...}`` gauge, and consumer lag (``epd:consumer_num_pending``)
  polled every 5 s;
* SIGTERM / SIGINT: stop fetching, finish what is in flight (up to ``drain_timeout_s``), close.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from nats.aio.client import Client as NATS

from shared import metrics, protocol
from shared.config import CommonSettings
from shared.errors import EPDError, StoreError, WorkerFailed
from shared.health import HealthFile
from shared.jetstream import TRACE_HEADERS, JetStreamPublisher, Publisher, connect, ensure_topology, set_trace
from shared.logs import REQUEST_ID
from shared.protocol import Subjects, WorkerHeartbeat
from shared.topology import Role, Service

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 2.0
#: How often a worker polls its durable consumer's pending counts (``epd:consumer_num_pending``).
LAG_POLL_INTERVAL_S = 5.0
#: Errors that say nothing about the job (the store is down): retried like unexpected exceptions.
TRANSIENT_ERRORS: tuple[type[EPDError], ...] = (StoreError,)


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

    def __init__(self, error: EPDError, *, message: str | None = None, outcome: str = "failed"):
        super().__init__(error.message if message is None else message)
        self.error = error
        self.message = error.message if message is None else message
        self.outcome = outcome


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

    @property
    def is_last_attempt(self) -> bool:
        return self.num_delivered >= self.max_deliver

    @property
    def request_id(self) -> str:
        return self.headers.get(protocol.HDR_REQUEST_ID, "-")

    @property
    def backoff_s(self) -> float:
        """The default retry delay: 1 s per delivery so far."""
        return 1.0 * self.num_delivered


@dataclass
class WorkerContext:
    """What the runner hands a handler at set-up."""

    settings: CommonSettings
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
    job_type: ClassVar[type]
    stream_attr: ClassVar[str] = ""
    durable: ClassVar[str] = ""
    #: The handler's job counter (label ``outcome``): the runner counts ``bad_message``,
    #: ``retried`` and terminal outcomes; the handler counts its successes.
    jobs_metric: ClassVar[Any] = None

    in_flight: int = 0

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

    async def close(self) -> None:
        """Release what ``setup`` built."""

    def heartbeat(self, settings: CommonSettings) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            role=self.service.value,
            worker_id=settings.worker_id,
            fingerprint=getattr(self, "fingerprint", ""),
            model=settings.served_model_name(),
            engine=settings.engine,
            in_flight=self.in_flight,
            sent_at=time.time(),
        )


def _count(handler: Handler, outcome: str) -> None:
    if handler.jobs_metric is not None:
        handler.jobs_metric.labels(outcome).inc()


async def settle(handler: Handler, delivery: Delivery) -> Settlement:
    """Decode the job, run the handler and turn its outcome into ack / nak / term, calling
    :meth:`Handler.on_terminal` once when the job's request ends in an error."""
    try:
        job = protocol.decode(delivery.data, handler.job_type)
    except protocol.ProtocolError as exc:
        _count(handler, "bad_message")
        return Settlement(Action.TERM, reason=f"undecodable {handler.job_type.__name__}: {exc}")
    if delivery.published_at:
        queue = handler.stream_attr.removeprefix("stream_")  # encode / generate / decode
        metrics.QUEUE_SECONDS.labels(queue).observe(max(0.0, time.time() - delivery.published_at))
    attempts = f"{delivery.num_delivered}/{delivery.max_deliver}"
    try:
        await handler.handle(job, delivery)
        return Settlement(Action.ACK)
    except Reject as exc:
        reject = exc
    except Retry as exc:
        if not delivery.is_last_attempt:
            _count(handler, "retried")
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
                _count(handler, "retried")
                return Settlement(Action.NAK, delivery.backoff_s, f"{type(exc).__name__}: {exc}")
            error = exc if isinstance(exc, EPDError) else WorkerFailed(f"{type(exc).__name__}: {exc}")
            reject = Reject(error, message=f"gave up after {delivery.num_delivered} attempts: "
                                           f"{type(exc).__name__}: {exc}")
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
        settings: CommonSettings,
        *,
        batch_size: int = 1,
        concurrency: int = 1,
        drain_timeout_s: float = 60.0,
    ):
        self.handler = handler
        self.settings = settings
        self.subjects = Subjects(settings.subject_prefix)
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.drain_timeout_s = drain_timeout_s
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
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
        nc = await connect(self.settings, name=f"epd-{self.name}-{self.settings.worker_id}")
        js = nc.jetstream()
        try:
            await ensure_topology(js, self.settings, self.subjects)
            ctx = WorkerContext(self.settings, self.subjects, JetStreamPublisher(js), nc)
            await self.handler.setup(ctx)
            stream = getattr(self.subjects, self.handler.stream_attr)
            psub = await js.pull_subscribe_bind(durable=self.handler.durable, stream=stream)
            heartbeat = asyncio.create_task(self._heartbeat(nc))
            lag = asyncio.create_task(self._poll_lag(js, stream))
            log.info("%s worker %s consuming %s/%s", self.name, self.settings.worker_id, stream, self.handler.durable)
            try:
                await self._consume(psub)
            finally:
                heartbeat.cancel()
                lag.cancel()
                if self.health is not None:  # not consuming any more: unhealthy while draining
                    self.health.remove()
                await self._drain()
                await psub.unsubscribe()
        finally:
            await self.handler.close()
            await nc.drain()
            log.info("%s worker %s stopped", self.name, self.settings.worker_id)

    async def _consume(self, psub: Any) -> None:
        while not self.stopping.is_set():
            free = self.concurrency - len(self._tasks)
            if free <= 0:
                await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await psub.fetch(min(free, self.batch_size), timeout=1.0)
            except asyncio.TimeoutError:  # nothing to fetch (nats' TimeoutError is one too)
                continue
            except Exception as exc:  # connection hiccup: keep the loop alive, nats reconnects
                log.warning("fetch failed: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                task = asyncio.create_task(self._process(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        if self._tasks:
            log.info("waiting for %d in-flight job(s)", len(self._tasks))
            done, pending = await asyncio.wait(self._tasks, timeout=self.drain_timeout_s)
            for task in pending:  # not acked: JetStream redelivers them to another worker
                task.cancel()

    async def _process(self, msg: Any) -> None:
        meta = msg.metadata
        delivery = Delivery(
            data=msg.data,
            subject=msg.subject,
            headers=dict(msg.headers or {}),
            num_delivered=meta.num_delivered,
            max_deliver=self.settings.max_deliver,
            published_at=meta.timestamp.timestamp() if meta.timestamp else None,
        )
        token = REQUEST_ID.set(delivery.request_id)
        # Everything the handler publishes for this job says who published it, when this worker
        # took the job, and when the request reached the API (carried over from the job's headers).
        trace = set_trace(self.name, received_at=delivery.headers.get(protocol.HDR_RECEIVED_AT),
                          started_at=time.time())
        ticker = asyncio.create_task(self._keep_alive(msg))
        self.handler.in_flight += 1
        in_flight = metrics.IN_FLIGHT.labels(self.name)
        in_flight.inc()
        try:
            settlement = await settle(self.handler, delivery)
            ticker.cancel()
            if settlement.action is Action.ACK:
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

    async def _keep_alive(self, msg: Any) -> None:
        interval = max(0.5, self.settings.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except Exception as exc:
                log.debug("in_progress failed: %s", exc)

    async def _poll_lag(self, js: Any, stream: str) -> None:
        """Consumer lag for ``/metrics``: what waits in the stream and what is being worked on."""
        pending = metrics.CONSUMER_PENDING.labels(stream, self.handler.durable)
        ack_pending = metrics.CONSUMER_ACK_PENDING.labels(stream, self.handler.durable)
        while True:
            try:
                info = await js.consumer_info(stream, self.handler.durable)
                pending.set(info.num_pending or 0)
                ack_pending.set(info.num_ack_pending or 0)
            except Exception as exc:
                log.debug("consumer info failed: %s", exc)
            await asyncio.sleep(LAG_POLL_INTERVAL_S)

    async def _heartbeat(self, nc: NATS) -> None:
        subject = self.subjects.heartbeat(self.name)
        while True:
            try:
                await nc.publish(subject, protocol.encode(self.handler.heartbeat(self.settings)))
                if self.health is not None:
                    # The file says "connected" only after a PING/PONG round trip just now (flush
                    # skips the round trip while reconnecting, hence is_connected too).
                    await nc.flush(timeout=HEARTBEAT_INTERVAL_S)
                    if nc.is_connected:
                        self.health.write(role=self.name, worker_id=self.settings.worker_id,
                                          in_flight=self.handler.in_flight)
            except Exception as exc:
                log.debug("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def run_worker(handler: Handler, settings: CommonSettings, **runner_kwargs: Any) -> None:
    """Process entry point: run until SIGTERM/SIGINT, then drain."""
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr="0.0.0.0")

    async def main() -> None:
        runner = WorkerRunner(handler, settings, **runner_kwargs)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.request_stop)
        await runner.run()

    asyncio.run(main())
