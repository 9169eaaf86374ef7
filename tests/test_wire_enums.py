"""The closed sets of strings that leave a process (NATS payloads, metric labels, the JSON of the
timeline, ``epd replay`` and ``epd bench``) are enums now: their values must stay the literal
strings they replaced, byte for byte. A rename of a value fails here, not on a deployed peer.

The expected values below are spelled as literals on purpose: do not build them from the enums."""

from __future__ import annotations

import enum

import msgspec
import pytest

from shared import metrics, protocol
from shared.connectors.params import Source
from shared.history import STATUSES, RequestStatus
from shared.metrics import JobOutcome, KVHandoffOutcome, LookupOutcome
from shared.protocol import (
    DecodeJob,
    ECSource,
    EvictionReason,
    FinalResult,
    GenerationJob,
    MediaKind,
    RouteReason,
    SamplingSpec,
    StageName,
    StructuredKind,
    Timing,
    WorkQueue,
)
from shared.store.format import MissReason
from shared.topology import Service

# enum -> the exact strings the code spelled before it existed
EXPECTED: dict[type[enum.Enum], set[str]] = {
    ECSource: {"local_cache", "local", "store", "recomputed", "connector", "engine_cache", "stolen"},
    Timing: {
        "features_s",
        "admission_s",
        "prefill_s",
        "decode_s",
        "first_token_s",
        "total_s",
        "decode_first_token_s",
        "kv_bytes",
        "decode_batch_rows_max",
    },
    WorkQueue: {"encode", "generate", "decode"},
    MediaKind: {"image", "video"},
    RouteReason: {"affinity", "load", "fallback", "no_affinity"},
    StructuredKind: {"json_object", "json_schema"},
    # the Epd-Stage header, ErrorEvent.stage and a timeline stage's service (with "replay")
    Service: {"api", "encoder", "prefill", "decode"},
    EvictionReason: {"bytes", "objects", "ttl", "retired", "purge", "gone"},
    RequestStatus: {"ok", "error", "cancelled", "incomplete"},
    JobOutcome: {
        "ok",
        "encoded",
        "already_stored",
        "stolen",
        "bad_message",
        "retried",
        "cancelled",
        "already_done",
        "failed",
        "expired",
        "rejected",
        "superseded",
    },
    KVHandoffOutcome: {
        "handed_off",
        "finished_in_prefill",
        "local_too_large",
        "local_store_error",
        "local_engine_error",
    },
    StageName: {
        "received",
        "image intake",
        "no encode job",
        "encode deduplicated",
        "encode queued",
        "encode",
        "EC stored",
        "EC announced",
        "encode failed",
        "generation queued",
        "re-prefill queued",
        "EC from local cache",
        "EC loaded from store",
        "EC recomputed locally",
        "EC encoded in process",
        "waiting for an engine slot",
        "prefill",
        "first token",
        "redelivered",
        "KV hand-off",
        "decode queued",
        "decode",
        "done",
        "error",
        "cancelled",
    },
}


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_enum_values_are_the_old_strings(cls: type[enum.Enum]) -> None:
    assert {m.value for m in cls} == EXPECTED[cls]


# Enums from before, (str, Enum): their values reach the wire too (``recomputed:<reason>``,
# ``epd_ec_sources`` / ``epd_kv_source`` params, metric labels through ``.value``).
EXPECTED_OLD: dict[type[enum.Enum], set[str]] = {
    MissReason: {
        "not_found",
        "corrupt",
        "checksum_mismatch",
        "fingerprint_mismatch",
        "item_mismatch",
        "schema_mismatch",
        "shape_mismatch",
        "too_large",
        "store_error",
        "timeout",
        "encoder_failed",
        "no_encoder",
        "bad_identifier",
    },
    Source: {"store", "engine_cache", "recomputed"},
    LookupOutcome: {"hit", "miss", "fallback", "unavailable", "engine_cache"},
}


@pytest.mark.parametrize("cls", list(EXPECTED_OLD), ids=lambda c: c.__name__)
def test_older_enum_values_are_unchanged(cls: type[enum.Enum]) -> None:
    assert {m.value for m in cls} == EXPECTED_OLD[cls]


