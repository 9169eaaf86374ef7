"""Queue replay: everything that happened to a request, read back from the JetStream streams.

The streams use limits retention, so they keep what passed through them (``EPD_STREAM_MAX_AGE_S``,
``EPD_STREAM_MAX_BYTES``). From them this module builds a :class:`RequestCase` (every message of
one request on every stream, decoded, in time order), lists recent requests, re-runs a recorded
request on the live workers and compares the outputs, and carries cases between clusters.

How a request's messages are found, without scanning whole streams:

* ``<P>_REQUESTS`` / ``<P>_RESULTS``: the request id is in the subject (``<p>.requests.<id>``,
  ``<p>.tokens.<id>``): a direct "last message on subject" get, and a consumer filtered on the
  tokens subject (the server's subject index does the filtering);
* ``<P>_EVENTS``: filtered on the request's image items (``<p>.ec.*.*.<item>``), within the
  request's time window (events of other requests that shared an image are kept: they explain a
  deduplicated encode job);
* work streams (``<P>_ENCODE``, ``<P>_GENERATE``, ``<P>_DECODE``, ...): an ephemeral consumer that
  starts at the request's received time and stops after its last result, keeping messages whose
  ``Epd-Request-Id`` header matches. Every scan is bounded (``MAX_SCAN_MESSAGES``) and says so
  when it hits the bound.

Cases imported from another cluster (``epd replay import``) live in ``<P>_IMPORTED`` (subjects
``<p>.imported.<id>.<kind>``), a stream no worker consumes, so importing a job never runs it; the
original stream, subject, sequence and time travel in ``Epd-Orig-*`` headers.

The case file (``epd replay export``) is JSON, never pickle: every message's exact bytes (base64
MessagePack) and headers, a decoded copy for reading, and - unless ``--no-media`` - the images'
bytes from the store (bounded by ``max_media_bytes``; EC objects are not carried: they belong to
one encoder version and the target cluster recomputes them from the images).

Nothing here imports torch: the CLI and the API use it.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import difflib
import hashlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from shared import protocol
from shared.config import CommonSettings
from shared.store.format import ec_key as make_ec_key
from shared.store.format import media_key as make_media_key
from shared.store.ec import ECStore
from shared.errors import EPDError, StoreError
from shared.jetstream import TRACE_HEADERS, JetStreamPublisher, set_trace
from shared.store.objects import ObjectStore
from shared.protocol import (
    ChatRequestRecord,
    EncodeJob,
    ErrorEvent,
    FinalResult,
    GenerationJob,
    Subjects,
    TokenChunk,
    WorkerHeartbeat,
)

log = logging.getLogger(__name__)

#: Messages one scan of one stream examines at most (then it stops and notes it in the case).
MAX_SCAN_MESSAGES = 100_000
#: Messages one case holds at most (a redelivered long completion is the largest case).
MAX_CASE_MESSAGES = 20_000
#: Scans start this long before the request's received time and end this long after its last result.
WINDOW_SLACK_S = 2.0
FETCH_BATCH = 256
MAX_LIST_LIMIT = 1000
MAX_CASE_FILE_BYTES = 256 * 1024**2
DEFAULT_MAX_MEDIA_BYTES = 64 * 1024**2
MAX_REQUEST_ID_CHARS = 200
#: Workers beat every 2 s: waiting this long sees every live worker once.
HEARTBEAT_WINDOW_S = 2.5

CASE_FORMAT = "epd-replay-case"
CASE_VERSION = 1

HDR_ORIG_STREAM = "Epd-Orig-Stream"
HDR_ORIG_SUBJECT = "Epd-Orig-Subject"
HDR_ORIG_SEQ = "Epd-Orig-Seq"
HDR_ORIG_TIME = "Epd-Orig-Time"

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


# -- errors -------------------------------------------------------------------------------------
class ReplayError(EPDError):
    """A replay operation that cannot be done; the message says why and what to do."""

    code = "replay_error"
    http_status = 500


class InvalidRequestId(ReplayError):
    code = "invalid_request_id"
    http_status = 400
    error_type = "invalid_request_error"


class RequestNotFound(ReplayError):
    """No message of the request on any stream: an unknown id, or its messages expired."""

    code = "request_not_found"
    http_status = 404
    error_type = "invalid_request_error"


class MessagesExpired(ReplayError):
    """The request is known, but messages a replay needs are gone (stream age / size limits)."""

    code = "messages_expired"
    http_status = 410
    error_type = "invalid_request_error"


class MediaExpired(ReplayError):
    """An image of the request is no longer in the store and no EC object can stand in for it."""

    code = "media_expired"
    http_status = 410
    error_type = "invalid_request_error"


class NoLiveWorkers(ReplayError):
    code = "no_live_workers"
    http_status = 503


class ReplayTimeout(ReplayError):
    code = "replay_timeout"
    http_status = 504


class CaseFileError(ReplayError):
    """A case file that is not a valid, bounded ``epd-replay-case`` document."""

    code = "invalid_case_file"
    http_status = 400
    error_type = "invalid_request_error"


def check_request_id(request_id: str) -> str:
    """A request id is one NATS subject token: letters, digits, ``-`` and ``_``."""
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS \
            or not _REQUEST_ID_RE.match(request_id):
        raise InvalidRequestId(
            f"invalid request id {request_id!r:.80}: expected letters, digits, '-' or '_' "
            f"(at most {MAX_REQUEST_ID_CHARS} characters), e.g. chatcmpl-0123abcd..."
        )
    return request_id


def new_replay_id() -> str:
    return f"replay-{uuid.uuid4().hex}"


def iso_time(ts: float | None) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _tag(msg: Any) -> str:
    return type(msg).__struct_config__.tag  # type: ignore[attr-defined]


# -- messages and cases -------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamMessage:
    """One stored message: where it is, when JetStream stored it, its headers and payload."""

    stream: str
    seq: int
    subject: str
    time: float
    headers: dict[str, str]
    data: bytes
    msg: protocol.Message | None
    error: str = ""
    imported: bool = False

    @classmethod
    def build(cls, stream: str, seq: int, subject: str, time_: float, headers: dict[str, str] | None,
              data: bytes | None, *, imported: bool = False) -> "StreamMessage":
        data = data or b""
        try:
            msg, error = protocol.decode(data), ""
        except protocol.ProtocolError as exc:
            msg, error = None, str(exc)
        return cls(stream, seq, subject, time_, dict(headers or {}), data, msg, error, imported)

    @property
    def kind(self) -> str:
        if self.msg is not None:
            return _tag(self.msg)
        return self.headers.get(protocol.HDR_KIND, "undecodable")

    @property
    def request_id(self) -> str:
        return self.headers.get(protocol.HDR_REQUEST_ID) or getattr(self.msg, "request_id", "") or ""

    @property
    def stage(self) -> str:
        return self.headers.get(protocol.HDR_STAGE, "")

    def header_time(self, name: str) -> float | None:
        return _float(self.headers.get(name))

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "seq": self.seq,
            "subject": self.subject,
            "time": round(self.time, 6),
            "time_iso": iso_time(self.time),
            "kind": self.kind,
            "headers": dict(self.headers),
            "message": protocol.to_builtins(self.msg) if self.msg is not None else None,
            **({"error": self.error} if self.error else {}),
            **({"imported": True} if self.imported else {}),
        }


@dataclass(frozen=True)
class Summary:
    """One line of ``epd replay list``."""

    request_id: str
    received_at: float
    status: str  # ok | error | incomplete
    images: int
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    e2e_s: float | None
    error: str = ""
    replay_of: str = ""
    model: str = ""

    def to_json(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self.__dict__)
        out["received_at_iso"] = iso_time(self.received_at)
        return out


@dataclass
class RequestCase:
    """Every message of one request on every stream, in time order."""

    request_id: str
    messages: list[StreamMessage]
    source: str = "live"  # live | imported
    notes: list[str] = field(default_factory=list)

    def of(self, *types: type) -> list[StreamMessage]:
        return [m for m in self.messages if isinstance(m.msg, types)]

    def _own(self, *types: type) -> list[Any]:
        return [m.msg for m in self.of(*types) if getattr(m.msg, "request_id", None) == self.request_id]

    @property
    def record(self) -> ChatRequestRecord | None:
        own = self._own(ChatRequestRecord)
        return own[0] if own else None

    @property
    def generation_job(self) -> GenerationJob | None:
        """The job the API published (a re-prefill's job has ``reprefill`` > 0)."""
        jobs = self._own(GenerationJob)
        jobs.sort(key=lambda j: getattr(j, "reprefill", 0))
        return jobs[0] if jobs else None

    @property
    def final(self) -> FinalResult | None:
        own = self._own(FinalResult)
        return own[-1] if own else None

    @property
    def error(self) -> ErrorEvent | None:
        own = self._own(ErrorEvent)
        return own[-1] if own else None

    @property
    def terminal(self) -> StreamMessage | None:
        """The message that ended the request (its FinalResult or ErrorEvent), if any."""
        ends = [m for m in self.of(FinalResult, ErrorEvent) if m.request_id == self.request_id]
        return ends[-1] if ends else None

    def chunks(self) -> list[StreamMessage]:
        """Token chunks of the last attempt (a redelivered job restarts at seq 0)."""
        chunks = [m for m in self.of(TokenChunk) if m.request_id == self.request_id]
        if not chunks:
            return []
        last = max(m.msg.attempt for m in chunks)  # type: ignore[union-attr]
        return [m for m in chunks if m.msg.attempt == last]  # type: ignore[union-attr]

    @property
    def received_at(self) -> float:
        if self.record is not None:
            return self.record.received_at
        for m in self.messages:
            ts = m.header_time(protocol.HDR_RECEIVED_AT)
            if ts:
                return ts
        return self.messages[0].time if self.messages else 0.0

    def item_hashes(self) -> list[str]:
        refs = list(self.record.images) if self.record else []
        job = self.generation_job
        if job is not None:
            refs += list(job.images)
        refs += [m.image for m in self._own(EncodeJob)]
        return list(dict.fromkeys(r.item_hash for r in refs))

    def summary(self) -> Summary:
        record, final, error = self.record, self.final, self.error
        received = self.received_at
        all_chunks = [m for m in self.of(TokenChunk) if m.request_id == self.request_id]
        first = min((m.time for m in all_chunks), default=None)
        end = self.terminal
        images = len(record.images) if record else (len(self.generation_job.images) if self.generation_job else 0)
        status = "ok" if final is not None else ("error" if error is not None else "incomplete")
        return Summary(
            request_id=self.request_id,
            received_at=received,
            status=status,
            images=images,
            prompt_tokens=final.prompt_tokens if final else None,
            completion_tokens=final.completion_tokens if final else (len(self.chunks()) or None),
            ttft_s=(first - received) if first is not None and received else None,
            e2e_s=(end.time - received) if end is not None and received else None,
            error=f"{error.code}: {error.message}" if error is not None and final is None else "",
            replay_of=record.replay_of if record else "",
            model=record.model if record else (self.generation_job.model if self.generation_job else ""),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "source": self.source,
            "summary": self.summary().to_json(),
            "notes": list(self.notes),
            "messages": [m.to_json() for m in self.messages],
        }


# -- bounded stream reads ----------------------------------------------------------------------
class StreamReader:
    """Direct gets by subject / sequence and time-windowed, filtered, bounded scans."""

    def __init__(self, nc: NATS, *, max_scan: int = MAX_SCAN_MESSAGES, timeout: float = 5.0):
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout)
        self.max_scan = max_scan
        self.timeout = timeout
        self.notes: list[str] = []

    async def stream_info(self, stream: str):
        try:
            return await self.js.stream_info(stream)
        except NotFoundError:
            return None

    async def last(self, stream: str, subject: str) -> StreamMessage | None:
        """The last message on ``subject`` (one request to the server, no scan)."""
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return StreamMessage.build(stream, raw.seq or 0, raw.subject or subject, raw.time.timestamp(), raw.headers,
                                   raw.data)

    async def first(self, stream: str, subject: str, from_seq: int = 1) -> StreamMessage | None:
        """The first message on ``subject`` at or after ``from_seq`` (the server's subject index)."""
        try:
            raw = await self.js.get_msg(stream, seq=max(1, from_seq), subject=subject, next=True)
        except NotFoundError:
            return None
        return StreamMessage.build(stream, raw.seq or 0, raw.subject or subject, raw.time.timestamp(), raw.headers,
                                   raw.data)

    async def by_seq(self, stream: str, seq: int) -> StreamMessage | None:
        try:
            raw = await self.js.get_msg(stream, seq)
        except NotFoundError:
            return None
        return StreamMessage.build(stream, raw.seq or seq, raw.subject or "", raw.time.timestamp(), raw.headers,
                                   raw.data)

    async def scan(
        self,
        stream: str,
        subject: str,
        *,
        start: float | None = None,
        until: float | None = None,
        match: Callable[[StreamMessage], bool] | None = None,
        limit: int = MAX_CASE_MESSAGES,
    ) -> list[StreamMessage]:
        """Messages on ``subject`` stored from ``start`` (unix time; None: the stream's beginning)
        until ``until``, for which ``match`` holds. An ephemeral, unacknowledged consumer does the
        filtering on the server; it examines at most ``max_scan`` messages."""
        cfg = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
            filter_subject=subject,
            deliver_policy=DeliverPolicy.ALL,
        )
        if start is not None:
            cfg.deliver_policy = DeliverPolicy.BY_START_TIME
            cfg.opt_start_time = dt.datetime.fromtimestamp(max(0.0, start), dt.timezone.utc)
        try:
            psub = await self.js.pull_subscribe(subject, stream=stream, config=cfg)
        except NotFoundError:  # no such stream (e.g. a topology without it)
            return []
        out: list[StreamMessage] = []
        examined = 0
        try:
            pending = (await psub.consumer_info()).num_pending
            while pending > 0:
                if examined >= self.max_scan:
                    self.notes.append(f"scan of {stream} ({subject}) stopped after {examined} messages "
                                      f"(bound {self.max_scan}); later messages are not shown")
                    break
                try:
                    msgs = await psub.fetch(min(FETCH_BATCH, pending), timeout=self.timeout)
                except asyncio.TimeoutError:  # nats' TimeoutError subclasses it
                    break
                done = False
                for m in msgs:
                    examined += 1
                    meta = m.metadata
                    pending = meta.num_pending
                    sm = StreamMessage.build(stream, meta.sequence.stream, m.subject, meta.timestamp.timestamp(),
                                             m.headers, m.data)
                    if until is not None and sm.time > until:
                        done = True
                        break
                    if match is None or match(sm):
                        out.append(sm)
                        if len(out) >= limit:
                            self.notes.append(f"{stream}: kept the first {limit} matching messages only")
                            done = True
                            break
                if done or not msgs:
                    break
        finally:
            try:
                await psub.unsubscribe()
                if cfg.name:
                    await self.js.delete_consumer(stream, cfg.name)
            except Exception as exc:  # the consumer goes away by itself after inactive_threshold
                log.debug("could not delete scan consumer: %s", exc)
        return out


