"""The wire schema: every message on NATS, every subject and stream name, in one place.

Messages are frozen, versioned ``msgspec`` structs encoded as MessagePack. They carry object
references, never tensors: encoder outputs and images live in the object store.

Versioning: each struct has a class-level ``SCHEMA`` version and a tag (``kind``) so a reader can
tell what it got. A reader refuses a message whose ``v`` is newer than it knows
(``ProtocolError``); fields added later must have defaults so older messages still decode.

Subjects (``<prefix>`` defaults to ``epd``; one prefix per deployment):

=================================  ===================  ============================================
subject                            stream               message
=================================  ===================  ============================================
<p>.requests.<request_id>          <P>_REQUESTS         ChatRequestRecord (what the API received)
<p>.encode.jobs                    <P>_ENCODE           EncodeJob (work; consumer "encoder")
<p>.ec.ready.<fp>.<item>           <P>_EVENTS           ECReady (an EC object was written)
<p>.ec.failed.<fp>.<item>          <P>_EVENTS           ECFailed (an encode job gave up)
<p>.ec.invalidated.<fp>            <P>_EVENTS (core)    ECInvalidated (EC objects were evicted / purged)
<p>.generate.jobs                  <P>_GENERATE         GenerationJob (work; consumer "prefill")
<p>.generate.routed.<worker>       <P>_GENERATE         GenerationJob routed to one worker (consumer
                                                        "prefill-routed-<worker>"; ``shared.routed_jobs``)
<p>.decode.jobs                    <P>_DECODE           DecodeJob (work; consumer "decode"; E|P|D)
<p>.tokens.<request_id>            <P>_RESULTS          TokenChunk / FinalResult / ErrorEvent
<p>.control.cancel.<request_id>    <P>_CONTROL          RequestCancelled (the caller gave up)
<p>.control.wanted.<fp>.<item>     <P>_CONTROL          ECWanted (a request waits on another's encode job)
<p>.workers.heartbeat.<role>       (core NATS only)     WorkerHeartbeat
<p>.imported.<request_id>.<kind>   <P>_IMPORTED         any of the above (``epd replay import``)
=================================  ===================  ============================================

Headers on every message: ``Epd-Request-Id``, ``Epd-Kind``, ``Epd-Sent-At``, and the trace headers
``Epd-Stage`` (the publishing service), ``Epd-Received-At`` (when the API received the request) and,
from workers, ``Epd-Started-At`` (when the worker took the job it publishes for).

Streams use limits retention (not work-queue) so they keep what passed through them for replay.

Key-value buckets: ``<P>_EC_INDEX`` (EC objects, ``shared.ec_lifecycle.index``), ``<P>_ROUTING_CLAIMS``
(who runs a routed generation job: the claims of ``shared.routed_jobs``) and ``<P>_EC_CLAIMS`` (who encodes
an item: an encoder or a generating worker stealing its job, ``shared.ec_lifecycle.claims``).
"""

from __future__ import annotations

import enum
import time
import zlib
from collections.abc import Mapping
from typing import Any, TypeVar, overload

import msgspec

from shared.errors import EPDError

#: The newest message schema this code reads. Messages default to v1; the jobs that carry a
#: ``SamplingSpec`` are v2 since its shape grew (penalties, logprobs, ...): a v1 worker refuses them
#: with a ProtocolError instead of silently sampling without the new fields. A ``GenerationJob``
#: whose messages hold a tool conversation is v3 (:data:`TOOL_MESSAGES_SCHEMA`), a ``FinalResult``
#: that carries its request's last chunk v4 (:data:`LAST_CHUNK_SCHEMA`).
PROTOCOL_VERSION = 4

# Nats headers -------------------------------------------------------------------------------
HDR_MSG_ID = "Nats-Msg-Id"
HDR_REQUEST_ID = "Epd-Request-Id"
HDR_KIND = "Epd-Kind"
HDR_SENT_AT = "Epd-Sent-At"
# Trace headers (``shared.jetstream.trace``): which service published, when the request reached
# the API, and when the publishing worker took the job it was working on. With the stream's own
# timestamp they let ``epd replay show`` draw a request's timeline from the messages alone.
HDR_STAGE = "Epd-Stage"
HDR_RECEIVED_AT = "Epd-Received-At"
HDR_STARTED_AT = "Epd-Started-At"
#: ``Epd-Stage`` of what ``epd replay`` publishes (the services put their ``shared.topology.Service``).
STAGE_REPLAY = "replay"

# Durable consumer names ---------------------------------------------------------------------
CONSUMER_ENCODER = "encoder"
CONSUMER_PREFILL = "prefill"
CONSUMER_DECODE = "decode"
#: Name prefix of a generating worker's own durable consumer of the jobs routed to it
#: (:meth:`Subjects.routed_consumer`).
CONSUMER_ROUTED_PREFIX = "prefill-routed-"

#: Queue group of the supervisors (one in every API process) that turn JetStream's
#: MAX_DELIVERIES advisories into terminal events: NATS hands each advisory to one member, so N
#: API replicas publish one event, not N (the event's msg id also dedups it in the stream).
QUEUE_SUPERVISOR = "epd-supervisor"
#: Queue group of the API processes that index the EC objects encoders announce (``ECReady``):
#: one replica records each announcement in the EC index.
QUEUE_EC_INDEX = "epd-ec-index"


