"""Video input: bounded probing and decoding of a video file, and frame sampling that picks the
frames vLLM's loader picks for the same parameters (issue 43).

The API decodes a video once, here, and the workers only ever see its sampled frames. The decoder
is OpenCV's FFmpeg build (``opencv-python-headless``): it is the decoder of vLLM's default video
loader, so a plain vLLM server given the same file decodes the same pixels - a condition for
greedy tokens equal to it. (PyAV bundles another FFmpeg build, whose colour conversion can differ
by a step; torchcodec needs the system's FFmpeg libraries, which many images lack.)

This module decodes, samples and hashes; a ``video_url`` is fetched and handed to it by
:func:`shared.fetch.load_video_url` (the API's side, as images are: :mod:`shared.media` decodes,
:mod:`shared.fetch` fetches, :mod:`shared.decode_budget` bounds the pixels decoded at once).

Every bound is checked from the container's header before any frame is decoded - the file's
bytes, its frame size (a header declaring a huge frame is a decompression bomb), its duration and
frame count - and again on what decoding yields. Errors are :class:`shared.errors.InvalidVideo`
(a 400) or :class:`shared.errors.PayloadTooLarge`, each naming the limit.

Samplers (:class:`VideoSampler`), as vLLM picks its loader by the model's video processor:

* ``uniform`` (vLLM's ``opencv`` loader, every processor without its own): ``num_frames`` spread
  evenly (``np.linspace``), or one frame every ``1/fps`` seconds, whichever gives fewer;
* ``qwen2_vl`` (``Qwen2VLVideoProcessor``: Qwen2-VL and Qwen2.5-VL): ``fps`` frames a second
  (default 2), at least 4, a multiple of the temporal patch (2); ``num_frames`` is not taken
  (vLLM ignores it there: here it is refused by name);
* ``qwen3_vl`` (``Qwen3VLVideoProcessor``): ``fps`` frames a second (default 2), at least 4,
  evenly spread and rounded; ``num_frames`` refused likewise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.errors import InvalidVideo, PayloadTooLarge, UnsupportedParameter

if TYPE_CHECKING:
    import numpy.typing as npt

HASH_SCHEMA = b"epd-video-v1"
SEGMENT_HASH_SCHEMA = b"epd-video-segment-v1"

#: vLLM's ``VideoMediaIO`` default frame count (``uniform``), and its fps-based loaders' defaults
DEFAULT_NUM_FRAMES = 32
DEFAULT_QWEN_FPS = 2.0
_QWEN_MIN_FRAMES = 4
_QWEN_MAX_FRAMES = 768
_QWEN_MAX_FPS = 30.0
_QWEN3_UNKNOWN_FPS = 24.0


class VideoSampler(StrEnum):
    """How a model's frames are picked from a video (vLLM's loader for its video processor)."""

    UNIFORM = "uniform"
    QWEN2_VL = "qwen2_vl"
    QWEN3_VL = "qwen3_vl"


#: the video processor class (``video_preprocessor_config.json``'s ``video_processor_type``) -> sampler
SAMPLER_OF_PROCESSOR: dict[str, VideoSampler] = {
    "Qwen2VLVideoProcessor": VideoSampler.QWEN2_VL,
    "Qwen3VLVideoProcessor": VideoSampler.QWEN3_VL,
}


def sampler_of_processor(video_processor: str | None) -> VideoSampler:
    """The sampler vLLM's loader uses for a model whose video processor class is this."""
    return SAMPLER_OF_PROCESSOR.get(video_processor or "", VideoSampler.UNIFORM)


@dataclass(frozen=True)
class VideoLimits:
    """Bounds on one video, each checked from the header before decoding, then on what decodes."""

    max_video_bytes: int = 64 * 1024 * 1024
    #: the longest video (seconds, from its frame count and rate)
    max_duration_s: float = 300.0
    #: the most frames the container may hold (a bound on the decode's reading, not only its output)
    max_total_frames: int = 30 * 300
    #: the most frames sampled from one video (what the encoder takes)
    max_sampled_frames: int = 128
    #: the largest frame, in pixels (width x height), as the header declares it and as it decodes
    max_frame_pixels: int = 1920 * 1080

    def __post_init__(self) -> None:
        if min(self.max_video_bytes, self.max_total_frames, self.max_sampled_frames, self.max_frame_pixels) < 1:
            raise ValueError("video limits must be >= 1")
        if not self.max_duration_s > 0:
            raise ValueError("max_duration_s must be > 0")


DEFAULT_VIDEO_LIMITS = VideoLimits()


