"""E|P|D on vLLM, whole stack: real NATS, real S3 server, api + encoder + prefill (role
``prefill``) + decode processes, all with ``EPD_ENGINE=vllm``. Encoder outputs move through
MinioECConnector, the prompt's KV cache through MinioKVConnector (``kv_transfer_params``).

The reference for every equality check is a plain vLLM engine run aggregated in this process.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared import protocol
from shared.engines.base import SamplingParams
from shared.fingerprint import model_fingerprint
from shared.objectstore import S3ObjectStore
from shared.protocol import DecodeJob, ErrorEvent, FinalResult, GenerationJob, SamplingSpec, TokenChunk
from tests.stackutil import (
    data_url, decoders, engine_messages, kv_keys, noise_image, start_stack, stream_killing_a_decoder, user_message,
    wait_for,
)
from tests.test_e2e_epd import api_tokens
from tests.vllmutil import CASES, generate, media

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_epd_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("vepd")
    running = start_stack(
        nats_server, s3_server, tiny_model_dir, work / "logs", topology="e-p-d",
        ready_timeout=900,  # three vLLM engines start at once (~150 s on 2 busy cores)
        EPD_ENGINE="vllm", EPD_VLLM_DIR=str(work / "vllm"),
        EPD_MAX_IMAGES_PER_REQUEST="2", EPD_MAX_IMAGE_BYTES=str(512 * 1024),
        EPD_ACK_WAIT_S="4",  # a killed decode worker's job is redelivered quickly
        EPD_REQUEST_TIMEOUT_S="600",  # ... but its replacement's vLLM takes a while to start
    )
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def store(vllm_epd_stack, s3_server):
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, vllm_epd_stack.bucket)


def _final(stack, request_id) -> FinalResult:
    finals = [m for _, _, m in stack.stream_messages("stream_results")
              if isinstance(m, FinalResult) and m.request_id == request_id]
    assert len(finals) == 1
    return finals[0]


def _decode_jobs(stack, request_id):
    return [m for _, _, m in stack.stream_messages("stream_decode")
            if isinstance(m, DecodeJob) and m.request_id == request_id]


@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
def test_epd_on_vllm_equals_aggregated_vllm(vllm_epd_stack, vllm_reference, store, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(vllm_epd_stack, text, images)
    want, _ = generate(vllm_reference, text, [media(seed, size) for seed, size in specs])
    assert got == want
    # Negative control: other images give other tokens, so the equality above can fail.
    assert generate(vllm_reference, text, [media(seed + 1000, size) for seed, size in specs])[0] != got
    rid = body["id"]
    (job,) = _decode_jobs(vllm_epd_stack, rid)  # prefill handed it off, and streamed nothing itself
    assert job.emitted == 0 and job.kv_key.endswith(f"/{rid}-0")
    final = _final(vllm_epd_stack, rid)
    assert final.kv_source == "store"  # the decode engine loaded the prefill engine's KV
    assert set(final.ec_sources.values()) == {"store"}
    assert final.worker != job.prefill_worker
    # The decode worker deletes the object when the request ends.
    wait_for(lambda: not any(rid in k for k in kv_keys(store, vllm_epd_stack)), 10, "KV cleanup")


BATCH = [
    ("Describe the image.", [(301, (64, 48))], 16),
    ("What color dominates?", [(302, (56, 56))], 9),
    ("Count the objects in this one, please.", [(303, (90, 40))], 20),
    ("Compare these two images.", [(304, (56, 84)), (305, (84, 56))], 13),
    ("Hello there, how are you today?", [], 11),
]


def test_concurrent_requests_through_one_decode_worker_equal_single(vllm_epd_stack, vllm_reference):
    """Five requests at once through the one decode worker (its vLLM batches them), each equal to
    its aggregated single run."""
    def run(case):
        text, specs, n = case
        return api_tokens(vllm_epd_stack, text, [noise_image(s, size) for s, size in specs], max_tokens=n)

    with ThreadPoolExecutor(len(BATCH)) as pool:
        results = list(pool.map(run, BATCH))
    workers = set()
    for (text, specs, n), (got, body) in zip(BATCH, results):
        items = [media(s, size) for s, size in specs]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        want = [e.token_id for e in vllm_reference.generate(engine_messages(text, len(items)), items, params)]
        assert got == want, text
        final = _final(vllm_epd_stack, body["id"])
        assert final.kv_source == "store"
        workers.add(final.worker)
    assert len(workers) == 1


def test_seeded_sampling_draws_as_in_the_aggregated_run(vllm_epd_stack, vllm_reference):
    """The decode engine samples every token (prefill streams none), so a seeded sampled request
    equals the aggregated run with the same seed; another seed is the negative control."""
    text, image = "Describe the image.", noise_image(311, (56, 56))
    got, _ = api_tokens(vllm_epd_stack, text, [image], temperature=0.9, seed=1234, max_tokens=16)
    item = media(311, (56, 56))

    def sampled(seed):
        params = SamplingParams(max_tokens=16, temperature=0.9, seed=seed, ignore_eos=True)
        return [e.token_id for e in vllm_reference.generate(engine_messages(text, 1), [item], params)]

    assert got == sampled(1234)
    assert got != sampled(4321)


async def _run_decode_job(stack, job: DecodeJob, timeout=120):
    import nats

    nc = await nats.connect(stack.nats_url)
    try:
        sub = await nc.subscribe(stack.subjects.tokens(job.request_id))
        await nc.jetstream().publish(stack.subjects.decode_jobs, protocol.encode(job),
                                     headers=protocol.headers_for(job, job.request_id))
        deadline = time.time() + timeout
        tokens = []
        while time.time() < deadline:
            event = protocol.decode((await sub.next_msg(timeout=deadline - time.time())).data)
            if isinstance(event, TokenChunk):
                tokens.extend(event.token_ids)
            else:
                return tokens, event
        raise AssertionError("no final event")
    finally:
        await nc.close()


@pytest.mark.parametrize("fault,reason", [("missing", "not_found"), ("garbage", "corrupt")])
def test_unusable_kv_object_is_prefilled_again_by_the_decode_engine(vllm_epd_stack, vllm_reference, store,
                                                                     tiny_model_dir, fault, reason):
    """A decode job whose KV object is missing or garbage: the decode worker's vLLM prefills the
    request itself and the output equals the aggregated run."""
    rid = f"test-kv-{fault}-{uuid.uuid4().hex[:8]}"
    fp = model_fingerprint(tiny_model_dir, dtype="float32", engine="vllm")
    key = f"{vllm_epd_stack.namespace}/kv/{fp}/{rid}-0"
    if fault == "garbage":
        store.put(key, b"not a KV object" * 100)
    sampling = SamplingSpec(temperature=0, max_tokens=8, ignore_eos=True)
    now = time.time()
    gen = GenerationJob(request_id=rid, model="qwen2-vl-tiny", messages=engine_messages("Hello there.", 0),
                        images=(), fingerprint="x", sampling=sampling, stream=False, deadline=now + 120,
                        created_at=now)
    job = DecodeJob(request_id=rid, kv_key=key, kv_attempt=0, kv_nbytes=0, model_fingerprint=fp, sampling=sampling,
                    deadline=gen.deadline, created_at=now, emitted=0, emitted_text="", prompt_tokens=0, generation=gen)
    tokens, final = asyncio.run(_run_decode_job(vllm_epd_stack, job))
    assert not isinstance(final, ErrorEvent), final
    assert isinstance(final, FinalResult) and final.kv_source.startswith("recomputed:")
    assert reason in final.kv_source
    want = [e.token_id for e in vllm_reference.generate(
        engine_messages("Hello there.", 0), [], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    assert tokens == list(final.token_ids) == want
    assert key not in kv_keys(store, vllm_epd_stack)  # the bad object is gone too


def test_killed_decode_worker_request_completes(vllm_epd_stack, vllm_reference):
    """SIGKILL the decode worker (and its vLLM processes) after it streamed tokens: JetStream
    redelivers the job to a new decode worker, whose vLLM loads the same KV object (it is deleted
    only when the request ends) and regenerates the same tokens under the same seq numbers; the API
    forwards only what it has not sent, so the client gets one complete, correct stream. Runs last:
    it replaces the module's decode worker."""
    (victim,) = decoders(vllm_epd_stack)
    text, image, n = "Describe the image.", noise_image(321, (64, 48)), 300
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    want = [e.token_id for e in vllm_reference.generate(engine_messages(text, 1), [media(321, (64, 48))], params)]
    body = {"model": "qwen2-vl-tiny", "messages": [user_message(text, [data_url(image)])], "stream": True,
            "temperature": 0, "max_tokens": n, "ignore_eos": True, "return_token_ids": True}
    ids, rid, killed_after, done = stream_killing_a_decoder(vllm_epd_stack, body, victim, timeout=600)
    assert done and killed_after is not None and killed_after < n
    assert ids == want  # complete, no token twice, none missing
    final = _final(vllm_epd_stack, rid)
    assert final.attempt == 2 and list(final.token_ids) == want
    assert final.kv_source == "store"  # the second worker loaded the same KV object
