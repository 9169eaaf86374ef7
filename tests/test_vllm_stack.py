"""E|PD on vLLM: real NATS, real S3 server, real api + encoder + prefill processes with
``EPD_ENGINE=vllm`` - the encoder worker runs vLLM as an encoder-only EC producer, the prefill
worker runs vLLM as an EC consumer, encoder outputs move through MinioECConnector and the store.

The reference for every equality check is a plain vLLM engine run aggregated in this process
(no connector, no NATS, no store), on the same prompts and images.
"""

from __future__ import annotations

import httpx
import pytest

from shared.infra import free_port
from shared.media import content_hash_of
from shared.protocol import ECReady, FinalResult
from tests.stackutil import start_stack
from tests.stackutil import data_url, noise_image, user_message
from tests.vllmutil import CASES, generate, media

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True, return_token_ids=True)


@pytest.fixture(scope="module")
def vllm_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    metrics_port = free_port()
    work = tmp_path_factory.mktemp("vs")
    running = start_stack(
        nats_server, s3_server, tiny_model_dir, work / "logs",
        service_env={"prefill": {"EPD_METRICS_PORT": str(metrics_port)}},
        ready_timeout=900,  # two vLLM engines start at once (~40-90 s each on 2 cores)
        EPD_ENGINE="vllm",
        EPD_VLLM_DIR=str(work / "vllm"),
        EPD_MAX_IMAGES_PER_REQUEST="2",
        EPD_MAX_IMAGE_BYTES=str(512 * 1024),
    )
    running.prefill_metrics_port = metrics_port
    running.vllm_dir = work / "vllm"
    try:
        yield running
    finally:
        running.stack.stop()


def api_tokens(stack, text, images):
    resp = stack.chat([user_message(text, [data_url(im) for im in images])], **GREEDY)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["choices"][0]["token_ids"], body


def finals(stack, request_ids):
    return {m.request_id: m for _, _, m in stack.stream_messages("stream_results")
            if isinstance(m, FinalResult) and m.request_id in request_ids}


@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
def test_api_output_equals_aggregated_vllm(vllm_stack, vllm_reference, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(vllm_stack, text, images)
    want, _ = generate(vllm_reference, text, [media(seed, size) for seed, size in specs])
    assert got == want
    assert body["usage"]["completion_tokens"] == len(want) == 12
    # Negative control: other images give other tokens, so the equality above can fail.
    others, _ = generate(vllm_reference, text, [media(seed + 1000, size) for seed, size in specs])
    assert others != got
    # The prefill worker's vLLM loaded every image's encoder output from the store: the encoder
    # worker's vLLM produced it (one ECReady per distinct image).
    final = finals(vllm_stack, {body["id"]})[body["id"]]
    hashes = {content_hash_of(im) for im in images}
    assert final.ec_sources == {h: "store" for h in hashes}
    ready = {m.item_hash: m for _, _, m in vllm_stack.stream_messages("stream_events") if isinstance(m, ECReady)}
    assert all(ready[h].n_tokens > 0 and ready[h].nbytes > 0 for h in hashes)


def test_text_only_and_streaming(vllm_stack, vllm_reference):
    resp = vllm_stack.chat([{"role": "user", "content": "Hello there, how are you?"}], **GREEDY)
    assert resp.status_code == 200, resp.text
    want, _ = generate(vllm_reference, "Hello there, how are you?", [])
    assert resp.json()["choices"][0]["token_ids"] == want

    image = noise_image(61, (56, 56))
    body = {"model": "qwen2-vl-tiny", "messages": [user_message("Describe it.", [data_url(image)])],
            "stream": True, **GREEDY}
    streamed: list[int] = []
    with httpx.stream("POST", f"{vllm_stack.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                import json

                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    streamed.extend(choice.get("token_ids", []))
    assert streamed == generate(vllm_reference, "Describe it.", [media(61, (56, 56))])[0]


def test_connector_counters_on_the_worker_metrics_endpoint(vllm_stack):
    api_tokens(vllm_stack, "Count the objects.", [noise_image(71, (56, 56))])
    text = httpx.get(f"http://127.0.0.1:{vllm_stack.prefill_metrics_port}/metrics", timeout=10).text
    hits = [line for line in text.splitlines()
            if line.startswith("epd:ec_connector_lookups_total{") and 'outcome="hit"' in line]
    assert hits and sum(float(line.rsplit(" ", 1)[1]) for line in hits) >= 1, text[:2000]
    assert "epd:ec_connector_seconds_count" in text


def test_vllm_files_stay_in_the_project_folder(vllm_stack):
    """Caches, compile artefacts and IPC sockets under EPD_VLLM_DIR, not in $HOME or /tmp defaults."""
    for sub in ("cache", "config", "rpc", "inductor"):
        assert (vllm_stack.vllm_dir / sub).is_dir(), sub
    assert (vllm_stack.vllm_dir / "cache" / "modelinfos").is_dir()  # vLLM really wrote there