async def _retention_hint(reader: StreamReader, stream: str) -> str:
    info = await reader.stream_info(stream)
    if info is None:
        return f"stream {stream} does not exist on this NATS server (wrong --prefix / EPD_SUBJECT_PREFIX?)"
    state, cfg = info.state, info.config
    age = f"{cfg.max_age:.0f} s" if cfg.max_age else "unlimited time"
    if not state.messages:
        return f"{stream} keeps messages for {age} and is empty now"
    first = await reader.by_seq(stream, state.first_seq)
    return (f"{stream} keeps messages for {age} (max {cfg.max_bytes} bytes) and now holds {state.messages} "
            f"from {iso_time(first.time if first else None)} on")


async def find_case(nc: NATS, subjects: Subjects, request_id: str, *, reader: StreamReader | None = None,
                    include_imported: bool = True) -> RequestCase:
    """Every message of ``request_id``; the live streams first, then imported cases.

    Raises :class:`RequestNotFound` (with the streams' retention, so "expired" and "unknown" can be
    told apart by the reader) when neither has a message of it."""
    check_request_id(request_id)
    reader = reader or StreamReader(nc)
    case = await _find_live(reader, subjects, request_id)
    if case is None and include_imported:
        case = await _find_imported(reader, subjects, request_id)
    if case is None:
        hint = await _retention_hint(reader, subjects.stream_requests)
        raise RequestNotFound(
            f"request {request_id} not found: no record on {subjects.request(request_id)} and no result on "
            f"{subjects.tokens(request_id)}, nor an imported case. The id is unknown or its messages expired: {hint}"
        )
    case.notes.extend(reader.notes)
    return case


