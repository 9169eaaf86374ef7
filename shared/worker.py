"""The one consumer-loop shape every worker uses.

A worker is a :class:`Handler` (``setup`` / ``handle`` / ``close``; testable without a broker:
``handle`` takes a :class:`Delivery` and returns a :class:`Verdict`) plus :class:`WorkerRunner`,
which owns NATS, signals and settings:

* durable pull consumer, ``fetch`` up to ``batch`` messages while there is free capacity;
* each message handled in its own task, with ``in_progress`` sent every ``ack_wait / 3`` so
  long work is not redelivered while it is still running;
* the handler's verdict becomes ``ack`` / ``nak(delay)`` / ``term``; an exception that escapes
  the handler becomes ``nak`` with a delay (redelivered up to ``max_deliver``);
* a heartbeat on core NATS every 2 s (the API's ``/health`` lists live workers);
* trace headers on everything a handler publishes for a job (``Epd-Stage``, ``Epd-Started-At``,
  ``Epd-Received-At``; ``shared.jetstream.set_trace``), the ``epd:requests_in_flight{service=<role>}``
  gauge, and consumer lag (``epd:consumer_num_pending``) polled every 5 s;
* SIGTERM / SIGINT: stop fetching, finish what is in flight (up to ``drain_timeout_s``), close.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import enum
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError

from shared import metrics, protocol
from shared.config import CommonSettings
from shared.health import HealthFile
from shared.jetstream import TRACE_HEADERS, JetStreamPublisher, Publisher, connect, ensure_topology, set_trace
from shared.logs import REQUEST_ID
from shared.protocol import Subjects, WorkerHeartbeat

log = logging.getLogger(__name__)
T = TypeVar("T")

HEARTBEAT_INTERVAL_S = 2.0
#: How often a worker polls its durable consumer's pending counts (``epd:consumer_num_pending``).
LAG_POLL_INTERVAL_S = 5.0


class Action(enum.Enum):
    ACK = "ack"
    NAK = "nak"
    TERM = "term"


@dataclass(frozen=True)
class Verdict:
    action: Action
    delay_s: float | None = None
    reason: str = ""

    @classmethod
    def ack(cls) -> "Verdict":
        return cls(Action.ACK)

    @classmethod
    def nak(cls, delay_s: float = 1.0, reason: str = "") -> "Verdict":
        return cls(Action.NAK, delay_s, reason)

    @classmethod
    def term(cls, reason: str) -> "Verdict":
        return cls(Action.TERM, None, reason)


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


@dataclass
class WorkerContext:
    """What the runner hands a handler at set-up."""

    settings: CommonSettings
    subjects: Subjects
    publisher: Publisher
    nc: NATS | None = None


class Handler(abc.ABC):
    role: str = "worker"
    #: stream and durable consumer this handler consumes (names from ``Subjects``).
    stream_attr: str = ""
    durable: str = ""

    def __init__(self) -> None:
        # One engine thread: model compute stays off the event loop and is never concurrent.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-engine")
        self.in_flight = 0

    async def run_compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run model compute in the engine thread, keeping the request_id context for logs."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, fn, *args)

    @abc.abstractmethod
    async def setup(self, ctx: WorkerContext) -> None:
        """Load the model, connect to the store. Called once before consuming."""

    @abc.abstractmethod
    async def handle(self, delivery: Delivery) -> Verdict:
        """Handle one message. Must be idempotent: at-least-once delivery."""

    async def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def heartbeat(self, settings: CommonSettings) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            role=self.role,
            worker_id=settings.worker_id,
            fingerprint=getattr(self, "fingerprint", ""),
            model=settings.served_model_name(),
            engine=settings.engine,
            in_flight=self.in_flight,
            sent_at=time.time(),
        )


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

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            log.info("%s worker %s: stop requested, draining", self.handler.role, self.settings.worker_id)
            self.stopping.set()

    async def run(self) -> None:
        nc = await connect(self.settings, name=f"epd-{self.handler.role}-{self.settings.worker_id}")
        js = nc.jetstream()
        try:
            await ensure_topology(js, self.settings, self.subjects)
            ctx = WorkerContext(self.settings, self.subjects, JetStreamPublisher(js), nc)
            await self.handler.setup(ctx)
            stream = getattr(self.subjects, self.handler.stream_attr)
            psub = await js.pull_subscribe_bind(durable=self.handler.durable, stream=stream)
            heartbeat = asyncio.create_task(self._heartbeat(nc))
            lag = asyncio.create_task(self._poll_lag(js, stream))
            log.info(
                "%s worker %s consuming %s/%s", self.handler.role, self.settings.worker_id, stream, self.handler.durable
            )
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
            log.info("%s worker %s stopped", self.handler.role, self.settings.worker_id)

    async def _consume(self, psub: Any) -> None:
        while not self.stopping.is_set():
            free = self.concurrency - len(self._tasks)
            if free <= 0:
                await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await psub.fetch(min(free, self.batch_size), timeout=1.0)
            except NatsTimeoutError:
                continue
            except Exception as exc:  # connection hiccup: keep the loop alive, nats reconnects
                log.warning("fetch failed: %s", exc)
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
        trace = set_trace(
            self.handler.role, received_at=delivery.headers.get(protocol.HDR_RECEIVED_AT), started_at=time.time()
        )
        ticker = asyncio.create_task(self._keep_alive(msg))
        self.handler.in_flight += 1
        in_flight = metrics.IN_FLIGHT.labels(self.handler.role)
        in_flight.inc()
        try:
            try:
                verdict = await self.handler.handle(delivery)
            except Exception:
                log.exception("handler failed (delivery %d/%d)", delivery.num_delivered, delivery.max_deliver)
                verdict = Verdict.nak(2.0, "unhandled exception")
            ticker.cancel()
            if verdict.action is Action.ACK:
                await msg.ack()
            elif verdict.action is Action.NAK:
                log.info("nak (%s), redeliver in %.1fs", verdict.reason, verdict.delay_s or 0)
                await msg.nak(delay=verdict.delay_s)
            else:
                log.warning("term: %s", verdict.reason)
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
        subject = self.subjects.heartbeat(self.handler.role)
        while True:
            try:
                await nc.publish(subject, protocol.encode(self.handler.heartbeat(self.settings)))
                if self.health is not None:
                    # The file says "connected" only after a PING/PONG round trip just now (flush
                    # skips the round trip while reconnecting, hence is_connected too).
                    await nc.flush(timeout=HEARTBEAT_INTERVAL_S)
                    if nc.is_connected:
                        self.health.write(role=self.handler.role, worker_id=self.settings.worker_id,
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
