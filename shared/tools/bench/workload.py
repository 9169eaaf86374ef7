"""The workload of ``epd bench``: a :class:`~shared.tools.bench.schema.WorkloadSpec` from flags or a
YAML file, and the deterministic list of requests it stands for.

Contract:

* :func:`plan` / :func:`iter_plan` depend only on the spec (and the run index of a sweep): the same
  seed gives the same requests, prompts, output lengths, arrival offsets and image bytes, on any
  machine. Independent random streams decide kinds, images, lengths and arrivals, so changing
  one share does not reshuffle the prompts.
* A *conversation* is ``spec.turns`` consecutive requests about the images of its first turn;
  turn k carries the history so far, with planned (not generated) assistant replies, so every
  request can be sent on its own. Turns after the first are ``repeat`` requests.
* ``repeat`` requests reuse images chosen among the last ``repeat_window`` distinct images
  of the plan; ``text`` requests carry none.
* Images (JPEG) are generated when a request body is built (:meth:`PlannedRequest.body`), not when the
  plan is made, and only the most recent ones are kept, so a long run does not hold them all.
  Their content depends on (seed, run index, image id, size): a later run of a sweep sees new
  images rather than the earlier run's cache hits; repeats inside a run stay repeats.
* ``video_share`` of the requests with media carry one video clip instead of images (a stream of
  its own decides: with ``video_share`` 0 a plan is the one it was without videos). A clip
  (:func:`video_clip`, mp4 at :data:`CLIP_FPS`) has ``video_frames`` frames of a ``video_sizes``
  size, drawn from (seed, run index, clip id, frames, size) like an image, and is sent with
  ``media_io_kwargs.video.fps`` = its rate, so every loader samples all its frames (vLLM's
  Qwen-VL loaders take no ``num_frames``; the uniform one takes at most 32 by default).
  ``video_repeat_share`` of the video requests send again one of the last ``repeat_window`` clips.
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from shared.tools.bench.schema import WorkloadSpec

#: The planned prompt words come from this list (plain English, one token each on most tokenizers).
WORDS = (
    "the a image picture photo scene object colour shape light shadow left right top bottom centre "
    "describe explain count list compare what where which how many small large bright dark red green "
    "blue pattern texture noise gradient corner edge region detail background foreground near far "
    "above below between inside outside around please briefly carefully exactly"
).split()

#: Images kept encoded (per process): a repeat among the last this-many distinct images is not drawn again.
IMAGE_CACHE = 64
#: Clips kept encoded (per process), likewise.
CLIP_CACHE = 16
#: Frames a second of the bench's clips; requests ask the loader for this rate: every frame is sampled.
CLIP_FPS = 2.0
#: The frame counts a video workload may ask for (EPD_MAX_VIDEO_FRAMES bounds what a server takes).
VIDEO_FRAMES_RANGE = (4, 32)


# -- spec from flags / YAML ---------------------------------------------------------------------
def parse_weights(text: str, key=str) -> dict:
    """``"1:0.8,2:0.2"`` -> {1: 0.8, 2: 0.2}; ``"1"`` -> {1: 1.0}; keys through ``key``."""
    out: dict = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, weight = part.partition(":")
        try:
            out[key(name.strip())] = float(weight) if sep else 1.0
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid weight list {text!r}: use e.g. 1:0.8,2:0.2") from exc
    if not out:
        raise argparse.ArgumentTypeError(f"empty weight list {text!r}")
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``"16"`` -> (16, 16); ``"8,32"`` -> (8, 32)."""
    try:
        parts = [int(p) for p in text.replace(":", ",").split(",") if p.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: use e.g. 16 or 8,32") from exc
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < 0:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: use MIN,MAX with MIN <= MAX")
    return parts[0], parts[1]


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid rates {text!r}: use e.g. 0.5,1,2") from exc
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"invalid rates {text!r}: positive numbers, comma-separated")
    return rates


def parse_size(text: str) -> tuple[int, int]:
    w, sep, h = text.lower().partition("x")
    try:
        size = int(w), int(h)
    except ValueError:
        raise ValueError(f"invalid image size {text!r}: use WxH, e.g. 448x448") from None
    if not sep or size[0] < 1 or size[1] < 1:
        raise ValueError(f"invalid image size {text!r}: use WxH, e.g. 448x448")
    return size