@dataclass(frozen=True)
class VideoSampling:
    """A request's sampling parameters (vLLM's ``media_io_kwargs["video"]``); None: the sampler's
    default (``uniform``: 32 frames, no fps; ``qwen*``: 2 fps)."""

    num_frames: int | None = None
    fps: float | None = None

    def __post_init__(self) -> None:
        if self.num_frames is not None and (isinstance(self.num_frames, bool) or self.num_frames < 1):
            raise InvalidVideo(f"num_frames must be a positive integer, got {self.num_frames!r}")
        fps_ok = isinstance(self.fps, int | float) and not isinstance(self.fps, bool) and math.isfinite(self.fps)
        if self.fps is not None and not (fps_ok and self.fps > 0):
            raise InvalidVideo(f"fps must be a positive number, got {self.fps!r}")


@dataclass(frozen=True)
class VideoInfo:
    """What a video's header says (OpenCV's reading, as vLLM's loader reads it)."""

    width: int
    height: int
    total_frames: int
    fps: float
    codec: str

    @property
    def duration_s(self) -> float:
        return self.total_frames / self.fps if self.fps > 0 else 0.0


@dataclass(frozen=True)
class SampledVideo:
    """A video's sampled frames (``[n, height, width, 3]`` RGB ``uint8``), which frames they are,
    the rate they stand for, and their content hash (:func:`video_hash`)."""

    frames: npt.NDArray[np.uint8]
    indices: tuple[int, ...]
    info: VideoInfo
    sampler: VideoSampler
    sampling: VideoSampling
    item_hash: str
    #: the video split for encoding (:func:`split_segments`): consecutive runs of its frames, each
    #: its own item; empty: encoded whole
    segments: tuple[SampledVideo, ...] = ()
    #: a segment: the rate of the video it is part of (its own indices are a part of the video's)
    rate: float | None = None

    @property
    def sampled_fps(self) -> float:
        """Frames a second of the sampled clip (the LM's temporal positions follow it), computed as
        transformers' ``VideoMetadata.sampled_fps`` does (the same float); a segment: its video's."""
        if self.rate is not None:
            return self.rate
        if self.info.fps <= 0 or not self.indices:
            return 0.0
        return len(self.indices) / self.info.total_frames * self.info.fps


def check_sampling(sampler: VideoSampler, sampling: VideoSampling) -> None:
    """Refuse, by name, a parameter this sampler does not take (vLLM's fps-based loaders ignore
    ``num_frames``: here that is a 400, never a parameter silently dropped)."""
    if sampler is not VideoSampler.UNIFORM and sampling.num_frames is not None:
        raise UnsupportedParameter(
            f"this model samples video by fps ({sampler.value} loader): num_frames is not taken; give fps",
            param="media_io_kwargs.video.num_frames",
        )