# Closed sets of wire strings ----------------------------------------------------------------
# ``StrEnum``: a member *is* its string - msgspec encodes it as the value, and ``str()`` /
# ``format()`` give the value too (a ``(str, Enum)`` formats as ``Class.MEMBER``), so metric
# labels, f-strings and JSON carry the same bytes as the literals these replaced. The struct
# fields that hold them stay typed ``str``: old messages decode as before, and a value a newer
# peer adds still decodes (kept as the plain string) instead of failing the whole message.
# ``tests/test_wire_enums.py`` pins every value.


class MediaKind(enum.StrEnum):
    """What a media item of a request is: an image, or a video (its sampled frames)."""

    IMAGE = "image"
    VIDEO = "video"


class ECSource(enum.StrEnum):
    """Where a request's image features came from: the values of ``FinalResult.ec_sources`` /
    ``DecodeJob.ec_sources`` (item hash -> source), read by the timeline, replay and bench.
    ``RECOMPUTED`` travels as ``recomputed:<reason>`` (:func:`recomputed`)."""

    #: the generating worker's in-memory feature cache
    LOCAL_CACHE = "local_cache"
    #: encoded in process (role ``agg``: no store, no encoder workers)
    LOCAL = "local"
    #: loaded from the EC store
    STORE = "store"
    #: encoded again by the generating worker (``recomputed:<reason>``, a ``MissReason`` value)
    RECOMPUTED = "recomputed"
    #: handed to a vLLM engine whose EC connector loads it (replaced by the engine's report)
    CONNECTOR = "connector"
    #: vLLM still held the item (encoder or prefix cache); the connector was not asked
    ENGINE_CACHE = "engine_cache"
    #: encoded by the generating worker in place of its queued encode job, then stored and
    #: announced (``EPD_ENCODE_STEALS``; ``shared.ec_lifecycle.claims``)
    STOLEN = "stolen"


def recomputed(reason: str) -> str:
    """The wire value of a recomputation: ``recomputed:<reason>`` (``ECSource`` / ``kv_source``)."""
    return f"{ECSource.RECOMPUTED.value}:{reason}"


def recompute_reason(source: str) -> str | None:
    """``<reason>`` of a ``recomputed:<reason>`` source (``"unknown"`` when empty); None for
    any other source."""
    kind, _, reason = source.partition(":")
    return (reason or "unknown") if kind == ECSource.RECOMPUTED else None


class Timing(enum.StrEnum):
    """The keys of ``FinalResult.timings`` / ``DecodeJob.timings`` (seconds unless said; the
    timeline and ``epd bench`` read them)."""

    #: job taken -> every image's features ready
    FEATURES = "features_s"
    #: features ready -> an engine slot (``shared.admission``)
    ADMISSION = "admission_s"
    PREFILL = "prefill_s"
    DECODE = "decode_s"
    #: job taken -> first token (prefill worker)
    FIRST_TOKEN = "first_token_s"
    #: job taken -> last token (prefill worker, E|PD)
    TOTAL = "total_s"
    #: E|P|D: decode job taken -> the decode worker's first token
    DECODE_FIRST_TOKEN = "decode_first_token_s"
    # not seconds: facts of the E|P|D decode worker (floats, like the rest of the dict)
    #: size of the KV object loaded
    KV_BYTES = "kv_bytes"
    #: the most rows of a decode step this request was part of
    DECODE_BATCH_ROWS_MAX = "decode_batch_rows_max"


#: The timings a prefill worker measures (in E|P|D they travel in the ``DecodeJob``).
PREFILL_TIMINGS = (Timing.FEATURES, Timing.ADMISSION, Timing.PREFILL)


class EvictionReason(enum.StrEnum):
    """Why EC objects were removed from the store: ``ECInvalidated.reason`` and the ``reason``
    label of ``epd:ec_evictions_total`` (``shared.ec_lifecycle.janitor``, ``epd ec purge``)."""

    #: the namespace was over ``EPD_EC_MAX_BYTES`` (least recently used first)
    BYTES = "bytes"
    #: the namespace was over ``EPD_EC_MAX_OBJECTS``
    OBJECTS = "objects"
    #: unused for ``EPD_EC_TTL_S``
    TTL = "ttl"
    #: of a fingerprint retired for ``EPD_EC_PURGE_RETIRED_AFTER_S``
    RETIRED = "retired"
    #: ``epd ec purge``
    PURGE = "purge"
    #: indexed, but no longer in the store (removed behind the index's back)
    GONE = "gone"


