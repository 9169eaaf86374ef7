"""Replay / timeline / logging pieces that need no service processes (the timeline from a
synthetic case, case-file validation, the seed contract, the JSON log format)."""

from __future__ import annotations

import argparse
import base64
import json
import logging

import msgspec
import pytest

from shared import history, protocol, timeline
from shared.jetstream import redact_url
from shared.logs import REQUEST_ID, JsonFormatter, RequestIdFilter
from shared.protocol import (
    ChatRequestRecord,
    DecodeJob,
    ECReady,
    EncodeJob,
    FinalResult,
    GenerationJob,
    ImageRef,
    SamplingSpec,
    TokenChunk,
)
from shared.tools import replay
from shared.tools.replay_cli import parse_duration

T0 = 1_700_000_000.0
ITEM = "ab" * 32
REF = ImageRef(item_hash=ITEM, media_key=f"ns/media/{ITEM}", width=56, height=56)


def _sm(stream, seq, t, msg, *, stage="api", started=None, rid="req-1"):
    headers = protocol.headers_for(msg, rid)
    headers[protocol.HDR_STAGE] = stage
    headers[protocol.HDR_RECEIVED_AT] = f"{T0:.6f}"
    if started is not None:
        headers[protocol.HDR_STARTED_AT] = f"{started:.6f}"
    return history.StreamMessage.build(stream, seq, "subj", t, headers, protocol.encode(msg))


def _job(rid="req-1"):
    return GenerationJob(
        request_id=rid,
        model="m",
        messages=[],
        images=(REF,),
        fingerprint="fp",
        sampling=SamplingSpec(temperature=0, max_tokens=3),
        stream=False,
        deadline=T0 + 60,
        created_at=T0 + 0.02,
    )


def _epd_case(*, split: bool = False, admission_s: float | None = None) -> history.RequestCase:
    rid = "req-1"
    msgs = [
        _sm(
            "P_REQUESTS",
            1,
            T0 + 0.010,
            ChatRequestRecord(request_id=rid, received_at=T0, model="m", body={}, images=(REF,)),
        ),
        _sm(
            "P_ENCODE",
            1,
            T0 + 0.005,
            EncodeJob(request_id=rid, image=REF, fingerprint="fp", ec_key="k", created_at=T0 + 0.005),
        ),
        _sm("P_GENERATE", 1, T0 + 0.020, _job()),
        _sm(
            "P_EVENTS",
            1,
            T0 + 0.300,
            ECReady(
                request_id=rid,
                item_hash=ITEM,
                fingerprint="fp",
                ec_key="ns/fp/i",
                n_tokens=4,
                nbytes=1000,
                producer="enc-0",
                encode_s=0.2,
                created_at=T0 + 0.300,
                encode_started_at=T0 + 0.090,
            ),
            stage="encoder",
            started=T0 + 0.050,
        ),
    ]
    started = T0 + 0.030
    for seq in range(3):
        stage = "prefill" if seq == 0 or not split else "decode"
        msgs.append(
            _sm(
                "P_RESULTS",
                10 + seq,
                T0 + 0.500 + 0.1 * seq,
                TokenChunk(request_id=rid, attempt=1, seq=seq, token_ids=(seq + 7,), text=f"t{seq}"),
                stage=stage,
                started=started if stage == "prefill" else T0 + 0.560,
            )
        )
    timings = {"features_s": 0.300, "prefill_s": 0.100, "decode_s": 0.2, "first_token_s": 0.47}
    if admission_s is not None:
        timings["admission_s"] = admission_s
    final = FinalResult(
        request_id=rid,
        attempt=1,
        token_ids=(7, 8, 9),
        text="t0t1t2",
        finish_reason="length",
        prompt_tokens=20,
        completion_tokens=3,
        timings=timings,
        ec_sources={ITEM: "store"},
        worker="w",
    )
    if split:
        msgs.append(
            _sm(
                "P_DECODE",
                1,
                T0 + 0.520,
                DecodeJob(
                    request_id=rid,
                    kv_key="kv",
                    kv_attempt=0,
                    kv_nbytes=5000,
                    model_fingerprint="mf",
                    sampling=SamplingSpec(),
                    deadline=T0 + 60,
                    created_at=T0 + 0.52,
                    emitted=1,
                    emitted_text="t0",
                    prompt_tokens=20,
                    generation=_job(),
                    timings={"features_s": 0.3, "prefill_s": 0.1},
                    ec_sources={ITEM: "store"},
                ),
                stage="prefill",
                started=started,
            )
        )
    msgs.append(
        _sm(
            "P_RESULTS",
            20,
            T0 + 0.800,
            final,
            stage="decode" if split else "prefill",
            started=T0 + 0.560 if split else started,
        )
    )
    return history.RequestCase(rid, history.ordered(msgs))


