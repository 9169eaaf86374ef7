"""Video through the whole stack (issue 43) on the transformers engine: a ``video_url`` part is
fetched or decoded once by the API, sampled with vLLM's loader's frames (``shared.video``), its
frames stored content-addressed; the encoder (e-pd, e-p-d) or the PD worker (agg) encodes them;
the answer's greedy tokens equal transformers' own ``generate`` with the folder's processor on the
same frames (none of the project's code), for a video alone, a video beside an image and two
videos; another clip gives other tokens. Bad videos are 400s naming their limit, before any job
is queued. Qwen3-VL (e-pd): the frames' indices in the source travel with them (the frames object),
so the encoder's EC object carries each temporal patch's time and the PD worker writes it into the
prompt, with the video's deepstack features from the store."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

from shared.protocol import EncodeJob, GenerationJob
from shared.video import VideoSampling, load_video
from tests.stackutil import GREEDY, data_url, final_result, noise_image, start_stack
from tests.test_video import write_clip
from tests.test_video_engine import SAMPLERS, _hf_tokens

_CI = [
    ("qwen2_vl", "agg"),
    ("qwen2_vl", "e-pd"),
    ("qwen2_vl", "e-p-d"),
    ("qwen2_5_vl", "e-p-d"),  # (the KV hand-off of a prompt whose positions follow seconds per patch)
    ("qwen3_vl", "e-p-d"),  # (the KV hand-off of a prompt with timestamps and deepstack features)
]
#: the cells whose path the ones above already hold (make test-matrix)
_MATRIX = [("qwen2_5_vl", "agg"), ("qwen2_5_vl", "e-pd"), ("qwen3_vl", "agg"), ("qwen3_vl", "e-pd")]
COMBOS = [pytest.param(c, id=f"{c[0]}-{c[1]}") for c in _CI] + [
    pytest.param(c, id=f"{c[0]}-{c[1]}", marks=pytest.mark.matrix) for c in _MATRIX
]


def _video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("clips")
    return {
        "a": write_clip(root / "a.mp4", 30, 10.0, size=(84, 56), seed=0),
        "b": write_clip(root / "b.mp4", 30, 10.0, size=(84, 56), seed=1),
        "c": write_clip(root / "c.mp4", 10, 10.0, size=(56, 84), seed=2),
    }


IMAGE = noise_image(5, (56, 56))
#: name -> (text, parts: ("image", PIL) / ("video", clip name))
CASES = {
    "video": ("Describe the video.", [("video", "a")]),
    "image-then-video": ("Compare the picture and the clip.", [("image", IMAGE), ("video", "c")]),
    "two-videos": ("Compare these clips.", [("video", "c"), ("video", "a")]),
    "other-video": ("Describe the video.", [("video", "b")]),
}


def _request(text: str, parts, clips: dict[str, bytes]) -> list[dict]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(x)}}
        if kind == "image"
        else {"type": "video_url", "video_url": {"url": _video_url(clips[x])}}
        for kind, x in parts
    ]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    from shared.tools.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("video-families")
    return {f: build_tiny_model(root / f, arch=f, size="tiny", seed=0) for f in {f for f, _ in (*_CI, *_MATRIX)}}


@pytest.fixture(scope="module")
def references(families, clip_files) -> dict[str, dict[str, list[int]]]:
    out = {}
    for family, path in families.items():
        # (the frames the API samples for the family: vLLM's loader's for its video processor)
        sampled = {n: load_video(d, SAMPLERS[family], VideoSampling()) for n, d in clip_files.items()}
        out[family] = {}
        for name, (text, parts) in CASES.items():
            kinds = [k for k, _ in parts]
            images = [x for k, x in parts if k == "image"]
            videos = [sampled[x] for k, x in parts if k == "video"]
            out[family][name] = _hf_tokens(path, text, kinds, images, videos, max_tokens=GREEDY["max_tokens"])
    torch.set_num_threads(1)
    return out


@pytest.fixture(scope="module", params=COMBOS)
def video_stack(request, nats_server, s3_server, families, tmp_path_factory):
    family, topology = request.param
    running = start_stack(
        nats_server,
        s3_server,
        families[family],
        tmp_path_factory.mktemp(f"video-{family}-{topology}"),
        topology=topology,
        EPD_MAX_VIDEOS_PER_REQUEST="2",
        EPD_MAX_VIDEO_FRAMES="16",
        EPD_ENCODE_STEALS="0",  # e-pd, e-p-d: every item's features through the store (what is held)
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),
    )
    try:
        yield family, topology, running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def refusing_stack(nats_server, s3_server, families, tmp_path_factory):
    """An e-pd stack of the tiny Qwen2-VL, for the API's refusals (the same on every stack)."""
    running = start_stack(
        nats_server,
        s3_server,
        families["qwen2_vl"],
        tmp_path_factory.mktemp("video-refusals"),
        topology="e-pd",
        EPD_MAX_VIDEOS_PER_REQUEST="2",
        EPD_MAX_VIDEO_FRAMES="16",
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),
    )
    try:
        yield running
    finally:
        running.stack.stop()