def test_the_connectors_sources_are_feature_sources() -> None:
    """The vLLM connectors report with their own ``Source``: the same strings as ``ECSource``."""
    assert {s.value for s in Source} <= {s.value for s in ECSource}
    assert Source.RECOMPUTED.report(MissReason.TIMEOUT.value) == protocol.recomputed("timeout")
    assert Source.STORE.report() == ECSource.STORE


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_members_are_their_strings_everywhere(cls: type[enum.Enum]) -> None:
    """A member equals, hashes, formats, stringifies and encodes (msgspec, json) as its value:
    prometheus_client labels with str(), logs and f-strings use format()."""
    import json

    for m in cls:
        v = m.value
        assert isinstance(m, str) and m == v and hash(m) == hash(v)
        assert str(m) == f"{m}" == "%s" % m == v  # noqa: UP031 - logging formats with %s
        assert msgspec.msgpack.encode(m) == msgspec.msgpack.encode(v)
        assert msgspec.json.encode({m: m}) == msgspec.json.encode({v: v})
        assert json.dumps({m: m}) == json.dumps({v: v})


def test_statuses_keep_their_order() -> None:
    assert STATUSES == ("ok", "error", "cancelled", "incomplete")  # epd replay list --status choices


def test_recomputed_sources() -> None:
    assert protocol.recomputed("timeout") == "recomputed:timeout"
    assert protocol.recompute_reason("recomputed:timeout") == "timeout"
    assert protocol.recompute_reason("recomputed:") == "unknown"
    assert protocol.recompute_reason("store") is None
    assert protocol.recompute_reason("local_cache") is None


def _final(**kw) -> FinalResult:
    return FinalResult(
        request_id="r1",
        attempt=0,
        token_ids=(1, 2),
        text="hi",
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=2,
        **kw,
    )


# A FinalResult as an older worker wrote it, with the literal strings (the "recorded" message).
OLD_FINAL = msgspec.msgpack.encode(
    {
        "kind": "final_result",
        "v": 1,
        "request_id": "r1",
        "attempt": 0,
        "token_ids": [1, 2],
        "text": "hi",
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "timings": {"features_s": 0.5, "admission_s": 0.0, "prefill_s": 0.25, "decode_s": 1.0},
        "ec_sources": {"a" * 64: "local_cache", "b" * 64: "store", "c" * 64: "recomputed:timeout"},
        "worker": "pd-1",
        "kv_source": "store",
    }
)


def test_old_message_decodes_and_new_one_encodes_the_same_strings() -> None:
    old = protocol.decode(OLD_FINAL, FinalResult)
    assert old.timings[Timing.FEATURES] == 0.5 and old.timings["prefill_s"] == 0.25
    assert old.ec_sources["a" * 64] == ECSource.LOCAL_CACHE
    assert old.ec_sources["c" * 64] == "recomputed:timeout" == protocol.recomputed("timeout")
    assert old.kv_source == ECSource.STORE

    new = _final(
        timings={Timing.FEATURES: 0.5, Timing.ADMISSION: 0.0, Timing.PREFILL: 0.25, Timing.DECODE: 1.0},
        ec_sources={
            "a" * 64: ECSource.LOCAL_CACHE,
            "b" * 64: ECSource.STORE,
            "c" * 64: protocol.recomputed("timeout"),
        },
        worker="pd-1",
        kv_source=ECSource.STORE,
    )
    # same bytes on the wire as the old worker's message (fields in the same order), but for the
    # later field last_chunk, null (a reader of the old schema ignores it)
    assert protocol.encode(new) == protocol.encode(old)
    wire = msgspec.msgpack.decode(protocol.encode(new))
    assert wire.pop("last_chunk") is None
    assert wire == msgspec.msgpack.decode(OLD_FINAL)
    # and the JSON of replay / bench output: plain strings
    assert protocol.to_builtins(new) == protocol.to_builtins(old)
    assert msgspec.json.decode(msgspec.json.encode(new))["ec_sources"]["b" * 64] == "store"


