"""NATS connection, idempotent stream/consumer set-up, typed publishing and typed subscriptions.

Every service calls :func:`connect` then :func:`ensure_topology` at start-up; creating a stream
or durable consumer that exists is a no-op, and a changed limit (max age, bytes, dup window)
updates the stream in place.

Whoever waits for messages on a subject (the request client for tokens, the prefill worker for
an encoder's ``ECReady`` / ``ECFailed``, ``epd replay`` for heartbeats) does it through
:func:`subscribe_typed`: decoded, type-checked, junk skipped and counted, bounded by a deadline.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import types
from collections.abc import AsyncIterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import metrics, protocol
from shared.config import NatsSettings
from shared.errors import ServiceUnavailable
from shared.protocol import Message, Subjects

log = logging.getLogger(__name__)

# JetStream error code for "stream name already in use with a different configuration".
_ERR_STREAM_EXISTS_DIFFERENT = 10058
_ERR_CONSUMER_EXISTS_DIFFERENT = 10148

#: Trace headers added to every message published from this context (``Epd-Stage``,
#: ``Epd-Received-At``, ``Epd-Started-At``): the API sets them per request, the worker runner per
#: job, so handlers publish with them without knowing. Context-local, so concurrent jobs never mix.
TRACE_HEADERS: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "epd_trace_headers", default=types.MappingProxyType({})
)


def set_trace(stage: str, *, received_at: float | str | None = None, started_at: float | None = None):
    """Set the trace headers of the current context; returns the token for ``TRACE_HEADERS.reset``."""
    headers = {protocol.HDR_STAGE: stage}
    if received_at:
        headers[protocol.HDR_RECEIVED_AT] = received_at if isinstance(received_at, str) else f"{received_at:.6f}"
    if started_at:
        headers[protocol.HDR_STARTED_AT] = f"{started_at:.6f}"
    return TRACE_HEADERS.set(headers)


def redact_url(url: str) -> str:
    """``nats://user:secret@host`` -> ``nats://***@host``: URLs in errors and logs carry no credentials."""
    return re.sub(r"(?<=://)[^@/]*@", "***@", url)


class Publisher(Protocol):
    """What handlers need to emit messages; a broker-free fake can record them in tests."""

    async def publish(self, subject: str, msg: Message, *, request_id: str, msg_id: str | None = None) -> bool: ...


class _ConnectionLog:
    """One log line per connection event instead of nats-py's default: a traceback for every
    failed reconnect attempt (two a second while NATS is down)."""

    def __init__(self, url: str):
        self.url = url
        self.down_since: float | None = None
        self.last_error = ""
        #: the connection, once made: its close (which calls disconnected_cb too) is no lost connection
        self.client: NATS | None = None

    def callbacks(self) -> dict[str, Any]:
        return {
            "error_cb": self.on_error,
            "disconnected_cb": self.on_disconnected,
            "reconnected_cb": self.on_reconnected,
        }

    async def on_error(self, exc: Exception) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if text != self.last_error:  # the same error again while reconnecting: already said
            self.last_error = text
            log.warning("NATS connection error (%s): %s", self.url, text)

    async def on_disconnected(self) -> None:
        if self.client is not None and self.client.is_closed:
            log.debug("NATS connection (%s) closed", self.url)
            return
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("disconnected from NATS (%s): reconnecting", self.url)

    async def on_reconnected(self) -> None:
        down = time.monotonic() - self.down_since if self.down_since is not None else 0.0
        self.down_since, self.last_error = None, ""
        log.info("reconnected to NATS (%s) after %.1fs", self.url, down)


