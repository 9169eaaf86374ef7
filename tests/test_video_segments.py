"""Video segments (issue 43, ``EPD_VIDEO_SEGMENT_FRAMES``): a video of more sampled frames is split at
temporal-patch boundaries into segments, each its own item (stored frames, encode job, EC object);
the PD worker joins their features into the one video the LM sees. Qwen2-VL's, Qwen2.5-VL's and
Qwen3-VL's vision towers attend within a temporal patch, so the joined features are the whole video's
(within the last bits of batched kernels; Qwen3-VL's deepstack layers' too) and the greedy tokens are
the unsegmented request's; Qwen3-VL's prompt times each temporal patch from the whole video's metadata
(never a segment's EC object's, which may be another video's); a later clip whose sampled frames share
a segment reuses its EC object (no encode job)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace as dataclasses_replace

import numpy as np
import pytest
import torch

from services.prefill.features import FeatureCache, LocalFeatures
from shared.engines.base import EncodedImage, SamplingParams, VideoFrames, join_segments
from shared.families import feature_width
from shared.protocol import EncodeJob, GenerationJob, ImageRef
from shared.video import SampledVideo, VideoSampler, VideoSampling, load_video, split_segments
from tests.stackutil import GREEDY, final_result, run_sync, start_stack
from tests.test_video import write_clip
from tests.test_video_engine import SAMPLERS, _hf_tokens

#: the features of a segment against its part of the whole video's forward: equal but for the
#: last bits of a matmul of another row count (seen: 0 here; bounded for any CPU)
ATOL = 1e-5


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    """Intra-coded clips (MJPG: every frame decodes alone, so a shorter clip's frames are the longer
    one's): ``long`` 3 s at 10 fps (6 sampled frames, 3 temporal patches), ``short`` its first 2 s
    (4 sampled frames: the long clip's first 4); ``small`` the long one at 64x32, a frame size the tiny
    Qwen3-VL's video processor keeps for 2 to 8 frames (its pixel budget binds for none of them:
    :func:`test_qwen3_vl_frame_size_depends_on_the_video_length`)."""
    root = tmp_path_factory.mktemp("segclips")
    return {
        "long": write_clip(root / "long.avi", 30, 10.0, size=(84, 56), fourcc="MJPG", seed=3),
        "short": write_clip(root / "short.avi", 20, 10.0, size=(84, 56), fourcc="MJPG", seed=3),
        "small": write_clip(root / "small.avi", 30, 10.0, size=(64, 32), fourcc="MJPG", seed=3),
    }


def _ref(video: SampledVideo) -> ImageRef:
    """A segmented video's ref as the API's client makes it (``shared.client``), its segments' refs
    in order and the whole video's source metadata."""

    def one(v: SampledVideo, media_key: str, **kw) -> ImageRef:
        n, height, width, _ = v.frames.shape
        return ImageRef(
            item_hash=v.item_hash,
            media_key=media_key,
            width=width,
            height=height,
            kind="video",
            frames=n,
            fps=v.sampled_fps,
            **kw,
        )

    return one(
        video,
        "",
        segments=tuple(one(seg, "m/" + seg.item_hash) for seg in video.segments),
        source_indices=tuple(video.indices),
        source_fps=float(video.info.fps),
        source_frames=video.info.total_frames,
    )


def _through_the_worker(engine, video: SampledVideo) -> tuple[list[EncodedImage], EncodedImage]:
    """The PD worker's path (agg: ``LocalFeatures``): each segment resolved - its stored frames
    content-addressed (the first stored stays), encoded, cached by its item -, then joined."""
    stored: dict[str, VideoFrames] = {}
    for seg in video.segments:
        stored.setdefault(seg.item_hash, VideoFrames.of(seg))

    async def load(ref: ImageRef) -> VideoFrames:
        return stored[ref.item_hash]

    source = LocalFeatures(engine, FeatureCache(1 << 30), load)
    ref = _ref(video)

    async def run() -> tuple[list[EncodedImage], EncodedImage]:
        parts = [(await source.resolve(seg, "r"))[0] for seg in ref.segments]
        joined = await source.join(ref, list(parts), "r")
        assert isinstance(joined, EncodedImage)
        return parts, joined

    return run_sync(run())


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_joined_segments_are_the_whole_video(tmp_path, clips, arch):
    """The PD worker's join: every column of the features (Qwen3-VL: the main ones and each deepstack
    layer's) the whole video's, the prompt's times the whole video's (Qwen3-VL's ``<t seconds>``),
    the greedy tokens the whole video's - also for a still clip, whose segments are one item (the
    same EC object thrice, with the first segment's times). Qwen3-VL on a frame size its processor
    keeps whatever the frame count (not yet segmented in service: see ``VIDEO_SEGMENT_FAMILIES``)."""
    from shared.engines.transformers_engine import TransformersEngine
    from shared.tools.models.tiny import build_tiny_model

    video = load_video(clips["small" if arch == "qwen3_vl" else "long"], SAMPLERS[arch], VideoSampling())
    split = split_segments(video, 2, 2)
    assert [len(s.frames) for s in split.segments] == [2, 2, 2]
    assert len({s.item_hash for s in split.segments}) == 3 and video.item_hash not in {
        s.item_hash for s in split.segments
    }
    # a still clip: its three segments the same pixels, one item (one EC object for all three)
    still_frames = np.concatenate([video.frames[:2]] * 3)
    still = split_segments(dataclasses_replace(video, frames=still_frames, item_hash="still"), 2, 2)
    assert len({s.item_hash for s in still.segments}) == 1
    model = build_tiny_model(tmp_path / arch, arch=arch, size="tiny", seed=0)
    config = json.loads((model / "config.json").read_text())
    # the feature columns: the main features, then (Qwen3-VL) each deepstack layer's
    blocks = 1 + len(config.get("vision_config", {}).get("deepstack_visual_indexes") or ())
    assert blocks == (3 if arch == "qwen3_vl" else 1)
    hidden = feature_width(config) // blocks
    engine = TransformersEngine(model, dtype="float32")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the video."}]}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def tokens(item):
        return [e.token_id async for e in engine.generate(messages, [item], params)]

    try:
        for clip in (split, still):
            (whole,) = run_sync(engine.encode_videos([VideoFrames.of(clip)]))
            parts, joined = _through_the_worker(engine, clip)
            assert joined.grid_thw == whole.grid_thw and joined.n_tokens == whole.n_tokens
            assert joined.features.shape == whole.features.shape == (whole.n_tokens, hidden * blocks)
            for b in range(blocks):  # every layer's features, each the whole video's
                cols = slice(b * hidden, (b + 1) * hidden)
                assert torch.allclose(joined.features[:, cols], whole.features[:, cols], rtol=0, atol=ATOL), b
                assert whole.features[:, cols].abs().sum() > 0
            # the prompt's times are the whole video's (Qwen3-VL: one a temporal patch; else none)
            assert joined.timestamps == whole.timestamps
            assert (whole.timestamps is not None) == (arch == "qwen3_vl")
            if clip is still and arch == "qwen3_vl":  # (the segments' own times would be the first's thrice)
                assert sum((p.timestamps or () for p in parts), ()) != whole.timestamps
            # the negative control: segments in another order are not the video
            if clip is split:
                reordered = join_segments(parts[::-1], video.sampled_fps)
                assert not torch.allclose(reordered.features, whole.features, atol=ATOL)
            assert run_sync(tokens(joined)) == run_sync(tokens(whole))
    finally:
        run_sync(engine.aclose())


def test_qwen3_vl_frame_size_depends_on_the_video_length(tmp_path, clips):
    """Why Qwen3-VL's videos are not segmented yet: its video processor sizes every frame by the
    whole video's frame count (``smart_resize(num_frames, ...)``: min and max pixels are the video's
    budget), so a segment of the 84x56 clip processed alone gets another frame size - another grid,
    other features - than its part of the whole video. (Qwen2-VL's sizes a frame alone: the same.)"""
    from transformers import AutoProcessor

    from shared.families import VIDEO_SEGMENT_FAMILIES
    from shared.tools.models.tiny import build_tiny_model

    def grids(arch: str, clip: str) -> tuple[list[int], list[int]]:
        processor = AutoProcessor.from_pretrained(build_tiny_model(tmp_path / arch, arch=arch, size="tiny", seed=0))
        video = load_video(clips[clip], SAMPLERS[arch], VideoSampling())

        def grid(frames) -> list[int]:
            out = processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
            return out["video_grid_thw"][0].tolist()

        return grid(video.frames), grid(video.frames[:2])

    whole, segment = grids("qwen3_vl", "long")
    assert whole[1:] != segment[1:], (whole, segment)
    whole, segment = grids("qwen3_vl", "small")  # (the size the join test uses: kept for 2 and 6 frames)
    assert whole[1:] == segment[1:], (whole, segment)
    whole, segment = grids("qwen2_vl", "long")
    assert whole[1:] == segment[1:], (whole, segment)
    assert all("qwen3_vl" not in families for families in VIDEO_SEGMENT_FAMILIES.values())


def test_a_short_video_is_not_split():
    from shared.video import SampledVideo, VideoInfo

    frames = torch.zeros((4, 8, 8, 3), dtype=torch.uint8).numpy()
    info = VideoInfo(width=8, height=8, total_frames=4, fps=2.0, codec="MJPG")
    v = SampledVideo(frames, (0, 1, 2, 3), info, VideoSampler.QWEN2_VL, VideoSampling(), "h")
    assert split_segments(v, 4, 2) is v and not split_segments(v, 4, 2).segments
    assert [len(s.frames) for s in split_segments(v, 3, 2).segments] == [2, 2]  # rounded down to the patch
    assert all(s.sampled_fps == v.sampled_fps for s in split_segments(v, 2, 2).segments)


@pytest.fixture(scope="module")
def segment_stack(nats_server, s3_server, tmp_path_factory):
    from shared.tools.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("segstack")
    model = build_tiny_model(root / "qwen2_vl", arch="qwen2_vl", size="tiny", seed=0)
    running = start_stack(
        nats_server,
        s3_server,
        model,
        root / "logs",
        topology="e-pd",
        EPD_VIDEO_SEGMENT_FRAMES="2",  # a segment a temporal patch: the 6-frame clip in 3
        EPD_ENCODE_STEALS="0",
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),
    )
    try:
        yield model, running
    finally:
        running.stack.stop()