def test_video_tokens_equal_transformers_generate(video_stack, references, clip_files):
    family, topology, stack = video_stack
    got = {}
    for name, (text, parts) in CASES.items():
        resp = stack.chat(_request(text, parts, clip_files), **GREEDY)
        assert resp.status_code == 200, (name, resp.text)
        body = resp.json()
        got[name] = body["choices"][0]["token_ids"]
        assert got[name] == references[family][name], (family, topology, name)
        assert body["choices"][0]["message"]["content"].strip(), (family, topology, name)
        sources = final_result(stack, body["id"]).ec_sources
        want = "local" if topology == "agg" else "store"
        assert sources and all(v in (want, "local_cache") for v in sources.values()), (name, sources)
    assert got["video"] != got["other-video"]  # the negative control
    # one encode job per distinct item (e-pd, e-p-d): clips a, b, c and the image
    if topology != "agg":
        jobs = {
            m.image.item_hash: m.image for _, _, m in stack.stream_messages("stream_encode") if isinstance(m, EncodeJob)
        }
        videos = [ref for ref in jobs.values() if ref.kind == "video"]
        assert len(videos) == 3 and all(ref.frames in (4, 6) for ref in videos), videos


def test_bad_videos_are_refused_before_any_job(refusing_stack, clip_files):
    stack = refusing_stack
    jobs = len(stack.stream_messages("stream_generate")) + len(stack.stream_messages("stream_encode"))
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64).decode()
    mp4 = clip_files["a"]
    cases = [
        (
            "not a video",
            [{"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{png}"}}],
            {},
            "invalid_video",
            "not a video",
        ),
        (
            "truncated",
            [{"type": "video_url", "video_url": {"url": _video_url(mp4[: len(mp4) // 2])}}],
            {},
            "invalid_video",
            "not a video",
        ),
        (
            "an image as a video",
            [{"type": "video_url", "video_url": {"url": data_url(IMAGE)}}],
            {},
            "unsupported_content",
            "video/*",
        ),
        (
            "too many videos",
            [{"type": "video_url", "video_url": {"url": _video_url(mp4)}}] * 3,
            {},
            "too_many_images",
            "at most 2 videos",
        ),
        (
            "num_frames on an fps loader",
            [{"type": "video_url", "video_url": {"url": _video_url(mp4)}}],
            {"media_io_kwargs": {"video": {"num_frames": 8}}},
            "unsupported_parameter",
            "num_frames is not taken",
        ),
        (
            "an unknown media_io_kwargs key",
            [{"type": "video_url", "video_url": {"url": _video_url(mp4)}}],
            {"media_io_kwargs": {"image": {"x": 1}}},
            "unsupported_parameter",
            "media_io_kwargs.image",
        ),
        (
            "a bad fps",
            [{"type": "video_url", "video_url": {"url": _video_url(mp4)}}],
            {"media_io_kwargs": {"video": {"fps": -1}}},
            "invalid_request",
            "fps must be a positive number",
        ),
        (
            "too many sampled frames",
            [{"type": "video_url", "video_url": {"url": _video_url(mp4)}}],
            {"media_io_kwargs": {"video": {"fps": 30}}},
            "invalid_video",
            "sampling picks",
        ),
    ]
    for name, content, extra, code, words in cases:
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": "hi"}]}]
        resp = stack.chat(messages, **GREEDY, **extra)
        assert resp.status_code == 400, (name, resp.text)
        error = resp.json()["error"]
        assert error["code"] == code and words in error["message"], (name, error)
    assert len(stack.stream_messages("stream_generate")) + len(stack.stream_messages("stream_encode")) == jobs
    # still serving: the same clip with its default sampling
    ok = stack.chat(_request("hi", [("video", "a")], clip_files), **GREEDY)
    assert ok.status_code == 200, ok.text
    (job,) = stack.messages_of("stream_generate", GenerationJob, ok.json()["id"])
    assert [(ref.kind, ref.frames) for ref in job.images] == [("video", 6)]