async def _find_live(reader: StreamReader, subjects: Subjects, rid: str) -> RequestCase | None:
    record = await reader.last(subjects.stream_requests, subjects.request(rid))
    results = await reader.scan(
        subjects.stream_results, subjects.tokens(rid), start=(record.time - WINDOW_SLACK_S) if record else None
    )
    if record is None and not results:
        return None
    messages: list[StreamMessage] = ([record] if record else []) + results
    case = RequestCase(rid, messages)
    received = case.received_at
    terminal = case.terminal
    end = terminal.time if terminal is not None else time.time()
    start, until = received - WINDOW_SLACK_S, end + WINDOW_SLACK_S

    def belongs(m: StreamMessage) -> bool:
        return m.request_id == rid

    skip = {subjects.stream_requests, subjects.stream_results, subjects.stream_events}
    for stream, subjs in subjects.streams().items():
        if stream in skip:
            continue
        for subject in subjs:
            messages += await reader.scan(stream, subject, start=start, until=until, match=belongs)
    case.messages = messages
    def relevant(m: StreamMessage) -> bool:  # another request's event counts if it came while this one ran
        return m.request_id == rid or m.time >= received

    for item in case.item_hashes():  # events of the request's images, whoever's job produced them
        messages += await reader.scan(subjects.stream_events, f"{subjects.prefix}.ec.*.*.{item}", start=start,
                                      until=until, match=relevant)
    if record is None:
        case.notes.append(f"no record of the request on {subjects.request(rid)} (expired, or the API could not "
                          "record it): body and images unknown")
    if terminal is None:
        case.notes.append("no final result or error on the tokens subject: the request is running, was lost, "
                          "or the API gave up (deadline)")
    case.messages = _ordered(messages)
    return case