class StageName(enum.StrEnum):
    """The names of a request's timeline stages (``shared.timeline``, which says what each one
    is): the ``name`` of each stage in ``/debug/requests/<id>?format=json`` and ``epd replay show``,
    what ``epd bench`` reads back and books time under. Here, not in ``shared.timeline``, because
    they are read across processes and by the tools without the transport (nats) imports."""

    RECEIVED = "received"
    IMAGE_INTAKE = "image intake"
    NO_ENCODE_JOB = "no encode job"
    ENCODE_DEDUPLICATED = "encode deduplicated"
    ENCODE_QUEUED = "encode queued"
    ENCODE = "encode"
    EC_STORED = "EC stored"
    EC_ANNOUNCED = "EC announced"
    ENCODE_FAILED = "encode failed"
    GENERATION_QUEUED = "generation queued"
    REPREFILL_QUEUED = "re-prefill queued"
    EC_FROM_LOCAL_CACHE = "EC from local cache"
    EC_LOADED_FROM_STORE = "EC loaded from store"
    EC_RECOMPUTED = "EC recomputed locally"
    EC_ENCODED_IN_PROCESS = "EC encoded in process"
    WAITING_FOR_SLOT = "waiting for an engine slot"
    PREFILL = "prefill"
    FIRST_TOKEN = "first token"
    REDELIVERED = "redelivered"
    KV_HANDOFF = "KV hand-off"
    DECODE_QUEUED = "decode queued"
    DECODE = "decode"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"


class WorkQueue(enum.StrEnum):
    """The work streams workers consume (one durable consumer each): a handler's ``queue``, the
    ``stream`` label of ``epd:queue_time_seconds``. :meth:`Subjects.work_stream` names its stream."""

    ENCODE = "encode"
    GENERATE = "generate"
    DECODE = "decode"


#: The work queue and shared durable consumer of each worker service, by its ``Service`` value:
#: what the API's scaling signal polls and the Kubernetes KEDA triggers name (a generating worker's
#: own routed consumers, ``CONSUMER_ROUTED_PREFIX``, come on top in the queue ``generate``).
WORK_CONSUMERS: dict[str, tuple[WorkQueue, str]] = {
    "encoder": (WorkQueue.ENCODE, CONSUMER_ENCODER),
    "prefill": (WorkQueue.GENERATE, CONSUMER_PREFILL),
    "decode": (WorkQueue.DECODE, CONSUMER_DECODE),
}


class RouteReason(enum.StrEnum):
    """Why the API sent a generation job where it did: the ``reason`` label of
    ``epd:routing_decisions_total`` and ``GenerationJob.route_reason`` (``shared.routing``)."""

    #: routed to the worker that holds (most of) the request's images
    AFFINITY = "affinity"
    #: routed to the least loaded worker: a worker holding its images was full or too loaded
    LOAD = "load"
    #: the routed worker did not claim it in time, or its heartbeat stopped: sent to the shared queue
    FALLBACK = "fallback"
    #: no images, or no live worker holds any of them: the shared queue
    NO_AFFINITY = "no_affinity"


def route_token(worker_id: str) -> str:
    """A worker id as one subject token and consumer-name part: kept when it is made of
    ``[A-Za-z0-9_-]`` only, else those characters plus a checksum of the id (two ids never share one)."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in worker_id)
    if safe == worker_id and safe:
        return safe
    return f"{safe[:48]}_{zlib.crc32(worker_id.encode()):08x}"


class ProtocolError(ValueError):
    """A message that cannot be decoded or has an unknown/newer schema."""


def kv_stream(bucket: str) -> str:
    """The JetStream stream that holds key-value bucket ``bucket``."""
    return f"KV_{bucket}"


def kv_key_subject_prefix(bucket: str) -> str:
    """The subject prefix of bucket ``bucket``'s keys (the key follows it)."""
    return f"$KV.{bucket}."


#: NATS's own subject spaces that the per-role permissions name (``shared.nats_auth``): the
#: JetStream API, acknowledgements, flow control.
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
JS_FC = "$JS.FC"


