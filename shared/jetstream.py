"""NATS connection, idempotent stream/consumer set-up, typed publishing and typed subscriptions.

Every service calls :func:`connect` then :func:`ensure_topology` at start-up; creating a stream
or durable consumer that exists is a no-op, and a changed limit (max age, bytes, dup window)
updates the stream in place.

Whoever waits for messages on a subject (the request client for tokens, the prefill worker for
an encoder's ``ECReady`` / ``ECFailed``, ``epd replay`` for heartbeats) does it through
:func:`subscribe_typed`: decoded, type-checked, junk skipped and counted, bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import logging
import re
import ssl
import time
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NoStreamResponseError, NotFoundError
from nats.js.errors import ServiceUnavailableError as JSServiceUnavailableError
from nats.js.kv import KeyValue

from shared import metrics, natsclient, protocol
from shared.config import NatsSettings
from shared.errors import ConfigError, ServiceUnavailable
from shared.nats_auth import creates_topology, inbox_prefix
from shared.protocol import Message, Subjects

log = logging.getLogger(__name__)

# JetStream error code for "stream name already in use with a different configuration".
_ERR_STREAM_EXISTS_DIFFERENT = 10058
_ERR_CONSUMER_EXISTS_DIFFERENT = 10148
# ... "no suitable peers for placement" (more replicas than servers that can hold one) and
# "replicas > 1 not supported in non-clustered mode".
_ERR_NO_PEERS = 10005
_ERR_INSUFFICIENT_RESOURCES = 10023
_ERR_REPLICAS_NOT_CLUSTERED = 10074
_REPLICA_ERRORS = (_ERR_NO_PEERS, _ERR_INSUFFICIENT_RESOURCES, _ERR_REPLICAS_NOT_CLUSTERED)
# "insufficient storage resources available": the server's file store limit (``max_file_store``)
# cannot hold one more stream's ``max_bytes`` reservation.
_ERR_INSUFFICIENT_STORAGE = 10047
# "duplicate message id is in process": a repeat of a publish whose earlier try the stream is still
# storing (a retry right after a leader change); the next try gets its ack or a duplicate ack.
_ERR_MSG_ID_IN_PROCESS = 10158
#: Publish failures that say JetStream has no leader for the stream right now (an election, a
#: reconnect to another seed) rather than anything about the message: a publish that carries a
#: ``Nats-Msg-Id`` is retried through them (the duplicate window makes a repeat harmless).
RETRYABLE_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (
    NoStreamResponseError,  # what nats-py makes of "no responders" on a JetStream publish
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    JSServiceUnavailableError,
)

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

    async def publish(
        self, subject: str, msg: Message, *, request_id: str, msg_id: str | None = None, deadline: float | None = None
    ) -> bool: ...

    async def send(self, subject: str, msg: Message, *, request_id: str, msg_id: str | None = None) -> PendingAck: ...


class PendingAck:
    """JetStream's acknowledgement of a message :meth:`JetStreamPublisher.send` queued, still to
    come: :meth:`confirmed` waits for it (at most ``timeout_s``)."""

    def __init__(self, ack: Awaitable[Any] | None, *, timeout_s: float, doing: str):
        self._ack = ack  # None: stored already (a fake publisher's)
        self.timeout_s = timeout_s
        self.doing = doing

    async def confirmed(self) -> None:
        """Return once JetStream stored the message; raise :class:`~shared.errors.ServiceUnavailable`
        when it refused it or did not answer in time."""
        if self._ack is None:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._ack
        except (TimeoutError, nats.errors.Error) as exc:  # (nats' TimeoutError is one too)
            raise nats_unavailable(self.doing, exc) from exc
        finally:
            self._ack = None  # (confirming twice waits once)


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
        # a stalled server (SIGSTOP, a cut link) keeps the TCP connection: only unanswered pings
        # make the client leave it for another seed (nats-py's default waits 2 x 2 minutes)
        "ping_interval": settings.nats_ping_interval_s,
        "max_outstanding_pings": settings.nats_max_outstanding_pings,
        **connection_log.callbacks(),
    }
    try:
        kwargs.update(settings.tls_options())  # (TLS from the first byte: NatsSettings.tls_options)
    except (OSError, ssl.SSLError) as exc:  # a missing or unreadable CA / certificate file
        raise ServiceUnavailable(f"cannot set up TLS to NATS: {type(exc).__name__}: {exc}") from exc
    if settings.nats_user:
        kwargs["user"] = settings.nats_user
        kwargs["password"] = settings.nats_password.get_secret_value() if settings.nats_password else ""
        # replies to this identity's requests come below an inbox only it may subscribe to
        try:
            kwargs["inbox_prefix"] = inbox_prefix(settings.nats_user)
        except ValueError as exc:
            raise ConfigError(f"EPD_NATS_USER: {exc}") from exc
    try:
        nc = await natsclient.connect(
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
            num_replicas=settings.stream_replicas,
        )

    return {
        subjects.stream_encode: durable(protocol.CONSUMER_ENCODER, subjects.encode_jobs),
        subjects.stream_generate: durable(protocol.CONSUMER_PREFILL, subjects.generate_jobs),
        subjects.stream_decode: durable(protocol.CONSUMER_DECODE, subjects.decode_jobs),
    }


def cluster_size(nc: NATS) -> int:
    """Servers of the NATS cluster ``nc`` is connected to, as the server announces them now (its
    ``connect_urls``: the members currently routed; 1 for a server without a cluster)."""
    info = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    return max(1, len(set(info.get("connect_urls") or ())))


def check_replicas(nc: NATS, replicas: int) -> None:
    """Refuse ``EPD_STREAM_REPLICAS`` > 1 on a server without a cluster before creating anything."""
    if replicas > 1 and cluster_size(nc) == 1:
        raise ConfigError(
            f"EPD_STREAM_REPLICAS={replicas} needs a NATS cluster of at least {replicas} servers, but the NATS "
            f"server at {redact_url(str(nc.connected_url.geturl() if nc.connected_url else '?'))} is not "
            f"clustered (cluster size 1): set EPD_STREAM_REPLICAS=1 or point EPD_NATS_URL at a cluster"
        )


def file_store_reserved(settings: NatsSettings, subjects: Subjects) -> int:
    """Bytes of a NATS server's file store (``max_file_store``) the streams reserve up front:
    each holds its ``max_bytes`` (EPD_STREAM_MAX_BYTES) on every server that has a replica of it."""
    return sum(cfg.max_bytes or 0 for cfg in stream_configs(settings, subjects))


def storage_error(exc: BaseException, settings: NatsSettings, subjects: Subjects, what: str) -> ConfigError | None:
    """The :class:`ConfigError` for a JetStream refusal to reserve ``what``'s ``max_bytes``
    (None when ``exc`` is something else)."""
    if not isinstance(exc, APIError) or exc.err_code != _ERR_INSUFFICIENT_STORAGE:
        return None
    gib = 2**30
    return ConfigError(
        f"NATS JetStream cannot reserve {settings.stream_max_bytes / gib:.3g} GiB for {what} ({exc.description}): "
        f"the {len(subjects.streams())} streams reserve EPD_STREAM_MAX_BYTES each, "
        f"{file_store_reserved(settings, subjects) / gib:.3g} GiB in all, and the server's file store limit "
        f"(jetstream max_file_store; 75% of the free disk at its start when unset) is smaller or spent. "
        f"Raise max_file_store (the NATS server's configuration; epd up sets it), free disk on the server, "
        f"or lower EPD_STREAM_MAX_BYTES"
    )


def replicas_error(exc: BaseException, nc: NATS | None, replicas: int, what: str) -> ConfigError | None:
    """The :class:`ConfigError` for a JetStream refusal to place ``replicas`` replicas of ``what``
    (None when ``exc`` is something else)."""
    if not isinstance(exc, APIError) or exc.err_code not in _REPLICA_ERRORS or replicas <= 1:
        return None
    size = cluster_size(nc) if nc is not None else "?"
    return ConfigError(
        f"EPD_STREAM_REPLICAS={replicas}: JetStream cannot place {replicas} replicas of {what} "
        f"({exc.description}); the NATS cluster has {size} server(s) up now. Set EPD_STREAM_REPLICAS to at "
        f"most the cluster size (3 servers with R3 survive one lost server) and start every server of the cluster"
    )


def connection_user(js_or_nc: Any) -> str | None:
    """The NATS user a JetStream context's (or a connection's) connection authenticated as."""
    nc = getattr(js_or_nc, "_nc", js_or_nc)
    options = getattr(nc, "options", None)
    return options.get("user") if isinstance(options, dict) else None


#: How long a process whose identity does not create streams / buckets waits for them to appear
#: (the API creates them at its start) before it gives up, and how often it looks.
TOPOLOGY_WAIT_S = 600.0
TOPOLOGY_POLL_S = 0.25
_WAIT_LOG_S = 15.0


async def _wait_created(lookup: Callable[[], Awaitable[T]], what: str, user: str | None, wait_s: float) -> T:
    """``lookup()`` again until it finds ``what`` (NotFoundError while it does not), logging
    while it waits; a ServiceUnavailable after ``wait_s``."""
    started = time.monotonic()
    logged = -_WAIT_LOG_S
    while True:
        try:
            return await lookup()
        except (BucketNotFoundError, NotFoundError):
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise ServiceUnavailable(
                    f"{what} does not exist after {waited:.0f}s and NATS identity {user!r} may not create it: "
                    "start the API (it creates the streams and buckets) or run this process as a role that may"
                ) from None
            if waited - logged >= _WAIT_LOG_S:
                logged = waited
                log.info(
                    "%s does not exist yet; NATS identity %r binds only: waiting for the API to create it", what, user
                )
            await asyncio.sleep(TOPOLOGY_POLL_S)


async def open_bucket(
    js: JetStreamContext,
    bucket: str,
    *,
    replicas: int,
    what: str,
    description: str,
    ttl: float | None = None,
    wait_s: float = TOPOLOGY_WAIT_S,
) -> KeyValue:
    """A key-value bucket of one revision per key, on disk, created when missing (safe from several
    processes at once). More ``replicas`` than the cluster has: a ``ConfigError`` that says so,
    naming ``what`` (e.g. "the EC index"). A process whose NATS identity binds only
    (:func:`shared.nats_auth.creates_topology`) waits up to ``wait_s`` for the API to create it."""
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        pass
    user = connection_user(js)
    if not creates_topology(user):
        return await _wait_created(lambda: js.key_value(bucket), f"{what} bucket {bucket}", user, wait_s)
    config = KeyValueConfig(
        bucket=bucket, history=1, ttl=ttl, storage=StorageType.FILE, replicas=replicas, description=description
    )
    try:
        return await js.create_key_value(config)
    except APIError as exc:
        error = replicas_error(exc, getattr(js, "_nc", None), replicas, f"{what} bucket {bucket}")
        if error is not None:
            raise error from exc
        raise


async def kv_latest(js: Any, bucket: str, keys: str = ">", *, timeout: float = 30.0) -> list[tuple[str, bytes, int]]:
    """The live entries of key-value ``bucket`` under the key pattern ``keys``, as of the call:
    ``(key, value, revision)`` in revision order; deleted and purged keys left out.

    Not nats-py's ``KeyValue.watch``: its end-of-initial-values marker compares the consumer's info
    with what the client has parsed so far, and the info can overtake the values the consumer
    already pushed - the marker then comes first, and a snapshot read up to it misses entries (an
    EC janitor pass saw none of the objects, about once in a few hundred passes under load). A pull
    consumer delivers nothing until asked, so the count its creation reports is exactly what there
    is, and the first that many messages are the snapshot (later writes come after them)."""
    stream, prefix = protocol.kv_stream(bucket), protocol.kv_key_subject_prefix(bucket)
    name = f"snap_{uuid.uuid4().hex}"
    info = await js.add_consumer(
        stream,
        config=ConsumerConfig(
            name=name,
            filter_subject=prefix + keys,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            # (a read of a moment: no raft group of its own; gone soon if the delete below is lost)
            num_replicas=1,
            mem_storage=True,
            inactive_threshold=5.0,
        ),
    )
    out: list[tuple[str, bytes, int]] = []
    left = info.num_pending
    try:
        if left:
            sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
            try:
                while left > 0:
                    for msg in await sub.fetch(min(left, 256), timeout=timeout):
                        left = 0 if msg.metadata.num_pending == 0 else left - 1
                        headers = msg.headers or {}
                        if "KV-Operation" in headers or "Nats-Marker-Reason" in headers:
                            continue  # a delete or purge marker (or a future kind of marker): not a live value
                        out.append((msg.subject[len(prefix) :], msg.data, msg.metadata.sequence.stream))
            finally:
                await sub.unsubscribe()
    finally:
        try:
            await js.delete_consumer(stream, name)
        except Exception as exc:  # noqa: BLE001 - its inactivity threshold removes it anyway
            log.debug("deleting consumer %s of %s: %s", name, stream, exc)
    return out


async def ensure_topology(
    js: JetStreamContext,
    settings: NatsSettings,
    subjects: Subjects,
    *,
    nc: NATS | None = None,
    consumer: tuple[str, str] | None = None,
    wait_s: float = TOPOLOGY_WAIT_S,
) -> None:
    """Create (or update) every stream and durable consumer, with ``EPD_STREAM_REPLICAS``
    replicas. Safe to call from every service. Raises :class:`~shared.errors.ConfigError` when
    the server cannot hold that many replicas (``nc``: the connection, to name the cluster size
    and to refuse replicas > 1 on a server without a cluster before creating anything).

    A process whose NATS identity binds only (a worker's role identity,
    :func:`shared.nats_auth.creates_topology`) creates nothing: it waits (up to ``wait_s``, with
    a log line) until every stream and ``consumer`` (``(stream, durable)``, its own) exist."""
    if not creates_topology(settings.nats_user):
        for name in subjects.streams():
            await _wait_created(functools.partial(js.stream_info, name), f"stream {name}", settings.nats_user, wait_s)
        if consumer is not None:
            stream, durable = consumer
            await _wait_created(
                functools.partial(js.consumer_info, stream, durable),
                f"consumer {stream}/{durable}",
                settings.nats_user,
                wait_s,
            )
        return
    if nc is not None:
        check_replicas(nc, settings.stream_replicas)
    until = time.monotonic() + TOPOLOGY_RETRY_S
    for cfg in stream_configs(settings, subjects):
        try:
            try:
                await _patiently(functools.partial(js.add_stream, cfg), f"stream {cfg.name}", until)
            except BadRequestError as exc:
                if exc.err_code != _ERR_STREAM_EXISTS_DIFFERENT:
                    raise
                log.info("updating stream %s to the configured limits", cfg.name)
                await _patiently(functools.partial(js.update_stream, cfg), f"stream {cfg.name}", until)
        except APIError as exc:
            error = replicas_error(exc, nc, settings.stream_replicas, f"stream {cfg.name}") or storage_error(
                exc, settings, subjects, f"stream {cfg.name}"
            )
            if error is not None:
                raise error from exc
            raise
    for stream, ccfg in consumer_configs(settings, subjects).items():
        doing = f"consumer {stream}/{ccfg.durable_name}"
        try:
            await _patiently(functools.partial(js.add_consumer, stream, ccfg), doing, until)
        except BadRequestError as exc:
            if exc.err_code != _ERR_CONSUMER_EXISTS_DIFFERENT:
                raise
            # Deliver policy cannot change on an existing durable; the rest can.
            assert ccfg.durable_name is not None  # consumer_configs() names every consumer
            info = await js.consumer_info(stream, ccfg.durable_name)
            evolved = ccfg.evolve(deliver_policy=info.config.deliver_policy)
            await _patiently(functools.partial(js.add_consumer, stream, evolved), doing, until)
    if settings.stream_replicas > 1:
        await _wait_for_consumer_leaders(js, consumer_configs(settings, subjects))


async def _wait_for_consumer_leaders(
    js: JetStreamContext, consumers: Mapping[str, ConsumerConfig], timeout_s: float = 30.0
) -> None:
    """Wait until each replicated durable consumer has elected a leader before consuming or
    publishing to it. Seen on a 3-node cluster: a worker that started right after creating new R3
    consumers, whose info still showed no leader, got no jobs for 60 s (not reproduced in
    isolation since). Bounded: a warning, not a failure, when it takes longer."""
    deadline = time.monotonic() + timeout_s
    for stream, ccfg in consumers.items():
        assert ccfg.durable_name is not None
        while True:
            try:
                info = await js.consumer_info(stream, ccfg.durable_name)
                if info.cluster is None or info.cluster.leader:
                    break
            except Exception as exc:  # noqa: BLE001 - no leader to answer yet
                log.debug("consumer %s/%s: %s", stream, ccfg.durable_name, exc)
            if time.monotonic() >= deadline:
                log.warning("consumer %s/%s has no leader after %.0fs", stream, ccfg.durable_name, timeout_s)
                return
            await asyncio.sleep(0.1)


#: First and largest pause between two tries of :func:`through_elections`.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0

T = TypeVar("T")
#: ... and a plain TimeoutError: an ``op`` bounded by its own ``asyncio.wait_for``.
_RETRYABLE: tuple[type[BaseException], ...] = (*RETRYABLE_PUBLISH_ERRORS, TimeoutError)
_RETRYABLE_OR_API: tuple[type[BaseException], ...] = (*_RETRYABLE, APIError)  # (APIError: by its code)


#: How long :func:`ensure_topology` repeats a stream or consumer request that timed out
TOPOLOGY_RETRY_S = 60.0


async def _patiently(op: Callable[[], Awaitable[T]], doing: str, until: float) -> T:
    """``op()`` - a JetStream API request that is safe to repeat (creating or updating a stream or
    consumer to a given config) - again while it times out, until ``until`` (``time.monotonic()``).
    Seen on a loaded 2-core machine: a worker starting beside a dozen others asked for its consumer,
    the server answered after the client's 5 s, and the worker exited at start-up."""
    pause = RETRY_FIRST_S
    while True:
        try:
            return await op()
        except nats.errors.TimeoutError:
            if time.monotonic() + pause >= until:
                raise
            log.info("%s: the JetStream request timed out; asking again", doing)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)