def _ordered(messages: list[StreamMessage]) -> list[StreamMessage]:
    seen: set[tuple[str, int]] = set()
    out = []
    for m in messages:
        if (m.stream, m.seq) not in seen:
            seen.add((m.stream, m.seq))
            out.append(m)
    out.sort(key=lambda m: (m.time, _float(m.headers.get(protocol.HDR_SENT_AT)) or 0.0, m.seq))
    return out


def _from_imported(m: StreamMessage) -> StreamMessage:
    h = m.headers
    orig_time = _float(h.get(HDR_ORIG_TIME)) or m.time
    orig_seq = int(_float(h.get(HDR_ORIG_SEQ)) or 0)
    headers = {k: v for k, v in h.items() if not k.startswith("Epd-Orig-") and k != protocol.HDR_MSG_ID}
    return StreamMessage(h.get(HDR_ORIG_STREAM, m.stream), orig_seq, h.get(HDR_ORIG_SUBJECT, m.subject), orig_time,
                         headers, m.data, m.msg, m.error, imported=True)


async def _find_imported(reader: StreamReader, subjects: Subjects, rid: str) -> RequestCase | None:
    raw = await reader.scan(subjects.stream_imported, subjects.imported(rid))
    if not raw:
        return None
    case = RequestCase(rid, _ordered([_from_imported(m) for m in raw]), source="imported")
    case.notes.append(f"imported case (stream {subjects.stream_imported}); times are the original cluster's")
    return case


