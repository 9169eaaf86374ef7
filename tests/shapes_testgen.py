"""A test generator of the demo model's scenes, written apart from the training one.

:mod:`shared.tools.models.shapes` draws the scenes the demo model is trained on (PIL, its own
randomisation); a model can fit that generator's quirks and still miss the same scenes drawn
another way. This module draws them another way, sharing nothing with it but the question texts
and the answer words: numpy rasterisation with 4x4 supersampled coverage (soft edges), equilateral
triangles, log-uniform image sides 64-448 px (any aspect ratio), shapes 15-55% of the short side
across, colours drawn in HSV around each colour's hue, light backgrounds with a tint, a shade
gradient and Gaussian noise. The video templates' clips (:class:`Movie`): such a picture's one
shape gliding at a constant velocity (a small drift across its main axis allowed), 112-224 px
frames, each frame its own noise, written as Motion-JPEG in AVI (the training clips are mp4v in
mp4). ``bench/demo_accuracy.py --generator test`` and ``tests/test_demo_model.py`` ask the model
these cases.

Same ``(template, seed)`` -> the same case (numpy's PCG64 seeded from both).
"""

from __future__ import annotations

import base64
import colorsys
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.tools.models.shapes import DIRECTIONS, NUMBER_WORDS, QUESTIONS, SHAPES, VIDEO_TEMPLATES, Case, Template

#: colour -> (hue in degrees, +- spread, lowest value): a named colour is any fill in that range
HUES: dict[str, tuple[float, float, float]] = {
    "red": (0.0, 10.0, 0.65),
    "green": (120.0, 15.0, 0.6),
    "blue": (225.0, 12.0, 0.65),
    "yellow": (54.0, 6.0, 0.85),
}
SS = 4  # supersampling factor per axis


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cx: float
    cy: float
    size: float  # the side (square, triangle) or diameter (circle), pixels
    rgb: tuple[int, int, int]


@dataclass(frozen=True)
class Picture:
    width: int
    height: int
    background: tuple[int, int, int]
    gradient: tuple[float, float]  # shade change across x and y, per channel
    noise_sigma: float
    noise_seed: int
    shapes: tuple[Shape, ...]

    def render(self) -> Any:
        """The picture as a PIL RGB image."""
        from PIL import Image

        h, w = self.height, self.width
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
        shade = self.gradient[0] * (xs / w - 0.5) + self.gradient[1] * (ys / h - 0.5)
        img = np.asarray(self.background, np.float32)[None, None, :] + shade[..., None]
        for shape in self.shapes:
            half = shape.size / 2 + 2
            x0, x1 = max(0, int(shape.cx - half)), min(w, int(math.ceil(shape.cx + half)))
            y0, y1 = max(0, int(shape.cy - half)), min(h, int(math.ceil(shape.cy + half)))
            cover = _coverage(shape, x0, x1, y0, y1)
            region = img[y0:y1, x0:x1]
            img[y0:y1, x0:x1] = region * (1 - cover[..., None]) + np.asarray(shape.rgb, np.float32) * cover[..., None]
        if self.noise_sigma:
            img = img + np.random.default_rng(self.noise_seed).normal(0, self.noise_sigma, img.shape)
        return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8))

    def data_url(self) -> str:
        buf = io.BytesIO()
        self.render().save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _coverage(shape: Shape, x0: int, x1: int, y0: int, y1: int) -> Any:
    """The share of each pixel of the box [x0, x1) x [y0, y1) that ``shape`` covers (SS x SS samples)."""
    offsets = (np.arange(SS, dtype=np.float32) + 0.5) / SS
    xs = (np.arange(x0, x1, dtype=np.float32)[:, None] + offsets[None, :]).reshape(-1)
    ys = (np.arange(y0, y1, dtype=np.float32)[:, None] + offsets[None, :]).reshape(-1)
    dx = xs[None, :] - shape.cx
    dy = ys[:, None] - shape.cy
    s = shape.size
    if shape.kind == "circle":
        inside = dx**2 + dy**2 <= (s / 2) ** 2
    elif shape.kind == "square":
        inside = (np.abs(dx) <= s / 2) & (np.abs(dy) <= s / 2)
    else:  # equilateral, point up, centred on its bounding box
        height = s * math.sqrt(3) / 2
        top = -height / 2
        t = (dy - top) / height  # 0 at the apex, 1 at the base
        inside = (t >= 0) & (t <= 1) & (np.abs(dx) <= t * s / 2)
    samples = inside.astype(np.float32).reshape(y1 - y0, SS, x1 - x0, SS)
    return samples.mean(axis=(1, 3))