async def connect(settings: NatsSettings, *, name: str, connect_timeout: float = 5.0, **options: Any) -> NATS:
    """Connect to NATS; raises ServiceUnavailable with the URL (never the password) on failure.

    Services reconnect forever (the default). ``options`` override the client's options, e.g.
    ``max_reconnect_attempts=1`` for a CLI that must fail fast when NATS is unreachable."""
    connection_log = _ConnectionLog(redact_url(settings.nats_url))
    kwargs: dict[str, Any] = {
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        **connection_log.callbacks(),
    }
    if settings.nats_user:
        kwargs["user"] = settings.nats_user
        kwargs["password"] = settings.nats_password.get_secret_value() if settings.nats_password else ""
    try:
        nc = await nats.connect(
            # A comma-separated list seeds a NATS cluster; the client also learns the other members.
            [url.strip() for url in settings.nats_url.split(",") if url.strip()],
            name=name,
            connect_timeout=connect_timeout,
            **{**kwargs, **options},
        )
    except Exception as exc:  # nats raises several unrelated types here
        raise ServiceUnavailable(
            f"cannot connect to NATS at {redact_url(settings.nats_url)}: {type(exc).__name__}: {exc}"
        ) from exc
    connection_log.client = nc
    return nc


def nats_unavailable(doing: str, exc: BaseException) -> ServiceUnavailable:
    """The error for a NATS operation that failed: 503 ``service_unavailable`` naming NATS."""
    return ServiceUnavailable(f"NATS unavailable ({doing}: {type(exc).__name__}: {exc}); retry shortly")


def stream_configs(settings: NatsSettings, subjects: Subjects) -> list[StreamConfig]:
    # JetStream requires duplicate_window <= max_age.
    dup_window = min(settings.dup_window_s, settings.stream_max_age_s)
    return [
        StreamConfig(
            name=name,
            subjects=subjs,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=settings.stream_max_age_s,
            max_bytes=settings.stream_max_bytes,
            duplicate_window=dup_window,
            num_replicas=settings.stream_replicas,
        )
        for name, subjs in subjects.streams().items()
    ]


def consumer_configs(settings: NatsSettings, subjects: Subjects) -> dict[str, ConsumerConfig]:
    """Durable pull consumers, by stream."""

    def durable(name: str, subject: str) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=name,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=settings.ack_wait_s,
            max_deliver=settings.max_deliver,
            filter_subject=subject,
            deliver_policy=DeliverPolicy.NEW,
            max_ack_pending=1024,
        )

    return {
        subjects.stream_encode: durable(protocol.CONSUMER_ENCODER, subjects.encode_jobs),
        subjects.stream_generate: durable(protocol.CONSUMER_PREFILL, subjects.generate_jobs),
        subjects.stream_decode: durable(protocol.CONSUMER_DECODE, subjects.decode_jobs),
    }


async def ensure_topology(js: JetStreamContext, settings: NatsSettings, subjects: Subjects) -> None:
    """Create (or update) every stream and durable consumer. Safe to call from every service."""
    for cfg in stream_configs(settings, subjects):
        try:
            await js.add_stream(cfg)
        except BadRequestError as exc:
            if exc.err_code != _ERR_STREAM_EXISTS_DIFFERENT:
                raise
            log.info("updating stream %s to the configured limits", cfg.name)
            await js.update_stream(cfg)
    for stream, ccfg in consumer_configs(settings, subjects).items():
        try:
            await js.add_consumer(stream, ccfg)
        except BadRequestError as exc:
            if exc.err_code != _ERR_CONSUMER_EXISTS_DIFFERENT:
                raise
            # Deliver policy cannot change on an existing durable; the rest can.
            assert ccfg.durable_name is not None  # consumer_configs() names every consumer
            info = await js.consumer_info(stream, ccfg.durable_name)
            await js.add_consumer(stream, ccfg.evolve(deliver_policy=info.config.deliver_policy))