# -- list ---------------------------------------------------------------------------------------
async def list_requests(nc: NATS, subjects: Subjects, *, since_s: float = 3600.0, status: str | None = None,
                        limit: int = 20, reader: StreamReader | None = None) -> list[Summary]:
    """The newest requests first, received within ``since_s``: walks ``<P>_REQUESTS`` backwards
    by sequence (no scan) and reads each request's first and last result message directly."""
    if status not in (None, "ok", "error", "incomplete"):
        raise ReplayError(f"unknown status {status!r}: use ok, error or incomplete")
    limit = max(1, min(int(limit), MAX_LIST_LIMIT))
    reader = reader or StreamReader(nc)
    stream = subjects.stream_requests
    info = await reader.stream_info(stream)
    if info is None:
        raise RequestNotFound(await _retention_hint(reader, stream))
    cutoff = time.time() - since_s
    out: list[Summary] = []
    seq, examined = info.state.last_seq, 0
    while seq >= max(1, info.state.first_seq) and len(out) < limit and examined < reader.max_scan:
        sm = await reader.by_seq(stream, seq)
        seq -= 1
        examined += 1
        if sm is None:
            continue
        if sm.time < cutoff:
            break
        if not isinstance(sm.msg, ChatRequestRecord):
            continue
        summary = await _quick_summary(reader, subjects, sm)
        if status is None or summary.status == status:
            out.append(summary)
    return out


async def _quick_summary(reader: StreamReader, subjects: Subjects, record_msg: StreamMessage) -> Summary:
    record: ChatRequestRecord = record_msg.msg  # type: ignore[assignment]
    subject = subjects.tokens(record.request_id)
    last = await reader.last(subjects.stream_results, subject)
    first = await reader.first(subjects.stream_results, subject) if last is not None else None
    messages = [record_msg] + [m for m in (first, last) if m is not None]
    return RequestCase(record.request_id, _ordered(messages)).summary()


# -- live workers -------------------------------------------------------------------------------
async def live_workers(nc: NATS, subjects: Subjects, *, wait_s: float, need_role: str = "prefill"
                       ) -> dict[str, list[WorkerHeartbeat]]:
    """Workers whose heartbeat arrives within ``HEARTBEAT_WINDOW_S`` (longer, up to ``wait_s``,
    while no ``need_role`` worker has beaten)."""
    seen: dict[str, dict[str, WorkerHeartbeat]] = {}
    sub = await nc.subscribe(subjects.heartbeat_all)
    started = time.monotonic()
    try:
        while True:
            window = HEARTBEAT_WINDOW_S if need_role in seen else max(wait_s, HEARTBEAT_WINDOW_S)
            left = started + window - time.monotonic()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except asyncio.TimeoutError:
                break
            try:
                hb = protocol.decode(msg.data, WorkerHeartbeat)
            except protocol.ProtocolError:
                continue
            seen.setdefault(hb.role, {})[hb.worker_id] = hb
    finally:
        await sub.unsubscribe()
    return {role: list(hbs.values()) for role, hbs in seen.items()}


# -- run ----------------------------------------------------------------------------------------
@dataclass
class ReplayOutcome:
    original_id: str
    replay_id: str
    greedy: bool
    seed: int | None
    recorded: FinalResult | None
    recorded_error: ErrorEvent | None
    result: FinalResult | ErrorEvent
    recorded_texts: list[str]
    replay_texts: list[str]
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool | None:
        """Same token ids and text as the recorded result (None: nothing recorded to compare)."""
        if self.recorded is None:
            return None
        if not isinstance(self.result, FinalResult):
            return False
        return (tuple(self.recorded.token_ids) == tuple(self.result.token_ids)
                and self.recorded.text == self.result.text)

    @property
    def first_difference(self) -> int | None:
        if self.recorded is None or not isinstance(self.result, FinalResult):
            return None
        a, b = self.recorded.token_ids, self.result.token_ids
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i
        return None if len(a) == len(b) else min(len(a), len(b))

    def diff(self) -> str:
        """Token-level diff of the two completions: ``[-recorded-]{+replay+}``."""
        if self.recorded is None or not isinstance(self.result, FinalResult):
            return ""
        a, b = list(self.recorded.token_ids), list(self.result.token_ids)
        ta = self.recorded_texts if len(self.recorded_texts) == len(a) else [f"<{t}>" for t in a]
        tb = self.replay_texts if len(self.replay_texts) == len(b) else [f"<{t}>" for t in b]
        parts = []
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op == "equal":
                parts.append("".join(ta[i1:i2]))
            else:
                if i2 > i1:
                    parts.append("[-" + "".join(ta[i1:i2]) + "-]")
                if j2 > j1:
                    parts.append("{+" + "".join(tb[j1:j2]) + "+}")
        return "".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "original_id": self.original_id,
            "replay_id": self.replay_id,
            "greedy": self.greedy,
            "seed": self.seed,
            "identical": self.identical,
            "first_difference": self.first_difference,
            "recorded": protocol.to_builtins(self.recorded) if self.recorded else None,
            "recorded_error": protocol.to_builtins(self.recorded_error) if self.recorded_error else None,
            "result": protocol.to_builtins(self.result),
            "diff": self.diff(),
            "elapsed_s": round(self.elapsed_s, 4),
            "notes": list(self.notes),
        }