def _ask(stack, clip: bytes):
    url = "data:video/avi;base64," + base64.b64encode(clip).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "Describe the video."},
            ],
        }
    ]
    resp = stack.chat(messages, **GREEDY)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_segmented_request_equals_the_unsegmented_generate(segment_stack, clips):
    model, stack = segment_stack
    video = load_video(clips["long"], VideoSampler.QWEN2_VL, VideoSampling())
    want = _hf_tokens(model, "Describe the video.", ["video"], [], [video], max_tokens=GREEDY["max_tokens"])

    def segment_jobs() -> list:
        return [m.image for _, _, m in stack.stream_messages("stream_encode") if isinstance(m, EncodeJob)]

    before = len(segment_jobs())
    body = _ask(stack, clips["long"])
    assert body["choices"][0]["token_ids"] == want
    (job,) = stack.messages_of("stream_generate", GenerationJob, body["id"])
    (ref,) = job.images
    assert ref.kind == "video" and ref.frames == 6 and ref.media_key == "" and len(ref.segments) == 3
    jobs = segment_jobs()[before:]
    assert sorted(j.item_hash for j in jobs) == sorted(s.item_hash for s in ref.segments)  # one job a segment
    assert all(j.frames == 2 for j in jobs)
    sources = final_result(stack, body["id"]).ec_sources
    assert set(sources) == {s.item_hash for s in ref.segments} and set(sources.values()) == {"store"}

    # a shorter clip whose sampled frames are the long one's first four: its two segments are
    # stored already - no encode job - and its answer is its own
    before = len(segment_jobs())
    short = _ask(stack, clips["short"])
    (short_job,) = stack.messages_of("stream_generate", GenerationJob, short["id"])
    assert [s.item_hash for s in short_job.images[0].segments] == [s.item_hash for s in ref.segments[:2]]
    assert len(segment_jobs()) == before
    short_video = load_video(clips["short"], VideoSampler.QWEN2_VL, VideoSampling())
    assert short["choices"][0]["token_ids"] == _hf_tokens(
        model, "Describe the video.", ["video"], [], [short_video], max_tokens=GREEDY["max_tokens"]
    )