class Subjects:
    """Subject and stream names for one deployment prefix."""

    def __init__(self, prefix: str = "epd"):
        if not prefix or any(c in prefix for c in ".*> "):
            raise ValueError(f"invalid subject prefix {prefix!r}")
        self.prefix = prefix
        p = prefix
        P = prefix.upper().replace("-", "_")
        self.requests_all = f"{p}.requests.>"
        self.encode_jobs = f"{p}.encode.jobs"
        self.ec_events_all = f"{p}.ec.>"
        self.generate_jobs = f"{p}.generate.jobs"
        #: Every generation job routed to one worker (``shared.routed_jobs``; :meth:`generate_routed`).
        self.generate_routed_all = f"{p}.generate.routed.*"
        self.decode_jobs = f"{p}.decode.jobs"
        self.tokens_all = f"{p}.tokens.>"
        self.heartbeat_all = f"{p}.workers.heartbeat.>"
        self.control_all = f"{p}.control.>"
        #: Every cancellation (one token per request id): what a worker listens to for its running jobs.
        self.cancel_all = f"{p}.control.cancel.*"
        # Cases imported by ``epd replay import`` (not in ``streams()``: only the replay tool
        # creates it; no worker consumes it, so imported jobs are never executed by accident).
        self.imported_all = f"{p}.imported.>"
        self.stream_imported = f"{P}_IMPORTED"
        #: EC store lifecycle (``shared.ec_lifecycle.index``): every invalidation, and the JetStream
        #: key-value bucket that indexes EC objects (size, last use) and holds the janitor lease.
        self.ec_invalidated_all = f"{p}.ec.invalidated.>"
        #: Every ``ECReady`` (the API indexes what encoders announce).
        self.ec_ready_all = f"{p}.ec.ready.>"
        self.ec_index_bucket = f"{P}_EC_INDEX"
        #: Claims of routed generation jobs: which worker runs each (``shared.routed_jobs``).
        self.routing_bucket = f"{P}_ROUTING_CLAIMS"
        #: Who computes an item's encoder output: an encoder or a stealing generating worker
        #: (``shared.ec_lifecycle.claims``).
        self.ec_claims_bucket = f"{P}_EC_CLAIMS"
        #: Every write to a routing claim (core NATS sees the bucket's puts: new ones only).
        self.routing_claims_all = kv_key_subject_prefix(self.routing_bucket) + ">"

        self.stream_requests = f"{P}_REQUESTS"
        self.stream_encode = f"{P}_ENCODE"
        self.stream_events = f"{P}_EVENTS"
        self.stream_generate = f"{P}_GENERATE"
        self.stream_decode = f"{P}_DECODE"
        self.stream_results = f"{P}_RESULTS"
        self.stream_control = f"{P}_CONTROL"

    def work_stream(self, queue: WorkQueue) -> str:
        """The stream of a work queue's jobs (``<P>_ENCODE`` / ``<P>_GENERATE`` / ``<P>_DECODE``)."""
        streams = {
            WorkQueue.ENCODE: self.stream_encode,
            WorkQueue.GENERATE: self.stream_generate,
            WorkQueue.DECODE: self.stream_decode,
        }
        return streams[queue]

    def request(self, request_id: str) -> str:
        return f"{self.prefix}.requests.{request_id}"

    def generate_routed(self, worker_id: str) -> str:
        """Where the API publishes a generation job routed to ``worker_id`` (``shared.routed_jobs``)."""
        return f"{self.prefix}.generate.routed.{route_token(worker_id)}"

    @staticmethod
    def routed_consumer(worker_id: str) -> str:
        """The durable consumer of ``worker_id``'s routed jobs (in ``<P>_GENERATE``)."""
        return CONSUMER_ROUTED_PREFIX + route_token(worker_id)

    def ec_ready(self, fingerprint: str, item_hash: str) -> str:
        return f"{self.prefix}.ec.ready.{fingerprint}.{item_hash}"

    def ec_failed(self, fingerprint: str, item_hash: str) -> str:
        return f"{self.prefix}.ec.failed.{fingerprint}.{item_hash}"

    def ec_any(self, fingerprint: str, item_hash: str) -> str:
        """Both the ready and the failed event of one item."""
        return f"{self.prefix}.ec.*.{fingerprint}.{item_hash}"

    def ec_item_events(self, item_hash: str) -> str:
        """Every ready and failed event of one item, whatever the fingerprint (a request's history)."""
        return f"{self.prefix}.ec.*.*.{item_hash}"

    def ec_invalidated(self, fingerprint: str) -> str:
        """Where the janitor / ``epd ec purge`` announce removed EC objects of ``fingerprint``."""
        return f"{self.prefix}.ec.invalidated.{fingerprint}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}.tokens.{request_id}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}.control.cancel.{request_id}"

    def ec_wanted(self, fingerprint: str, item_hash: str) -> str:
        return f"{self.prefix}.control.wanted.{fingerprint}.{item_hash}"

    def heartbeat(self, role: str) -> str:
        return f"{self.prefix}.workers.heartbeat.{role}"

    @staticmethod
    def max_deliveries_advisory(stream: str, consumer: str) -> str:
        """JetStream's advisory that a message of ``stream`` exhausted ``consumer``'s deliveries."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"

    def imported(self, request_id: str, kind: str = "*") -> str:
        """An imported message of a request (``kind``: the message tag; ``*`` for all of them)."""
        return f"{self.prefix}.imported.{request_id}.{kind}"

    def streams(self) -> dict[str, list[str]]:
        """Stream name -> subjects, for idempotent creation at start-up."""
        return {
            self.stream_requests: [self.requests_all],
            self.stream_encode: [self.encode_jobs],
            self.stream_events: [self.ec_events_all],
            self.stream_generate: [self.generate_jobs, self.generate_routed_all],
            self.stream_decode: [self.decode_jobs],
            self.stream_results: [self.tokens_all],
            self.stream_control: [self.control_all],
        }


# Messages -----------------------------------------------------------------------------------
class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    v: int = 1


class ImageRef(msgspec.Struct, frozen=True, kw_only=True):
    """One distinct media item of a request - an image, or a video's sampled frames (``kind``) -:
    its content hash and where its bytes are stored (an image's file; a video's frames as a
    tensor object, ``shared.store.format.encode_video_frames``)."""

    item_hash: str
    media_key: str
    width: int
    height: int
    #: False when the API found the EC object already stored and queued no encode job, so a
    #: worker that then misses in the store must not wait for an encoder.
    encode_queued: bool = True
    #: a :class:`MediaKind` value
    kind: str = MediaKind.IMAGE
    #: a video: its sampled frames and the rate they stand for (frames a second); 0 for an image
    frames: int = 0
    fps: float = 0.0
    #: a video encoded in segments (``EPD_VIDEO_SEGMENT_FRAMES``): one ref per segment, in order,
    #: each its own item (stored frames, encode job, EC object); the video itself then has no
    #: media of its own (``media_key`` empty) and is its segments' features joined
    segments: tuple[ImageRef, ...] = ()
    #: a video in segments: which frames of the source its sampled frames are, the source's rate and
    #: frame count (vLLM's loader's metadata, from which Qwen3-VL times each temporal patch in its
    #: prompt) - the whole video's, for the LM after the join: a segment's stored frames and EC
    #: object are keyed by its pixels alone, so theirs may be another video's (or another segment's
    #: of this one: a still clip). Empty / 0 otherwise (a video's stored frames carry its own).
    source_indices: tuple[int, ...] = ()
    source_fps: float = 0.0
    source_frames: int = 0


#: Schema of the jobs that carry a ``SamplingSpec`` (``GenerationJob``, ``DecodeJob``).
SAMPLING_SCHEMA = 2
#: Schema of a ``GenerationJob`` whose messages hold ``tool`` messages or an assistant's
#: ``tool_calls`` (:func:`generation_schema`): a v2 worker drops those keys when it renders the chat
#: template, so it must refuse the job (ProtocolError) rather than answer another conversation.
#: Jobs without them stay v2, readable by v2 workers.
TOOL_MESSAGES_SCHEMA = 3
#: Schema of a ``FinalResult`` with its request's last chunk (:meth:`FinalResult.with_last_chunk`):
#: a v3 reader would take the result without that token, so it must refuse the message (upgrade
#: the APIs before the workers). Results without one stay v1.
LAST_CHUNK_SCHEMA = 4


def generation_schema(messages: list[dict[str, Any]]) -> int:
    """The ``v`` of a ``GenerationJob`` with ``messages`` (:data:`TOOL_MESSAGES_SCHEMA` for a tool
    conversation, else :data:`SAMPLING_SCHEMA`)."""
    tools = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages if isinstance(m, dict))
    return TOOL_MESSAGES_SCHEMA if tools else SAMPLING_SCHEMA


class StructuredKind(enum.StrEnum):
    """What a :class:`StructuredOutput` constrains the completion to (``shared.engines.grammar``)."""

    #: any JSON object (OpenAI ``response_format: {"type": "json_object"}``; vLLM ``json_object``)
    JSON_OBJECT = "json_object"
    #: a JSON document valid under ``StructuredOutput.schema`` (``json_schema`` / a named tool's
    #: parameters; vLLM ``json``)
    JSON_SCHEMA = "json_schema"


#: The most bytes of a ``StructuredOutput.schema`` (its UTF-8 JSON text).
MAX_STRUCTURED_SCHEMA_BYTES = 64 * 1024

#: The most tools of a chat request (``GenerationJob.tools``), and their JSON text's bytes together.
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A grammar the completion must follow (grammar-constrained decoding, xgrammar on both
    engines). ``kind`` is typed as the enum, not ``str``: a worker that does not know a kind
    refuses the job (``ProtocolError``) instead of generating without the constraint.
    ``schema`` is the JSON schema as compact JSON text (``shared.engines.grammar.structured_output``
    writes it; key order is kept: the grammar emits object properties in the schema's order), empty
    for ``json_object``."""

    kind: StructuredKind
    schema: str = ""

    def __post_init__(self) -> None:
        # Checked on construction and on decoding (msgspec turns the error into a ValidationError).
        if self.kind == StructuredKind.JSON_SCHEMA:
            if not self.schema:
                raise ValueError("a json_schema StructuredOutput needs a schema")
            if len(self.schema.encode()) > MAX_STRUCTURED_SCHEMA_BYTES:
                raise ValueError(f"StructuredOutput schema exceeds {MAX_STRUCTURED_SCHEMA_BYTES} bytes")
        elif self.schema:
            raise ValueError(f"a {self.kind} StructuredOutput takes no schema")


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one completion (vLLM ``SamplingParams`` semantics; the defaults change
    nothing). Every field is applied by every engine on every topology: a field an engine cannot
    honour is refused at start-up or by the API, never dropped."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # -- v2 --
    #: keep the k most likely tokens; 0 = all
    top_k: int = 0
    #: drop tokens whose probability is below ``min_p`` x the most likely one's; 0 = off
    min_p: float = 0.0
    #: OpenAI penalties over the generated tokens (-2..2; 0 = off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: vLLM / HF repetition penalty over prompt + generated tokens (> 0; 1 = off)
    repetition_penalty: float = 1.0
    #: (token id, bias added to its logit before sampling), sorted by token id
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: no EOS / stop token / stop string ends the completion before this many tokens
    min_tokens: int = 0
    #: token ids that end the completion (the token is not part of the text)
    stop_token_ids: tuple[int, ...] = ()
    #: None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely alternatives
    logprobs: int | None = None
    #: the grammar the completion must follow (``response_format`` json_object / json_schema, a
    #: named ``tool_choice``); None: free text
    structured: StructuredOutput | None = None