def test_timeline_of_an_epd_image_request():
    case = _epd_case()
    tl = timeline.build_timeline(case)
    by_name = {s.name: s for s in tl.stages}
    for name in (
        "received",
        "encode queued",
        "encode",
        "EC stored",
        "generation queued",
        "EC loaded from store",
        "prefill",
        "first token",
        "decode",
        "done",
    ):
        assert name in by_name, (name, tl.names())
    assert by_name["received"].start == T0
    assert by_name["encode queued"].start == T0 + 0.005 and by_name["encode queued"].end == T0 + 0.050
    assert by_name["encode"].duration == pytest.approx(0.2)
    assert by_name["EC stored"].end == T0 + 0.300
    assert by_name["generation queued"].end == T0 + 0.030  # the prefill worker took the job
    assert by_name["EC loaded from store"].start == T0 + 0.030
    assert by_name["prefill"].start == pytest.approx(T0 + 0.330) and by_name["prefill"].duration == pytest.approx(0.1)
    assert by_name["first token"].start == T0 + 0.500
    assert by_name["done"].start == T0 + 0.800
    assert "KV hand-off" not in by_name  # E|PD: no hand-off
    s = tl.summary
    assert (s.status, s.images, s.completion_tokens) == ("ok", 1, 3)
    assert s.ttft_s == pytest.approx(0.5) and s.e2e_s == pytest.approx(0.8)
    text = timeline.render_text(tl)
    assert "EC loaded from store" in text and "200.0 ms" in text
    assert "waiting for an engine slot" not in by_name


def test_a_cases_chunks_are_its_last_attempts_in_token_order_one_copy_each():
    """A chunk a worker published again after an election is stored after the chunks sent
    behind it (and a copy may have been stored after all): the recorded text is in token order,
    each token once; an earlier attempt's chunks are not part of it."""
    rid = "req-1"
    stored = [(1, 0), (2, 0), (2, 2), (2, 1), (2, 3), (2, 1)]  # (attempt, seq), in stream order
    msgs = [
        _sm(
            "P_RESULTS",
            10 + i,
            T0 + i / 10,
            TokenChunk(request_id=rid, attempt=a, seq=seq, token_ids=(seq,), text=f"a{a}t{seq}"),
            stage="prefill",
        )
        for i, (a, seq) in enumerate(stored)
    ]
    case = history.RequestCase(rid, history.ordered(msgs))
    assert [m.msg.text for m in case.chunks()] == ["a2t0", "a2t1", "a2t2", "a2t3"]
    assert case.chunks()[1].seq == 13  # the first copy of seq 1


def test_timeline_shows_the_wait_for_an_engine_slot_before_the_prefill():
    by_name = {s.name: s for s in timeline.build_timeline(_epd_case(admission_s=0.050)).stages}
    slot = by_name["waiting for an engine slot"]
    assert slot.start == pytest.approx(T0 + 0.330) and slot.end == pytest.approx(T0 + 0.380)
    assert by_name["prefill"].start == pytest.approx(T0 + 0.380)  # it starts when the slot is there
    # A wait under a millisecond is no stage; the prefill still starts after it.
    by_name = {s.name: s for s in timeline.build_timeline(_epd_case(admission_s=0.0002)).stages}
    assert "waiting for an engine slot" not in by_name
    assert by_name["prefill"].start == pytest.approx(T0 + 0.3302)


def test_timeline_of_a_split_request_shows_the_kv_hand_off_and_a_recompute_reason():
    case = _epd_case(split=True)
    final_msg = case.terminal
    recomputed = msgspec.structs.replace(final_msg.msg, ec_sources={ITEM: "recomputed:timeout"})
    case.messages[case.messages.index(final_msg)] = history.StreamMessage.build(
        final_msg.stream,
        final_msg.seq,
        final_msg.subject,
        final_msg.time,
        final_msg.headers,
        protocol.encode(recomputed),
    )
    tl = timeline.build_timeline(case)
    by_name = {s.name: s for s in tl.stages}
    assert by_name["KV hand-off"].start == T0 + 0.500 and by_name["KV hand-off"].end == T0 + 0.520
    assert by_name["decode queued"].end == T0 + 0.560
    assert by_name["decode"].service == "decode" and by_name["decode"].start == T0 + 0.560
    assert by_name["EC recomputed locally"].detail.endswith(": timeout")
    assert "EC loaded from store" not in by_name


def test_html_page_is_self_contained_and_escaped():
    case = _epd_case()
    case.notes.append("<script>alert(1)</script>")
    page = timeline.render_html(case)
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "<script" not in page and "&lt;script&gt;" in page
    assert "<link" not in page and " src=" not in page and "url(" not in page
    for name in ("received", "encode queued", "EC stored", "prefill", "first token", "decode", "done"):
        assert f">{name}<" in page
    assert "200.0 ms" in page  # the encode span


