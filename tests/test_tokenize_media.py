"""``/tokenize`` of a chat with video (and image) parts (issue 43): the API loads the media as a chat
request's (``media_io_kwargs`` parsed by the same code) and expands each placeholder as the engine
does (``services.api.tokenizer.MediaCounter``: the family's processor call and expansion). Its
token ids equal the HF processor's own ``input_ids`` for the same frames (none of the project's code
but the frame sampling), and its count equals the chat completion's ``usage.prompt_tokens`` on a real
agg stack (real NATS and S3); another sampling rate gives another count (the negative control). A
family without video is a 400 naming the families that take it."""

from __future__ import annotations

import base64

import httpx
import pytest

from shared.tools.bench.workload import video_clip
from shared.video import VideoSampler, VideoSampling, load_video
from tests.stackutil import data_url, noise_image, start_stack

#: 12 frames at 2 fps (6 s): vLLM's Qwen2-VL loader samples 12 of them at fps 2, 6 at fps 1
CLIP = video_clip(7, 12, 84, 56, 2.0)
IMAGE = noise_image(3, (56, 84))


def _video_part(clip: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip).decode()}}


def _messages(*parts: dict, text: str = "What happens in the clip?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json={"model": "qwen2-vl-tiny", **body}, timeout=120)


@pytest.fixture(scope="module")
def agg_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("tokenize-media"),
        topology="agg",
        EPD_MAX_VIDEOS_PER_REQUEST="2",
        EPD_MAX_VIDEO_FRAMES="16",
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),
    )
    try:
        yield running
    finally:
        running.stack.stop()


