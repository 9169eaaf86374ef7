"""A request's history, read back from the JetStream streams: what ``epd replay`` and the API's
debug page show.

The streams use limits retention, so they keep what passed through them (``EPD_STREAM_MAX_AGE_S``,
``EPD_STREAM_MAX_BYTES``). From them this module builds a :class:`RequestCase` (every message of
one request on every stream, decoded, in time order) and lists recent requests. It only reads:
re-running, comparing, exporting and importing cases is the replay tool's
(``shared.tools.replay``), which builds on this module.

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

Runtime library: no torch, nothing from ``shared.tools``.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeGuard, TypeVar, overload

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared import protocol
from shared.errors import Cancelled, EPDError
from shared.protocol import (
    ChatRequestRecord,
    EncodeJob,
    ErrorEvent,
    FinalResult,
    GenerationJob,
    Subjects,
    TokenChunk,
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
MAX_REQUEST_ID_CHARS = 200

#: Headers of an imported message: where and when the original was stored.
HDR_ORIG_STREAM = "Epd-Orig-Stream"
HDR_ORIG_SUBJECT = "Epd-Orig-Subject"
HDR_ORIG_SEQ = "Epd-Orig-Seq"
HDR_ORIG_TIME = "Epd-Orig-Time"

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_\-]+")  # fullmatch: "$" would accept a trailing newline


# -- errors -------------------------------------------------------------------------------------
class HistoryError(EPDError):
    """A request's history cannot be read; the message says why and what to do."""

    code = "replay_error"
    http_status = 500


class InvalidRequestId(HistoryError):
    code = "invalid_request_id"
    http_status = 400
    error_type = "invalid_request_error"


class RequestNotFound(HistoryError):
    """No message of the request on any stream: an unknown id, or its messages expired."""

    code = "request_not_found"
    http_status = 404
    error_type = "invalid_request_error"


def check_request_id(request_id: Any) -> str:
    """A request id is one NATS subject token: letters, digits, ``-`` and ``_``."""
    if (
        not isinstance(request_id, str)
        or not request_id
        or len(request_id) > MAX_REQUEST_ID_CHARS
        or not _REQUEST_ID_RE.fullmatch(request_id)
    ):
        raise InvalidRequestId(
            f"invalid request id {request_id!r:.80}: expected letters, digits, '-' or '_' "
            f"(at most {MAX_REQUEST_ID_CHARS} characters), e.g. chatcmpl-0123abcd..."
        )
    return request_id


def iso_time(ts: float | None) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _stamp(raw: Any) -> float:
    """The unix time JetStream stored a raw message at (0.0 if the server did not say)."""
    return raw.time.timestamp() if raw.time is not None else 0.0


def message_kind(msg: Any) -> str:
    """The tag of a protocol message (``token_chunk``, ...)."""
    return type(msg).__struct_config__.tag


# -- messages and cases -------------------------------------------------------------------------
#: What a stored message carries: ``protocol.Message | None`` as read (None: undecodable), one
#: message class in what ``RequestCase.of(SomeClass)`` returns.
_Msg_co = TypeVar("_Msg_co", bound="protocol.Message | None", covariant=True)
_M = TypeVar("_M", bound=protocol.Message)


@dataclass(frozen=True)
class StreamMessage(Generic[_Msg_co]):
    """One stored message: where it is, when JetStream stored it, its headers and payload.
    ``StreamMessage[ECReady]``: one whose payload is an ``ECReady`` (``RequestCase.of(ECReady)``)."""

    stream: str
    seq: int
    subject: str
    time: float
    headers: dict[str, str]
    data: bytes
    msg: _Msg_co
    error: str = ""
    imported: bool = False

    @classmethod
    def build(
        cls,
        stream: str,
        seq: int,
        subject: str,
        time_: float,
        headers: dict[str, str] | None,
        data: bytes | None,
        *,
        imported: bool = False,
    ) -> Stored:
        data = data or b""
        msg: protocol.Message | None
        try:
            msg, error = protocol.decode(data), ""
        except protocol.ProtocolError as exc:
            msg, error = None, str(exc)
        return StreamMessage(stream, seq, subject, time_, dict(headers or {}), data, msg, error, imported)

    def carrying(self, msg: _M) -> StreamMessage[_M]:
        """This message with another payload (a ``FinalResult``'s ``last_chunk`` as a chunk of its own)."""
        return StreamMessage(
            self.stream, self.seq, self.subject, self.time, self.headers, self.data, msg, self.error, self.imported
        )

    @property
    def kind(self) -> str:
        if self.msg is not None:
            return message_kind(self.msg)
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