async def through_elections(
    op: Callable[[float], Awaitable[T]], *, doing: str, until: float | None, timeout: float = 5.0
) -> T:
    """Run ``op(timeout_s)`` - one JetStream operation that is safe to repeat (a read, or a publish
    with a ``Nats-Msg-Id``) - again with a short backoff while it fails with
    ``RETRYABLE_PUBLISH_ERRORS`` (no stream leader: an election after a NATS node failed, a
    reconnect to another seed), until ``until`` (``time.time()``; None: one try). Raises
    :class:`~shared.errors.ServiceUnavailable` naming ``doing`` when it still fails then, or at
    once on any other NATS error; counts the repeats in ``epd:publish_retries_total``."""
    pause, tries = RETRY_FIRST_S, 0
    while True:
        tries += 1
        left = timeout if until is None else min(timeout, until - time.time())
        try:
            result = await op(max(0.05, left))
            break
        except _RETRYABLE_OR_API as exc:
            if not isinstance(exc, _RETRYABLE) and getattr(exc, "err_code", None) != _ERR_MSG_ID_IN_PROCESS:
                raise nats_unavailable(doing, exc) from exc
            if until is None or time.time() + pause >= until:
                raise nats_unavailable(f"{doing}, {tries} tries" if tries > 1 else doing, exc) from exc
            if tries == 1:
                log.info("%s: %s: retrying while JetStream elects a leader", doing, type(exc).__name__)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)
        except nats.errors.Error as exc:  # nats.errors.TimeoutError is an asyncio.TimeoutError: not a deadline
            raise nats_unavailable(doing, exc) from exc
    if tries > 1:
        log.info("%s: done after %d tries", doing, tries)
        metrics.PUBLISH_RETRIES.inc(tries - 1)
    return result


