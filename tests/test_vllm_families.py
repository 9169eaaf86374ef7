"""The vLLM engine on every family it serves (issue 42): our engine's greedy
tokens equal a plain vLLM run's (``tests.vllm_plain_reference``: ``vllm.LLM.chat`` on the same
folder, none of the project's code) for an image, another image, two images and text only; the
answers are not empty and another image gives other tokens (the negative control).

The issue saw a tiny Qwen2.5-VL answer every request with twelve empty tokens on our engine and real
ones on a plain vLLM server: the server applied the folder's generation_config.json sampling
defaults (Qwen2.5-VL's repetition_penalty 1.05) to what the requests left out, our API did not
(``test_a_request_gets_the_model_s_sampling_defaults_as_on_a_plain_vllm_server``).

Per family: the plain run (its own process), then our engine (module-scoped, shared by the cases),
one vLLM at a time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image

from shared.engines.base import GenerationStats, MediaImage
from shared.families import VIDEO_SEGMENT_FAMILIES, model_type_of
from shared.media import content_hash_of
from shared.protocol import GenerationJob
from shared.store.objects import S3ObjectStore
from tests.stackutil import GREEDY as STACK_GREEDY_ANY
from tests.stackutil import (
    api_tokens,
    data_url,
    engine_messages,
    final_result,
    noise_image,
    png_bytes,
    require_vllm_tier,
    start_stack,
    user_message,
)
from tests.vllmutil import GREEDY, close_engine

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

#: every family the vLLM engine serves (``shared.families.SUPPORTED_FAMILIES["vllm"]``: a test below holds it)
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "internvl"]

#: the sampling defaults a family's published checkpoints carry in generation_config.json, written
#: into its tiny build here (a plain vLLM server applies them to what a request leaves out: the
#: issue's Qwen2.5-VL answered other tokens on ours, which ignored them). Qwen2.5-VL's Instruct
#: checkpoints: repetition_penalty 1.05 with top_k 1 and top_p 0.001.
PUBLISHED_SAMPLING_DEFAULTS: dict[str, dict] = {
    "qwen2_5_vl": {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.1, "top_k": 1, "top_p": 0.001},
}
#: greedy with every sampling field the defaults above set given (the plain run's neutral greedy:
#: what the engine-level cases compare); ``test_a_request_gets_the_model_s_sampling_defaults``
#: sends only ``temperature: 0``
STACK_GREEDY = {**STACK_GREEDY_ANY, "repetition_penalty": 1.0}
#: the cases a request with only ``temperature: 0`` is sent as, to the plain run (as vLLM's server
#: samples it) and to the stack
SERVER_CASES = ("text-only", "image")
SERVER_REQUEST = {"temperature": 0, "ignore_eos": True}


def _white(size: tuple[int, int]) -> Image.Image:
    # (the tiny Qwen3-VL gives the same tokens for any two noise images: the other image is not noise)
    return Image.new("RGB", size, (255, 255, 255))


#: name -> (text, images)
CASES: dict[str, tuple[str, list[Image.Image]]] = {
    "image": ("Describe the image.", [noise_image(21, (112, 84))]),
    "other-image": ("Describe the image.", [_white((112, 84))]),
    "two-images": ("Compare these two images.", [noise_image(14, (56, 84)), _white((84, 56))]),
    "text-only": ("What is in this image?", []),
}


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


#: the video case (issue 43), for the families the vLLM engine serves video for: 3 s of 10 fps
#: noise, sampled as vLLM's loader samples it (Qwen-VL: 2 fps -> 6 frames)
VIDEO_TEXT = "Describe the video."


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    from tests.test_video import write_clip

    return write_clip(tmp_path_factory.mktemp("clip") / "clip.mp4", 30, 10.0, size=(84, 56), seed=0)


@pytest.fixture(scope="module")
def other_clip(tmp_path_factory) -> bytes:
    """Another clip of the same size and length (other noise): the video's negative control."""
    from tests.test_video import write_clip

    return write_clip(tmp_path_factory.mktemp("clip") / "other.mp4", 30, 10.0, size=(84, 56), seed=1)


def _video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def _video_messages(data: bytes) -> list[dict]:
    parts = [{"type": "video_url", "video_url": {"url": _video_url(data)}}, {"type": "text", "text": VIDEO_TEXT}]
    return [{"role": "user", "content": parts}]