def effective_seed(request_id: str, seed: int | None) -> int:
    """The sampling seed of a job: the client's, else one derived from the request id. A
    redelivered job therefore samples the tokens it already streamed, and a replay under a new
    id reproduces a recorded request by passing ``effective_seed(original_id, None)``."""
    return seed if seed is not None else zlib.crc32(request_id.encode())


class ChatRequestRecord(_Msg, frozen=True, kw_only=True, tag="chat_request"):
    """The request as the API received it, with image and video payloads replaced by ``image_ref``
    / ``video_ref`` parts (``{"type": "image_ref", "item_hash": ...}``) so it stays small. Kept for
    replay."""

    request_id: str
    received_at: float
    model: str
    body: dict[str, Any]
    images: tuple[ImageRef, ...] = ()
    #: set by ``epd replay run``: the request this one re-runs.
    replay_of: str = ""


class EncodeJob(_Msg, frozen=True, kw_only=True, tag="encode_job"):
    """Encode one image. Published with ``Nats-Msg-Id = encode_job_msg_id(ec_key, generation)``
    so concurrent duplicates collapse while a re-encode after the object was removed does not."""

    request_id: str
    image: ImageRef
    fingerprint: str
    ec_key: str
    created_at: float


def encode_job_msg_id(ec_key: str, generation: int) -> str:
    """The ``Nats-Msg-Id`` of an :class:`EncodeJob`: the EC key plus the generation of its index
    entry - the revision of the entry's last change (written, deleted or purged), 0 while it never
    had one. Requests that find the object missing at the same generation share one job (JetStream
    drops the copies within its duplicate window); once the object was evicted or purged its entry's
    deletion is a new generation, so asking for it again queues a new job at once instead of being
    dropped as a copy of the job that encoded it the first time."""
    return f"{ec_key}@{generation}"