async def replay_request(
    nc: NATS,
    subjects: Subjects,
    request_id: str,
    *,
    namespace: str,
    store: ObjectStore | None = None,
    keep_seed: bool = True,
    timeout_s: float | None = None,
    worker_wait_s: float = 10.0,
    reader: StreamReader | None = None,
) -> ReplayOutcome:
    """Re-run a recorded request on the live workers under a new request id and collect the result.

    The recorded ``GenerationJob`` is published again with a fresh deadline (and a recorded
    ``ChatRequestRecord`` with ``replay_of`` set, so ``show`` works on the replay too). Images are
    referenced, not carried: with ``store`` given, each one must still be there (its EC object
    for the live encoder version, or its media bytes to encode from), else :class:`MediaExpired`;
    an encode job is queued when the EC object is missing and an encoder is alive, otherwise the
    prefill worker encodes locally. With ``keep_seed`` a request sampled with the worker's derived
    seed keeps it (``protocol.effective_seed`` of the original id), so sampled requests reproduce too.
    """
    reader = reader or StreamReader(nc)
    case = await find_case(nc, subjects, request_id, reader=reader)
    job = case.generation_job
    if job is None:
        hint = await _retention_hint(reader, subjects.stream_generate)
        raise MessagesExpired(f"request {request_id} has no generation job left on {subjects.generate_jobs} "
                              f"(expired or trimmed), so it cannot be replayed: {hint}")
    notes: list[str] = []
    distinct = list(dict.fromkeys(ref.item_hash for ref in job.images))
    # Images first (cheap, and the clearer error): each needs its media or an EC object.
    stored = await _stored_images(store, namespace, job.fingerprint, distinct, notes)
    if stored is not None:
        for item in distinct:
            if not stored[item][0] and not stored[item][1]:
                raise MediaExpired(
                    f"image {item[:16]} of request {request_id} is no longer in the store (no media object "
                    f"{make_media_key(namespace, item)}, no EC object for encoder {job.fingerprint}): it cannot be "
                    "replayed here. `epd replay export` carries the images of a case for this reason")

    workers = await live_workers(nc, subjects, wait_s=worker_wait_s)
    prefills = workers.get("prefill", [])
    if not prefills:
        raise NoLiveWorkers(f"no prefill worker heartbeat on {subjects.heartbeat_all} within {worker_wait_s:.0f} s: "
                            f"start workers on this NATS with EPD_SUBJECT_PREFIX={subjects.prefix}")
    fingerprint = prefills[0].fingerprint or job.fingerprint
    if fingerprint != job.fingerprint:
        notes.append(f"encoder fingerprint changed since the recording ({job.fingerprint} -> {fingerprint}): "
                     "a changed model or processor may change the output")
        stored = await _stored_images(store, namespace, fingerprint, distinct, notes)
    encoders = [hb for hb in workers.get("encoder", []) if hb.fingerprint == fingerprint]

    sampling = job.sampling
    if sampling.seed is None and sampling.temperature > 0:
        if keep_seed:
            sampling = msgspec.structs.replace(sampling, seed=protocol.effective_seed(request_id, None))
            notes.append(f"sampled without a client seed: replaying with the original's derived seed {sampling.seed}")
        else:
            notes.append("sampled without a client seed and --new-seed: the replay samples with its own seed")

    replay_id = new_replay_id()
    refs: dict[str, protocol.ImageRef] = {}
    to_encode: list[protocol.ImageRef] = []
    for ref in job.images:
        if ref.item_hash in refs:
            continue
        # Queue an encode job like the API would: EC object missing and an encoder alive.
        queue = bool(encoders) and stored is not None and not stored[ref.item_hash][0]
        new_ref = msgspec.structs.replace(ref, media_key=make_media_key(namespace, ref.item_hash), encode_queued=queue)
        refs[ref.item_hash] = new_ref
        if queue:
            to_encode.append(new_ref)
    images = tuple(refs[r.item_hash] for r in job.images)

    timeout = timeout_s if timeout_s else min(max(job.deadline - job.created_at, 10.0), 3600.0)
    received = time.time()
    deadline = received + timeout
    js = nc.jetstream()
    publisher = JetStreamPublisher(js)
    trace = set_trace("replay", received_at=received)
    sub = None
    try:
        record = case.record
        await publisher.publish(subjects.request(replay_id), ChatRequestRecord(
            request_id=replay_id, received_at=received, model=job.model, body=record.body if record else {},
            images=images, replay_of=request_id,
        ), request_id=replay_id)
        for ref in to_encode:
            await publisher.publish(subjects.encode_jobs, EncodeJob(
                request_id=replay_id, image=ref, fingerprint=fingerprint,
                ec_key=make_ec_key(namespace, fingerprint, ref.item_hash), created_at=time.time(),
            ), request_id=replay_id)
        sub = await nc.subscribe(subjects.tokens(replay_id))
        new_job = msgspec.structs.replace(job, request_id=replay_id, images=images, fingerprint=fingerprint,
                                          sampling=sampling, deadline=deadline, created_at=time.time())
        if hasattr(new_job, "reprefill"):
            new_job = msgspec.structs.replace(new_job, reprefill=0)
        await publisher.publish(subjects.generate_jobs, new_job, request_id=replay_id, msg_id=replay_id)
        log.info("replaying %s as %s (%d image(s), %d encode job(s))", request_id, replay_id, len(refs),
                 len(to_encode))
        texts, result = await _collect(sub, deadline)
    finally:
        TRACE_HEADERS.reset(trace)
        if sub is not None:
            await sub.unsubscribe()
    if result is None:
        raise ReplayTimeout(f"replay {replay_id} of {request_id} produced no result within {timeout:.0f} s; "
                            f"inspect it with `epd replay show {replay_id}`")
    return ReplayOutcome(
        original_id=request_id, replay_id=replay_id, greedy=sampling.temperature == 0, seed=sampling.seed,
        recorded=case.final, recorded_error=case.error if case.final is None else None, result=result,
        recorded_texts=[m.msg.text for m in case.chunks()],  # type: ignore[union-attr]
        replay_texts=texts, elapsed_s=time.time() - received, notes=notes + case.notes,
    )