def _takes_video(family_dir: Path) -> bool:
    from shared.families import VIDEO_FAMILIES, model_type_of

    return model_type_of(family_dir) in VIDEO_FAMILIES["vllm"]


def _model_type(family_dir: Path) -> str:
    from shared.families import model_type_of

    return model_type_of(family_dir)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> Path:
    from shared.tools.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny", seed=0)
    published = PUBLISHED_SAMPLING_DEFAULTS.get(request.param)
    if published:
        config = folder / "generation_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **published}, indent=2))
    return folder


@pytest.fixture(scope="module")
def plain_tokens(family_dir, vllm_work_dir, tmp_path_factory, clip, other_clip) -> dict[str, list[int]]:
    """Every case's greedy token ids from a plain vLLM run (its own process, ended before ours starts)."""
    from shared.engines.vllm_engine import vllm_folders

    require_vllm_tier("plain_tokens")
    work = tmp_path_factory.mktemp("plain")
    cases = {
        name: {"text": text, "images": [_data_url(i) for i in images], "max_tokens": GREEDY.max_tokens}
        for name, (text, images) in CASES.items()
    }
    for name in SERVER_CASES:
        cases[f"{name}@server"] = {**cases[name], "request": SERVER_REQUEST}
    if _takes_video(family_dir):
        for name, data in (("video", clip), ("other-video", other_clip)):
            cases[name] = {
                "text": VIDEO_TEXT,
                "images": [],
                "videos": [_video_url(data)],
                "max_tokens": GREEDY.max_tokens,
            }
    (work / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, **vllm_folders(Path(vllm_work_dir)), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    args = [str(family_dir), str(work / "cases.json"), str(work / "out.json")]
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_plain_reference", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def our_answers(plain_tokens, family_dir, vllm_work_dir, clip, other_clip) -> dict[str, tuple[list[int], str]]:
    """Every case's greedy token ids and text from our vLLM engine (agg: no connector) on the
    family's folder, started once the plain run ended and closed before the family's stack starts."""
    from shared.engines.vllm_engine import VllmEngine

    require_vllm_tier("our_answers")
    ours = VllmEngine(family_dir, dtype="float32", model_id=family_dir.name, work_dir=vllm_work_dir)

    async def answer(text: str, images: list[Image.Image]) -> tuple[list[int], str]:
        items = [MediaImage(image=i, item_hash=content_hash_of(i)) for i in images]
        events = [e async for e in ours.generate(engine_messages(text, len(items)), items, GREEDY, GenerationStats())]
        assert events and events[-1].finish_reason == "length"
        return [e.token_id for e in events], "".join(e.text for e in events)

    async def video_answer(data: bytes) -> tuple[list[int], str]:
        from shared.engines.base import MediaVideo, VideoFrames
        from shared.families import video_processor_of
        from shared.video import VideoSampling, load_video, sampler_of_processor

        # the frames the API samples for the family (vLLM's loader's: Qwen3-VL's its own), with
        # their indices in the source (Qwen3-VL's prompt times each temporal patch from them)
        sampled = load_video(data, sampler_of_processor(video_processor_of(family_dir)), VideoSampling())
        item = MediaVideo(video=VideoFrames.of(sampled), item_hash=sampled.item_hash)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": VIDEO_TEXT}]}]
        events = [e async for e in ours.generate(messages, [item], GREEDY, GenerationStats())]
        return [e.token_id for e in events], "".join(e.text for e in events)

    async def all_cases():
        out = {name: await answer(text, images) for name, (text, images) in CASES.items()}
        if _takes_video(family_dir):
            out["video"] = await video_answer(clip)
            out["other-video"] = await video_answer(other_clip)
        return out

    try:
        return asyncio.run(all_cases())
    finally:
        close_engine(ours)


@pytest.fixture(scope="module")
def family_stack(our_answers, nats_server, s3_server, family_dir, tmp_path_factory):
    """An e-pd stack on the vLLM engine (an encoder worker and a PD worker, each a vLLM; features
    through the store and our EC connector), after the in-process engine closed."""
    work = tmp_path_factory.mktemp(f"{family_dir.name}-stack")
    running = start_stack(
        nats_server,
        s3_server,
        family_dir,
        work / "logs",
        ready_timeout=900,  # two vLLM engines start at once (~40-90 s each on 2 cores)
        EPD_ENGINE="vllm",
        EPD_VLLM_DIR=str(work / "vllm"),
        EPD_MAX_IMAGES_PER_REQUEST="2",
        EPD_ENCODE_STEALS="0",  # every image's features through the store (what the test holds)
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),  # (JetStream reserves it per stream on the session's server)
        EPD_VIDEO_SEGMENT_FRAMES="2",  # the clip's 6 sampled frames in 3 segments, where the family allows
    )
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def family_e_p_d_stack(plain_tokens, nats_server, s3_server, family_dir, tmp_path_factory):
    """An e-p-d stack on the vLLM engine (encoder, prefill and decode workers, each a vLLM; EC and
    KV through the store and our connectors). A ``matrix`` cell: ``make test-matrix`` runs it (CI
    holds vLLM's e-p-d on Qwen2-VL, tests/test_vllm_epd_stack.py; the KV path is family-blind)."""
    work = tmp_path_factory.mktemp(f"{family_dir.name}-e-p-d")
    running = start_stack(
        nats_server,
        s3_server,
        family_dir,
        work / "logs",
        topology="e-p-d",
        ready_timeout=900,  # three vLLM engines start at once
        EPD_ENGINE="vllm",
        EPD_VLLM_DIR=str(work / "vllm"),
        EPD_MAX_IMAGES_PER_REQUEST="2",
        EPD_ENCODE_STEALS="0",
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),
    )
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_plain_vllm(family_dir, plain_tokens, our_answers, case):
    """Agg: our engine (no connector) answers each case with the plain run's tokens."""
    ids, text = our_answers[case]
    assert len(ids) == GREEDY.max_tokens
    assert ids == plain_tokens[case]
    assert text.strip(), f"{family_dir.name} {case}: an empty answer ({ids})"