#: A message as read from a stream: any protocol message, or None (undecodable: ``error`` says why).
Stored = StreamMessage[protocol.Message | None]


def holds(m: Stored, kind: type[_M]) -> TypeGuard[StreamMessage[_M]]:
    """Whether ``m``'s payload is a ``kind`` (and ``m`` so a ``StreamMessage[kind]``)."""
    return isinstance(m.msg, kind)


class RequestStatus(enum.StrEnum):
    """How a recorded request ended (``Summary.status``, in ``epd replay list`` and its JSON;
    ``epd replay list --status``)."""

    OK = "ok"
    ERROR = "error"
    #: ended with a ``Cancelled`` error event (the caller gave up)
    CANCELLED = "cancelled"
    #: no terminal event (yet)
    INCOMPLETE = "incomplete"


#: The status values, in order (``epd replay list --status`` choices).
STATUSES = tuple(s.value for s in RequestStatus)


@dataclass(frozen=True)
class Summary:
    """One line of ``epd replay list``."""

    request_id: str
    received_at: float
    status: str  # a RequestStatus
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
    messages: list[Stored]
    source: str = "live"  # live | imported
    notes: list[str] = field(default_factory=list)

    @overload
    def of(self, kind: type[_M], /) -> list[StreamMessage[_M]]: ...
    @overload
    def of(self, *kinds: type[protocol.Message]) -> list[StreamMessage[protocol.Message]]: ...
    def of(self, *kinds: type) -> list[StreamMessage[Any]]:
        """The messages whose payload is one of ``kinds``, in time order; typed by the class asked
        for when one is (``of(ECReady)``: ``StreamMessage[ECReady]``), as ``protocol.decode``."""
        return [m for m in self.messages if isinstance(m.msg, kinds)]

    def _own(self, kind: type[_M]) -> list[_M]:
        return [m.msg for m in self.of(kind) if getattr(m.msg, "request_id", None) == self.request_id]

    @property
    def record(self) -> ChatRequestRecord | None:
        own = self._own(ChatRequestRecord)
        return own[0] if own else None

    @property
    def generation_job(self) -> GenerationJob | None:
        """The job the API published (a re-prefill's job has ``reprefill`` > 0)."""
        jobs = self._own(GenerationJob)
        jobs.sort(key=lambda j: j.reprefill)
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
    def terminal(self) -> StreamMessage[protocol.Message] | None:
        """The message that ended the request (its FinalResult or ErrorEvent), if any."""
        ends = [m for m in self.of(FinalResult, ErrorEvent) if m.request_id == self.request_id]
        return ends[-1] if ends else None

    def token_chunks(self) -> list[StreamMessage[TokenChunk]]:
        """Every token chunk of the request as stored, a chunk that came with a ``FinalResult``
        (``FinalResult.last_chunk``) included: as a message of its own, at its result's place."""
        chunks: list[StreamMessage[TokenChunk]] = []
        for m in self.of(TokenChunk, FinalResult):
            if m.request_id != self.request_id:
                continue
            if holds(m, TokenChunk):
                chunks.append(m)
            elif isinstance(m.msg, FinalResult) and m.msg.last_chunk is not None:
                chunks.append(m.carrying(m.msg.last_chunk))
        return chunks

    def chunks(self) -> list[StreamMessage[TokenChunk]]:
        """Token chunks of the last attempt (a redelivered job restarts at seq 0), in token order,
        the first copy of each seq (a chunk a worker published again, after an election, is
        stored after the chunks sent behind it; a copy may have been stored after all)."""
        chunks = self.token_chunks()
        if not chunks:
            return []
        last = max(m.msg.attempt for m in chunks)
        by_seq: dict[int, StreamMessage[TokenChunk]] = {}
        for m in chunks:
            if m.msg.attempt == last:
                by_seq.setdefault(m.msg.seq, m)
        return [by_seq[seq] for seq in sorted(by_seq)]

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
        first = min((m.time for m in self.token_chunks()), default=None)
        end = self.terminal
        images = len(record.images) if record else (len(self.generation_job.images) if self.generation_job else 0)
        if final is not None:
            status = RequestStatus.OK
        elif error is not None:
            status = RequestStatus.CANCELLED if error.code == Cancelled.code else RequestStatus.ERROR
        else:
            status = RequestStatus.INCOMPLETE
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

    async def last(self, stream: str, subject: str) -> Stored | None:
        """The last message on ``subject`` (one request to the server, no scan)."""
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return StreamMessage.build(stream, raw.seq or 0, raw.subject or subject, _stamp(raw), raw.headers, raw.data)

    async def first(self, stream: str, subject: str, from_seq: int = 1) -> Stored | None:
        """The first message on ``subject`` at or after ``from_seq`` (the server's subject index)."""
        try:
            raw = await self.js.get_msg(stream, seq=max(1, from_seq), subject=subject, next=True)
        except NotFoundError:
            return None
        return StreamMessage.build(stream, raw.seq or 0, raw.subject or subject, _stamp(raw), raw.headers, raw.data)

    async def by_seq(self, stream: str, seq: int) -> Stored | None:
        try:
            raw = await self.js.get_msg(stream, seq)
        except NotFoundError:
            return None
        return StreamMessage.build(stream, raw.seq or seq, raw.subject or "", _stamp(raw), raw.headers, raw.data)

    async def scan(
        self,
        stream: str,
        subject: str,
        *,
        start: float | None = None,
        until: float | None = None,
        match: Callable[[Stored], bool] | None = None,
        limit: int = MAX_CASE_MESSAGES,
    ) -> list[Stored]:
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
            cfg.opt_start_time = dt.datetime.fromtimestamp(max(0.0, start), dt.UTC)
        try:
            psub = await self.js.pull_subscribe(subject, stream=stream, config=cfg)
        except NotFoundError:  # no such stream (e.g. a topology without it)
            return []
        out: list[Stored] = []
        examined = 0
        try:
            pending = (await psub.consumer_info()).num_pending or 0
            while pending > 0:
                if examined >= self.max_scan:
                    self.notes.append(
                        f"scan of {stream} ({subject}) stopped after {examined} messages "
                        f"(bound {self.max_scan}); later messages are not shown"
                    )
                    break
                try:
                    msgs = await psub.fetch(min(FETCH_BATCH, pending), timeout=self.timeout)
                except TimeoutError:  # nats' TimeoutError subclasses it
                    break
                done = False
                for m in msgs:
                    examined += 1
                    meta = m.metadata
                    pending = meta.num_pending
                    sm = StreamMessage.build(
                        stream, meta.sequence.stream, m.subject, meta.timestamp.timestamp(), m.headers, m.data
                    )
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
            except Exception as exc:  # noqa: BLE001 - the consumer goes away by itself after inactive_threshold
                log.debug("could not delete scan consumer: %s", exc)
        return out