def _fill(rng: np.random.Generator, colour: str) -> tuple[int, int, int]:
    hue, spread, low_v = HUES[colour]
    h = ((hue + rng.uniform(-spread, spread)) % 360) / 360
    rgb = colorsys.hsv_to_rgb(h, rng.uniform(0.65, 1.0), rng.uniform(low_v, 1.0))
    r, g, b = (int(round(255 * c)) for c in rgb)
    return r, g, b


def picture(rng: np.random.Generator, colours: list[str], kinds: list[str]) -> Picture:
    """A picture with one shape per (colour, kind), none touching, all inside."""
    n = len(colours)
    while True:
        width, height = (int(round(math.exp(rng.uniform(math.log(64), math.log(448))))) for _ in range(2))
        short = min(width, height)
        placed: list[Shape] = []
        for colour, kind in zip(colours, kinds, strict=True):
            for _attempt in range(100):
                size = max(12.0, short * rng.uniform(0.15, 0.55 if n == 1 else 0.35))
                reach = size / 2 * (math.sqrt(2) if kind == "square" else 1.0) + 2
                if 2 * reach >= short:
                    continue
                cx, cy = rng.uniform(reach, width - reach), rng.uniform(reach, height - reach)
                if all(math.hypot(cx - o.cx, cy - o.cy) > reach + o.size / 2 * math.sqrt(2) + 4 for o in placed):
                    placed.append(Shape(kind, colour, float(cx), float(cy), float(size), _fill(rng, colour)))
                    break
            else:
                break
        if len(placed) == n:
            break
    return Picture(width, height, *_backdrop(rng), tuple(placed))


def _backdrop(rng: np.random.Generator) -> tuple[tuple[int, int, int], tuple[float, float], float, int]:
    """A light tinted background, its shade gradient, the noise's sigma and the noise seed."""
    grey = rng.uniform(195, 255)
    r, g, b = (int(min(255, max(0, grey + rng.uniform(-12, 12)))) for _ in range(3))
    gradient = (float(rng.uniform(-12, 12)), float(rng.uniform(-12, 12)))
    sigma = float(rng.choice([0.0, 2.0, 4.0, 6.0]))
    return (r, g, b), gradient, sigma, int(rng.integers(2**31))


@dataclass(frozen=True)
class Movie:
    """A clip: ``first``'s one shape moving ``velocity`` (dx, dy) pixels a frame for ``frames``
    frames at ``fps``; each frame's noise is drawn anew."""

    first: Picture
    velocity: tuple[float, float]
    frames: int
    fps: float

    @property
    def direction(self) -> str:
        """Where the shape goes: the axis it moves most along, and the sign there."""
        dx, dy = self.velocity
        if abs(dx) >= abs(dy):
            return "right" if dx > 0 else "left"
        return "down" if dy > 0 else "up"

    def picture(self, k: int) -> Picture:
        (shape,) = self.first.shapes
        moved = Shape(
            shape.kind,
            shape.colour,
            shape.cx + k * self.velocity[0],
            shape.cy + k * self.velocity[1],
            shape.size,
            shape.rgb,
        )
        p = self.first
        return Picture(p.width, p.height, p.background, p.gradient, p.noise_sigma, p.noise_seed + 7919 * k, (moved,))

    def render(self) -> list[Any]:
        return [self.picture(k).render() for k in range(self.frames)]

    def avi(self) -> bytes:
        """The clip as Motion-JPEG in AVI, written by OpenCV."""
        import tempfile
        from pathlib import Path

        import cv2

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "movie.avi"
            out = cv2.VideoWriter(
                str(path), cv2.VideoWriter.fourcc(*"MJPG"), self.fps, (self.first.width, self.first.height)
            )
            assert out.isOpened(), "OpenCV cannot write MJPG/AVI here"
            for frame in self.render():
                out.write(cv2.cvtColor(np.asarray(frame), cv2.COLOR_RGB2BGR))
            out.release()
            return path.read_bytes()

    def data_url(self) -> str:
        return "data:video/x-msvideo;base64," + base64.b64encode(self.avi()).decode("ascii")


