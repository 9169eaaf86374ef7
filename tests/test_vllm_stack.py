"""E|PD on vLLM: real NATS, real S3 server, real api + encoder + prefill processes with
``EPD_ENGINE=vllm`` - the encoder worker runs vLLM as an encoder-only EC producer, the prefill
worker runs vLLM as an EC consumer, encoder outputs move through S3ECConnector and the store.

The reference for every equality check is a plain vLLM engine run aggregated in this process
(no connector, no NATS, no store), on the same prompts and images.

Every case is ``make test-vllm``'s (marked ``vllm``). ``make test`` kept the two-image case as a
smoke until it cost ``make test`` 2 min that ``make test-vllm``, which starts this stack anyway,
repeats; a quick check of the vLLM path alone: ``make test-vllm PYTEST_ARGS="-k two-images
tests/test_vllm_stack.py"``.
"""

from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.engines.vllm_engine import vllm_rpc_dir
from shared.media import content_hash_of
from shared.protocol import ECReady, EncodeJob, FinalResult
from shared.tools.infra import free_port
from tests.stackutil import (
    GREEDY,
    api_tokens,
    chat_body,
    data_url,
    epd_cli,
    final_result,
    metric_value,
    noise_image,
    run_sync,
    scrape,
    start_stack,
    stream_chat,
    user_message,
    wait_for,
    worker_id_of,
)
from tests.vllmutil import CASES, generate, media

pytestmark = pytest.mark.slow
#: The equality case make test keeps (two non-square images: two EC objects through the connector).

SAMPLED = dict(temperature=0.9, max_tokens=12, ignore_eos=True, return_token_ids=True)


@pytest.fixture(scope="module")
def vllm_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    metrics_port = free_port()
    work = tmp_path_factory.mktemp("vs")
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        work / "logs",
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


def _ec_ready(stack, item: str) -> list[ECReady]:
    return [m for _, _, m in stack.stream_messages("stream_events") if isinstance(m, ECReady) and m.item_hash == item]


@pytest.mark.parametrize(
    "name,text,specs",
    [pytest.param(*c, id=c[0], marks=pytest.mark.vllm) for c in CASES],
)
def test_api_output_equals_aggregated_vllm(vllm_stack, vllm_reference, name, text, specs):
    images = [noise_image(seed, size) for seed, size in specs]
    got, body = api_tokens(vllm_stack, text, images)
    want, _ = run_sync(generate(vllm_reference, text, [media(seed, size) for seed, size in specs]))
    assert got == want
    assert body["usage"]["completion_tokens"] == len(want) == 12
    # Negative control: other images give other tokens, so the equality above can fail.
    others, _ = run_sync(generate(vllm_reference, text, [media(seed + 1000, size) for seed, size in specs]))
    assert others != got
    # The prefill worker's vLLM loaded every image's encoder output from the store: the encoder
    # worker's vLLM produced it (one ECReady per distinct image).
    final = final_result(vllm_stack, body["id"])
    hashes = {content_hash_of(im) for im in images}
    assert final.ec_sources == {h: "store" for h in hashes}
    for h in hashes:
        (ready,) = _ec_ready(vllm_stack, h)
        assert ready.n_tokens > 0 and ready.nbytes > 0


@pytest.mark.vllm
def test_text_only_and_streaming(vllm_stack, vllm_reference):
    resp = vllm_stack.chat([{"role": "user", "content": "Hello there, how are you?"}], **GREEDY)
    assert resp.status_code == 200, resp.text
    want, _ = run_sync(generate(vllm_reference, "Hello there, how are you?", []))
    assert resp.json()["choices"][0]["token_ids"] == want

    out = stream_chat(vllm_stack, chat_body("Describe it.", [noise_image(61, (56, 56))], **GREEDY))
    assert out.done and not out.errors
    assert out.token_ids == run_sync(generate(vllm_reference, "Describe it.", [media(61, (56, 56))]))[0]