def check_spec(spec: WorkloadSpec) -> WorkloadSpec:
    """``spec`` if it describes a workload that can run; ValueError saying what is wrong otherwise."""
    problems = []
    if spec.requests is None and spec.duration_s is None:
        problems.append("set requests or duration_s")
    if spec.requests is not None and spec.requests < 1:
        problems.append("requests must be >= 1")
    if spec.duration_s is not None and spec.duration_s <= 0:
        problems.append("duration_s must be > 0")
    if spec.arrival not in ("concurrency", "poisson"):
        problems.append(f"arrival must be 'concurrency' or 'poisson', not {spec.arrival!r}")
    if spec.arrival == "concurrency" and spec.concurrency < 1:
        problems.append("concurrency must be >= 1")
    if spec.arrival == "poisson" and not spec.sweep and not (spec.rate and spec.rate > 0):
        problems.append("arrival 'poisson' needs a rate > 0 (or a sweep)")
    if spec.sweep and spec.arrival != "poisson":
        problems.append("a sweep needs arrival 'poisson'")
    if any(r <= 0 for r in spec.sweep):
        problems.append("sweep rates must be > 0")
    for name, weights in (
        ("images_per_request", spec.images_per_request),
        ("image_sizes", spec.image_sizes),
        ("video_sizes", spec.video_sizes),
    ):
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            problems.append(f"{name} needs non-negative weights with a positive sum")
    if any(n < 1 for n in spec.images_per_request):
        problems.append("images_per_request keys must be >= 1 (text-only requests: text_only_share)")
    for size in [*spec.image_sizes, *spec.video_sizes]:
        try:
            parse_size(size)
        except ValueError as exc:
            problems.append(str(exc))
    lo, hi = spec.video_frames
    if not VIDEO_FRAMES_RANGE[0] <= lo <= hi <= VIDEO_FRAMES_RANGE[1]:
        low, high = VIDEO_FRAMES_RANGE
        problems.append(f"video_frames must be [min, max] with {low} <= min <= max <= {high}")
    for name in ("repeat_share", "text_only_share", "video_share", "video_repeat_share"):
        if not 0.0 <= getattr(spec, name) <= 1.0:
            problems.append(f"{name} must be in [0, 1]")
    if spec.repeat_window < 1:
        problems.append("repeat_window must be >= 1")
    for name in ("prompt_words", "output_tokens"):
        lo, hi = getattr(spec, name)
        if lo > hi or lo < (1 if name == "output_tokens" else 0):
            problems.append(f"{name} must be [min, max] with min <= max")
    if spec.turns < 1:
        problems.append("turns must be >= 1")
    if problems:
        raise ValueError("invalid workload: " + "; ".join(problems))
    return spec


