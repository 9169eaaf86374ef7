"""Wire schema: round trips, versioning, and type checks (pure logic)."""

import msgspec
import pytest

from shared import protocol
from shared.protocol import (
    EncodeJob,
    ErrorEvent,
    FinalResult,
    GenerationJob,
    ImageRef,
    ProtocolError,
    SamplingSpec,
    Subjects,
    TokenChunk,
)

REF = ImageRef(item_hash="ab" * 32, media_key="epd/media/" + "ab" * 32, width=64, height=48)


def _final(**kw) -> FinalResult:
    return FinalResult(
        request_id="r1",
        attempt=1,
        token_ids=(1, 2),
        text="ab",
        finish_reason="stop",
        prompt_tokens=5,
        completion_tokens=2,
        **kw,
    )


def test_every_message_round_trips():
    msgs = [
        EncodeJob(request_id="r1", image=REF, fingerprint="f" * 24, ec_key="k", created_at=1.5),
        GenerationJob(
            request_id="r1",
            model="m",
            messages=[{"role": "user", "content": [{"type": "image"}]}],
            images=(REF,),
            fingerprint="f" * 24,
            sampling=SamplingSpec(temperature=0.0, stop=("x",)),
            stream=True,
            deadline=10.0,
            created_at=1.0,
        ),
        TokenChunk(request_id="r1", attempt=1, seq=3, token_ids=(7,), text="a"),
        _final(timings={"total_s": 0.1}),
        ErrorEvent(request_id="r1", code="invalid_image", message="bad", stage="prefill", http_status=400),
    ]
    for msg in msgs:
        data = protocol.encode(msg)
        assert protocol.decode(data) == msg
        assert protocol.decode(data, type(msg)) == msg


def test_newer_schema_is_refused():
    msg = TokenChunk(v=protocol.PROTOCOL_VERSION + 1, request_id="r", attempt=1, seq=0, token_ids=(1,), text="")
    with pytest.raises(ProtocolError, match="newer"):
        protocol.decode(protocol.encode(msg))
    # control: the current version decodes
    ok = TokenChunk(request_id="r", attempt=1, seq=0, token_ids=(1,), text="")
    assert protocol.decode(protocol.encode(ok)) == ok


def test_a_result_with_its_last_chunk_is_refused_by_a_reader_of_the_schema_before(monkeypatch):
    """A v3 API would take the result and drop the token it carries: it refuses the message."""
    chunk = TokenChunk(request_id="r1", attempt=1, seq=1, token_ids=(2,), text="b")
    plain = _final()
    folded = plain.with_last_chunk(chunk)
    assert folded.v == protocol.LAST_CHUNK_SCHEMA and plain.v == 1
    assert protocol.decode(protocol.encode(folded)).split() == (chunk, msgspec.structs.replace(folded, last_chunk=None))
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", protocol.LAST_CHUNK_SCHEMA - 1)
    with pytest.raises(ProtocolError, match="newer"):
        protocol.decode(protocol.encode(folded))
    assert protocol.decode(protocol.encode(plain)) == plain  # control: results without one stay readable


def test_wrong_type_and_garbage_are_protocol_errors():
    data = protocol.encode(TokenChunk(request_id="r", attempt=1, seq=0, token_ids=(1,), text=""))
    with pytest.raises(ProtocolError, match="expected"):
        protocol.decode(data, EncodeJob)
    with pytest.raises(ProtocolError):
        protocol.decode(b"\x93garbage")
    with pytest.raises(ProtocolError):
        protocol.decode(msgspec.msgpack.encode({"kind": "no_such_kind", "v": 1}))


def test_messages_are_frozen():
    msg = TokenChunk(request_id="r", attempt=1, seq=0, token_ids=(1,), text="")
    with pytest.raises(AttributeError):
        msg.seq = 2  # type: ignore[misc]  # frozen: the assignment must fail