def frame_indices(info: VideoInfo, sampler: VideoSampler, sampling: VideoSampling) -> list[int]:
    """The indices of the frames vLLM's loader for ``sampler`` picks from a video of ``info``
    with ``sampling`` (its ``compute_frames_index_to_sample``; tested against it)."""
    check_sampling(sampler, sampling)
    total = info.total_frames
    if total < 1:
        raise InvalidVideo("video has no frames")
    if sampler is VideoSampler.UNIFORM:
        num = DEFAULT_NUM_FRAMES if sampling.num_frames is None else sampling.num_frames
        n = min(num, total)
        if sampling.fps is not None:
            n = min(n, math.floor(info.duration_s * sampling.fps))
        n = max(1, n)
        if n == total:
            return list(range(n))
        return np.linspace(0, total - 1, n, dtype=int).tolist()
    fps = min(DEFAULT_QWEN_FPS if sampling.fps is None else float(sampling.fps), _QWEN_MAX_FPS)
    if sampler is VideoSampler.QWEN2_VL:
        if info.fps <= 0:
            raise InvalidVideo("video has no known frame rate (variable or unknown): cannot sample it by fps")
        temporal = 2
        max_frames = math.floor(min(_QWEN_MAX_FRAMES, total) / temporal) * temporal
        n_f = total / info.fps * fps
        n_f = min(max(n_f, _QWEN_MIN_FRAMES), max_frames, total)
        n = math.floor(n_f / temporal) * temporal
        if n < 1:
            raise InvalidVideo(f"video has {total} frame(s); this model needs at least {temporal}")
        # transformers' torch.arange(0, total, total / n).int(): a double step, float32 values
        step = total / n
        size = math.ceil(total / step)
        values = (np.arange(size, dtype=np.float64) * step).astype(np.float32).astype(np.int64)
        return np.minimum(values, total - 1).tolist()
    source_fps = info.fps if info.fps > 0 else _QWEN3_UNKNOWN_FPS
    n = int(total / source_fps * fps)
    n = min(max(n, _QWEN_MIN_FRAMES), _QWEN_MAX_FRAMES, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def _cv2() -> Any:
    import cv2  # (lazy: only the API's video path needs it)

    return cv2


class _Capture:
    """An OpenCV capture reading bytes from memory (its stream-buffered FFmpeg backend, as vLLM's).
    It holds the stream object: the capture reads it without a reference of its own, and
    releasing a capture whose stream was collected crashes the process."""

    def __init__(self, data: bytes):
        self.stream = io.BytesIO(data)
        self.cap = _open(self.stream)

    def __enter__(self) -> Any:
        return self.cap

    def __exit__(self, *exc: object) -> None:
        self.cap.release()


def _open(stream: io.BytesIO) -> Any:
    cv2 = _cv2()
    import cv2.videoio_registry as vr

    api = None
    for backend in vr.getStreamBufferedBackends():
        if not vr.hasBackend(backend):
            continue
        if not vr.isBackendBuiltIn(backend):
            _, abi, plugin_api = vr.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and plugin_api < 2):
                continue
        api = backend
        break
    if api is None:
        raise InvalidVideo("this server's OpenCV has no in-memory video backend")
    try:
        cap = cv2.VideoCapture(stream, api, [])
    except cv2.error as exc:
        raise InvalidVideo(f"not a readable video ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not cap.isOpened():
        raise InvalidVideo("not a video, or one whose container or codec this server cannot read")
    return cap


def _info(cap: Any, container: str | None) -> VideoInfo:
    cv2 = _cv2()
    fourcc = int(cap.get(cv2.CAP_PROP_FOURCC))
    codec = "".join(chr((fourcc >> (8 * i)) & 0xFF) for i in range(4)).strip("\x00 ") if fourcc > 0 else "?"
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    # vLLM's cross-check of the frame count by an end-of-stream seek, for an mp4 edit list that
    # hides a decode lead-in: fewer presentable frames than the header counts. Only ISO BMFF has
    # edit lists; in another container the same reading is a truncated file (refused when read).
    if total > 0 and container == CONTAINERS[0] and cap.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
        visible = int(cap.get(cv2.CAP_PROP_POS_FRAMES))
        at_end = not cap.grab()
        cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
        if at_end and 0 < visible < total - 1:
            total = visible
    return VideoInfo(
        width=int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
        height=int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
        total_frames=total,
        fps=float(cap.get(cv2.CAP_PROP_FPS)),
        codec=codec,
    )


def check_info(info: VideoInfo, limits: VideoLimits) -> None:
    """Refuse a video whose header is past a limit (before a frame is decoded)."""
    if info.width < 1 or info.height < 1:
        raise InvalidVideo(f"video declares no frame size ({info.width}x{info.height})")
    if info.width * info.height > limits.max_frame_pixels:
        raise InvalidVideo(
            f"video frames are {info.width}x{info.height}, over the limit of {limits.max_frame_pixels} pixels a frame"
        )
    if info.total_frames < 1:
        raise InvalidVideo("video has no frames (or its container does not say how many)")
    if info.total_frames > limits.max_total_frames:
        raise InvalidVideo(f"video has {info.total_frames} frames, over the limit of {limits.max_total_frames}")
    if info.duration_s > limits.max_duration_s:
        raise InvalidVideo(f"video is {info.duration_s:.1f} s long, over the limit of {limits.max_duration_s:g} s")


def probe(data: bytes, limits: VideoLimits = DEFAULT_VIDEO_LIMITS) -> VideoInfo:
    """A video's header, checked against ``limits`` (no frame decoded)."""
    _check_bytes(data, limits)
    with _Capture(data) as cap:
        info = _info(cap, container_of(data))
        check_info(info, limits)
        return info


#: the containers taken, by their signature (FFmpeg reads many more formats - image sequences,
#: playlists that name other files - which a video input has no need of)
CONTAINERS = ("mp4/mov (ISO BMFF)", "webm/mkv (Matroska)", "avi")


def container_of(data: bytes) -> str | None:
    """The container ``data`` starts as (one of :data:`CONTAINERS`), or None."""
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return CONTAINERS[0]
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return CONTAINERS[1]
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return CONTAINERS[2]
    return None


def _check_bytes(data: bytes, limits: VideoLimits) -> None:
    if not data:
        raise InvalidVideo("video data is empty")
    if len(data) > limits.max_video_bytes:
        raise PayloadTooLarge(f"video is {len(data)} bytes, over the limit of {limits.max_video_bytes} bytes")
    if container_of(data) is None:
        raise InvalidVideo(f"not a video in a container this server takes ({', '.join(CONTAINERS)})")


def load_video(
    data: bytes,
    sampler: VideoSampler,
    sampling: VideoSampling = VideoSampling(),
    limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
) -> SampledVideo:
    """Decode ``data`` once and keep the frames ``sampler`` picks (vLLM's loader's frames, pixel
    for pixel: the same decoder, read in order, BGR to RGB as it does). Every frame picked must
    decode: a truncated or corrupt video is refused, never served with frames missing."""
    _check_bytes(data, limits)
    check_sampling(sampler, sampling)
    cv2 = _cv2()
    with _Capture(data) as cap:
        info = _info(cap, container_of(data))
        check_info(info, limits)
        indices = frame_indices(info, sampler, sampling)
        if len(indices) > limits.max_sampled_frames:
            raise InvalidVideo(
                f"sampling picks {len(indices)} frames, over the limit of {limits.max_sampled_frames}: "
                "ask for fewer (num_frames or fps)"
            )
        wanted = set(indices)
        frames: list[npt.NDArray[np.uint8]] = []
        for idx in range(indices[-1] + 1):
            if not cap.grab():
                raise InvalidVideo(f"video is truncated or corrupt: frame {idx} of {info.total_frames} does not decode")
            if idx in wanted:
                ok, frame = cap.retrieve()
                if not ok or frame is None or frame.size == 0:
                    raise InvalidVideo(f"video is corrupt: frame {idx} does not decode")
                if frame.shape[:2] != (info.height, info.width):
                    raise InvalidVideo(
                        f"video frame {idx} is {frame.shape[1]}x{frame.shape[0]}, not the declared "
                        f"{info.width}x{info.height}"
                    )
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    stacked = np.stack(frames)
    return SampledVideo(
        frames=stacked,
        indices=tuple(indices),
        info=info,
        sampler=sampler,
        sampling=sampling,
        item_hash=video_hash(stacked, sampler, sampling, info),
    )


def video_hash(frames: npt.NDArray[np.uint8], sampler: VideoSampler, sampling: VideoSampling, info: VideoInfo) -> str:
    """The content address of a sampled video: its frames' pixels and every setting that changes
    what the encoder makes of them (the sampler, the parameters, the source rate the temporal
    positions follow) - another ``num_frames`` is another item."""
    h = hashlib.sha256(HASH_SCHEMA)
    n, height, width, channels = frames.shape
    h.update(f"{sampler.value}|{sampling.num_frames}|{sampling.fps}|{info.fps!r}|{info.total_frames}".encode())
    h.update(f"|{n}x{height}x{width}x{channels}|".encode())
    h.update(np.ascontiguousarray(frames).data)
    return h.hexdigest()


def segment_hash(frames: npt.NDArray[np.uint8]) -> str:
    """The content address of a video segment: its frames' pixels only. What a segment encodes to
    depends on nothing else (the sampling that picked the frames, and the rate they stand for, act
    in the LM's positions, which the whole video's item carries), so videos that share a run of
    frames share its EC object."""
    h = hashlib.sha256(SEGMENT_HASH_SCHEMA)
    n, height, width, channels = frames.shape
    h.update(f"{n}x{height}x{width}x{channels}|".encode())
    h.update(np.ascontiguousarray(frames).data)
    return h.hexdigest()


def split_segments(video: SampledVideo, segment_frames: int, temporal_patch: int) -> SampledVideo:
    """``video`` with its frames split into segments of ``segment_frames`` (rounded down to a
    multiple of ``temporal_patch``, at least one patch; the last may be shorter), when it has more
    than that. Segment boundaries fall on temporal patches, so a family whose vision tower attends
    within a temporal patch (Qwen2-VL, Qwen2.5-VL: ``cu_seqlens`` per grid row) encodes each segment
    to exactly its part of the whole video's features (in the last bits, as batched kernels do)."""
    if temporal_patch < 1 or segment_frames < 1:
        raise ValueError("segment_frames and temporal_patch must be >= 1")
    size = max(temporal_patch, segment_frames // temporal_patch * temporal_patch)
    n = len(video.frames)
    if n <= size:
        return video
    segments = []
    for start in range(0, n, size):
        frames = np.ascontiguousarray(video.frames[start : start + size])
        segments.append(
            SampledVideo(
                frames=frames,
                indices=video.indices[start : start + size],
                info=video.info,
                sampler=video.sampler,
                sampling=video.sampling,
                item_hash=segment_hash(frames),
                rate=video.sampled_fps,
            )
        )
    return dataclasses.replace(video, segments=tuple(segments))