class JetStreamPublisher:
    """Publishes protocol messages into their streams with request_id headers.

    A publish that carries a ``Nats-Msg-Id`` is retried while JetStream has no leader for its
    stream (``RETRYABLE_PUBLISH_ERRORS``: an election after a NATS node failed, a reconnect to
    another seed), with a short backoff, until ``deadline`` (``time.time()``; default: now +
    ``retry_s``): the duplicate window drops a copy that got through after all. Each of its tries
    waits ``try_s`` for the acknowledgement, so a try lost on the way (sent into a stalled server,
    or to a leader that stepped down) holds it that long, not ``timeout``. A publish without a
    ``Nats-Msg-Id`` is tried once, for up to ``timeout`` (a repeat could duplicate it)."""

    def __init__(self, js: JetStreamContext, *, timeout: float = 5.0, retry_s: float = 10.0, try_s: float = 1.0):
        self.js = js
        self.timeout = timeout
        self.retry_s = retry_s
        self.try_s = try_s

    @classmethod
    def for_settings(cls, js: JetStreamContext, settings: NatsSettings) -> JetStreamPublisher:
        """A service's publisher: retries and tries as configured (``EPD_PUBLISH_RETRY_S``, ``EPD_PUBLISH_TRY_S``)."""
        return cls(js, retry_s=settings.publish_retry_s, try_s=settings.publish_try_s)

    async def publish(
        self, subject: str, msg: Message, *, request_id: str, msg_id: str | None = None, deadline: float | None = None
    ) -> bool:
        """Returns False when JetStream dropped it as a duplicate of ``msg_id``. Raises
        :class:`~shared.errors.ServiceUnavailable` when JetStream does not acknowledge it in time
        (NATS down, stalled, reconnecting, or without a stream leader past the retry window),
        never a bare ``nats`` error."""
        data = protocol.encode(msg)
        headers = protocol.headers_for(msg, request_id, msg_id=msg_id, extra=TRACE_HEADERS.get())
        retry_until, try_s = None, self.timeout
        if msg_id is not None:
            retry_until = deadline if deadline is not None else time.time() + self.retry_s
            try_s = self.try_s
        ack = await through_elections(
            lambda left: self.js.publish(subject, data, timeout=left, headers=headers),
            doing=f"publishing {type(msg).__name__}",
            until=retry_until,
            timeout=try_s,
        )
        metrics.MESSAGE_BYTES.labels(type(msg).__struct_config__.tag).inc(len(data))
        return not ack.duplicate

    async def send(self, subject: str, msg: Message, *, request_id: str, msg_id: str | None = None) -> PendingAck:
        """Queue ``msg`` on the connection without waiting for JetStream's acknowledgement:
        ``await pending.confirmed()`` later. It goes out after everything this connection queued
        before it and before everything queued after it (a :meth:`publish` called next included),
        so the stream stores them in that order. Sent once, like a :meth:`publish` without
        ``msg_id``: for a stream of messages whose sender waits for one acknowledgement while the
        next message is already on its way (``shared.token_stream``). Its acknowledgement is
        waited for ``try_s``: a sender that gets none publishes the message again (with the same
        ``msg_id``, or one its readers drop as a copy)."""
        data = protocol.encode(msg)
        headers = protocol.headers_for(msg, request_id, msg_id=msg_id, extra=TRACE_HEADERS.get())
        doing = f"publishing {type(msg).__name__}"
        try:
            # Bounded here, not with publish_async's wait_stall (a task per call): a stalled NATS
            # can hold the connection's quota of unacknowledged sends.
            async with asyncio.timeout(self.timeout):
                ack = await self.js.publish_async(subject, data, headers=headers)
        except (TimeoutError, nats.errors.Error) as exc:
            raise nats_unavailable(doing, exc) from exc
        metrics.MESSAGE_BYTES.labels(type(msg).__struct_config__.tag).inc(len(data))
        return PendingAck(ack, timeout_s=self.try_s, doing=doing)


