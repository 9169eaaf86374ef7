"""Queue replay: re-run a recorded request on the live workers and compare, export and import cases.

A request's recorded history (:class:`~shared.history.RequestCase`, ``find_case``,
``list_requests``) is read by the runtime module ``shared.history``, which the API's debug page
uses too; this operator tool builds on it and sends re-runs through the same request client as
the API (``shared.client``).

The case file (``epd replay export``) is JSON, never pickle: every message's exact bytes (base64
MessagePack) and headers, a decoded copy for reading, and - unless ``--no-media`` - the images'
bytes from the store (bounded by ``max_media_bytes``; EC objects are not carried: they belong to
one encoder version and the target cluster recomputes them from the images). Imported cases live
in ``<P>_IMPORTED`` (see ``shared.history``).

Nothing here imports torch: the CLI uses it.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import protocol
from shared.client import RequestClient, Submission, chunk_texts
from shared.config import NatsSettings, ToolSettings
from shared.ec_lifecycle.index import ECIndex
from shared.errors import DeadlineExceeded, EPDError, StoreError
from shared.history import (
    HDR_ORIG_SEQ,
    HDR_ORIG_STREAM,
    HDR_ORIG_SUBJECT,
    HDR_ORIG_TIME,
    MAX_CASE_MESSAGES,
    HistoryError,
    RequestCase,
    StreamReader,
    check_request_id,
    find_case,
    message_kind,
    retention_hint,
)
from shared.jetstream import TRACE_HEADERS, set_trace, subscribe_typed
from shared.protocol import (
    ErrorEvent,
    FinalResult,
    GenerationJob,
    SamplingSpec,
    Subjects,
    TokenChunk,
    WorkerHeartbeat,
)
from shared.store.ec import ECStore
from shared.store.format import media_key as make_media_key
from shared.store.objects import ObjectStore
from shared.topology import Service

log = logging.getLogger(__name__)

MAX_CASE_FILE_BYTES = 256 * 1024**2
DEFAULT_MAX_MEDIA_BYTES = 64 * 1024**2
#: Workers beat every 2 s: waiting this long sees every live worker once.
HEARTBEAT_WINDOW_S = 2.5

CASE_FORMAT = "epd-replay-case"
CASE_VERSION = 1


# -- errors -------------------------------------------------------------------------------------
class ReplayError(HistoryError):
    """A replay operation that cannot be done; the message says why and what to do."""

    code = "replay_error"
    http_status = 500


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


def new_replay_id() -> str:
    return f"replay-{uuid.uuid4().hex}"


# -- live workers -------------------------------------------------------------------------------
async def live_workers(
    nc: NATS, subjects: Subjects, *, wait_s: float, need_role: Service = Service.PREFILL
) -> dict[str, list[WorkerHeartbeat]]:
    """Workers whose heartbeat arrives within ``HEARTBEAT_WINDOW_S`` (longer, up to ``wait_s``,
    while no ``need_role`` worker has beaten)."""
    seen: dict[str, dict[str, WorkerHeartbeat]] = {}
    started = time.time()
    async with await subscribe_typed(nc, subjects.heartbeat_all, WorkerHeartbeat) as sub:
        while True:
            window = HEARTBEAT_WINDOW_S if need_role in seen else max(wait_s, HEARTBEAT_WINDOW_S)
            hb = await sub.next(deadline=started + window)
            if hb is None:
                break
            seen.setdefault(hb.role, {})[hb.worker_id] = hb
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
        return tuple(self.recorded.token_ids) == tuple(self.result.token_ids) and self.recorded.text == self.result.text

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
    stream_replicas: int = 1,
) -> ReplayOutcome:
    """Re-run a recorded request on the live workers under a new request id and collect the result.

    The recorded ``GenerationJob`` is published again with a fresh deadline (and a recorded
    ``ChatRequestRecord`` with ``replay_of`` set, so ``show`` works on the replay too). Images are
    referenced, not carried: with ``store`` given, each one must still be there (its EC object
    for the live encoder version, or its media bytes to encode from), else :class:`MediaExpired`;
    an encode job is queued when the EC object is missing and an encoder is alive, otherwise the
    prefill worker encodes locally. With ``keep_seed`` a request sampled with the worker's derived
    seed keeps it (``protocol.effective_seed`` of the original id), so sampled requests reproduce too.
    ``stream_replicas``: of the EC index bucket, should this call be the one creating it.
    """
    reader = reader or StreamReader(nc)
    case = await find_case(nc, subjects, request_id, reader=reader)
    job = await _replayable_job(case, reader, subjects, request_id)
    notes: list[str] = []
    distinct = list(dict.fromkeys(ref.item_hash for ref in job.images))
    # Images first (cheap, and the clearer error): each needs its media or an EC object.
    stored = await _require_stored_images(store, namespace, job, distinct, request_id, notes)
    fingerprint, encoders = await _live_encoder_version(nc, subjects, job, worker_wait_s, notes)
    if fingerprint != job.fingerprint:
        stored = await _stored_images(store, namespace, fingerprint, distinct, notes)
    sampling = _replay_sampling(job.sampling, request_id, keep_seed=keep_seed, notes=notes)

    replay_id = new_replay_id()
    # The recorded images, re-keyed to this namespace's media; the client queues an encode job for
    # each whose EC object is missing, like the API does, when an encoder of this version is alive.
    images = [msgspec.structs.replace(ref, media_key=make_media_key(namespace, ref.item_hash)) for ref in job.images]
    ec_store = ECStore(store, namespace=namespace, fingerprint=fingerprint, producer="epd-replay") if store else None
    encode = bool(encoders) and stored is not None

    timeout = timeout_s if timeout_s else min(max(job.deadline - job.created_at, 10.0), 3600.0)
    received = time.time()
    ec_index = await ECIndex.open(nc.jetstream(), subjects.ec_index_bucket, replicas=stream_replicas)
    client = RequestClient(nc, subjects, ec_index=ec_index, store=ec_store, source="replay")
    record = case.record
    submission = Submission(
        request_id=replay_id,
        model=job.model,
        messages=job.messages,
        sampling=sampling,
        stream=job.stream,
        received_at=received,
        deadline=received + timeout,
        body=record.body if record else {},
        images=images,
        replay_of=request_id,
        fingerprint=fingerprint,
        prompt=job.prompt,
        tools=job.tools,
    )
    chunks, result = await _run_replay(client, submission, encode=encode, images=len(distinct), timeout=timeout)
    return ReplayOutcome(
        original_id=request_id,
        replay_id=replay_id,
        greedy=sampling.temperature == 0,
        seed=sampling.seed,
        recorded=case.final,
        recorded_error=case.error if case.final is None else None,
        result=result,
        recorded_texts=[m.msg.text for m in case.chunks()],
        replay_texts=chunk_texts(chunks),
        elapsed_s=time.time() - received,
        notes=notes + case.notes,
    )


async def _replayable_job(
    case: RequestCase, reader: StreamReader, subjects: Subjects, request_id: str
) -> GenerationJob:
    """The recorded generation job of ``case``, else :class:`MessagesExpired` saying why it is gone."""
    job = case.generation_job
    if job is None:
        hint = await retention_hint(reader, subjects.stream_generate)
        raise MessagesExpired(
            f"request {request_id} has no generation job left on {subjects.generate_jobs} "
            f"(expired or trimmed), so it cannot be replayed: {hint}"
        )
    return job


async def _require_stored_images(
    store: ObjectStore | None,
    namespace: str,
    job: GenerationJob,
    items: list[str],
    request_id: str,
    notes: list[str],
) -> dict[str, tuple[bool, bool]] | None:
    """:func:`_stored_images` of the recorded encoder version; :class:`MediaExpired` for an image
    with neither its media nor its EC object left."""
    stored = await _stored_images(store, namespace, job.fingerprint, items, notes)
    if stored is not None:
        for item in items:
            if not stored[item][0] and not stored[item][1]:
                raise MediaExpired(
                    f"image {item[:16]} of request {request_id} is no longer in the store (no media object "
                    f"{make_media_key(namespace, item)}, no EC object for encoder {job.fingerprint}): it cannot be "
                    "replayed here. `epd replay export` carries the images of a case for this reason"
                )
    return stored


async def _live_encoder_version(
    nc: NATS, subjects: Subjects, job: GenerationJob, worker_wait_s: float, notes: list[str]
) -> tuple[str, list[WorkerHeartbeat]]:
    """The encoder fingerprint the live prefill workers serve (noted when it changed since the
    recording) and the live encoders of it; :class:`NoLiveWorkers` without a prefill worker."""
    workers = await live_workers(nc, subjects, wait_s=worker_wait_s)
    prefills = workers.get(Service.PREFILL, [])
    if not prefills:
        raise NoLiveWorkers(
            f"no prefill worker heartbeat on {subjects.heartbeat_all} within {worker_wait_s:.0f} s: "
            f"start workers on this NATS with EPD_SUBJECT_PREFIX={subjects.prefix}"
        )
    fingerprint = prefills[0].fingerprint or job.fingerprint
    if fingerprint != job.fingerprint:
        notes.append(
            f"encoder fingerprint changed since the recording ({job.fingerprint} -> {fingerprint}): "
            "a changed model or processor may change the output"
        )
    return fingerprint, [hb for hb in workers.get(Service.ENCODER, []) if hb.fingerprint == fingerprint]


def _replay_sampling(sampling: SamplingSpec, request_id: str, *, keep_seed: bool, notes: list[str]) -> SamplingSpec:
    """The recorded sampling, with the original's derived seed where it sampled without one and
    ``keep_seed``."""
    if sampling.seed is None and sampling.temperature > 0:
        if keep_seed:
            sampling = msgspec.structs.replace(sampling, seed=protocol.effective_seed(request_id, None))
            notes.append(f"sampled without a client seed: replaying with the original's derived seed {sampling.seed}")
        else:
            notes.append("sampled without a client seed and --new-seed: the replay samples with its own seed")
    return sampling


async def _run_replay(
    client: RequestClient, submission: Submission, *, encode: bool, images: int, timeout: float
) -> tuple[list[TokenChunk], FinalResult | ErrorEvent]:
    """Submit the replay and collect its tokens and result (traced as a replay); :class:`ReplayTimeout`
    past its deadline."""
    replay_id, request_id = submission.request_id, submission.replay_of
    trace = set_trace(protocol.STAGE_REPLAY, received_at=submission.received_at)
    try:
        tokens = await client.submit(submission, encode=encode)
        log.info("replaying %s as %s (%d image(s))", request_id, replay_id, images)
        return await tokens.collect()
    except DeadlineExceeded as exc:
        raise ReplayTimeout(
            f"replay {replay_id} of {request_id} produced no result within {timeout:.0f} s; "
            f"inspect it with `epd replay show {replay_id}`"
        ) from exc
    finally:
        TRACE_HEADERS.reset(trace)


async def _stored_images(
    store: ObjectStore | None, namespace: str, fingerprint: str, items: list[str], notes: list[str]
) -> dict[str, tuple[bool, bool]] | None:
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
                media.append(
                    {
                        "item_hash": item,
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "data": base64.b64encode(data).decode(),
                    }
                )
        cases.append(
            {
                "request_id": rid,
                "source": case.source,
                "notes": notes,
                "messages": [{**m.to_json(), "data": base64.b64encode(m.data).decode()} for m in case.messages],
                "media": media,
            }
        )
    return {
        "format": CASE_FORMAT,
        "version": CASE_VERSION,
        "exported_at": time.time(),
        "prefix": subjects.prefix,
        "cases": cases,
    }


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
            raise CaseFileError(f"case {case['request_id']}: 'messages' must be a list of at most {MAX_CASE_MESSAGES}")
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
            if (
                not isinstance(m.get("stream"), str)
                or not isinstance(m.get("subject"), str)
                or not isinstance(m.get("time"), (int, float))
                or not isinstance(m.get("seq"), int)
            ):
                raise CaseFileError(f"{where}: needs 'stream', 'subject' (strings), 'time' (number), 'seq' (int)")
        media = case.get("media", [])
        if not isinstance(media, list) or not all(
            isinstance(x, dict)
            and isinstance(x.get("item_hash"), str)
            and isinstance(x.get("data"), str)
            and isinstance(x.get("sha256"), str)
            for x in media
        ):
            raise CaseFileError(
                f"case {case['request_id']}: 'media' must be a list of {{item_hash, sha256, data}} objects"
            )
    return doc


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    messages: int = 0
    media: int = 0
    notes: list[str] = field(default_factory=list)


async def ensure_imported_stream(nc: NATS, settings: NatsSettings, subjects: Subjects) -> None:
    js = nc.jetstream()
    cfg = StreamConfig(
        name=subjects.stream_imported,
        subjects=[subjects.imported_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.stream_max_age_s,
        max_bytes=settings.stream_max_bytes,
        duplicate_window=min(settings.dup_window_s, settings.stream_max_age_s),
        num_replicas=settings.stream_replicas,
    )
    try:
        await js.add_stream(cfg)
    except BadRequestError:
        await js.update_stream(cfg)


async def import_cases(
    nc: NATS,
    subjects: Subjects,
    settings: ToolSettings,
    doc: dict[str, Any],
    *,
    store: ObjectStore | None = None,
) -> ImportReport:
    """Publish the cases of ``doc`` into ``<P>_IMPORTED`` of this NATS (and their images into this
    store under ``settings.store.namespace``), so ``show`` and ``run`` find them here. A case whose
    request id is already imported here is skipped."""
    doc = validate_case_doc(doc)
    await ensure_imported_stream(nc, settings.nats, subjects)
    js = nc.jetstream()
    reader = StreamReader(nc)
    report = ImportReport()
    ec_store = (
        ECStore(store, namespace=settings.store.namespace, fingerprint="-", producer="epd-replay") if store else None
    )
    for case in doc["cases"]:
        rid = case["request_id"]
        if await reader.first(subjects.stream_imported, subjects.imported(rid)) is not None:
            report.skipped.append(rid)
            continue
        for i, m in enumerate(case["messages"]):
            raw = base64.b64decode(m["data"])
            kind = message_kind(protocol.decode(raw))
            headers = {k: v for k, v in m["headers"].items() if k.startswith("Epd-") and not k.startswith("Epd-Orig-")}
            headers.update(
                {
                    HDR_ORIG_STREAM: m["stream"],
                    HDR_ORIG_SUBJECT: m["subject"],
                    HDR_ORIG_SEQ: str(m["seq"]),
                    HDR_ORIG_TIME: f"{float(m['time']):.6f}",
                    protocol.HDR_MSG_ID: f"import-{rid}-{i}",
                }
            )
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
