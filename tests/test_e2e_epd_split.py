"""E|P|D end to end: real NATS, real S3 server, real api / encoder / prefill (role ``prefill``) /
decode processes on the tiny Qwen2-VL.

The reference for every equality check is the transformers engine run aggregated in this process
(``tests.test_e2e_epd.reference_tokens``), as for E|PD.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared import protocol
from shared.engines.base import SamplingParams
from shared.fingerprint import model_fingerprint
from shared.objectstore import S3ObjectStore
from shared.protocol import DecodeJob, ErrorEvent, FinalResult, GenerationJob, SamplingSpec, TokenChunk
from tests.stackutil import data_url, engine_messages, kv_keys, noise_image, stream_killing_a_decoder, user_message
from tests.stackutil import decoders as _decoders, start_decoder as _start_decoder, stop_decoders as _stop_decoders
from tests.stackutil import wait_for
from tests.test_e2e_epd import CASES, GREEDY, api_tokens, reference_tokens

pytestmark = pytest.mark.slow


# -- helpers ------------------------------------------------------------------------------------
def _messages_of(stack, stream_attr, cls, request_id):
    return [m for _, _, m in stack.stream_messages(stream_attr) if isinstance(m, cls) and m.request_id == request_id]


def _final(stack, request_id) -> FinalResult:
    finals = _messages_of(stack, "stream_results", FinalResult, request_id)
    assert len(finals) >= 1
    return finals[0]


@pytest.fixture
def store(epd_stack_epd, s3_server):
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, epd_stack_epd.bucket)


@pytest.fixture
def restore_decoder(epd_stack_epd):
    """Whatever a test does to the decode workers, a decode worker runs afterwards."""
    yield
    if not _decoders(epd_stack_epd):
        _start_decoder(epd_stack_epd)


def _decode_log(stack) -> str:
    return "\n".join(p.log_path.read_text() for p in stack.stack.processes if p.name == "decode")


# -- equality with the aggregated run -----------------------------------------------------------
@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
def test_epd_split_equals_aggregated(epd_stack_epd, reference_engine, store, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(epd_stack_epd, text, images)
    want = reference_tokens(reference_engine, text, images)
    assert got == want
    assert body["usage"]["completion_tokens"] == len(want) == 12
    assert body["choices"][0]["message"]["content"] == reference_engine.tokenizer.decode(want, skip_special_tokens=True)
    # Negative control: other images' features give other tokens, so the equality above can fail.
    # (Several other image sets: the tiny model's output depends only weakly on some images.)
    assert any(reference_tokens(reference_engine, text, [noise_image(seed + k, size) for seed, size in specs]) != got
               for k in (1000, 2000, 3000))

    # It really went prefill -> KV object -> decode worker, and the KV object is gone after.
    rid = body["id"]
    jobs = _messages_of(epd_stack_epd, "stream_decode", DecodeJob, rid)
    assert len(jobs) == 1 and jobs[0].emitted == 1 and jobs[0].kv_nbytes > 0
    final = _final(epd_stack_epd, rid)
    assert final.worker.startswith("decode-") and final.timings["kv_bytes"] == jobs[0].kv_nbytes
    assert jobs[0].prefill_worker.startswith("prefill-")
    wait_for(lambda: jobs[0].kv_key not in kv_keys(store, epd_stack_epd), 10, "KV object deletion")


def test_seeded_sampling_continues_from_the_handed_off_rng_state(epd_stack_epd, reference_engine):
    image = noise_image(81, (56, 56))
    params = dict(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, return_token_ids=True)
    got = epd_stack_epd.chat([user_message("Tell me a story.", [data_url(image)])], seed=1234, **params)
    assert got.status_code == 200, got.text
    want = [ev.token_id for ev in reference_engine.generate(
        engine_messages("Tell me a story.", 1), reference_engine.encode([image]),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True))]
    assert got.json()["choices"][0]["token_ids"] == want
    other = reference_engine.generate(engine_messages("Tell me a story.", 1), reference_engine.encode([image]),
                                      SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321,
                                                     ignore_eos=True))
    assert [ev.token_id for ev in other] != want  # control: the seed matters


def test_streaming_and_a_request_that_ends_in_prefill(epd_stack_epd, reference_engine):
    image = noise_image(61, (64, 48))
    text = "Describe the image."
    want = reference_tokens(reference_engine, text, [image])
    body = {"model": "qwen2-vl-tiny", "messages": [user_message(text, [data_url(image)])], "stream": True, **GREEDY}
    ids = []
    with httpx.stream("POST", f"{epd_stack_epd.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    ids.extend(choice.get("token_ids", []))
    assert ids == want
    # max_tokens=1: the first token is the last; prefill finishes it, no decode job.
    resp = epd_stack_epd.chat([user_message(text, [data_url(image)])], **{**GREEDY, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == want[:1]
    assert _messages_of(epd_stack_epd, "stream_decode", DecodeJob, resp.json()["id"]) == []


# -- batching -----------------------------------------------------------------------------------
BATCH = [
    ("Describe the image.", [(201, (64, 48))], 32),
    ("What color dominates here?", [(202, (56, 56))], 30),
    ("Count the objects in this one, please.", [(203, (90, 40))], 28),
    ("Compare these two images.", [(204, (56, 84)), (205, (84, 56))], 26),
    ("Hello there, how are you today?", [], 24),
]


def test_concurrent_requests_batched_in_one_decode_worker_equal_single(epd_stack_epd, reference_engine,
                                                                       restore_decoder):
    """5 requests of different prompt lengths and lengths through ONE decode worker, decoded
    together (one forward per step, rows joining and leaving), each equal to its single run."""
    _stop_decoders(epd_stack_epd)
    before = len(epd_stack_epd.stream_messages("stream_decode"))

    def run(case):
        text, specs, n = case
        images = [noise_image(s, size) for s, size in specs]
        return api_tokens(epd_stack_epd, text, images, max_tokens=n)

    with ThreadPoolExecutor(len(BATCH)) as pool:
        futures = [pool.submit(run, case) for case in BATCH]
        # All decode jobs wait in the stream; then one worker takes them in one fetch.
        wait_for(lambda: len(epd_stack_epd.stream_messages("stream_decode")) >= before + len(BATCH), 120,
                  "the decode jobs")
        _start_decoder(epd_stack_epd)  # 50 ms per step: they overlap even if loading KV takes a while
        results = [f.result(timeout=180) for f in futures]

    rows = []
    for (text, specs, n), (got, body) in zip(BATCH, results):
        images = [noise_image(s, size) for s, size in specs]
        want = [ev.token_id for ev in reference_engine.generate(
            engine_messages(text, len(images)), reference_engine.encode(images),
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]
        assert got == want, text
        final = _final(epd_stack_epd, body["id"])
        rows.append(final.timings["decode_batch_rows_max"])
        assert final.worker == _final(epd_stack_epd, results[0][1]["id"]).worker  # one decode worker
    assert max(rows) >= 4, rows  # they really were decoded together


# -- failures -----------------------------------------------------------------------------------
def test_corrupted_kv_object_is_reprefilled_with_the_same_output(epd_stack_epd, reference_engine, store,
                                                                 restore_decoder):
    _stop_decoders(epd_stack_epd)
    image = noise_image(71, (56, 56))
    text = "Describe the image."
    want = reference_tokens(reference_engine, text, [image])
    existing = kv_keys(store, epd_stack_epd)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(api_tokens, epd_stack_epd, text, [image])
        new = wait_for(lambda: kv_keys(store, epd_stack_epd) - existing, 120, "the KV object")
        (key,) = new
        blob = bytearray(store.get(key, max_bytes=1 << 30))
        blob[-7] ^= 0xFF  # a flipped byte inside the KV tensors
        store.put(key, bytes(blob), metadata=store.stat(key).metadata)
        _start_decoder(epd_stack_epd)
        got, body = future.result(timeout=180)
    assert got == want
    rid = body["id"]
    assert key.endswith(f"{rid}-0")
    gens = _messages_of(epd_stack_epd, "stream_generate", GenerationJob, rid)
    assert sorted(g.reprefill for g in gens) == [0, 1]  # prefilled once more, and only once
    assert sorted(j.kv_attempt for j in _messages_of(epd_stack_epd, "stream_decode", DecodeJob, rid)) == [0, 1]
    assert re.search(rf"kv miss key=\S*{rid}-0 reason=checksum_mismatch", _decode_log(epd_stack_epd))
    wait_for(lambda: not {k for k in kv_keys(store, epd_stack_epd) if rid in k}, 10, "KV cleanup")


def test_killed_decode_worker_request_completes(epd_stack_epd, reference_engine, restore_decoder):
    """SIGKILL the decode worker after it streamed tokens: the job is redelivered, the next
    worker decodes again from the KV object (same tokens, same seq numbers), the API drops what
    it already forwarded, and the client gets the complete, correct answer."""
    (victim,) = _decoders(epd_stack_epd)  # 50 ms per step: 63 steps take >= 3 s
    image = noise_image(72, (64, 48))
    text = "Describe the image."
    want = [ev.token_id for ev in reference_engine.generate(
        engine_messages(text, 1), reference_engine.encode([image]),
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))]
    body = {"model": "qwen2-vl-tiny", "messages": [user_message(text, [data_url(image)])], "stream": True,
            **GREEDY, "max_tokens": 64}
    ids, rid, killed_after, done = stream_killing_a_decoder(epd_stack_epd, body, victim, timeout=180)
    assert done and killed_after is not None and killed_after < len(want)
    assert ids == want  # complete, no token twice, none missing
    final = _final(epd_stack_epd, rid)
    assert final.attempt == 2 and list(final.token_ids) == want
    # The second worker re-emitted what the first had sent, under the same seq numbers.
    chunks = _messages_of(epd_stack_epd, "stream_results", TokenChunk, rid)
    seq1 = [c for c in chunks if c.seq == 1]
    assert {c.attempt for c in seq1} == {1, 2} and len({c.token_ids for c in seq1}) == 1


async def _publish_and_wait(nats_url, subjects, subject, msg, request_id, timeout=60):
    import nats

    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(subjects.tokens(request_id))
        await nc.jetstream().publish(subject, protocol.encode(msg), headers=protocol.headers_for(msg, request_id))
        deadline = time.time() + timeout
        while time.time() < deadline:
            event = protocol.decode((await sub.next_msg(timeout=deadline - time.time())).data)
            if not isinstance(event, TokenChunk):
                return event
    finally:
        await nc.close()


def _crafted_decode_job(stack, tiny_model_dir, request_id, *, reprefill, fingerprint=None):
    fp = fingerprint or model_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")
    sampling = SamplingSpec(temperature=0, max_tokens=8, ignore_eos=True)
    gen = GenerationJob(
        request_id=request_id, model="qwen2-vl-tiny", messages=engine_messages("Hello", 0), images=(),
        fingerprint="x", sampling=sampling, stream=False, deadline=time.time() + 60, created_at=time.time(),
        reprefill=reprefill,
    )
    return DecodeJob(
        request_id=request_id, kv_key=f"{stack.namespace}/kv/{fp}/{request_id}-{reprefill}", kv_attempt=reprefill,
        kv_nbytes=1, model_fingerprint=fp, sampling=sampling, deadline=gen.deadline, created_at=time.time(),
        emitted=1, emitted_text="", prompt_tokens=5, generation=gen,
    )


def test_reprefills_are_bounded(epd_stack_epd, tiny_model_dir):
    """A KV object that is missing again after the last allowed re-prefill ends the request with
    a clear error instead of looping."""
    rid = f"test-bounded-{int(time.time() * 1000)}"
    job = _crafted_decode_job(epd_stack_epd, tiny_model_dir, rid, reprefill=2)  # EPD_MAX_REPREFILLS=2
    event = asyncio.run(_publish_and_wait(epd_stack_epd.nats_url, epd_stack_epd.subjects,
                                          epd_stack_epd.subjects.decode_jobs, job, rid))
    assert isinstance(event, ErrorEvent) and event.code == "kv_unavailable" and event.http_status == 502
    assert "not_found" in event.message
    assert _messages_of(epd_stack_epd, "stream_generate", GenerationJob, rid) == []  # no further prefill


def test_decode_job_of_another_model_is_refused(epd_stack_epd, tiny_model_dir):
    rid = f"test-othermodel-{int(time.time() * 1000)}"
    job = _crafted_decode_job(epd_stack_epd, tiny_model_dir, rid, reprefill=0, fingerprint="0" * 24)
    event = asyncio.run(_publish_and_wait(epd_stack_epd.nats_url, epd_stack_epd.subjects,
                                          epd_stack_epd.subjects.decode_jobs, job, rid))
    assert isinstance(event, ErrorEvent) and event.code == "model_mismatch"