async def _stored_images(store: ObjectStore | None, namespace: str, fingerprint: str, items: list[str],
                         notes: list[str]) -> dict[str, tuple[bool, bool]] | None:
    """item -> (EC object of ``fingerprint`` stored, media stored); None when it cannot be told."""
    if store is None:
        return None
    ec_store = ECStore(store, namespace=namespace, fingerprint=fingerprint, producer="epd-replay")
    out = {}
    try:
        for item in items:
            ec = await asyncio.to_thread(ec_store.exists, item)
            media = await asyncio.to_thread(store.exists, make_media_key(namespace, item))
            out[item] = (ec, media)
    except StoreError as exc:
        notes.append(f"could not check the store ({exc}); replaying without the check")
        return None
    return out


async def _collect(sub, deadline: float) -> tuple[list[str], FinalResult | ErrorEvent | None]:
    """Token texts (by seq, last attempt wins) and the final result or error, until ``deadline``."""
    texts: dict[int, str] = {}
    attempt = 0
    while (left := deadline - time.time()) > 0:
        try:
            msg = await sub.next_msg(timeout=left)
        except asyncio.TimeoutError:
            break
        try:
            event = protocol.decode(msg.data)
        except protocol.ProtocolError:
            continue
        if isinstance(event, TokenChunk):
            if event.attempt > attempt:
                attempt, texts = event.attempt, {}
            for i, _ in enumerate(event.token_ids):
                texts[event.seq + i] = event.text if i == 0 else ""
        elif isinstance(event, (FinalResult, ErrorEvent)):
            return [texts[k] for k in sorted(texts)], event
    return [texts[k] for k in sorted(texts)], None


# -- export / import ----------------------------------------------------------------------------
def _media_refs(case: RequestCase) -> dict[str, str]:
    """item hash -> recorded media key, for the case's images."""
    refs: dict[str, str] = {}
    record, job = case.record, case.generation_job
    for ref in list(record.images if record else ()) + list(job.images if job else ()):
        refs.setdefault(ref.item_hash, ref.media_key)
    return refs


async def export_cases(
    nc: NATS,
    subjects: Subjects,
    request_ids: list[str],
    *,
    store: ObjectStore | None = None,
    include_media: bool = True,
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
) -> dict[str, Any]:
    """A case document for ``request_ids`` (see the module docstring for what it carries)."""
    if not request_ids:
        raise ReplayError("no request id given")
    budget = max_media_bytes
    cases = []
    for rid in dict.fromkeys(request_ids):
        case = await find_case(nc, subjects, rid)
        notes = list(case.notes)
        media = []
        if include_media:
            for item, key in _media_refs(case).items():
                if store is None:
                    notes.append(f"image {item[:16]} not exported: no object store configured")
                    continue
                try:
                    data = await asyncio.to_thread(store.get, key, max(1, budget))
                except StoreError as exc:
                    notes.append(f"image {item[:16]} not exported: store error: {exc}")
                    continue
                except EPDError:  # ObjectTooLarge: over what is left of the budget
                    notes.append(f"image {item[:16]} not exported: over the media budget of {max_media_bytes} bytes")
                    continue
                if data is None:
                    notes.append(f"image {item[:16]} not exported: it is no longer in the store ({key})")
                    continue
                budget -= len(data)
                media.append({"item_hash": item, "sha256": hashlib.sha256(data).hexdigest(),
                              "data": base64.b64encode(data).decode()})
        cases.append({
            "request_id": rid,
            "source": case.source,
            "notes": notes,
            "messages": [
                {**m.to_json(), "data": base64.b64encode(m.data).decode()} for m in case.messages
            ],
            "media": media,
        })
    return {"format": CASE_FORMAT, "version": CASE_VERSION, "exported_at": time.time(), "prefix": subjects.prefix,
            "cases": cases}


def write_case_file(doc: dict[str, Any], path: str | Path) -> int:
    data = json.dumps(doc, indent=1, ensure_ascii=False).encode()
    Path(path).write_bytes(data)
    return len(data)