def _hf_input_ids(model_dir, messages: list[dict], fps: float | None, images=()) -> list[int]:
    """The HF processor's prompt ids for the chat (its own template, its own placeholder expansion)
    on the frames vLLM's loader samples: the reference."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    frames = load_video(CLIP, VideoSampler.QWEN2_VL, VideoSampling(fps=fps)).frames
    norm = [
        {
            "role": m["role"],
            "content": [{"type": p["type"].removesuffix("_url")} if p["type"] != "text" else p for p in m["content"]],
        }
        for m in messages
    ]
    text = processor.apply_chat_template(norm, add_generation_prompt=True, tokenize=False)
    out = processor(
        text=[text], images=list(images) or None, videos=[frames], do_sample_frames=False, return_tensors="np"
    )
    return out["input_ids"][0].tolist()


def test_tokenize_counts_a_videos_tokens_as_the_engine_expands_them(agg_stack, tiny_model_dir):
    counts = {}
    for fps in (None, 1.0):
        messages = _messages(_video_part(CLIP))
        extra = {"media_io_kwargs": {"video": {"fps": fps}}} if fps else {}
        tok = _post(agg_stack, "/tokenize", {"messages": messages, **extra})
        assert tok.status_code == 200, tok.text
        tok = tok.json()
        assert tok["tokens"] == _hf_input_ids(tiny_model_dir, messages, fps), fps
        chat = _post(agg_stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra})
        assert chat.status_code == 200, chat.text
        assert tok["count"] == len(tok["tokens"]) == chat.json()["usage"]["prompt_tokens"], fps
        counts[fps] = tok["count"]
    # the negative control: half the frames sampled -> half the temporal patches -> fewer tokens
    assert counts[1.0] < counts[None]

    # an image beside the video: both expanded, as the chat's prompt
    messages = _messages({"type": "image_url", "image_url": {"url": data_url(IMAGE)}}, _video_part(CLIP))
    tok = _post(agg_stack, "/tokenize", {"messages": messages}).json()
    assert tok["tokens"] == _hf_input_ids(tiny_model_dir, messages, None, images=[IMAGE])
    chat = _post(agg_stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert tok["count"] == chat.json()["usage"]["prompt_tokens"] > counts[None]


def test_tokenize_refuses_what_a_chat_request_refuses(agg_stack):
    def error(resp: httpx.Response, code: str, needle: str) -> None:
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == code and needle in err["message"], err

    video = _messages(_video_part(CLIP))
    # media_io_kwargs parsed as a chat request's: the Qwen2-VL loader takes no num_frames
    error(
        _post(agg_stack, "/tokenize", {"messages": video, "media_io_kwargs": {"video": {"num_frames": 8}}}),
        "unsupported_parameter",
        "num_frames is not taken",
    )
    error(
        _post(agg_stack, "/tokenize", {"prompt": "x", "media_io_kwargs": {"video": {"fps": 1}}}),
        "invalid_request",
        "media_io_kwargs",
    )
    error(
        _post(agg_stack, "/tokenize", {"messages": _messages(*[_video_part(CLIP)] * 3)}),
        "too_many_images",
        "at most 2 videos",
    )
    # a placeholder typed into the text: refused as the engine refuses it
    error(
        _post(agg_stack, "/tokenize", {"messages": _messages(_video_part(CLIP), text="<|video_pad|>")}),
        "invalid_request",
        "video placeholder tokens",
    )


@pytest.fixture(scope="module")
def llava_api(nats_server, s3_server, tmp_path_factory):
    """Just the API of a tiny LLaVA (a family without video)."""
    from shared.tools.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("models") / "llava", arch="llava", size="tiny", seed=0)
    running = start_stack(
        nats_server, s3_server, model, tmp_path_factory.mktemp("tokenize-llava"), services=["api"], roles={}
    )
    try:
        yield running
    finally:
        running.stack.stop()


def test_tokenize_of_a_video_for_a_family_without_video_is_a_400_naming_those_with(llava_api):
    resp = _post(llava_api, "/tokenize", {"messages": _messages(_video_part(CLIP))})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "unsupported_content" and err["param"] == "messages"
    assert "llava" in err["message"] and "qwen2_vl" in err["message"] and "qwen2_5_vl" in err["message"]


@pytest.fixture(scope="module")
def qwen3_vl_api(nats_server, s3_server, tmp_path_factory):
    """Just the API of a tiny Qwen3-VL (its video prompt times each temporal patch)."""
    from shared.tools.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3-vl", arch="qwen3_vl", size="tiny", seed=0)
    running = start_stack(
        nats_server,
        s3_server,
        model,
        tmp_path_factory.mktemp("tokenize-qwen3-vl"),
        services=["api"],
        roles={},
        EPD_MAX_VIDEOS_PER_REQUEST="2",
        EPD_MAX_VIDEO_FRAMES="16",
    )
    try:
        yield model, running
    finally:
        running.stack.stop()


def test_tokenize_writes_a_qwen3_vl_videos_timestamps(qwen3_vl_api):
    """Qwen3-VL: each temporal patch of a video is ``<t seconds>`` + its vision tokens; the count
    equals the HF processor's ``input_ids`` on the frames vLLM's Qwen3-VL loader samples, with their
    metadata (frame indices, source fps: the times); another fps gives other times and fewer tokens
    (the negative control). (The count equals a vLLM engine's ``usage``: tests/test_vllm_families.py.)"""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    model, stack = qwen3_vl_api
    processor = AutoProcessor.from_pretrained(model)

    def reference(images: list, fps: float | None) -> list[int]:
        video = load_video(CLIP, VideoSampler.QWEN3_VL, VideoSampling(fps=fps))
        kinds = [{"type": "image"}] * len(images) + [{"type": "video"}, {"type": "text", "text": "What happens?"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": kinds}], add_generation_prompt=True, tokenize=False
        )
        meta = VideoMetadata(
            total_num_frames=video.info.total_frames, fps=video.info.fps, frames_indices=list(video.indices)
        )
        out = processor(
            text=[text],
            images=images or None,
            videos=[video.frames],
            video_metadata=[meta],
            do_sample_frames=False,
            return_tensors="np",
        )
        return out["input_ids"][0].tolist()

    got = {}
    for images, fps in (([], None), ([], 1.0), ([IMAGE], None)):
        parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images] + [_video_part(CLIP)]
        body: dict = {"messages": _messages(*parts, text="What happens?")}
        if fps:
            body["media_io_kwargs"] = {"video": {"fps": fps}}
        resp = httpx.post(f"{stack.url}/tokenize", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        got[(len(images), fps)] = resp.json()["tokens"]
        assert got[(len(images), fps)] == reference(images, fps), (len(images), fps)
    assert b"seconds>" in processor.tokenizer.decode(got[(0, None)]).encode()
    assert len(got[(0, 1.0)]) < len(got[(0, None)])  # the negative control: fewer patches, other times