def test_unknown_values_from_a_newer_peer_still_decode_as_strings() -> None:
    """The struct fields stay ``str``: a source / timing key this version does not know is kept
    as the plain string (not refused), as before the enums."""
    data = protocol.encode(
        _final(timings={"future_s": 1.0}, ec_sources={"d" * 64: "teleported"}, kv_source="recomputed:new_reason")
    )
    msg = protocol.decode(data, FinalResult)
    assert msg.timings == {"future_s": 1.0}
    assert msg.ec_sources == {"d" * 64: "teleported"}
    assert protocol.recompute_reason(msg.kv_source) == "new_reason"


def test_decode_job_timings_keep_their_keys() -> None:
    gen = GenerationJob(
        request_id="r1",
        model="m",
        messages=[],
        images=(),
        fingerprint="f",
        sampling=SamplingSpec(max_tokens=4),
        stream=False,
        deadline=1.0,
        created_at=0.0,
    )
    job = DecodeJob(
        request_id="r1",
        kv_key="k",
        kv_attempt=0,
        kv_nbytes=1,
        model_fingerprint="f",
        sampling=gen.sampling,
        deadline=1.0,
        created_at=0.0,
        emitted=1,
        emitted_text="a",
        prompt_tokens=2,
        generation=gen,
        timings={t: 1.0 for t in protocol.PREFILL_TIMINGS},
        ec_sources={"a" * 64: ECSource.STORE},
    )
    raw = msgspec.msgpack.decode(protocol.encode(job))
    assert raw["timings"] == {"features_s": 1.0, "admission_s": 1.0, "prefill_s": 1.0}
    assert raw["ec_sources"] == {"a" * 64: "store"}


def test_metric_labels_are_the_values() -> None:
    """prometheus_client turns label values into strings with str(): a (str, Enum) would label
    ``JobOutcome.OK``; a StrEnum labels ``ok``."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    jobs = Counter("epd:test_jobs_total", "test", ["outcome"], registry=registry)
    jobs.labels(JobOutcome.ALREADY_STORED).inc()
    assert 'epd:test_jobs_total{outcome="already_stored"} 1.0' in generate_latest(registry).decode()
    assert metrics.ENCODE_JOBS.labels(JobOutcome.ENCODED) is metrics.ENCODE_JOBS.labels("encoded")


def test_old_invalidation_decodes_and_new_one_encodes_the_same() -> None:
    old = msgspec.msgpack.encode(
        {
            "kind": "ec_invalidated",
            "v": 1,
            "fingerprint": "fp",
            "item_hashes": ["x"],
            "reason": "ttl",
            "by": "j",
            "created_at": 1.0,
        }
    )
    msg = protocol.decode(old, protocol.ECInvalidated)
    assert msg.reason == EvictionReason.TTL
    new = protocol.ECInvalidated(
        fingerprint="fp", item_hashes=("x",), reason=EvictionReason.TTL, by="j", created_at=1.0
    )
    assert protocol.encode(new) == protocol.encode(msg)
    # a reason this version does not know (a newer janitor's) decodes, as the plain string
    newer = protocol.encode(
        protocol.ECInvalidated(fingerprint="fp", item_hashes=(), reason="quota", by="j", created_at=1.0)
    )
    assert protocol.decode(newer, protocol.ECInvalidated).reason == "quota"


def test_work_queues_name_their_streams() -> None:
    subjects = protocol.Subjects("epd")
    assert {q: subjects.work_stream(q) for q in WorkQueue} == {
        "encode": "EPD_ENCODE",
        "generate": "EPD_GENERATE",
        "decode": "EPD_DECODE",
    }


def test_stage_of_an_error_event_and_the_replay_tool() -> None:
    assert protocol.STAGE_REPLAY == "replay"
    event = protocol.ErrorEvent(request_id="r1", code="worker_failed", message="x", stage=Service.PREFILL)
    assert msgspec.msgpack.decode(protocol.encode(event))["stage"] == "prefill"