async def retention_hint(reader: StreamReader, stream: str) -> str:
    """How long ``stream`` keeps messages and what it holds now (for "not found" errors)."""
    info = await reader.stream_info(stream)
    if info is None:
        return f"stream {stream} does not exist on this NATS server (wrong --prefix / EPD_SUBJECT_PREFIX?)"
    state, cfg = info.state, info.config
    age = f"{cfg.max_age:.0f} s" if cfg.max_age else "unlimited time"
    if not state.messages:
        return f"{stream} keeps messages for {age} and is empty now"
    first = await reader.by_seq(stream, state.first_seq)
    return (
        f"{stream} keeps messages for {age} (max {cfg.max_bytes} bytes) and now holds {state.messages} "
        f"from {iso_time(first.time if first else None)} on"
    )


async def find_case(
    nc: NATS, subjects: Subjects, request_id: str, *, reader: StreamReader | None = None, include_imported: bool = True
) -> RequestCase:
    """Every message of ``request_id``; the live streams first, then imported cases.

    Raises :class:`RequestNotFound` (with the streams' retention, so "expired" and "unknown" can be
    told apart by the reader) when neither has a message of it."""
    check_request_id(request_id)
    reader = reader or StreamReader(nc)
    case = await _find_live(reader, subjects, request_id)
    if case is None and include_imported:
        case = await _find_imported(reader, subjects, request_id)
    if case is None:
        hint = await retention_hint(reader, subjects.stream_requests)
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
    messages: list[Stored] = ([record] if record else []) + results
    case = RequestCase(rid, messages)
    received = case.received_at
    terminal = case.terminal
    end = terminal.time if terminal is not None else time.time()
    start, until = received - WINDOW_SLACK_S, end + WINDOW_SLACK_S

    def belongs(m: Stored) -> bool:
        return m.request_id == rid

    skip = {subjects.stream_requests, subjects.stream_results, subjects.stream_events}
    for stream, subjs in subjects.streams().items():
        if stream in skip:
            continue
        for subject in subjs:
            messages += await reader.scan(stream, subject, start=start, until=until, match=belongs)
    case.messages = messages

    def relevant(m: Stored) -> bool:  # another request's event counts if it came while this one ran
        return m.request_id == rid or m.time >= received

    for item in case.item_hashes():  # events of the request's images, whoever's job produced them
        messages += await reader.scan(
            subjects.stream_events, subjects.ec_item_events(item), start=start, until=until, match=relevant
        )
    if record is None:
        case.notes.append(
            f"no record of the request on {subjects.request(rid)} (expired, or the API could not "
            "record it): body and images unknown"
        )
    if terminal is None:
        case.notes.append(
            "no final result or error on the tokens subject: the request is running, was lost, "
            "or the API gave up (deadline)"
        )
    case.messages = ordered(messages)
    return case


