"""E|PD end to end: real NATS, real S3 server, real api/encoder/prefill processes, tiny Qwen2-VL.

The reference for every equality check is the same transformers engine run aggregated in this
process (encode + generate, no NATS, no store).
"""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.engines.base import SamplingParams
from shared.engines.ec_objects import encoded_to_extra
from shared.media import content_hash_of
from shared.protocol import (
    ECReady,
    ECSource,
    EncodeJob,
    FinalResult,
    GenerationJob,
    ImageRef,
    SamplingSpec,
    recomputed,
)
from shared.store.ec import META_FINGERPRINT, META_SCHEMA, ECStore
from shared.store.format import SCHEMA, encode_ec_object
from shared.store.objects import S3ObjectStore
from shared.store.tensors import tensor_to_raw

# GREEDY and api_tokens are imported from here by other test modules too.
from tests.stackutil import (
    GREEDY,
    api_tokens,
    data_url,
    engine_encode,
    engine_messages,
    engine_tokens,
    final_result,
    metric_value,
    noise_image,
    png_bytes,
    run_job,
    scrape,
    user_message,
)

pytestmark = pytest.mark.slow

REF_PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

CASES = [
    ("non-square", "Describe the image.", [(11, (64, 48))]),
    ("square", "What color dominates?", [(12, (56, 56))]),
    ("wide", "Count the objects.", [(13, (90, 40))]),
    ("two-images", "Compare these two images.", [(14, (56, 84)), (15, (84, 56))]),
]


def reference_tokens(engine, text, images):
    """Greedy tokens of the aggregated reference: ``engine`` encodes and generates in process."""
    return engine_tokens(engine, engine_messages(text, len(images)), engine_encode(engine, images), REF_PARAMS)


@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
def test_disaggregated_equals_aggregated(epd_stack, reference_engine, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(epd_stack, text, images)
    want = reference_tokens(reference_engine, text, images)
    assert got == want
    assert body["usage"]["completion_tokens"] == len(want) == 12
    assert body["choices"][0]["message"]["content"] == reference_engine.tokenizer.decode(want, skip_special_tokens=True)
    # Negative control: other images' features give other tokens, so the equality above can fail.
    others = [noise_image(seed + 1000, size) for seed, size in specs]
    assert reference_tokens(reference_engine, text, others) != got


def test_text_only_request_publishes_no_encode_job(epd_stack):
    resp = epd_stack.chat([{"role": "user", "content": "Hello there, how are you?"}], **GREEDY)
    assert resp.status_code == 200, resp.text
    rid = resp.json()["id"]
    assert len(resp.json()["choices"][0]["token_ids"]) == 12
    assert epd_stack.messages_of("stream_encode", EncodeJob, rid) == []
    assert final_result(epd_stack, rid).ec_sources == {}
    # Control: an image request does publish one, for its image.
    image = noise_image(21, (56, 56))
    resp = epd_stack.chat([user_message("Hi", [data_url(image)])], **GREEDY)
    assert resp.status_code == 200, resp.text
    jobs = epd_stack.messages_of("stream_encode", EncodeJob, resp.json()["id"])
    assert [j.image.item_hash for j in jobs] == [content_hash_of(image)]


def test_one_image_in_concurrent_requests_is_encoded_once(epd_stack):
    image = noise_image(31, (64, 64))
    item = content_hash_of(image)
    url = data_url(image)
    n = 4
    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(lambda i: epd_stack.chat([user_message(f"Prompt {i}", [url])], **GREEDY), range(n)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]

    jobs = [
        m
        for _, _, m in epd_stack.stream_messages("stream_encode")
        if isinstance(m, EncodeJob) and m.image.item_hash == item
    ]
    ready = [
        m for _, _, m in epd_stack.stream_messages("stream_events") if isinstance(m, ECReady) and m.item_hash == item
    ]
    assert len(jobs) == 1
    assert len(ready) == 1 and ready[0].encode_s > 0
    finals = [final_result(epd_stack, r.json()["id"]) for r in responses]  # exactly one each
    assert len({f.request_id for f in finals}) == n
    sources = [f.ec_sources[item] for f in finals]
    assert all(s in (ECSource.STORE, ECSource.LOCAL_CACHE) for s in sources), sources


# -- store damage: the request still completes with the same tokens via local encoding ---------
@pytest.fixture
def ec_store(epd_stack, s3_server, reference_engine):
    store = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, epd_stack.bucket)
    return ECStore(
        store, namespace=epd_stack.namespace, fingerprint=reference_engine.encoder_fingerprint, producer="test"
    )


