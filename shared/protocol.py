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
<p>.generate.jobs                  <P>_GENERATE         GenerationJob (work; consumer "prefill")
<p>.tokens.<request_id>            <P>_RESULTS          TokenChunk / FinalResult / ErrorEvent
<p>.workers.heartbeat.<role>       (core NATS only)     WorkerHeartbeat
=================================  ===================  ============================================

Streams use limits retention (not work-queue) so they keep what passed through them for replay.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 1

# Nats headers -------------------------------------------------------------------------------
HDR_MSG_ID = "Nats-Msg-Id"
HDR_REQUEST_ID = "Epd-Request-Id"
HDR_KIND = "Epd-Kind"
HDR_SENT_AT = "Epd-Sent-At"

# Durable consumer names ---------------------------------------------------------------------
CONSUMER_ENCODER = "encoder"
CONSUMER_PREFILL = "prefill"


class ProtocolError(ValueError):
    """A message that cannot be decoded or has an unknown/newer schema."""


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
        self.tokens_all = f"{p}.tokens.>"
        self.heartbeat_all = f"{p}.workers.heartbeat.>"

        self.stream_requests = f"{P}_REQUESTS"
        self.stream_encode = f"{P}_ENCODE"
        self.stream_events = f"{P}_EVENTS"
        self.stream_generate = f"{P}_GENERATE"
        self.stream_results = f"{P}_RESULTS"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}.requests.{request_id}"

    def ec_ready(self, fingerprint: str, item_hash: str) -> str:
        return f"{self.prefix}.ec.ready.{fingerprint}.{item_hash}"

    def ec_failed(self, fingerprint: str, item_hash: str) -> str:
        return f"{self.prefix}.ec.failed.{fingerprint}.{item_hash}"

    def ec_any(self, fingerprint: str, item_hash: str) -> str:
        """Both the ready and the failed event of one item."""
        return f"{self.prefix}.ec.*.{fingerprint}.{item_hash}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}.tokens.{request_id}"

    def heartbeat(self, role: str) -> str:
        return f"{self.prefix}.workers.heartbeat.{role}"

    def streams(self) -> dict[str, list[str]]:
        """Stream name -> subjects, for idempotent creation at start-up."""
        return {
            self.stream_requests: [self.requests_all],
            self.stream_encode: [self.encode_jobs],
            self.stream_events: [self.ec_events_all],
            self.stream_generate: [self.generate_jobs],
            self.stream_results: [self.tokens_all],
        }


# Messages -----------------------------------------------------------------------------------
class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    v: int = PROTOCOL_VERSION


class ImageRef(msgspec.Struct, frozen=True, kw_only=True):
    """One distinct image of a request: its content hash and where its bytes are stored."""

    item_hash: str
    media_key: str
    width: int
    height: int
    #: False when the API found the EC object already stored and queued no encode job, so a
    #: worker that then misses in the store must not wait for an encoder.
    encode_queued: bool = True


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


class ChatRequestRecord(_Msg, frozen=True, kw_only=True, tag="chat_request"):
    """The request as the API received it, with image payloads replaced by ``image_ref`` parts
    (``{"type": "image_ref", "item_hash": ...}``) so it stays small. Kept for replay."""

    request_id: str
    received_at: float
    model: str
    body: dict[str, Any]
    images: tuple[ImageRef, ...] = ()


class EncodeJob(_Msg, frozen=True, kw_only=True, tag="encode_job"):
    """Encode one image. Published with ``Nats-Msg-Id = ec_key`` so duplicates collapse."""

    request_id: str
    image: ImageRef
    fingerprint: str
    ec_key: str
    created_at: float


class ECReady(_Msg, frozen=True, kw_only=True, tag="ec_ready"):
    request_id: str
    item_hash: str
    fingerprint: str
    ec_key: str
    n_tokens: int
    nbytes: int
    producer: str
    encode_s: float
    created_at: float


class ECFailed(_Msg, frozen=True, kw_only=True, tag="ec_failed"):
    request_id: str
    item_hash: str
    fingerprint: str
    code: str
    message: str
    created_at: float


class GenerationJob(_Msg, frozen=True, kw_only=True, tag="generation_job"):
    """Prefill (+ decode in E|PD) one request. ``messages`` hold ``{"type": "image"}`` parts in
    the order of ``images`` (one entry per placeholder; duplicates allowed)."""

    request_id: str
    model: str
    messages: list[dict[str, Any]]
    images: tuple[ImageRef, ...]
    fingerprint: str
    sampling: SamplingSpec
    stream: bool
    deadline: float
    created_at: float


class TokenChunk(_Msg, frozen=True, kw_only=True, tag="token_chunk"):
    """Tokens ``seq .. seq+len(token_ids)-1`` of the completion. A redelivered job restarts at
    ``seq == 0`` with a higher ``attempt``; the API drops what it already forwarded."""

    request_id: str
    attempt: int
    seq: int
    token_ids: tuple[int, ...]
    text: str


class FinalResult(_Msg, frozen=True, kw_only=True, tag="final_result"):
    request_id: str
    attempt: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = {}
    ec_sources: dict[str, str] = {}
    worker: str = ""


class ErrorEvent(_Msg, frozen=True, kw_only=True, tag="error"):
    request_id: str
    code: str
    message: str
    stage: str
    http_status: int = 500


class WorkerHeartbeat(_Msg, frozen=True, kw_only=True, tag="heartbeat"):
    role: str
    worker_id: str
    fingerprint: str
    model: str
    engine: str
    in_flight: int
    sent_at: float


Message = Union[
    ChatRequestRecord,
    EncodeJob,
    ECReady,
    ECFailed,
    GenerationJob,
    TokenChunk,
    FinalResult,
    ErrorEvent,
    WorkerHeartbeat,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, expect: type | tuple[type, ...] | None = None) -> Message:
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


def to_builtins(msg: Message) -> dict[str, Any]:
    """A JSON-friendly dict (for replay output and logs)."""
    return msgspec.to_builtins(msg)


def headers_for(msg: Message, request_id: str, *, msg_id: str | None = None) -> dict[str, str]:
    headers = {
        HDR_REQUEST_ID: request_id,
        HDR_KIND: type(msg).__struct_config__.tag,  # type: ignore[attr-defined]
        HDR_SENT_AT: f"{time.time():.6f}",
    }
    if msg_id:
        headers[HDR_MSG_ID] = msg_id
    return headers