def ordered(messages: list[Stored]) -> list[Stored]:
    """``messages`` without repeats (same stream and seq), in stored-time order."""
    seen: set[tuple[str, int]] = set()
    out = []
    for m in messages:
        if (m.stream, m.seq) not in seen:
            seen.add((m.stream, m.seq))
            out.append(m)
    out.sort(key=lambda m: (m.time, _float(m.headers.get(protocol.HDR_SENT_AT)) or 0.0, m.seq))
    return out


def _from_imported(m: Stored) -> Stored:
    h = m.headers
    orig_time = _float(h.get(HDR_ORIG_TIME)) or m.time
    orig_seq = int(_float(h.get(HDR_ORIG_SEQ)) or 0)
    headers = {k: v for k, v in h.items() if not k.startswith("Epd-Orig-") and k != protocol.HDR_MSG_ID}
    return StreamMessage(
        h.get(HDR_ORIG_STREAM, m.stream),
        orig_seq,
        h.get(HDR_ORIG_SUBJECT, m.subject),
        orig_time,
        headers,
        m.data,
        m.msg,
        m.error,
        imported=True,
    )


async def _find_imported(reader: StreamReader, subjects: Subjects, rid: str) -> RequestCase | None:
    raw = await reader.scan(subjects.stream_imported, subjects.imported(rid))
    if not raw:
        return None
    case = RequestCase(rid, ordered([_from_imported(m) for m in raw]), source="imported")
    case.notes.append(f"imported case (stream {subjects.stream_imported}); times are the original cluster's")
    return case


# -- list ---------------------------------------------------------------------------------------
async def list_requests(
    nc: NATS,
    subjects: Subjects,
    *,
    since_s: float = 3600.0,
    status: str | None = None,
    limit: int = 20,
    reader: StreamReader | None = None,
) -> list[Summary]:
    """The newest requests first, received within ``since_s``: walks ``<P>_REQUESTS`` backwards
    by sequence (no scan) and reads each request's first and last result message directly."""
    if status not in (None, *STATUSES):
        raise HistoryError(f"unknown status {status!r}: use {', '.join(STATUSES)}")
    limit = max(1, min(int(limit), MAX_LIST_LIMIT))
    reader = reader or StreamReader(nc)
    stream = subjects.stream_requests
    info = await reader.stream_info(stream)
    if info is None:
        raise RequestNotFound(await retention_hint(reader, stream))
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
        if not holds(sm, ChatRequestRecord):
            continue
        summary = await _quick_summary(reader, subjects, sm)
        if status is None or summary.status == status:
            out.append(summary)
    return out


async def _quick_summary(
    reader: StreamReader, subjects: Subjects, record_msg: StreamMessage[ChatRequestRecord]
) -> Summary:
    record = record_msg.msg
    subject = subjects.tokens(record.request_id)
    last = await reader.last(subjects.stream_results, subject)
    first = await reader.first(subjects.stream_results, subject) if last is not None else None
    messages: list[Stored] = [record_msg, *(m for m in (first, last) if m is not None)]
    return RequestCase(record.request_id, ordered(messages)).summary()