def load_spec(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> WorkloadSpec:
    """A spec from a YAML file (keys = ``WorkloadSpec`` field names) with ``overrides`` (the flags
    given) on top. Setting only ``duration_s`` (in the file or the overrides) drops the default
    request count; setting ``rate`` or ``sweep`` without ``arrival`` means arrival ``poisson``."""
    import yaml

    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of WorkloadSpec fields")
        data.update(loaded or {})
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if "duration_s" in data and "requests" not in data:
        data["requests"] = None
    if "arrival" not in data and ("rate" in data or data.get("sweep")):
        data["arrival"] = "poisson"
    try:
        spec = msgspec.convert(data, WorkloadSpec, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid workload: {exc}") from None
    return check_spec(spec)


# -- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageSpec:
    """One planned image: its id in the plan and its size. Bytes come from :func:`image_bytes`."""

    id: int
    width: int
    height: int


@dataclass(frozen=True)
class VideoSpec:
    """One planned clip: its id in the plan, its frame count and frame size. Bytes come from
    :func:`clip_bytes`."""

    id: int
    frames: int
    width: int
    height: int


@dataclass(frozen=True)
class Turn:
    """One earlier turn of a conversation, as the request's history carries it."""

    user: str
    assistant: str


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the workload. ``images`` (or ``videos``) go in the conversation's first user message."""

    index: int
    kind: str  # "text" | "image" | "repeat" | "video" | "video_repeat" (as RequestRecord.kind)
    images: tuple[ImageSpec, ...]
    prompt: str
    output_tokens: int
    #: seconds after the run's start (arrival "poisson"); 0.0 for a concurrency run
    arrival_s: float = 0.0
    conversation: int = 0
    turn: int = 0
    history: tuple[Turn, ...] = ()
    seed: int = 0
    run_index: int = 0
    videos: tuple[VideoSpec, ...] = ()

    def messages(self) -> list[dict[str, Any]]:
        """The OpenAI chat messages (images as JPEG data URLs, clips as mp4 data URLs, built now)."""
        image_parts = [
            {"type": "image_url", "image_url": {"url": image_data_url(self.seed, self.run_index, im)}}
            for im in self.images
        ] + [
            {"type": "video_url", "video_url": {"url": clip_data_url(self.seed, self.run_index, clip)}}
            for clip in self.videos
        ]
        out: list[dict[str, Any]] = []
        for i, user in enumerate([t.user for t in self.history] + [self.prompt]):
            if i == 0 and image_parts:
                out.append({"role": "user", "content": [*image_parts, {"type": "text", "text": user}]})
            else:
                out.append({"role": "user", "content": user})
            if i < len(self.history):
                out.append({"role": "assistant", "content": self.history[i].assistant})
        return out

    def body(self, model: str, *, ignore_eos: bool = True, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """A streaming chat-completions body (OpenAI's fields, plus ``ignore_eos`` and ``extra``)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages(),
            "max_tokens": self.output_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        if self.videos:  # every frame of the clip sampled, whatever the model's loader
            body["media_io_kwargs"] = {"video": {"fps": CLIP_FPS}}
        body.update(extra or {})
        return body


def _weighted(weights: dict) -> tuple[list, np.ndarray]:
    keys = sorted(weights)
    p = np.array([float(weights[k]) for k in keys])
    return keys, p / p.sum()


def _words(rng: np.random.Generator, lo: int, hi: int) -> str:
    n = int(rng.integers(lo, hi + 1))
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def iter_plan(spec: WorkloadSpec, *, rate: float | None = None, run_index: int = 0) -> Iterator[PlannedRequest]:
    """The workload's requests, in order, without end. ``rate`` (req/s) gives Poisson arrival
    offsets (default: ``spec.rate`` when ``spec.arrival`` is "poisson"; none otherwise)."""
    if rate is None and spec.arrival == "poisson":
        rate = spec.rate
    # (a fifth stream decides videos: spawn(5)'s first four are spawn(4)'s, so image plans stay as they were)
    streams = np.random.SeedSequence(spec.seed).spawn(5)
    kinds, images, lengths, arrivals, videos = (np.random.default_rng(s) for s in streams)
    counts, count_p = _weighted(spec.images_per_request)
    sizes, size_p = _weighted(spec.image_sizes)
    sizes = [parse_size(s) for s in sizes]
    clip_sizes, clip_size_p = _weighted(spec.video_sizes)
    clip_sizes = [parse_size(s) for s in clip_sizes]
    recent: list[ImageSpec] = []  # distinct images so far, newest last (the last repeat_window kept)
    recent_clips: list[VideoSpec] = []  # likewise, clips
    next_image = next_clip = 0
    index = 0
    clock = 0.0
    for conversation in itertools.count():
        text_only = kinds.random() < spec.text_only_share
        clip: VideoSpec | None = None
        fresh_clip = False
        if not text_only and spec.video_share > 0 and videos.random() < spec.video_share:
            if recent_clips and videos.random() < spec.video_repeat_share:
                clip = recent_clips[int(videos.integers(len(recent_clips)))]
            else:
                w, h = clip_sizes[int(videos.choice(len(clip_sizes), p=clip_size_p))]
                frames = int(videos.integers(spec.video_frames[0], spec.video_frames[1] + 1))
                clip = VideoSpec(next_clip, frames, w, h)
                fresh_clip = True
                next_clip += 1
                recent_clips = (recent_clips + [clip])[-spec.repeat_window :]
        n_images = 0 if text_only or clip else int(counts[kinds.choice(len(counts), p=count_p)])
        repeat = n_images > 0 and bool(recent) and kinds.random() < spec.repeat_share
        chosen: list[ImageSpec] = []
        if repeat:  # among the last repeat_window distinct images (all `recent` holds)
            chosen = [recent[int(i)] for i in images.permutation(len(recent))[:n_images]]
            # More images than the window holds: the rest are new (the request is then "image").
        while len(chosen) < n_images:
            w, h = sizes[int(images.choice(len(sizes), p=size_p))]
            chosen.append(ImageSpec(next_image, w, h))
            next_image += 1
        fresh = [im for im in chosen if im not in recent]
        recent = (recent + fresh)[-spec.repeat_window :]
        history: list[Turn] = []
        for turn in range(1 if text_only else spec.turns):
            prompt = _words(lengths, *spec.prompt_words) or "describe"
            out_tokens = int(lengths.integers(spec.output_tokens[0], spec.output_tokens[1] + 1))
            if rate:
                clock += float(arrivals.exponential(1.0 / rate))
            if text_only:
                kind = "text"
            elif clip is not None:
                kind = "video" if turn == 0 and fresh_clip else "video_repeat"
            elif turn > 0 or not fresh:
                kind = "repeat"
            else:
                kind = "image"
            yield PlannedRequest(
                index=index,
                kind=kind,
                images=tuple(chosen),
                prompt=prompt,
                output_tokens=out_tokens,
                arrival_s=clock if rate else 0.0,
                conversation=conversation,
                turn=turn,
                history=tuple(history),
                seed=spec.seed,
                run_index=run_index,
                videos=(clip,) if clip is not None else (),
            )
            index += 1
            # The planned reply stands in for the model's: every turn can be sent on its own.
            history.append(Turn(prompt, _words(lengths, *spec.prompt_words) or "ok"))


def plan(spec: WorkloadSpec, *, rate: float | None = None, run_index: int = 0) -> list[PlannedRequest]:
    """The first ``spec.requests`` requests of :func:`iter_plan`, stopping earlier at the first
    arrival after ``spec.duration_s`` (Poisson). A duration-only concurrency workload has no fixed
    length: its runner takes from :func:`iter_plan` until the time is up (ValueError here)."""
    if rate is None and spec.arrival == "poisson":
        rate = spec.rate
    if spec.requests is None and (spec.duration_s is None or not rate):
        raise ValueError("a duration-only workload without a rate has no fixed length: use iter_plan")
    out: list[PlannedRequest] = []
    for req in iter_plan(spec, rate=rate, run_index=run_index):
        if spec.requests is not None and len(out) >= spec.requests:
            break
        if rate and spec.duration_s is not None and req.arrival_s > spec.duration_s:
            break
        out.append(req)
    return out


# -- images -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=IMAGE_CACHE)
def image_bytes(seed: int, run_index: int, image_id: int, width: int, height: int) -> bytes:
    """A deterministic JPEG (quality 90, like a photo's size): colour waves, coarse blotches and
    fine grain drawn from (seed, run index, image id, size), so no two images look alike. A few ms
    even for large sizes: drawing images must not slow the load generator."""
    from PIL import Image

    rng = np.random.default_rng([seed, run_index, image_id, width, height])
    x = np.arange(width, dtype=np.float32) / width
    y = np.arange(height, dtype=np.float32) / height
    freq, phase, base = rng.uniform(1, 8, (3, 2)), rng.uniform(0, 2 * np.pi, (3, 2)), rng.uniform(60, 196, 3)
    pixels = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):  # separable waves: cheap to draw at any size
        pixels[..., c] = (
            base[c]
            + 45 * np.sin(freq[c, 0] * 2 * np.pi * x + phase[c, 0])[None, :]
            + 45 * np.sin(freq[c, 1] * 2 * np.pi * y + phase[c, 1])[:, None]
        )
    cells = rng.integers(0, 256, (max(1, height // 32), max(1, width // 32), 3), dtype=np.uint8)
    blocks = Image.fromarray(cells, "RGB").resize((width, height), Image.Resampling.BILINEAR)
    pixels += np.asarray(blocks, np.float32) * 0.4 - 51
    pixels += rng.integers(-10, 11, (height, width, 3), dtype=np.int8)
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def image_data_url(seed: int, run_index: int, image: ImageSpec) -> str:
    return (
        "data:image/jpeg;base64,"
        + base64.b64encode(image_bytes(seed, run_index, image.id, image.width, image.height)).decode()
    )


# -- video clips --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=CLIP_CACHE)
def clip_bytes(seed: int, run_index: int, clip_id: int, frames: int, width: int, height: int) -> bytes:
    """A planned clip's mp4 (:func:`video_clip` at :data:`CLIP_FPS`), its content drawn from
    (seed, run index, clip id, frames, size) as an image's is."""
    return video_clip([seed, run_index, clip_id, frames, width, height], frames, width, height, CLIP_FPS)


def clip_data_url(seed: int, run_index: int, clip: VideoSpec) -> str:
    data = clip_bytes(seed, run_index, clip.id, clip.frames, clip.width, clip.height)
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def video_clip(seed: int | Sequence[int], frames: int, width: int, height: int, fps: float) -> bytes:
    """A deterministic mp4 (``mp4v``, written by OpenCV's FFmpeg - the decoder the API reads it
    with): a coloured square moving across a plain background, ``frames`` frames of ``width`` x
    ``height`` at ``fps``; ``seed`` (an int or a sequence of ints, as numpy's ``default_rng``
    takes) picks the colours, the start and the direction, so two seeds give two distinct clips.
    Used by the bench's video workload and ``bench/p11_video.py``."""
    import tempfile

    import cv2

    rng = np.random.default_rng(seed)
    background = rng.integers(0, 256, 3).tolist()
    colour = rng.integers(0, 256, 3).tolist()
    side = max(1, min(width, height) // 4)
    x = int(rng.integers(0, width - side + 1))
    y = int(rng.integers(0, height - side + 1))
    dx, dy = (int(v) for v in rng.choice([-1, 1], 2) * rng.integers(2, 6, 2))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), fps, (width, height))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write an mp4v clip here (no FFmpeg in its build?)")
        for _ in range(frames):
            frame = np.empty((height, width, 3), np.uint8)
            frame[:] = background
            frame[y : y + side, x : x + side] = colour
            writer.write(frame)
            x = min(max(x + dx, 0), width - side)
            y = min(max(y + dy, 0), height - side)
        writer.release()
        return path.read_bytes()