async def close_connection(nc: NATS, timeout_s: float = 10.0) -> None:
    """Drain (acks and publishes still buffered go out) when the server answers; close at once
    when it does not (a stalled server never finishes a drain: SIGTERM must still stop a
    process within a bounded time)."""
    if nc.is_closed:
        return
    if not nc.is_connected or not await server_answers(nc, timeout=min(1.0, timeout_s)):
        log.warning("NATS does not answer: closing the connection without draining")
        await nc.close()
        return
    try:
        await asyncio.wait_for(nc.drain(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - NATS unreachable: nothing more can be delivered anyway
        log.warning("could not drain the NATS connection (%s: %s): closing it", type(exc).__name__, exc)
        await nc.close()


M = TypeVar("M")


class TypedSubscription(Generic[M]):
    """A core NATS subscription that hands out decoded protocol messages of the expected types,
    to one reader.

    Undecodable messages, messages of a newer schema and messages of other types are skipped
    and counted (``skipped``); nothing else is filtered here. Close it (``close()`` or ``async
    with``) when done; closing twice is harmless. Build it with :func:`subscribe_typed`.

    The subscription's callback queues each message here, where :meth:`next` takes it: no task
    per message (nats-py's ``next_msg`` starts two), and a reader can tell whether one is
    already there (:attr:`ready`). At most ``MAX_QUEUED`` wait; more are dropped and counted
    (``dropped``): a reader that far behind has lost track anyway (the token stream reads what it
    missed from the stream store)."""

    MAX_QUEUED = 65536

    def __init__(self, subject: str, expect: tuple[type, ...]):
        self._sub: Any = None  # (set by open() once subscribed)
        self.subject = subject
        self.expect = expect
        self.skipped = 0
        self.dropped = 0
        self._closed = False
        self._queued: collections.deque[Any] = collections.deque()
        self._arrived: asyncio.Future[None] | None = None  # what next() waits on while none is queued

    @classmethod
    async def open(cls, nc: NATS, subject: str, expect: tuple[type, ...], *, queue: str = "") -> TypedSubscription:
        """Subscribe (the callback exists before the subscription does)."""
        typed = cls(subject, expect)
        typed._sub = await nc.subscribe(subject, queue=queue, cb=typed._received)
        return typed

    async def _received(self, msg: Any) -> None:
        """The subscription's callback."""
        if len(self._queued) >= self.MAX_QUEUED:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("over %d messages queued on %s: dropping", self.MAX_QUEUED, self.subject)
            return
        self._queued.append(msg)
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    @property
    def ready(self) -> bool:
        """A message is queued: :meth:`next` returns without waiting (unless it is skipped)."""
        return bool(self._queued)

    async def next(self, *, deadline: float) -> M | None:
        """The next expected message, or None once ``deadline`` (``time.time()``) has passed."""
        while (left := deadline - time.time()) > 0:
            if not self._queued:
                self._arrived = asyncio.get_running_loop().create_future()
                try:
                    async with asyncio.timeout(left):
                        await self._arrived
                except TimeoutError:
                    return None
                finally:
                    self._arrived = None
                continue  # (the deadline again)
            msg = self._queued.popleft()
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

    ``confirm``: return only once the server has the subscription: a round trip the connected
    server answers itself (a message to a fresh inbox this connection subscribed to, after the
    subscription: the server handles a connection's commands in order). Not a JetStream API call,
    which only the meta leader answers (every confirm waited out its timeout while a NATS cluster
    re-elected it), and not ``flush()`` (one that times out during a stall kills nats-py's read
    loop). Needed when the event
    may be caused by someone else right after a check made next (the prefill worker subscribes to
    an item's ``ECReady``, then looks in the store: without it, an encoder finishing in between
    announces to nobody, and the worker waits ``EPD_EC_WAIT_S`` for nothing). Fails open.

    Usage::

        async with await subscribe_typed(nc, subjects.ec_any(fp, item), ECReady, ECFailed) as sub:
            event = await sub.next(deadline=time.time() + wait_s)  # None: nothing in time
    """
    typed: TypedSubscription = await TypedSubscription.open(nc, subject, expect, queue=queue)
    if confirm:
        await confirm_subscriptions(nc, what=subject)
    return typed


#: How long :func:`confirm_subscriptions` waits for its echo.
CONFIRM_TIMEOUT_S = 2.0


async def server_answers(nc: NATS, *, timeout: float = CONFIRM_TIMEOUT_S) -> bool:
    """A round trip the connected server answers itself (not the JetStream meta leader): subscribe
    to a fresh inbox, publish to it, await the echo. Since the server handles a connection's
    commands in order, a True also means it has processed every earlier subscription."""
    inbox = nc.new_inbox()
    probe = await nc.subscribe(inbox, max_msgs=1)
    try:
        await nc.publish(inbox, b"")
        await probe.next_msg(timeout=timeout)
        return True
    except (TimeoutError, nats.errors.Error):
        return False
    finally:
        try:
            await probe.unsubscribe()
        except Exception as exc:  # noqa: BLE001 - auto-unsubscribed after its one message already
            log.debug("unsubscribe from the probe inbox: %s", exc)


async def confirm_subscriptions(nc: NATS, *, what: str = "", timeout: float = CONFIRM_TIMEOUT_S) -> bool:
    """Return once the connected server has processed this connection's earlier subscriptions
    (:func:`server_answers`; see :func:`subscribe_typed`). False (and a warning) when no echo
    came within ``timeout``: fails open."""
    try:
        if await server_answers(nc, timeout=timeout):
            return True
        reason = f"no echo within {timeout:.1f}s"
    except Exception as exc:  # noqa: BLE001 - fails open: the subscription exists either way
        reason = f"{type(exc).__name__}: {exc}"
    log.warning("could not confirm the subscription to %s: %s", what or "?", reason)
    return False