def test_case_documents_are_validated():
    good = {
        "format": replay.CASE_FORMAT,
        "version": 1,
        "cases": [
            {
                "request_id": "req-1",
                "media": [],
                "messages": [
                    {
                        "stream": "S",
                        "subject": "s",
                        "seq": 1,
                        "time": T0,
                        "headers": {},
                        "data": base64.b64encode(protocol.encode(_job())).decode(),
                    }
                ],
            }
        ],
    }
    assert replay.validate_case_doc(good) is good
    case, message = good["cases"][0], good["cases"][0]["messages"][0]
    # Each bad document fails with its own error type and a message that names what is wrong.
    bad_cases = [
        ({"format": "other"}, replay.CaseFileError, "not an epd-replay-case document"),
        ({**good, "version": 99}, replay.CaseFileError, "unsupported case file version 99"),
        ({**good, "cases": []}, replay.CaseFileError, "holds no cases"),
        ({**good, "cases": [{**case, "request_id": "a.b"}]}, history.InvalidRequestId, "invalid request id 'a.b'"),
        (
            {**good, "cases": [{**case, "messages": [{**message, "data": "!!"}]}]},
            replay.CaseFileError,
            "message 0: not a valid protocol message",
        ),
        (
            {**good, "cases": [{**case, "messages": [{**message, "data": base64.b64encode(b"\x93junk").decode()}]}]},
            replay.CaseFileError,
            "message 0: not a valid protocol message",
        ),
        ({**good, "cases": [{**case, "media": [{"item_hash": 1}]}]}, replay.CaseFileError, "'media' must be a list"),
    ]
    for doc, error, needle in bad_cases:
        with pytest.raises(error) as info:
            replay.validate_case_doc(doc)
        assert needle in str(info.value), (doc, str(info.value))


def test_case_file_size_is_bounded(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 2048)
    monkeypatch.setattr(replay, "MAX_CASE_FILE_BYTES", 1024)
    with pytest.raises(replay.CaseFileError, match="over the 1024-byte limit"):
        replay.read_case_file(path)
    with pytest.raises(replay.CaseFileError, match="cannot read"):
        replay.read_case_file(tmp_path / "missing.json")


def test_request_ids_and_durations():
    for good in ("chatcmpl-0123abcd", "replay-ff", "a_b"):
        assert history.check_request_id(good) == good
    for bad in ("", "a.b", "a*", "a b", "x" * 500, "a>"):
        with pytest.raises(history.InvalidRequestId):
            history.check_request_id(bad)
    assert [parse_duration(x) for x in ("90", "30s", "15m", "2h", "1d")] == [90, 30, 900, 7200, 86400]
    for bad in ("soon", "", "5x", "-5"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"invalid duration {bad!r}"):
            parse_duration(bad)


def test_effective_seed_is_the_clients_else_derived_from_the_request_id():
    from shared.protocol import effective_seed

    assert effective_seed("chatcmpl-1", 7) == 7
    assert effective_seed("chatcmpl-1", None) == effective_seed("chatcmpl-1", None)
    assert effective_seed("chatcmpl-1", None) != effective_seed("chatcmpl-2", None)  # control


def test_outcome_diff_marks_the_changed_tokens():
    rec = FinalResult(
        request_id="a",
        attempt=1,
        token_ids=(1, 2, 3),
        text="abc",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=3,
    )
    new = FinalResult(
        request_id="b",
        attempt=1,
        token_ids=(1, 5, 3),
        text="aXc",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=3,
    )
    out = replay.ReplayOutcome("a", "b", True, None, rec, None, new, ["a", "b", "c"], ["a", "X", "c"], 0.1)
    assert out.identical is False and out.first_difference == 1
    assert out.diff() == "a[-b-]{+X+}c"
    same = replay.ReplayOutcome("a", "b", True, None, rec, None, rec, ["a", "b", "c"], ["a", "b", "c"], 0.1)
    assert same.identical is True and same.first_difference is None and same.diff() == "abc"


def test_json_logs_carry_the_request_id():
    record = logging.LogRecord("x.y", logging.INFO, __file__, 1, "done %s", ("ok",), None)
    token = REQUEST_ID.set("chatcmpl-42")
    try:
        RequestIdFilter().filter(record)
    finally:
        REQUEST_ID.reset(token)
    line = json.loads(JsonFormatter("prefill").format(record))
    assert line["request_id"] == "chatcmpl-42" and line["msg"] == "done ok" and line["service"] == "prefill"


def test_urls_lose_their_credentials():
    assert redact_url("nats://user:s3cret@nats:4222") == "nats://***@nats:4222"
    assert redact_url("nats://nats:4222") == "nats://nats:4222"