class JetStreamPublisher:
    """Publishes protocol messages into their streams with request_id headers."""

    def __init__(self, js: JetStreamContext, *, timeout: float = 5.0):
        self.js = js
        self.timeout = timeout

    async def publish(self, subject: str, msg: Message, *, request_id: str, msg_id: str | None = None) -> bool:
        """Returns False when JetStream dropped it as a duplicate of ``msg_id``. Raises
        :class:`~shared.errors.ServiceUnavailable` when JetStream does not acknowledge it in time
        (NATS down, stalled or reconnecting), never a bare ``nats`` error."""
        data = protocol.encode(msg)
        try:
            ack = await self.js.publish(
                subject,
                data,
                timeout=self.timeout,
                headers=protocol.headers_for(msg, request_id, msg_id=msg_id, extra=TRACE_HEADERS.get()),
            )
        except nats.errors.Error as exc:  # nats.errors.TimeoutError is an asyncio.TimeoutError: not a deadline
            raise nats_unavailable(f"publishing {type(msg).__name__}", exc) from exc
        metrics.MESSAGE_BYTES.labels(type(msg).__struct_config__.tag).inc(len(data))
        return not ack.duplicate


M = TypeVar("M")


class TypedSubscription(Generic[M]):
    """A core NATS subscription that hands out decoded protocol messages of the expected types.

    Undecodable messages, messages of a newer schema and messages of other types are skipped
    and counted (``skipped``); nothing else is filtered here. Close it (``close()`` or ``async
    with``) when done; closing twice is harmless. Build it with :func:`subscribe_typed`."""

    def __init__(self, sub: Any, subject: str, expect: tuple[type, ...]):
        self._sub = sub
        self.subject = subject
        self.expect = expect
        self.skipped = 0
        self._closed = False

    async def next(self, *, deadline: float) -> M | None:
        """The next expected message, or None once ``deadline`` (``time.time()``) has passed."""
        while (left := deadline - time.time()) > 0:
            try:
                msg = await self._sub.next_msg(timeout=left)
            except TimeoutError:  # nats.errors.TimeoutError subclasses it
                return None
            try:
                return protocol.decode(msg.data, self.expect or None)  # type: ignore[return-value]  # decode checked it is one of expect, the M types
            except protocol.ProtocolError as exc:
                self.skipped += 1
                log.warning("skipping a message on %s: %s", msg.subject, exc)
        return None

    async def until(self, deadline: float) -> AsyncIterator[M]:
        """Every expected message until ``deadline`` (``time.time()``)."""
        while (msg := await self.next(deadline=deadline)) is not None:
            yield msg

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._sub.unsubscribe()
        except Exception as exc:  # noqa: BLE001 - a closed connection has dropped the subscription already
            log.debug("unsubscribe from %s: %s", self.subject, exc)

    async def __aenter__(self) -> TypedSubscription[M]:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


async def subscribe_typed(
    nc: NATS, subject: str, *expect: type, queue: str = "", confirm: bool = False
) -> TypedSubscription:
    """Subscribe to ``subject`` (in queue group ``queue``, if given) for messages of the ``expect``
    types (any protocol message when none is given). Subscribe before publishing whatever
    causes the awaited message, or it may be missed: core NATS keeps no history.

    ``confirm``: return only once the server has the subscription (a JetStream round trip on the
    same connection: the server handles a connection's commands in order). Needed when the event
    may be caused by someone else right after a check made next (the prefill worker subscribes to
    an item's ``ECReady``, then looks in the store: without it, an encoder finishing in between
    announces to nobody, and the worker waits ``EPD_EC_WAIT_S`` for nothing). Fails open.

    Usage::

        async with await subscribe_typed(nc, subjects.ec_any(fp, item), ECReady, ECFailed) as sub:
            event = await sub.next(deadline=time.time() + wait_s)  # None: nothing in time
    """
    sub = await nc.subscribe(subject, queue=queue)
    if confirm:
        try:  # (not nc.flush(): a flush that times out kills nats-py's read loop when the PONG comes)
            await nc.jetstream().account_info()
        except Exception as exc:  # noqa: BLE001 - fails open: the subscription exists either way
            log.warning("could not confirm the subscription to %s: %s: %s", subject, type(exc).__name__, exc)
    return TypedSubscription(sub, subject, expect)
