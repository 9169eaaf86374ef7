"""E|P|D on vLLM, whole stack: real NATS, real S3 server, api + encoder + prefill (role
``prefill``) + decode processes, all with ``EPD_ENGINE=vllm``. Encoder outputs move through
S3ECConnector, the prompt's KV cache through S3KVConnector (``kv_transfer_params``).

The reference for every equality check is a plain vLLM engine run aggregated in this process.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared import protocol
from shared.engines.base import SamplingParams
from shared.fingerprint import model_fingerprint
from shared.media import content_hash_of
from shared.protocol import DecodeJob, ErrorEvent, FinalResult, GenerationJob, ImageRef, SamplingSpec
from shared.store.format import media_key
from shared.store.objects import S3ObjectStore
from shared.tools.infra import free_port
from tests.stackutil import (
    GREEDY,
    api_tokens,
    chat_body,
    decoders,
    engine_messages,
    engine_tokens,
    final_result,
    kv_keys,
    metric_value,
    noise_image,
    run_job,
    run_sync,
    scrape,
    start_stack,
    stream_killing_a_decoder,
    wait_for,
    work_consumers,
)
from tests.vllmutil import CASES, generate, media

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_epd_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """An ack wait of 15 s: a worker starved of CPU on a loaded machine keeps its job (it sends
    ``in_progress`` every ack_wait/3), and a killed decode worker's job still comes back soon.
    The decode worker serves /metrics (vLLM's own engine stats are there)."""
    work = tmp_path_factory.mktemp("vepd")
    metrics_port = free_port()
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        work / "logs",
        topology="e-p-d",
        service_env={"decode": {"EPD_METRICS_PORT": str(metrics_port)}},
        ready_timeout=900,  # three vLLM engines start at once (~150 s on 2 busy cores)
        EPD_ENGINE="vllm",
        EPD_VLLM_DIR=str(work / "vllm"),
        EPD_MAX_IMAGES_PER_REQUEST="2",
        EPD_MAX_IMAGE_BYTES=str(512 * 1024),
        EPD_ACK_WAIT_S="15",
        EPD_REQUEST_TIMEOUT_S="600",  # a killed decode worker's replacement's vLLM takes a while to start
        EPD_VIDEO_SEGMENT_FRAMES="4",  # a 6-frame clip in 2 segments (a 4-frame one whole)
    )
    running.decode_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def store(vllm_epd_stack, s3_server):
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, vllm_epd_stack.bucket)


def _decode_job_ids(stack) -> set[str]:
    return {m.request_id for _, _, m in stack.stream_messages("stream_decode") if isinstance(m, DecodeJob)}


def _decode_consumer(stack):
    """The decode workers' JetStream consumer info (pending pull requests, unacked deliveries)."""
    return work_consumers(stack.nats_url, stack.subjects)[protocol.CONSUMER_DECODE]


def _reference(vllm_reference, text, specs, max_tokens=12) -> list[int]:
    items = [media(s, size) for s, size in specs]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine_tokens(vllm_reference, engine_messages(text, len(items)), items, params)


@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
def test_epd_on_vllm_equals_aggregated_vllm(vllm_epd_stack, vllm_reference, store, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(vllm_epd_stack, text, images)
    want, _ = run_sync(generate(vllm_reference, text, [media(seed, size) for seed, size in specs]))
    assert got == want
    # Negative control: other images give other tokens, so the equality above can fail.
    assert run_sync(generate(vllm_reference, text, [media(seed + 1000, size) for seed, size in specs]))[0] != got
    rid = body["id"]
    (job,) = vllm_epd_stack.messages_of("stream_decode", DecodeJob, rid)  # prefill handed it off ...
    assert job.emitted == 0 and job.kv_key.endswith(f"/{rid}-0")  # ... and streamed nothing itself
    final = final_result(vllm_epd_stack, rid)
    assert final.kv_source == "store"  # the decode engine loaded the prefill engine's KV
    assert set(final.ec_sources.values()) == {"store"}
    assert final.worker != job.prefill_worker
    # The decode worker deletes the object when the request ends.
    wait_for(lambda: not any(rid in k for k in kv_keys(store, vllm_epd_stack)), 120, "KV cleanup")


@pytest.mark.parametrize("seconds,segments", [(2, 0), (3, 2)], ids=["whole", "segmented"])
def test_a_video_through_epd_on_vllm_equals_aggregated_vllm(
    vllm_epd_stack, vllm_reference, tmp_path, seconds, segments
):
    """A video (issue 43) through E|P|D on vLLM: encoded by the encoder (a 6-frame clip in two
    segments, joined in the store by the prefill worker), prefilled, its KV handed to the decode
    worker - which gives its vLLM the video's frames again (a segmented one's joined) - equals the
    aggregated engine on the same frames; another clip gives other tokens."""
    import base64

    from shared.engines.base import MediaVideo, VideoFrames
    from shared.video import VideoSampler, VideoSampling, load_video
    from tests.test_video import write_clip

    def ask(seed: int) -> tuple[list[int], dict, list[int]]:
        clip = write_clip(tmp_path / f"clip{seed}.mp4", 10 * seconds, 10.0, size=(84, 56), seed=seed)
        url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
        parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "Describe the video."}]
        resp = vllm_epd_stack.chat([{"role": "user", "content": parts}], **GREEDY)
        assert resp.status_code == 200, resp.text
        sampled = load_video(clip, VideoSampler.QWEN2_VL, VideoSampling())
        item = MediaVideo(video=VideoFrames.of(sampled), item_hash=sampled.item_hash)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the video."}]}]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return (
            resp.json()["choices"][0]["token_ids"],
            resp.json(),
            engine_tokens(vllm_reference, messages, [item], params),
        )

    got, body, want = ask(seconds)
    assert got == want
    other, _, other_want = ask(seconds + 100)
    assert other == other_want and other != got  # the negative control
    (job,) = vllm_epd_stack.messages_of("stream_decode", DecodeJob, body["id"])
    (ref,) = job.generation.images
    assert ref.kind == "video" and len(ref.segments) == segments
    final = final_result(vllm_epd_stack, body["id"])
    assert final.kv_source == "store" and set(final.ec_sources.values()) == {"store"}, final