def movie(rng: np.random.Generator, colour: str, kind: str, direction: str) -> Movie:
    """A clip of one shape of ``kind`` and ``colour`` going ``direction``: 4, 6 or 8 frames of an
    even size, log-uniform 112-224 px a side; it travels 25-55% of the frame along its axis (at
    most all the room the shape has), drifting up to a fifth of that across, inside throughout."""
    while True:
        width, height = (2 * int(round(math.exp(rng.uniform(math.log(112), math.log(224))) / 2)) for _ in range(2))
        frames = int(rng.choice([4, 6, 8]))
        size = min(width, height) * rng.uniform(0.15, 0.4)
        reach = size / 2 * (math.sqrt(2) if kind == "square" else 1.0) + 2
        horizontal = direction in ("left", "right")
        along, across = (width, height) if horizontal else (height, width)
        travel = min(along * rng.uniform(0.25, 0.55), along - 2 * reach - 1)
        drift = travel * rng.uniform(-0.2, 0.2)
        if travel < 0.2 * along or abs(drift) > across - 2 * reach - 1:
            continue
        lo = rng.uniform(reach, along - reach - travel)
        start, end = (lo + travel, lo) if direction in ("left", "up") else (lo, lo + travel)
        c_lo = rng.uniform(reach + max(0.0, -drift), across - reach - max(0.0, drift))
        x0, x1, y0, y1 = (start, end, c_lo, c_lo + drift) if horizontal else (c_lo, c_lo + drift, start, end)
        break
    shape = Shape(kind, colour, float(x0), float(y0), float(size), _fill(rng, colour))
    first = Picture(width, height, *_backdrop(rng), (shape,))
    step = ((x1 - x0) / (frames - 1), (y1 - y0) / (frames - 1))
    return Movie(first, (float(step[0]), float(step[1])), frames, float(rng.choice([3.0, 5.0, 10.0])))


def make_test_case(template: Template, seed: int) -> Case[Any]:
    """Test case ``seed`` of ``template`` (deterministic)."""
    rng = np.random.default_rng([seed, list(Template).index(template), 0x5EED])
    question = str(rng.choice(QUESTIONS[template]))
    text_last = bool(rng.random() < 0.5)
    colour_names = list(HUES)

    def some_colours(k: int, pool: list[str]) -> list[str]:
        return [str(rng.choice(pool)) for _ in range(k)]

    def some_kinds(k: int) -> list[str]:
        return [str(rng.choice(SHAPES)) for _ in range(k)]

    if template in VIDEO_TEMPLATES:
        clip = movie(rng, some_colours(1, colour_names)[0], some_kinds(1)[0], str(rng.choice(DIRECTIONS)))
        answer = clip.direction if template is Template.DIRECTION else clip.first.shapes[0].colour
        return Case(template, (clip,), question, text_last, answer)

    if template is Template.COLOUR or template is Template.SHAPE:
        pic = picture(rng, some_colours(1, colour_names), some_kinds(1))
        answer = pic.shapes[0].colour if template is Template.COLOUR else pic.shapes[0].kind
        return Case(template, (pic,), question, text_last, answer)
    if template is Template.COUNT:
        n = int(rng.integers(1, 4))
        pic = picture(rng, some_colours(n, colour_names), some_kinds(n))
        return Case(template, (pic,), question, text_last, NUMBER_WORDS[n - 1])
    red_first = bool(rng.random() < 0.5)
    pics = []
    for has_red in (red_first, not red_first):
        n = int(rng.integers(1, 4))
        colours = some_colours(n, ["green", "blue", "yellow"])
        if has_red:
            colours[int(rng.integers(n))] = "red"
        pics.append(picture(rng, colours, some_kinds(n)))
    return Case(template, tuple(pics), question, text_last, "first" if red_first else "second")