@pytest.mark.vllm
def test_one_image_in_concurrent_requests_is_encoded_once(vllm_stack, vllm_reference):
    """Four requests at once with the same (new) image: the API queues one encode job for the
    item (the others collapse on its Nats-Msg-Id), the encoder's vLLM produces one output, and
    every request - each with its own prompt - equals its aggregated vLLM run."""
    image, n = noise_image(81, (64, 48)), 4
    item, url = content_hash_of(image), data_url(image)
    prompts = [f"Prompt {i}: describe the image." for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(lambda p: vllm_stack.chat([user_message(p, [url])], **GREEDY), prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]

    jobs = [
        m
        for _, _, m in vllm_stack.stream_messages("stream_encode")
        if isinstance(m, EncodeJob) and m.image.item_hash == item
    ]
    assert len(jobs) == 1
    assert len(_ec_ready(vllm_stack, item)) == 1
    outputs = [r.json()["choices"][0]["token_ids"] for r in responses]
    wants = [run_sync(generate(vllm_reference, p, [media(81, (64, 48))]))[0] for p in prompts]
    assert outputs == wants
    assert len({tuple(w) for w in wants}) > 1  # the prompts matter: each output is its own request's
    sources = [final_result(vllm_stack, r.json()["id"]).ec_sources[item] for r in responses]
    # From the store, or from vLLM's encoder cache when a request with the same item ran
    # alongside: never encoded by the prefill worker.
    assert set(sources) <= {"store", "engine_cache"} and "store" in sources, sources


def _lookups(stack, outcome: str) -> float:
    return metric_value(
        scrape(f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics"),
        "epd:ec_connector_lookups_total",
        outcome=outcome,
    )


@pytest.mark.vllm
def test_connector_counts_this_requests_store_hit(vllm_stack):
    """The connector's counters on the prefill worker's /metrics: this request's one new image
    adds exactly one lookup with outcome "hit" (taken from the store), none "engine_cache" (vLLM
    had it already) and no miss or fallback."""
    outcomes = ("hit", "engine_cache", "miss", "fallback")
    before = {o: _lookups(vllm_stack, o) for o in outcomes}
    image = noise_image(71, (56, 56))
    _, body = api_tokens(vllm_stack, "Count the objects.", [image])
    assert final_result(vllm_stack, body["id"]).ec_sources == {content_hash_of(image): "store"}
    # The counters reach the worker's registry with vLLM's stats, possibly after the response.
    wait_for(lambda: _lookups(vllm_stack, "hit") > before["hit"], 120, "the store hit to be counted")
    after = {o: _lookups(vllm_stack, o) for o in outcomes}
    assert {o: after[o] - before[o] for o in outcomes} == {"hit": 1, "engine_cache": 0, "miss": 0, "fallback": 0}
    text = scrape(f"http://127.0.0.1:{vllm_stack.prefill_metrics_port}/metrics")
    assert metric_value(text, "epd:ec_connector_seconds_count", op="fetch") >= 1


@pytest.mark.vllm
def test_a_repeated_request_is_a_prefix_cache_hit_in_the_worker_metrics(vllm_stack):
    """vLLM's prefix-cache hits reach ``epd:prefix_cache_tokens_total`` on the prefill worker: the
    same image and question a second time hits more prompt tokens than the first time (a new image:
    at most the template's opening blocks), and every prompt token is counted as queried."""
    url = f"http://127.0.0.1:{vllm_stack.prefill_metrics_port}/metrics"

    def counts() -> tuple[float, float]:
        text = scrape(url)
        return (
            metric_value(text, "epd:prefix_cache_tokens_total", kind="hit"),
            metric_value(text, "epd:prefix_cache_tokens_total", kind="query"),
        )

    # vLLM on CPU caches whole blocks of 128 tokens: a prompt of ~530 tokens (the image is a few of them).
    image = noise_image(73, (112, 112))
    question = "Describe the colours of this picture in detail, one by one, from left to right. " * 12
    deltas = []
    for _ in range(2):
        before = counts()
        _, body = api_tokens(vllm_stack, question, [image])
        prompt = body["usage"]["prompt_tokens"]
        after = wait_for(
            lambda b=before, p=prompt: (c := counts())[1] >= b[1] + p and c, 60, "the prompt tokens to be counted"
        )
        assert after[1] - before[1] == prompt
        deltas.append(after[0] - before[0])
    first_hits, repeat_hits = deltas
    assert repeat_hits > first_hits and repeat_hits > 0, deltas
    assert prompt - repeat_hits < prompt / 2, (prompt, deltas)  # most of the prompt came from the cache


@pytest.mark.vllm
def test_replay_of_a_sampled_request_on_vllm_reproduces_it(vllm_stack):
    """``epd replay run`` of a request the vLLM stack sampled with its derived seed (no client
    seed): the replay draws the same tokens (``--compare`` exits 0); with ``--new-seed`` it draws
    others (exit 1) - the negative control."""
    from shared.tools.replay_cli import EXIT_DIFFERENT

    got, body = api_tokens(vllm_stack, "Describe the image.", [noise_image(91, (56, 56))], **SAMPLED)
    rid = body["id"]
    same = epd_cli(vllm_stack.env, "replay", "run", rid, "--compare", "--json")
    assert same.returncode == 0, same.stdout + same.stderr
    out = json.loads(same.stdout)
    assert out["replay_id"] != rid and out["greedy"] is False and out["identical"] is True
    assert out["result"]["token_ids"] == got
    other = epd_cli(vllm_stack.env, "replay", "run", rid, "--compare", "--new-seed", "--json")
    assert other.returncode == EXIT_DIFFERENT, other.stdout + other.stderr
    out = json.loads(other.stdout)
    assert out["identical"] is False and out["result"]["token_ids"] != got


@pytest.mark.vllm
def test_vllm_files_stay_in_the_project_folder(vllm_stack):
    """vLLM's own files land under EPD_VLLM_DIR (the env variables the engine sets route them):
    its model-info cache (``VLLM_CACHE_ROOT``) and its live IPC sockets (``VLLM_RPC_BASE_PATH``).
    The folders themselves prove nothing (the engine creates them); what vLLM wrote into them does."""
    infos = list((vllm_stack.vllm_dir / "cache" / "modelinfos").glob("*.json"))
    assert infos, "vLLM wrote no model info under VLLM_CACHE_ROOT"
    assert all("hash" in json.loads(p.read_text()) for p in infos)
    sockets = [p for p in vllm_rpc_dir(vllm_stack.vllm_dir).iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets, "no vLLM IPC socket under VLLM_RPC_BASE_PATH while the engines run"


@pytest.mark.vllm
def test_a_vllm_pd_worker_steals_encodes_no_encoder_took(
    nats_server, s3_server, tiny_model_dir, vllm_reference, tmp_path
):
    """E|PD on vLLM with ``EPD_ENCODE_STEALS`` and no encoder worker at all: the PD worker steals
    each queued encode, its vLLM (an EC producer too) encodes and stores the item, the worker
    announces it; the output equals the aggregated engine's. The next request finds the item in
    the store (a valid object: the connector loads it) and equals the reference too."""
    work = tmp_path
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        work / "logs",
        services=["api", "prefill"],
        roles={"prefill": 1},
        ready_timeout=900,
        EPD_ENGINE="vllm",
        EPD_VLLM_DIR=str(work / "vllm"),
        EPD_ENCODE_STEALS="1",
        EPD_EC_WAIT_S="300",
    )
    try:
        image = noise_image(91, (64, 48))
        item = content_hash_of(image)
        want, _ = run_sync(generate(vllm_reference, "Describe the image.", [media(91, (64, 48))]))
        got, body = api_tokens(running, "Describe the image.", [image], timeout=240)
        assert got == want
        # (not final_result(): it waits for every job to be acked, and no encoder takes the encode job)
        (final,) = running.messages_of("stream_results", FinalResult, body["id"])
        assert final.ec_sources == {item: "stolen"}
        (ready,) = _ec_ready(running, item)
        pd = next(p for p in running.stack.processes if p.name == "prefill")
        # announced at the request's first token: stored by then, its rows not reported yet (n_tokens 0)
        assert ready.nbytes > 0 and ready.producer == worker_id_of(pd, "prefill")

        again, body = api_tokens(running, "What is in it?", [image], timeout=240)
        assert again == run_sync(generate(vllm_reference, "What is in it?", [media(91, (64, 48))]))[0]
        (final,) = running.messages_of("stream_results", FinalResult, body["id"])
        assert final.ec_sources[item] in {"store", "engine_cache"}
    finally:
        running.stack.stop()
