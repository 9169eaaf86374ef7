"""Video decoding and frame sampling (``shared.video``, issue 43): the frames picked are the ones
vLLM's loader picks for the same parameters (its ``compute_frames_index_to_sample``, over a grid of
lengths, rates and parameters), decoded to the same pixels (its ``load_bytes`` on the same file),
and every bound is a clear error naming its limit."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from shared.errors import InvalidVideo, PayloadTooLarge, UnsupportedParameter
from shared.video import (
    VideoInfo,
    VideoLimits,
    VideoSampler,
    VideoSampling,
    frame_indices,
    load_video,
    probe,
    sampler_of_processor,
)


def write_clip(path: Path, frames: int, fps: float, size=(64, 48), fourcc="mp4v", seed=0, flat=False) -> bytes:
    """A clip of noise frames (each its own; ``flat``: one grey level each), written by OpenCV's FFmpeg."""
    import cv2

    rng = np.random.default_rng(seed)
    w, h = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (w, h))
    assert writer.isOpened()
    for i in range(frames):
        writer.write(np.full((h, w, 3), 10 * i, np.uint8) if flat else rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    writer.release()
    return path.read_bytes()


def _vllm_loader(sampler: VideoSampler):
    from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend, VideoBackend

    return {
        VideoSampler.UNIFORM: VideoBackend,
        VideoSampler.QWEN2_VL: Qwen2VLVideoBackend,
        VideoSampler.QWEN3_VL: Qwen3VLVideoBackend,
    }[sampler]


def _vllm_target(sampler: VideoSampler, sampling: VideoSampling):
    """vLLM's target for these parameters, with its defaults (VideoMediaIO: 32 frames; the
    fps-based loaders: 2 fps)."""
    from vllm.multimodal.video_decoders.base import VideoTargetMetadata

    if sampler is VideoSampler.UNIFORM:
        return VideoTargetMetadata(
            num_frames=32 if sampling.num_frames is None else sampling.num_frames,
            fps=-1 if sampling.fps is None else sampling.fps,
            max_duration=300,
        )
    return VideoTargetMetadata(num_frames=32, fps=2 if sampling.fps is None else sampling.fps, max_duration=300)


TOTALS = [1, 2, 3, 4, 5, 7, 20, 30, 31, 49, 100, 451, 1000, 9000]
SOURCE_FPS = [1.0, 7.5, 24.0, 29.97, 30.0, 60.0]
SAMPLINGS = {
    VideoSampler.UNIFORM: [
        VideoSampling(num_frames=n, fps=f) for n, f in itertools.product([None, 1, 4, 32, 64], [None, 0.5, 1, 2])
    ],
    # (22 on 30 frames at 30 fps: where float64 index math is a frame off float32, transformers')
    VideoSampler.QWEN2_VL: [VideoSampling(fps=f) for f in [None, 0.5, 1, 2, 4, 22, 30, 60]],
    VideoSampler.QWEN3_VL: [VideoSampling(fps=f) for f in [None, 0.5, 1, 2, 4, 30, 60]],
}


@pytest.mark.parametrize("sampler", list(VideoSampler))
def test_frame_indices_equal_vllms_loader(sampler):
    from vllm.multimodal.video_decoders.base import VideoSourceMetadata

    loader = _vllm_loader(sampler)
    compared = refused = 0
    for total, fps, sampling in itertools.product(TOTALS, SOURCE_FPS, SAMPLINGS[sampler]):
        info = VideoInfo(width=64, height=48, total_frames=total, fps=fps, codec="FMP4")
        source = VideoSourceMetadata(total_frames_num=total, original_fps=fps, duration=total / fps)
        try:
            want = list(loader.compute_frames_index_to_sample(source, _vllm_target(sampler, sampling)))
        except (ValueError, ZeroDivisionError):  # vLLM cannot sample it either (e.g. 1 frame, temporal patch 2)
            with pytest.raises(InvalidVideo):
                frame_indices(info, sampler, sampling)
            refused += 1
            continue
        assert frame_indices(info, sampler, sampling) == want, (total, fps, sampling)
        compared += 1
    assert compared > 200


def test_the_sampler_follows_vllms_choice_of_loader():
    from vllm.multimodal.video import get_video_loader_backend_for_processor

    for processor in ["Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor", "LlavaOnevisionVideoProcessor", None]:
        backend = get_video_loader_backend_for_processor(processor) or "opencv"
        assert sampler_of_processor(processor).value == {"opencv": "uniform"}.get(backend, backend)


@pytest.mark.parametrize(
    "sampler,sampling,fourcc",
    [
        (VideoSampler.UNIFORM, VideoSampling(num_frames=5), "mp4v"),
        (VideoSampler.UNIFORM, VideoSampling(num_frames=8, fps=3), "MJPG"),
        (VideoSampler.QWEN2_VL, VideoSampling(), "mp4v"),
        (VideoSampler.QWEN3_VL, VideoSampling(fps=4), "MJPG"),
    ],
)
def test_frames_equal_vllms_loader_pixel_for_pixel(tmp_path, sampler, sampling, fourcc):
    data = write_clip(tmp_path / ("clip.mp4" if fourcc == "mp4v" else "clip.avi"), 30, 10.0, fourcc=fourcc)
    ours = load_video(data, sampler, sampling)
    kwargs = {} if sampling.fps is None else {"fps": sampling.fps}
    if sampling.num_frames is not None:
        kwargs["num_frames"] = sampling.num_frames
    frames, meta = _vllm_loader(sampler).load_bytes(data, **kwargs)
    assert list(ours.indices) == meta["frames_indices"]
    assert ours.frames.dtype == np.uint8 and ours.frames.shape == frames.shape
    assert np.array_equal(ours.frames, frames)
    # the negative control: other parameters pick other frames, and the item is another one
    fewer = VideoSampling(num_frames=3) if sampler is VideoSampler.UNIFORM else VideoSampling(fps=1)
    other = load_video(data, sampler, fewer)
    assert other.indices != ours.indices and other.item_hash != ours.item_hash


def test_the_content_address_covers_pixels_and_settings(tmp_path):
    data = write_clip(tmp_path / "a.mp4", 30, 10.0)
    a = load_video(data, VideoSampler.UNIFORM, VideoSampling(num_frames=4))
    again = load_video(data, VideoSampler.UNIFORM, VideoSampling(num_frames=4))
    assert a.item_hash == again.item_hash
    # the same frames picked by other parameters are another item (the settings are in the key)
    same_frames = load_video(data, VideoSampler.UNIFORM, VideoSampling(num_frames=4, fps=100))
    assert same_frames.indices == a.indices and same_frames.item_hash != a.item_hash
    clip_b = write_clip(tmp_path / "b.mp4", 30, 10.0, seed=1)
    other_clip = load_video(clip_b, VideoSampler.UNIFORM, VideoSampling(num_frames=4))
    assert other_clip.item_hash != a.item_hash


# -- bad input: each a clear error naming its limit ------------------------------------------------


def test_not_a_video_and_truncated_videos_are_refused(tmp_path):
    from tests.stackutil import noise_image, png_bytes

    with pytest.raises(InvalidVideo, match="not a video"):
        probe(png_bytes(noise_image(1, (32, 32))))
    with pytest.raises(InvalidVideo, match="empty"):
        probe(b"")
    mp4 = write_clip(tmp_path / "c.mp4", 30, 10.0)
    with pytest.raises(InvalidVideo, match="not a video"):  # the index (moov) is at its end: cut off
        probe(mp4[: len(mp4) // 2])
    avi = write_clip(tmp_path / "c.avi", 30, 10.0, fourcc="MJPG")
    assert probe(avi).total_frames == 30
    with pytest.raises(InvalidVideo, match="truncated|corrupt|not a video"):
        load_video(avi[: len(avi) // 2], VideoSampler.UNIFORM, VideoSampling(num_frames=30))


def test_each_bound_is_checked_before_decoding(tmp_path):
    data = write_clip(tmp_path / "d.mp4", 40, 10.0, size=(64, 48))
    with pytest.raises(PayloadTooLarge, match=f"over the limit of {len(data) - 1} bytes"):
        probe(data, VideoLimits(max_video_bytes=len(data) - 1))
    with pytest.raises(InvalidVideo, match="64x48, over the limit of 3071 pixels"):
        probe(data, VideoLimits(max_frame_pixels=64 * 48 - 1))
    with pytest.raises(InvalidVideo, match="4.0 s long, over the limit of 3 s"):
        probe(data, VideoLimits(max_duration_s=3))
    with pytest.raises(InvalidVideo, match="40 frames, over the limit of 39"):
        probe(data, VideoLimits(max_total_frames=39))
    with pytest.raises(InvalidVideo, match="picks 8 frames, over the limit of 7"):
        load_video(data, VideoSampler.QWEN2_VL, VideoSampling(), VideoLimits(max_sampled_frames=7))
    assert probe(data, VideoLimits(max_frame_pixels=64 * 48, max_duration_s=4, max_total_frames=40)).total_frames == 40


def test_a_huge_declared_frame_is_refused_from_the_header(tmp_path):
    """A decompression bomb: ~180 KiB declaring 4096x4096 frames (48 MiB each decoded) is refused
    before a frame is decoded."""
    data = write_clip(tmp_path / "big.mp4", 1, 1.0, size=(4096, 4096), flat=True)
    assert len(data) < 512 * 1024
    with pytest.raises(InvalidVideo, match="4096x4096, over the limit of 2073600 pixels"):
        load_video(data, VideoSampler.UNIFORM)


def test_parameters_a_sampler_does_not_take_are_refused_by_name():
    info = VideoInfo(width=64, height=48, total_frames=100, fps=10.0, codec="FMP4")
    for sampler in (VideoSampler.QWEN2_VL, VideoSampler.QWEN3_VL):
        with pytest.raises(UnsupportedParameter, match="num_frames is not taken") as err:
            frame_indices(info, sampler, VideoSampling(num_frames=8))
        assert err.value.param == "media_io_kwargs.video.num_frames"
    for bad in ({"num_frames": 0}, {"num_frames": True}, {"fps": 0}, {"fps": float("nan")}, {"fps": -1}):
        with pytest.raises(InvalidVideo):
            VideoSampling(**bad)
    with pytest.raises(InvalidVideo, match="no known frame rate"):
        frame_indices(VideoInfo(64, 48, 100, 0.0, "FMP4"), VideoSampler.QWEN2_VL, VideoSampling())