def token_chunk_msg_id(chunk: TokenChunk) -> str:
    """The ``Nats-Msg-Id`` of a :class:`TokenChunk` published again (its first publish carries
    none): one per request, attempt and seq, so retries through an election store one copy."""
    return f"{chunk.request_id}-{chunk.attempt}-{chunk.seq}"


def request_record_msg_id(request_id: str) -> str:
    """The ``Nats-Msg-Id`` of a request's :class:`ChatRequestRecord`: one per request, so a record
    whose acknowledgement did not come in time is published again (through an election) and
    stored once."""
    return f"{request_id}-record"


def final_result_msg_id(request_id: str) -> str:
    """The ``Nats-Msg-Id`` of a request's :class:`FinalResult`: one per request, so the worker
    may retry its publish through a NATS leader election (``shared.jetstream.JetStreamPublisher``)
    and a copy that got through after all is dropped."""
    return f"{request_id}-final"


class ECReady(_Msg, frozen=True, kw_only=True, tag="ec_ready"):
    request_id: str
    item_hash: str
    fingerprint: str
    ec_key: str
    #: feature rows (0: not known to the announcer - a vLLM worker that stole the encode announces
    #: at its request's first token, before its engine reports them)
    n_tokens: int
    nbytes: int
    producer: str
    encode_s: float
    created_at: float
    #: wall-clock start of the vision encoder run (0: nothing was computed, e.g. already stored).
    encode_started_at: float = 0.0


class ECFailed(_Msg, frozen=True, kw_only=True, tag="ec_failed"):
    request_id: str
    item_hash: str
    fingerprint: str
    code: str
    message: str
    created_at: float


class ECInvalidated(_Msg, frozen=True, kw_only=True, tag="ec_invalidated"):
    """EC objects of ``fingerprint`` were removed from the store (evicted by the janitor, purged
    by ``epd ec purge``): every holder of a local copy (a PD worker's feature cache, a vLLM EC
    connector's held bytes) drops ``item_hashes``. Core NATS, at most once: a holder that misses
    it keeps a copy whose content is still right (keys are versioned), bounded by its own LRU."""

    fingerprint: str
    item_hashes: tuple[str, ...]
    #: ``bytes`` / ``objects`` / ``ttl`` / ``retired`` (janitor) or ``purge`` (``epd ec purge``), ``gone``
    #: (an ``EvictionReason`` value; a plain ``str`` on the wire: a newer peer's reason still decodes)
    reason: str
    by: str
    created_at: float


class GenerationJob(_Msg, frozen=True, kw_only=True, tag="generation_job"):
    """Prefill (+ decode in E|PD) one request. ``messages`` hold ``{"type": "image"}`` parts in
    the order of ``images`` (one entry per placeholder; duplicates allowed).

    A completions request carries ``prompt`` instead of messages. A tool conversation's messages
    also hold ``tool_calls`` (assistant) and ``tool_call_id`` (tool) - ``shared.chat.ChatMessage``'s
    wire form; such a job is v3 (:func:`generation_schema`).

    ``reprefill`` > 0: a decode worker found the KV object of the previous prefill unusable
    (missing, corrupt) and sent the request back (bounded by ``EPD_MAX_REPREFILLS``); it is
    also the KV object's attempt number."""

    v: int = SAMPLING_SCHEMA
    request_id: str
    model: str
    messages: list[dict[str, Any]]
    images: tuple[ImageRef, ...]
    fingerprint: str
    sampling: SamplingSpec
    stream: bool
    deadline: float
    created_at: float
    reprefill: int = 0
    #: ``/v1/completions``: the prompt itself - text used verbatim (no chat template) or token
    #: ids - with ``messages`` and ``images`` empty; ``None`` for a chat request
    prompt: str | tuple[int, ...] | None = None
    #: a chat request's ``tools``, each a function definition as compact JSON text
    #: (``{"type": "function", "function": {"name", "description", "parameters"[, "strict"]}}``,
    #: as vLLM hands them to the chat template); the engines render them with the chat template.
    #: At most ``MAX_TOOLS`` of at most ``MAX_TOOLS_BYTES`` together.
    tools: tuple[str, ...] = ()
    #: ``shared.routing``: the worker the API routed the job to ("": the shared queue) and why (a
    #: ``RouteReason`` value; "" when the API does not route). A fallback copy on the shared queue
    #: has reason ``fallback`` and ``route_detail`` says why (not claimed in time, worker gone).
    #: Readers that do not know these fields ignore them (no schema bump: nothing to refuse).
    routed_to: str = ""
    route_reason: str = ""
    route_detail: str = ""

    @property
    def stored_items(self) -> tuple[ImageRef, ...]:
        """The items stored and encoded for this job, in order (duplicates kept): each image or
        video, a segmented video's segments in its place."""
        return tuple(leaf for ref in self.images for leaf in (ref.segments or (ref,)))

    def __post_init__(self) -> None:
        # Checked on construction and on decoding (msgspec turns the error into a ValidationError).
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"a GenerationJob carries at most {MAX_TOOLS} tools, got {len(self.tools)}")
        if sum(len(t.encode()) for t in self.tools) > MAX_TOOLS_BYTES:
            raise ValueError(f"a GenerationJob's tools exceed {MAX_TOOLS_BYTES} bytes")