BATCH = [
    ("Describe the image.", [(301, (64, 48))], 16),
    ("What color dominates?", [(302, (56, 56))], 9),
    ("Count the objects in this one, please.", [(303, (90, 40))], 20),
    ("Compare these two images.", [(304, (56, 84)), (305, (84, 56))], 13),
    ("Hello there, how are you today?", [], 11),
]


def _engine_counts(text: str) -> tuple[float, float]:
    """(tokens generated, engine steps that produced output) from vLLM's own stats on /metrics:
    one ``vllm:iteration_tokens_total`` observation per engine step."""
    return (metric_value(text, "vllm:generation_tokens_total"), metric_value(text, "vllm:iteration_tokens_total_count"))


def test_concurrent_requests_are_batched_by_the_decode_engine(vllm_epd_stack, vllm_reference):
    """Five requests decoded together by the one decode worker, each equal to its aggregated single
    run. The worker is paused (SIGSTOP) until all five decode jobs wait in the queue, so they reach
    it at once; the evidence of batching is vLLM's own: the decode engine generated the five
    requests' tokens in fewer engine steps than tokens - steps that decoded several requests at
    once (requests run one after another take exactly one step per token)."""
    stack = vllm_epd_stack
    (decoder,) = decoders(stack)
    gen_before, steps_before = _engine_counts(scrape(stack.decode_metrics_url))
    known = _decode_job_ids(stack)

    def run(case):
        text, specs, n = case
        return api_tokens(stack, text, [noise_image(s, size) for s, size in specs], max_tokens=n)

    with ThreadPoolExecutor(len(BATCH)) as pool:
        os.kill(decoder.popen.pid, signal.SIGSTOP)
        try:
            # No pull request of the paused worker may be left open: a job delivered to it now
            # would start its ack timer with nobody sending in_progress.
            wait_for(
                lambda: _decode_consumer(stack).num_waiting == 0, 120, "the paused worker's pull requests to expire"
            )
            futures = [pool.submit(run, case) for case in BATCH]
            wait_for(
                lambda: len(_decode_job_ids(stack) - known) == len(BATCH) or any(f.done() for f in futures),
                600,
                "all five decode jobs to be queued",
            )
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            assert _decode_consumer(stack).num_ack_pending == 0  # none delivered while paused
        finally:
            os.kill(decoder.popen.pid, signal.SIGCONT)
        results = [f.result(timeout=600) for f in futures]

    for (text, specs, n), (got, body) in zip(BATCH, results):
        assert got == _reference(vllm_reference, text, specs, n), text
        final = final_result(stack, body["id"])
        assert final.kv_source == "store" and final.attempt == 1
    total = sum(n for _, _, n in BATCH)
    # vLLM's stats reach the worker's registry with its outputs, possibly after the responses.
    wait_for(
        lambda: _engine_counts(scrape(stack.decode_metrics_url))[0] - gen_before >= total,
        120,
        "vLLM's stats of the five requests",
    )
    gen_after, steps_after = _engine_counts(scrape(stack.decode_metrics_url))
    assert gen_after - gen_before == total
    assert steps_after - steps_before < total, f"{steps_after - steps_before} engine steps for {total} tokens"


def test_seeded_sampling_draws_as_in_the_aggregated_run(vllm_epd_stack, vllm_reference):
    """The decode engine samples every token (prefill streams none), so a seeded sampled request
    equals the aggregated run with the same seed; another seed is the negative control."""
    text, image = "Describe the image.", noise_image(311, (56, 56))
    got, _ = api_tokens(vllm_epd_stack, text, [image], temperature=0.9, seed=1234, max_tokens=16)
    item = media(311, (56, 56))

    def sampled(seed):
        params = SamplingParams(max_tokens=16, temperature=0.9, seed=seed, ignore_eos=True)
        return engine_tokens(vllm_reference, engine_messages(text, 1), [item], params)

    assert got == sampled(1234)
    assert got != sampled(4321)