def read_case_file(path: str | Path) -> dict[str, Any]:
    """Read and validate a case file (bounded size, known format, decodable messages)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CaseFileError(f"cannot read case file {path}: {exc}") from exc
    if size > MAX_CASE_FILE_BYTES:
        raise CaseFileError(f"case file {path} is {size} bytes, over the {MAX_CASE_FILE_BYTES}-byte limit")
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CaseFileError(f"case file {path} is not valid JSON: {exc}") from exc
    return validate_case_doc(doc)


def validate_case_doc(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != CASE_FORMAT:
        raise CaseFileError(f"not an {CASE_FORMAT} document")
    if doc.get("version") != CASE_VERSION:
        raise CaseFileError(f"unsupported case file version {doc.get('version')!r} (this tool reads {CASE_VERSION})")
    cases = doc.get("cases")
    if not isinstance(cases, list) or not cases:
        raise CaseFileError("the case file holds no cases")
    for case in cases:
        if not isinstance(case, dict):
            raise CaseFileError("a case is not an object")
        check_request_id(case.get("request_id"))
        messages = case.get("messages")
        if not isinstance(messages, list) or len(messages) > MAX_CASE_MESSAGES:
            raise CaseFileError(f"case {case['request_id']}: 'messages' must be a list of at most "
                                f"{MAX_CASE_MESSAGES}")
        for i, m in enumerate(messages):
            where = f"case {case['request_id']} message {i}"
            if not isinstance(m, dict) or not isinstance(m.get("headers"), dict) or not isinstance(m.get("data"), str):
                raise CaseFileError(f"{where}: needs 'headers' (object) and 'data' (base64)")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in m["headers"].items()):
                raise CaseFileError(f"{where}: headers must map strings to strings")
            try:
                raw = base64.b64decode(m["data"], validate=True)
                protocol.decode(raw)
            except (ValueError, protocol.ProtocolError) as exc:
                raise CaseFileError(f"{where}: not a valid protocol message: {exc}") from exc
            if not isinstance(m.get("stream"), str) or not isinstance(m.get("subject"), str) \
                    or not isinstance(m.get("time"), (int, float)) or not isinstance(m.get("seq"), int):
                raise CaseFileError(f"{where}: needs 'stream', 'subject' (strings), 'time' (number), 'seq' (int)")
        media = case.get("media", [])
        if not isinstance(media, list) or not all(
            isinstance(x, dict) and isinstance(x.get("item_hash"), str) and isinstance(x.get("data"), str)
            and isinstance(x.get("sha256"), str) for x in media
        ):
            raise CaseFileError(f"case {case['request_id']}: 'media' must be a list of "
                                "{item_hash, sha256, data} objects")
    return doc


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    messages: int = 0
    media: int = 0
    notes: list[str] = field(default_factory=list)


async def ensure_imported_stream(nc: NATS, settings: CommonSettings, subjects: Subjects) -> None:
    js = nc.jetstream()
    cfg = StreamConfig(
        name=subjects.stream_imported,
        subjects=[subjects.imported_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.stream_max_age_s,
        max_bytes=settings.stream_max_bytes,
        duplicate_window=min(settings.dup_window_s, settings.stream_max_age_s),
    )
    try:
        await js.add_stream(cfg)
    except BadRequestError:
        await js.update_stream(cfg)


async def import_cases(
    nc: NATS,
    subjects: Subjects,
    settings: CommonSettings,
    doc: dict[str, Any],
    *,
    store: ObjectStore | None = None,
) -> ImportReport:
    """Publish the cases of ``doc`` into ``<P>_IMPORTED`` of this NATS (and their images into this
    store under ``settings.namespace``), so ``show`` and ``run`` find them here. A case whose
    request id is already imported here is skipped."""
    doc = validate_case_doc(doc)
    await ensure_imported_stream(nc, settings, subjects)
    js = nc.jetstream()
    reader = StreamReader(nc)
    report = ImportReport()
    ec_store = ECStore(store, namespace=settings.namespace, fingerprint="-", producer="epd-replay") if store else None
    for case in doc["cases"]:
        rid = case["request_id"]
        if await reader.first(subjects.stream_imported, subjects.imported(rid)) is not None:
            report.skipped.append(rid)
            continue
        for i, m in enumerate(case["messages"]):
            raw = base64.b64decode(m["data"])
            kind = _tag(protocol.decode(raw))
            headers = {k: v for k, v in m["headers"].items() if k.startswith("Epd-") and not k.startswith("Epd-Orig-")}
            headers.update({
                HDR_ORIG_STREAM: m["stream"], HDR_ORIG_SUBJECT: m["subject"], HDR_ORIG_SEQ: str(m["seq"]),
                HDR_ORIG_TIME: f"{float(m['time']):.6f}", protocol.HDR_MSG_ID: f"import-{rid}-{i}",
            })
            await js.publish(subjects.imported(rid, kind), raw, headers=headers)
            report.messages += 1
        for item in case.get("media", []):
            data = base64.b64decode(item["data"])
            if hashlib.sha256(data).hexdigest() != item["sha256"]:
                raise CaseFileError(f"case {rid}: image {item['item_hash'][:16]} does not match its sha256")
            if ec_store is None:
                report.notes.append(f"image {item['item_hash'][:16]} not imported: no object store configured")
                continue
            await asyncio.to_thread(ec_store.store.ensure_bucket)
            await asyncio.to_thread(ec_store.put_media, item["item_hash"], data)
            report.media += 1
        report.imported.append(rid)
    return report