def _put_valid_object(ec_store, engine, image):
    item = content_hash_of(image)
    encoded = engine_encode(engine, [image])[0]
    raw, dtype, shape = tensor_to_raw(encoded.features)
    ec_store.save(item, raw, dtype=dtype, shape=shape, extra=encoded_to_extra(encoded))
    return item, raw, dtype, shape, encoded


def _recomputed(stack, reason: str) -> float:
    return metric_value(
        scrape(f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics"),
        "epd:ec_lookups_total",
        source="recomputed",
        reason=reason,
    )


def _run_damaged(epd_stack, reference_engine, image, reason):
    text = "Describe the image."
    want = reference_tokens(reference_engine, text, [image])
    before = _recomputed(epd_stack, reason)
    encode_jobs_before = len(epd_stack.stream_messages("stream_encode"))
    got, body = api_tokens(epd_stack, text, [image])
    assert got == want
    item = content_hash_of(image)
    final = final_result(epd_stack, body["id"])
    assert final.ec_sources[item] == recomputed(reason)
    assert _recomputed(epd_stack, reason) == before + 1
    assert re.search(rf"ec miss key=\S*{item}\S* reason={reason}", epd_stack.log_of("prefill"))
    # The API saw a valid-looking object and queued no encode job: the worker did not wait.
    assert len(epd_stack.stream_messages("stream_encode")) == encode_jobs_before
    return item


def test_corrupted_ec_object_is_recomputed(epd_stack, reference_engine, ec_store):
    image = noise_image(41, (56, 56))
    item, *_ = _put_valid_object(ec_store, reference_engine, image)
    key = ec_store.key(item)
    blob = bytearray(ec_store.store.get(key, max_bytes=1 << 30))
    blob[-5] ^= 0xFF  # flip bytes inside the tensor data
    info = ec_store.store.stat(key)
    ec_store.store.put(key, bytes(blob), metadata=info.metadata)
    _run_damaged(epd_stack, reference_engine, image, "checksum_mismatch")
    # The worker wrote a good object back: the store is repaired.
    assert ec_store.load(item).n_tokens > 0


def test_ec_object_of_another_fingerprint_is_not_used(epd_stack, reference_engine, ec_store):
    image = noise_image(42, (56, 56))
    item, raw, dtype, shape, _ = _put_valid_object(ec_store, reference_engine, image)
    # Same key, S3 metadata claiming our version, but the object was produced by another model.
    foreign = encode_ec_object(raw, dtype=dtype, shape=shape, fingerprint="0" * 24, item_hash=item, producer="other")
    ec_store.store.put(
        ec_store.key(item), foreign, metadata={META_SCHEMA: SCHEMA, META_FINGERPRINT: ec_store.fingerprint}
    )
    _run_damaged(epd_stack, reference_engine, image, "fingerprint_mismatch")


def test_ec_object_under_another_fingerprint_key_is_never_hit(epd_stack, reference_engine, ec_store):
    """An object stored for the same image by another encoder version lives under another key:
    the API does not see it (it queues an encode job) and the worker does not load it."""
    image = noise_image(43, (56, 56))
    item = content_hash_of(image)
    other = ECStore(ec_store.store, namespace=ec_store.namespace, fingerprint="f" * 24, producer="other-model")
    assert other.key(item) != ec_store.key(item)
    wrong = engine_encode(reference_engine, [noise_image(44, (56, 56))])[0]  # deliberately wrong features
    raw, dtype, shape = tensor_to_raw(wrong.features)
    other.save(item, raw, dtype=dtype, shape=shape, extra=encoded_to_extra(wrong))
    text = "Describe the image."
    got, body = api_tokens(epd_stack, text, [image])
    assert got == reference_tokens(reference_engine, text, [image])
    # Negative control: the foreign object's features would have given other tokens.
    assert engine_tokens(reference_engine, engine_messages(text, 1), [wrong], REF_PARAMS) != got
    # The API found no object for our encoder version, so it queued this request's encode job.
    jobs = epd_stack.messages_of("stream_encode", EncodeJob, body["id"])
    assert [j.image.item_hash for j in jobs] == [item]
    assert final_result(epd_stack, body["id"]).ec_sources[item] in (ECSource.STORE, ECSource.LOCAL_CACHE)


def test_ec_object_deleted_after_scheduling_is_recomputed(epd_stack, reference_engine, ec_store):
    """The API saw the object (no encode job queued); it vanished before the worker loaded it."""
    image = noise_image(45, (56, 56))
    item, *_ = _put_valid_object(ec_store, reference_engine, image)
    media_key = ec_store.put_media(item, png_bytes(image))
    ec_store.store.delete(ec_store.key(item))
    text = "Describe the image."
    request_id = f"test-deleted-{uuid.uuid4().hex[:12]}"
    job = GenerationJob(
        request_id=request_id,
        model="qwen2-vl-tiny",
        messages=engine_messages(text, 1),
        images=(ImageRef(item_hash=item, media_key=media_key, width=56, height=56, encode_queued=False),),
        fingerprint=ec_store.fingerprint,
        sampling=SamplingSpec(temperature=0, max_tokens=12, ignore_eos=True),
        stream=False,
        deadline=time.time() + 120,
        created_at=time.time(),
    )
    outcome = run_job(epd_stack, epd_stack.subjects.generate_jobs, job, timeout=120)
    assert isinstance(outcome.terminal, FinalResult), outcome.terminal
    want = reference_tokens(reference_engine, text, [image])
    assert outcome.tokens == list(outcome.terminal.token_ids) == want
    assert final_result(epd_stack, request_id).ec_sources[item] == "recomputed:not_found"


# -- the official OpenAI client -----------------------------------------------------------------
def test_openai_client_non_streaming_and_streaming(epd_stack, reference_engine):
    from openai import OpenAI

    client = OpenAI(base_url=f"{epd_stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen2-vl-tiny"]

    image = noise_image(51, (64, 48))
    text = "Describe the image."
    want = reference_tokens(reference_engine, text, [image])
    want_text = reference_engine.tokenizer.decode(want, skip_special_tokens=True)
    messages = [user_message(text, [data_url(image)])]
    extra = {"ignore_eos": True}

    completion = client.chat.completions.create(
        model="qwen2-vl-tiny", messages=messages, temperature=0, max_tokens=12, extra_body=extra
    )
    assert completion.choices[0].message.content == want_text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12 and completion.usage.prompt_tokens > 12

    stream = client.chat.completions.create(
        model="qwen2-vl-tiny",
        messages=messages,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == want_text
    assert finish == "length" and usage.completion_tokens == 12


def test_sampling_seed_and_stop_through_the_api(epd_stack, reference_engine):
    image = noise_image(81, (56, 56))
    msgs = [user_message("Tell me a story.", [data_url(image)])]
    params = dict(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, return_token_ids=True)
    a = epd_stack.chat(msgs, seed=1234, **params).json()["choices"][0]
    b = epd_stack.chat(msgs, seed=1234, **params).json()["choices"][0]
    c = epd_stack.chat(msgs, seed=4321, **params).json()["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]  # control: the seed matters
    # Same as the engine sampling in-process with that seed.
    want = engine_tokens(
        reference_engine,
        engine_messages("Tell me a story.", 1),
        engine_encode(reference_engine, [image]),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    )
    assert a["token_ids"] == want

    # A stop string cut from the greedy text ends the completion right before it.
    full = epd_stack.chat(msgs, **GREEDY).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert len(stop) == 2
    cut = epd_stack.chat(msgs, temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == full[: full.index(stop)]