def test_segments_are_joined_in_the_store_in_order_or_not_at_all(s3_server, caplog):
    """The vLLM engine's path (its connector loads one EC object per item): the PD worker joins a
    segmented video's EC objects, in order, into the video's own - against a real S3 store. A
    missing segment joins nothing (the engine then encodes the video whole); a second join finds
    the video stored. Negative control: segments in another order give another object."""
    import uuid

    import numpy as np

    from services.prefill.features import join_in_store
    from shared.protocol import ImageRef
    from shared.store.ec import ECStore
    from shared.store.objects import S3ObjectStore

    raw = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, f"seg-{uuid.uuid4().hex[:12]}")
    raw.ensure_bucket()
    store = ECStore(raw, namespace="epd", fingerprint="f" * 24, producer="encoder")
    rows = {
        h: np.random.default_rng(i).standard_normal((n, 8)).astype(np.float32)
        for i, (h, n) in enumerate([("a" * 64, 4), ("b" * 64, 4), ("c" * 64, 2)])
    }
    for h, r in rows.items():
        store.save(h, r.tobytes(), dtype="F32", shape=r.shape, extra={"engine": "vllm"})

    def video(item: str, order: str) -> ImageRef:
        segs = tuple(
            ImageRef(item_hash=h * 64, media_key="m", width=8, height=8, kind="video", frames=2) for h in order
        )
        return ImageRef(item_hash=item, media_key="", width=8, height=8, kind="video", frames=6, fps=2.0, segments=segs)

    whole = video("d" * 64, "abc")
    size = join_in_store(store, whole, "r1")
    assert size and size > 0
    obj = store.load(whole.item_hash)
    assert obj.shape == (10, 8) and obj.extra["segments"] == 3
    got = np.frombuffer(obj.data, dtype=np.float32).reshape(obj.shape)
    assert np.array_equal(got, np.concatenate([rows["a" * 64], rows["b" * 64], rows["c" * 64]]))
    assert join_in_store(store, whole, "r2") == 0  # stored already: nothing read or written

    reordered = video("e" * 64, "cba")
    assert join_in_store(store, reordered, "r3")
    assert store.load(reordered.item_hash).data != obj.data  # (the order is the video's)

    raw.delete(store.key("b" * 64))
    caplog.set_level("WARNING", logger="services.prefill.features")
    missing = video("f" * 64, "abc")
    assert join_in_store(store, missing, "r4") is None
    assert not store.exists(missing.item_hash)
    assert "not joined" in caplog.text and "encodes it whole" in caplog.text