def test_another_image_gives_other_tokens(family_dir, plain_tokens, our_answers):
    assert plain_tokens["image"] != plain_tokens["other-image"]
    assert our_answers["image"][0] != our_answers["other-image"][0]


def test_e_pd_stack_equals_plain_vllm(family_dir, plain_tokens, family_stack):
    """E|PD on the vLLM engine: every case through the API (each image encoded by the encoder
    worker, its EC object - Qwen3-VL's with the deepstack features - read by the PD worker through
    our connector) gives the plain run's tokens; another image gives other ones."""
    _holds_plain_tokens(family_dir, plain_tokens, family_stack)


@pytest.mark.matrix
def test_e_p_d_stack_equals_plain_vllm(family_dir, plain_tokens, family_e_p_d_stack, clip):
    """E|P|D on the vLLM engine: the same cases (and the video, where the family takes one), the KV
    cache handed from the prefill worker to the decode worker through the store, give the plain
    run's tokens."""
    _holds_plain_tokens(family_dir, plain_tokens, family_e_p_d_stack)
    if _takes_video(family_dir):
        resp = family_e_p_d_stack.chat(_video_messages(clip), **STACK_GREEDY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == plain_tokens["video"], family_dir.name


def _holds_plain_tokens(family_dir: Path, plain_tokens: dict[str, list[int]], stack) -> None:
    got = {name: api_tokens(stack, text, images, **STACK_GREEDY) for name, (text, images) in CASES.items()}
    for name, (ids, body) in got.items():
        assert ids == plain_tokens[name], (family_dir.name, name)
        assert body["choices"][0]["message"]["content"].strip(), f"{family_dir.name} {name}: an empty answer"
    assert got["image"][0] != got["other-image"][0]
    sources = [final_result(stack, body["id"]).ec_sources for name, (_, body) in got.items() if name != "text-only"]
    assert all(sources) and all(v == "store" for s in sources for v in s.values()), sources


def test_a_request_gets_the_model_s_sampling_defaults_as_on_a_plain_vllm_server(family_dir, plain_tokens, family_stack):
    """The issue's Qwen2.5-VL answer (other tokens than a plain vLLM server's; empty ones on the
    filer's build): a request with only ``temperature: 0`` gets the fields it leaves out from the
    model's generation_config.json, as on a plain vLLM server (``--generation-config auto``) - for
    Qwen2.5-VL its repetition_penalty 1.05. The negative control: those defaults change the plain
    server's tokens (else this test could not fail), and a request that gives the field wins."""
    for name in SERVER_CASES:
        text, images = CASES[name]
        resp = family_stack.chat(
            [user_message(text, [data_url(im) for im in images])],
            **SERVER_REQUEST,
            max_tokens=GREEDY.max_tokens,
            return_token_ids=True,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == plain_tokens[f"{name}@server"], (family_dir.name, name)
    if model_type_of(family_dir) in PUBLISHED_SAMPLING_DEFAULTS:
        assert any(plain_tokens[f"{n}@server"] != plain_tokens[n] for n in SERVER_CASES), "the defaults change nothing"
        # the request's own field wins over the model's default
        text, images = CASES["text-only"]
        ids, _ = api_tokens(family_stack, text, images, **STACK_GREEDY)
        assert ids == plain_tokens["text-only"]


def test_video_equals_plain_vllm_or_is_refused(family_dir, plain_tokens, our_answers, family_stack, clip, s3_server):
    """Video (issue 43): where the vLLM engine serves the family's video, our engine (agg) and the
    e-pd stack (the encoder's video features through our EC connector; Qwen2-VL and Qwen2.5-VL's in
    3 segments, joined by the PD worker) give a plain vLLM run's tokens for the clip (vLLM's loader
    sampling the file; ours the frames the API sampled); for
    every other family the API refuses a video before fetching it, naming where video is served."""
    resp = family_stack.chat(_video_messages(clip), **STACK_GREEDY)
    if not _takes_video(family_dir):
        assert "video" not in plain_tokens
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_content", resp.text
        assert "takes no video input" in resp.json()["error"]["message"]
        return
    assert len(plain_tokens["video"]) == GREEDY.max_tokens
    assert our_answers["video"][0] == plain_tokens["video"], family_dir.name
    assert our_answers["video"][1].strip()
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == plain_tokens["video"], family_dir.name

    # usage counts the video's tokens as /tokenize does (the API's count of the same messages)
    def count(messages: list[dict]) -> int:
        body = {"model": "qwen2-vl-tiny", "messages": messages}
        tok = httpx.post(f"{family_stack.url}/tokenize", json=body, timeout=120)
        assert tok.status_code == 200, tok.text
        return tok.json()["count"]

    text_only = [{"role": "user", "content": [{"type": "text", "text": VIDEO_TEXT}]}]
    video_count = count(_video_messages(clip))
    assert resp.json()["usage"]["prompt_tokens"] == video_count >= count(text_only) + 3  # (3 temporal patches)
    sources = final_result(family_stack, resp.json()["id"]).ec_sources
    assert set(sources.values()) == {"store"}, sources
    if model_type_of(family_dir) in VIDEO_SEGMENT_FAMILIES["vllm"]:
        # segmented: each segment encoded by the encoder and stored, joined by the PD worker into
        # the video's own EC object, which our connector loaded
        (job,) = family_stack.messages_of("stream_generate", GenerationJob, resp.json()["id"])
        (ref,) = job.images
        assert len(ref.segments) == 3 and set(sources) == {s.item_hash for s in ref.segments}
        store = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, family_stack.bucket)
        (joined,) = [o for o in store.list("") if o.key.endswith("/" + ref.item_hash)]
        assert "segments joined in the store" in family_stack.log_of("prefill"), joined
    else:
        assert len(sources) == 1
    if _model_type(family_dir) != "qwen3_vl":  # (the tiny Qwen3-VL answers noise clips and images alike)
        assert plain_tokens["video"] != plain_tokens["image"]  # (the video is seen: not the image's answer)


def test_another_clip_gives_other_video_tokens(family_dir, plain_tokens, our_answers, family_stack, other_clip):
    """The video's negative control: another clip of the same size and length gives the plain run
    other tokens, and our engine (agg) and the e-pd stack the plain run's for it."""
    resp = family_stack.chat(_video_messages(other_clip), **STACK_GREEDY)
    if not _takes_video(family_dir):  # refused as the first clip is (CI fails a skipped test: no skip here)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_content", resp.text
        return
    assert plain_tokens["other-video"] != plain_tokens["video"], family_dir.name
    assert our_answers["other-video"][0] == plain_tokens["other-video"], family_dir.name
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == plain_tokens["other-video"], family_dir.name