def _decode_job(
    stack, tiny_model_dir, rid: str, text: str, images: tuple[ImageRef, ...] = (), max_tokens: int = 8
) -> DecodeJob:
    """A decode job as a prefill worker would publish it, for KV object ``<rid>-0`` (which the
    test may or may not have stored)."""
    fp = model_fingerprint(tiny_model_dir, dtype="float32", engine="vllm")
    sampling = SamplingSpec(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    now = time.time()
    gen = GenerationJob(
        request_id=rid,
        model="qwen2-vl-tiny",
        messages=engine_messages(text, len(images)),
        images=images,
        fingerprint="x",
        sampling=sampling,
        stream=False,
        deadline=now + 300,
        created_at=now,
    )
    return DecodeJob(
        request_id=rid,
        kv_key=f"{stack.namespace}/kv/{fp}/{rid}-0",
        kv_attempt=0,
        kv_nbytes=0,
        model_fingerprint=fp,
        sampling=sampling,
        deadline=gen.deadline,
        created_at=now,
        emitted=0,
        emitted_text="",
        prompt_tokens=0,
        generation=gen,
    )


@pytest.mark.parametrize("fault,reason", [("missing", "not_found"), ("garbage", "corrupt")])
def test_unusable_kv_object_is_prefilled_again_by_the_decode_engine(
    vllm_epd_stack, vllm_reference, store, tiny_model_dir, fault, reason
):
    """A decode job whose KV object is missing or garbage: the decode worker's vLLM prefills the
    request itself and the output equals the aggregated run; the bad object is deleted."""
    rid = f"test-kv-{fault}-{uuid.uuid4().hex[:8]}"
    job = _decode_job(vllm_epd_stack, tiny_model_dir, rid, "Hello there.")
    if fault == "garbage":
        store.put(job.kv_key, b"not a KV object" * 100)
    outcome = run_job(vllm_epd_stack, vllm_epd_stack.subjects.decode_jobs, job)
    assert isinstance(outcome.terminal, FinalResult), outcome.terminal
    final = final_result(vllm_epd_stack, rid)
    assert final.kv_source == f"recomputed:{reason}"
    want = _reference(vllm_reference, "Hello there.", [], 8)
    assert outcome.tokens == list(final.token_ids) == want
    # The worker deletes the object after it published the result: wait for it.
    wait_for(lambda: job.kv_key not in kv_keys(store, vllm_epd_stack), 120, "the bad KV object to be deleted")


def test_decode_error_reaches_the_client_as_a_decodable_error_event(vllm_epd_stack, store, tiny_model_dir):
    """A decode job whose image is not in the store: the decode worker (vLLM connector path: it
    gives vLLM the images) ends the request with the media error - its own code, HTTP status and
    message - on the request's token subject, as an ErrorEvent the client can decode; the
    request is over, so its KV object is deleted too."""
    rid = f"test-media-{uuid.uuid4().hex[:8]}"
    item = content_hash_of(noise_image(331, (56, 56)))  # never uploaded
    ref = ImageRef(item_hash=item, media_key=media_key(vllm_epd_stack.namespace, item), width=56, height=56)
    job = _decode_job(vllm_epd_stack, tiny_model_dir, rid, "Describe the image.", (ref,))
    store.put(job.kv_key, b"stands in for the prefill worker's KV object")
    outcome = run_job(vllm_epd_stack, vllm_epd_stack.subjects.decode_jobs, job)
    error = outcome.terminal
    assert isinstance(error, ErrorEvent), error
    assert (error.request_id, error.stage, error.code, error.http_status) == (rid, "decode", "media_missing", 500)
    assert ref.media_key in error.message
    assert outcome.chunks == []
    wait_for(lambda: job.kv_key not in kv_keys(store, vllm_epd_stack), 120, "the KV object to be deleted")


def test_killed_decode_worker_request_completes(vllm_epd_stack, vllm_reference):
    """SIGKILL the decode worker (and its vLLM processes) after it streamed tokens: JetStream
    redelivers the job to a new decode worker, whose vLLM loads the same KV object (it is deleted
    only when the request ends) and regenerates the same tokens under the same seq numbers; the API
    forwards only what it has not sent, so the client gets one complete, correct stream. Runs last:
    it replaces the module's decode worker."""
    (victim,) = decoders(vllm_epd_stack)
    text, n = "Describe the image.", 300
    want = _reference(vllm_reference, text, [(321, (64, 48))], n)
    body = chat_body(
        text, [noise_image(321, (64, 48))], temperature=0, max_tokens=n, ignore_eos=True, return_token_ids=True
    )
    ids, rid, killed_after, done = stream_killing_a_decoder(vllm_epd_stack, body, victim, timeout=600)
    assert done and killed_after is not None and killed_after < n
    assert ids == want  # complete, no token twice, none missing
    final = final_result(vllm_epd_stack, rid)
    assert final.attempt == 2 and list(final.token_ids) == want
    assert final.kv_source == "store"  # the second worker loaded the same KV object