class DecodeJob(_Msg, frozen=True, kw_only=True, tag="decode_job"):
    """Continue a prefilled request (E|P|D). Published by a prefill worker (role ``prefill``)
    after it stored the KV object and streamed the first ``emitted`` token(s) (``TokenChunk``
    seq ``0 .. emitted-1``); the decode worker continues at seq ``emitted``. Published with
    ``Nats-Msg-Id = <request_id>-decode-<kv_attempt>`` so a redelivered prefill adds no second
    job. ``generation`` is the original job, for a re-prefill when the KV object is unusable."""

    v: int = SAMPLING_SCHEMA
    request_id: str
    kv_key: str
    kv_attempt: int
    kv_nbytes: int
    model_fingerprint: str
    sampling: SamplingSpec
    deadline: float
    created_at: float
    emitted: int
    emitted_text: str
    prompt_tokens: int
    generation: GenerationJob
    #: ``Timing`` -> seconds
    timings: dict[str, float] = {}
    #: item hash -> ``ECSource`` value (``recomputed:<reason>``)
    ec_sources: dict[str, str] = {}
    prefill_worker: str = ""


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """The log-probability (natural log, of the distribution the token was sampled from before
    temperature / top-k / top-p / penalties: vLLM's default ``raw_logprobs``) of one generated token,
    and the ``SamplingSpec.logprobs`` most likely tokens at its position as
    ``(token id, token text, logprob)``, most likely first. ``token`` is the token's own text
    (the transformers engine: ``tokenizer.decode([token_id])``; vLLM: its ``decoded_token``, which can
    differ for a byte-fallback or SentencePiece-space token)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


class TokenChunk(_Msg, frozen=True, kw_only=True, tag="token_chunk"):
    """Tokens ``seq .. seq+len(token_ids)-1`` of the completion. A redelivered job restarts at
    ``seq == 0`` with a higher ``attempt``; the API drops what it already forwarded."""

    request_id: str
    attempt: int
    seq: int
    token_ids: tuple[int, ...]
    text: str
    #: one per token id when the job's ``SamplingSpec.logprobs`` is set, else empty
    logprobs: tuple[TokenLogprob, ...] = ()


class FinalResult(_Msg, frozen=True, kw_only=True, tag="final_result"):
    request_id: str
    attempt: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    #: ``Timing`` -> seconds
    timings: dict[str, float] = {}
    #: item hash -> ``ECSource`` value (``recomputed:<reason>``)
    ec_sources: dict[str, str] = {}
    worker: str = ""
    #: E|P|D: where the decode worker's KV state came from - "store", or "recomputed:<reason>"
    #: when a vLLM decode engine had to prefill the request again; "" outside E|P|D (``ECSource``)
    kv_source: str = ""
    #: The request's last chunk, when it did not go out on its own: a worker sends a generation's
    #: last token with its result, one message fewer per request (``shared.token_stream``). A
    #: reader takes it as the chunk it is, before the result (``shared.client.TokenStream``,
    #: ``shared.history.RequestCase.token_chunks``).
    last_chunk: TokenChunk | None = None

    def with_last_chunk(self, chunk: TokenChunk) -> FinalResult:
        """This result carrying ``chunk`` (schema :data:`LAST_CHUNK_SCHEMA`)."""
        return msgspec.structs.replace(self, last_chunk=chunk, v=max(self.v, LAST_CHUNK_SCHEMA))

    def split(self) -> tuple[TokenChunk | None, FinalResult]:
        """The chunk this result carries (None when it carries none) and the result without it."""
        if self.last_chunk is None:
            return None, self
        return self.last_chunk, msgspec.structs.replace(self, last_chunk=None)


class ErrorEvent(_Msg, frozen=True, kw_only=True, tag="error"):
    """A request ended with an error. Build it with :func:`error_event` from a typed error."""

    request_id: str
    code: str
    message: str
    stage: str
    http_status: int = 500
    #: the request parameter a 4xx is about (``EPDError.param``: e.g. a schema the worker's grammar
    #: engine cannot compile is about ``response_format``); "" when none
    param: str = ""

    def __post_init__(self) -> None:
        # Checked on construction too (msgspec checks types only when decoding): an event that
        # the API cannot decode would leave its client waiting for the deadline.
        if not (isinstance(self.code, str) and isinstance(self.message, str)):
            raise TypeError(f"ErrorEvent code and message must be str, got {self.code!r}, {self.message!r}")
        if type(self.http_status) is not int or not 400 <= self.http_status <= 599:
            raise ValueError(f"ErrorEvent http_status must be an int 400..599, got {self.http_status!r}")


def error_event(request_id: str, stage: str, error: EPDError, *, message: str | None = None) -> ErrorEvent:
    """The ``ErrorEvent`` for ``error`` (its code and HTTP status; ``message`` overrides its text)."""
    return ErrorEvent(
        request_id=request_id,
        code=error.code,
        stage=stage,
        http_status=error.http_status,
        message=error.message if message is None else message,
        param=error.param or "",
    )


class RequestCancelled(_Msg, frozen=True, kw_only=True, tag="cancelled"):
    """The caller gave up on a request (client disconnected, deadline passed, API-side error).
    Workers drop its queued jobs when they take them and stop its running generation
    (``shared.worker``); it stays in ``<P>_CONTROL`` so a job taken later is still dropped."""

    request_id: str
    reason: str
    created_at: float


class ECWanted(_Msg, frozen=True, kw_only=True, tag="ec_wanted"):
    """``request_id`` waits on an encode job that another request queued (its own was dropped as
    a duplicate): that job is still wanted when its own request is cancelled."""

    request_id: str
    fingerprint: str
    item_hash: str
    created_at: float


#: Characters of an item hash a heartbeat advertises (``WorkerHeartbeat.items``): 64 bits, enough
#: that two images of one fleet's caches never share a prefix in practice, a quarter of the bytes.
ADVERTISED_HASH_CHARS = 16


class WorkerHeartbeat(_Msg, frozen=True, kw_only=True, tag="heartbeat"):
    """A worker is alive (every 2 s, core NATS). Generating workers that take routed jobs also
    say what they hold and how busy they are (``shared.routing``): the fields after ``sent_at``,
    added without a schema bump - an older API ignores them and an older worker's heartbeat
    decodes with ``routable`` False, so the API never routes to a worker without a routed
    consumer. Bounded: at most ``EPD_ROUTING_ADVERTISED_ITEMS`` hashes of
    :data:`ADVERTISED_HASH_CHARS` characters (1 KB for 64)."""

    role: str
    worker_id: str
    fingerprint: str
    model: str
    engine: str
    in_flight: int
    sent_at: float
    #: consumes ``Subjects.generate_routed(worker_id)`` (and claims what it takes there)
    routable: bool = False
    #: engine slots (``shared.admission``) and how many more jobs it would take now
    slots: int = 0
    free_slots: int = 0
    #: the most recently used items of its local caches, most recent first: item hash prefixes of
    #: :data:`ADVERTISED_HASH_CHARS` characters (feature cache; a vLLM engine's recent items)
    items: tuple[str, ...] = ()
    #: stopping (SIGTERM): finishes what it runs, takes nothing new - no routed job is sent to it,
    #: and a draining encoder with no job left counts as gone (a generating worker encodes its queue's items)
    draining: bool = False


Message = (
    ChatRequestRecord
    | EncodeJob
    | ECReady
    | ECFailed
    | ECInvalidated
    | GenerationJob
    | DecodeJob
    | TokenChunk
    | FinalResult
    | ErrorEvent
    | RequestCancelled
    | ECWanted
    | WorkerHeartbeat
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


_M = TypeVar("_M")


@overload
def decode(data: bytes, expect: type[_M]) -> _M: ...
@overload
def decode(data: bytes, expect: tuple[type, ...] | None = None) -> Message: ...
def decode(data: bytes, expect: type | tuple[type, ...] | None = None) -> Any:
    """Decode any message; with ``expect``, also check its type. Raises ProtocolError."""
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
    if msg.v > PROTOCOL_VERSION:
        raise ProtocolError(f"message schema v{msg.v} is newer than this worker's v{PROTOCOL_VERSION}")
    if expect is not None and not isinstance(msg, expect):
        raise ProtocolError(f"expected {expect}, got {type(msg).__name__}")
    return msg


def to_builtins(msg: msgspec.Struct) -> dict[str, Any]:
    """A JSON-friendly dict (for replay output and logs)."""
    return msgspec.to_builtins(msg)


def headers_for(
    msg: Message, request_id: str, *, msg_id: str | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """NATS headers of a message: request id, kind, send time (+ ``extra``, e.g. trace headers)."""
    headers = {
        HDR_REQUEST_ID: request_id,
        HDR_KIND: str(type(msg).__struct_config__.tag),  # every message has a str tag
        HDR_SENT_AT: f"{time.time():.6f}",
    }
    if extra:
        headers.update(extra)
    if msg_id:
        headers[HDR_MSG_ID] = msg_id
    return headers
