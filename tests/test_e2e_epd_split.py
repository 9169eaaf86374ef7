"""E|P|D end to end: real NATS, real S3 server, real api / encoder / prefill (role ``prefill``) /
decode processes on the tiny Qwen2-VL.

The reference for every equality check is the transformers engine run aggregated in this process
(``tests.test_e2e_epd.reference_tokens``), as for E|PD. The decode worker's error events are
tested in ``tests/test_decode_errors.py`` (a stack of their own: misconfigured decode workers).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.engines.base import SamplingParams
from shared.media import content_hash_of
from shared.protocol import DecodeJob, ECReady, EncodeJob, GenerationJob, TokenChunk
from shared.store.objects import S3ObjectStore
from tests.stackutil import (
    GREEDY,
    api_tokens,
    chat_body,
    data_url,
    decoders,
    engine_encode,
    engine_messages,
    engine_tokens,
    final_result,
    kv_keys,
    noise_image,
    start_decoder,
    stop_decoders,
    stream_chat,
    stream_killing_a_decoder,
    stream_tokens,
    user_message,
    wait_for,
)
from tests.test_e2e_epd import CASES, REF_PARAMS, reference_tokens

pytestmark = pytest.mark.slow


@pytest.fixture
def store(epd_stack_epd, s3_server):
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, epd_stack_epd.bucket)


@pytest.fixture
def restore_decoder(epd_stack_epd):
    """Whatever a test does to the decode workers, a decode worker runs afterwards."""
    yield
    if not decoders(epd_stack_epd):
        start_decoder(epd_stack_epd)


def _other_images_change_the_output(engine, text, specs, got) -> bool:
    """Negative control: other images' features give other tokens, so an equality can fail.
    (Several other image sets: the tiny model's output depends only weakly on some images.)"""
    return any(
        reference_tokens(engine, text, [noise_image(seed + k, size) for seed, size in specs]) != got
        for k in (1000, 2000, 3000)
    )


# -- equality with the aggregated run -----------------------------------------------------------
@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
def test_epd_split_equals_aggregated(epd_stack_epd, reference_engine, store, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(epd_stack_epd, text, images)
    want = reference_tokens(reference_engine, text, images)
    assert got == want
    assert body["usage"]["completion_tokens"] == len(want) == 12
    assert body["choices"][0]["message"]["content"] == reference_engine.tokenizer.decode(want, skip_special_tokens=True)
    assert _other_images_change_the_output(reference_engine, text, specs, got)

    # It really went prefill -> KV object -> decode worker, and the KV object is gone after.
    rid = body["id"]
    jobs = epd_stack_epd.messages_of("stream_decode", DecodeJob, rid)
    assert len(jobs) == 1 and jobs[0].emitted == 1 and jobs[0].kv_nbytes > 0
    final = final_result(epd_stack_epd, rid)
    assert final.worker.startswith("decode-") and final.timings["kv_bytes"] == jobs[0].kv_nbytes
    assert jobs[0].prefill_worker.startswith("prefill-")
    assert jobs[0].kv_key not in kv_keys(store, epd_stack_epd)  # deleted before the worker acked


def test_seeded_sampling_continues_from_the_handed_off_rng_state(epd_stack_epd, reference_engine):
    image = noise_image(81, (56, 56))
    params = dict(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, return_token_ids=True)
    got = epd_stack_epd.chat([user_message("Tell me a story.", [data_url(image)])], seed=1234, **params)
    assert got.status_code == 200, got.text
    want = engine_tokens(
        reference_engine,
        engine_messages("Tell me a story.", 1),
        engine_encode(reference_engine, [image]),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    )
    assert got.json()["choices"][0]["token_ids"] == want
    other = engine_tokens(
        reference_engine,
        engine_messages("Tell me a story.", 1),
        engine_encode(reference_engine, [image]),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True),
    )
    assert other != want  # control: the seed matters


def test_streaming_and_a_request_that_ends_in_prefill(epd_stack_epd, reference_engine, store):
    image = noise_image(61, (64, 48))
    text = "Describe the image."
    want = reference_tokens(reference_engine, text, [image])
    out = stream_chat(epd_stack_epd, chat_body(text, [image], **GREEDY), timeout=120)
    assert out.done and out.errors == [] and out.token_ids == want
    # What the workers sent (prefill seq 0, decode seq 1..): one copy per seq, no gap.
    rid = out.events[0]["id"]
    chunks = epd_stack_epd.messages_of("stream_results", TokenChunk, rid)
    assert stream_tokens(chunks, final_result(epd_stack_epd, rid)) == want
    # max_tokens=1: the first token is the last; prefill finishes it, no decode job.
    resp = epd_stack_epd.chat([user_message(text, [data_url(image)])], **{**GREEDY, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == want[:1]
    assert epd_stack_epd.messages_of("stream_decode", DecodeJob, resp.json()["id"]) == []
    assert final_result(epd_stack_epd, resp.json()["id"]).worker.startswith("prefill-")


# -- one image, encoded once ----------------------------------------------------------------------
def _encode_jobs_and_ready(stack, item: str) -> tuple[list[EncodeJob], list[ECReady]]:
    jobs = [
        m
        for _, _, m in stack.stream_messages("stream_encode")
        if isinstance(m, EncodeJob) and m.image.item_hash == item
    ]
    ready = [m for _, _, m in stack.stream_messages("stream_events") if isinstance(m, ECReady) and m.item_hash == item]
    return jobs, ready


def test_one_image_in_concurrent_requests_is_encoded_once(epd_stack_epd, reference_engine, store):
    """N concurrent requests with the same (new) image: one encode job, one ECReady, and every
    answer equals the aggregated run of its prompt."""
    image = noise_image(91, (64, 64))
    item = content_hash_of(image)
    prompts = [f"Prompt number {i}: describe the image." for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: api_tokens(epd_stack_epd, p, [image]), prompts))

    jobs, ready = _encode_jobs_and_ready(epd_stack_epd, item)
    assert len(jobs) == 1, jobs
    assert len(ready) == 1 and ready[0].encode_s > 0, ready
    for prompt, (got, body) in zip(prompts, results):
        assert got == reference_tokens(reference_engine, prompt, [image]), prompt
        final = final_result(epd_stack_epd, body["id"])
        assert final.ec_sources[item] in ("store", "local_cache"), final.ec_sources
    assert _other_images_change_the_output(reference_engine, prompts[0], [(91, (64, 64))], results[0][0])


def test_same_image_twice_in_one_request_is_encoded_once(epd_stack_epd, reference_engine, store):
    """One request with the same (new) image twice: one encode job, and the output equals the
    aggregated run with the image twice - not with it once, nor with two different images."""
    image, other = noise_image(92, (56, 56)), noise_image(93, (56, 56))
    item = content_hash_of(image)
    text = "Compare these two images."
    got, body = api_tokens(epd_stack_epd, text, [image, image])

    jobs, ready = _encode_jobs_and_ready(epd_stack_epd, item)
    assert len(jobs) == 1 and len(ready) == 1, (jobs, ready)
    assert got == reference_tokens(reference_engine, text, [image, image])
    # Controls: both placeholders matter, and both get this image's features.
    once = engine_tokens(
        reference_engine, engine_messages(text, 1), engine_encode(reference_engine, [image]), REF_PARAMS
    )
    assert got != once
    assert got != reference_tokens(reference_engine, text, [image, other])
    assert got != reference_tokens(reference_engine, text, [other, image])
    assert final_result(epd_stack_epd, body["id"]).worker.startswith("decode-")


# -- batching -----------------------------------------------------------------------------------
BATCH = [
    ("Describe the image.", [(201, (64, 48))], 32),
    ("What color dominates here?", [(202, (56, 56))], 30),
    ("Count the objects in this one, please.", [(203, (90, 40))], 28),
    ("Compare these two images.", [(204, (56, 84)), (205, (84, 56))], 26),
    ("Hello there, how are you today?", [], 24),
]


def test_concurrent_requests_batched_in_one_decode_worker_equal_single(
    epd_stack_epd, reference_engine, store, restore_decoder
):
    """5 requests of different prompt lengths and lengths through ONE decode worker, decoded
    together (one forward per step, rows joining and leaving), each equal to its single run."""
    stop_decoders(epd_stack_epd)
    before = len(epd_stack_epd.stream_messages("stream_decode"))

    def run(case):
        text, specs, n = case
        images = [noise_image(s, size) for s, size in specs]
        return api_tokens(epd_stack_epd, text, images, max_tokens=n)

    with ThreadPoolExecutor(len(BATCH)) as pool:
        futures = [pool.submit(run, case) for case in BATCH]
        # All decode jobs wait in the stream; then one worker takes them in one fetch.
        wait_for(
            lambda: len(epd_stack_epd.stream_messages("stream_decode")) >= before + len(BATCH), 120, "the decode jobs"
        )
        start_decoder(epd_stack_epd)  # 50 ms per step: they overlap even if loading KV takes a while
        results = [f.result(timeout=180) for f in futures]

    rows, workers = [], set()
    for (text, specs, n), (got, body) in zip(BATCH, results):
        images = [noise_image(s, size) for s, size in specs]
        want = engine_tokens(
            reference_engine,
            engine_messages(text, len(images)),
            engine_encode(reference_engine, images),
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        assert got == want, text
        final = final_result(epd_stack_epd, body["id"])
        rows.append(final.timings["decode_batch_rows_max"])
        workers.add(final.worker)
    assert len(workers) == 1, workers  # one decode worker
    assert max(rows) >= 4, rows  # they really were decoded together


# -- failures -----------------------------------------------------------------------------------
def test_corrupted_kv_object_is_reprefilled_with_the_same_output(
    epd_stack_epd, reference_engine, store, restore_decoder
):
    stop_decoders(epd_stack_epd)
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
        start_decoder(epd_stack_epd)
        got, body = future.result(timeout=180)
    assert got == want
    rid = body["id"]
    assert key.endswith(f"{rid}-0")
    gens = epd_stack_epd.messages_of("stream_generate", GenerationJob, rid)
    assert sorted(g.reprefill for g in gens) == [0, 1]  # prefilled once more, and only once
    assert sorted(j.kv_attempt for j in epd_stack_epd.messages_of("stream_decode", DecodeJob, rid)) == [0, 1]
    assert re.search(rf"kv miss key=\S*{rid}-0 reason=checksum_mismatch", epd_stack_epd.log_of("decode"))
    assert list(final_result(epd_stack_epd, rid).token_ids) == want


def test_killed_decode_worker_request_completes(epd_stack_epd, reference_engine, store, restore_decoder):
    """SIGKILL the decode worker after it streamed tokens: the job is redelivered (after the
    stack's 15 s ack wait), the next worker decodes again from the KV object (same tokens, same
    seq numbers), the API drops what it already forwarded, and the client gets the complete,
    correct answer."""
    (victim,) = decoders(epd_stack_epd)  # 50 ms per step: 63 steps take >= 3 s
    image = noise_image(72, (64, 48))
    text = "Describe the image."
    want = engine_tokens(
        reference_engine,
        engine_messages(text, 1),
        engine_encode(reference_engine, [image]),
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
    )
    body = chat_body(text, [image], **{**GREEDY, "max_tokens": 64})
    ids, rid, killed_after, done = stream_killing_a_decoder(epd_stack_epd, body, victim, timeout=180)
    assert done and killed_after is not None and killed_after < len(want)
    assert ids == want  # complete, no token twice, none missing
    final = final_result(epd_stack_epd, rid)  # exactly one: the killed attempt never finished
    assert final.attempt == 2 and list(final.token_ids) == want
    # The second worker re-emitted what the first had sent, under the same seq numbers (the
    # copies agree: stream_tokens checks every (attempt, seq)).
    chunks = epd_stack_epd.messages_of("stream_results", TokenChunk, rid)
    assert stream_tokens(chunks, final) == want
    seq1 = [c for c in chunks if c.seq == 1]
    assert {c.attempt for c in seq1} == {1, 2}