def test_subjects_are_namespaced_and_streams_do_not_overlap():
    a, b = Subjects("epd"), Subjects("other")
    assert a.tokens("r1") == "epd.tokens.r1"
    assert a.ec_ready("fp", "h") == "epd.ec.ready.fp.h"
    assert a.ec_any("fp", "h") == "epd.ec.*.fp.h"
    # (the subjects the janitor and history used to spell themselves: the same strings)
    assert a.ec_item_events("h") == "epd.ec.*.*.h" and b.ec_ready_all == "other.ec.ready.>"
    assert protocol.QUEUE_EC_INDEX == "epd-ec-index"
    subjects_a = [s for subs in a.streams().values() for s in subs]
    assert len(subjects_a) == len(set(subjects_a))
    assert set(a.streams()).isdisjoint(b.streams())
    with pytest.raises(ValueError):
        Subjects("bad.prefix")


def test_error_event_is_built_from_a_typed_error():
    from shared.errors import DeadlineExceeded, KVUnavailable, ModelMismatch

    for error, status in ((KVUnavailable("gone"), 502), (DeadlineExceeded("late"), 504), (ModelMismatch("other"), 500)):
        event = protocol.error_event("r1", "decode", error)
        assert (event.code, event.http_status, event.message, event.stage) == (
            error.code,
            status,
            error.message,
            "decode",
        )
        assert protocol.decode(protocol.encode(event), ErrorEvent) == event
    assert protocol.error_event("r1", "decode", KVUnavailable("x"), message="y").message == "y"


@pytest.mark.parametrize(
    "fields",
    [
        {"message": 502, "http_status": "gone"},  # the old decode worker's swapped arguments
        {"message": "gone", "http_status": "502"},
        {"message": "gone", "http_status": 200},
        {"message": "gone", "http_status": True},
    ],
)
def test_an_error_event_the_api_could_not_decode_cannot_be_built(fields):
    with pytest.raises((TypeError, ValueError)):
        ErrorEvent(request_id="r1", code="kv_unavailable", stage="decode", **fields)
    # control: the same fields, well typed, build and decode
    good = ErrorEvent(request_id="r1", code="kv_unavailable", stage="decode", message="gone", http_status=502)
    assert protocol.decode(protocol.encode(good)) == good


def test_an_ill_typed_error_event_on_the_wire_is_refused():
    """What the API does with an event a worker built wrongly: decoding fails, it is never taken
    for a valid error (the reason a client of the old decode worker waited for its deadline)."""
    raw = msgspec.msgpack.encode(
        {
            "kind": "error",
            "v": 1,
            "request_id": "r1",
            "code": "kv_unavailable",
            "message": 502,
            "stage": "decode",
            "http_status": "gone",
        }
    )
    with pytest.raises(ProtocolError):
        protocol.decode(raw)


def test_chat_messages_are_validated_once_into_one_struct_with_one_role_set():
    """The API parses OpenAI messages into ``shared.chat.ChatMessage`` (developer -> system,
    image_url -> image placeholder); the job carries them as the maps the engines read."""
    from services.api.schemas import parse_chat_request
    from shared.chat import ROLES, ChatMessage, ImagePart, TextPart
    from shared.errors import InvalidRequest

    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "text", "text": "what?"}],
            },
            {"role": "assistant", "content": None},
        ]
    }
    parsed = parse_chat_request(body, served_model="m", max_images=2, max_tokens_limit=8, default_max_tokens=4)
    assert parsed.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content=[ImagePart(), TextPart(text="what?")]),
        ChatMessage(role="assistant", content=""),
    ]
    assert parsed.image_urls == ["data:x"]
    wire = [m.to_wire() for m in parsed.messages]
    assert wire == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": ""},
    ]
    job = GenerationJob(
        request_id="r",
        model="m",
        messages=wire,
        images=(),
        fingerprint="f",
        sampling=SamplingSpec(),
        stream=False,
        deadline=1.0,
        created_at=0.0,
    )
    assert protocol.decode(protocol.encode(job), GenerationJob).messages == wire
    # One role set: what the API accepts is what the engines accept; anything else is refused.
    assert set(ROLES) == {"system", "user", "assistant", "developer", "tool"}
    for role in ("function", None):
        with pytest.raises(InvalidRequest, match=r"messages\[0\]\.role must be one of"):
            parse_chat_request(
                {"messages": [{"role": role, "content": "x"}]},
                served_model="m",
                max_images=1,
                max_tokens_limit=8,
                default_max_tokens=4,
            )
