"""Synthetic shape scenes and the questions the demo model answers (torch-free).

A scene is a light background (white, grey or lightly tinted, sometimes with pixel noise), 64-448 px
on each side (any aspect ratio), with 1-3 non-overlapping filled shapes of varied sizes; shape in
:data:`SHAPES`, colour in :data:`COLOURS` (each colour's shade varies widely: jittered around its RGB, or
drawn in HSV around its hue), edges hard or anti-aliased, triangles of varied height. A
:class:`Case` is one chat turn about one or two scenes, from one of four templates
(:class:`Template`) about images: the question text comes before or after the image part(s), "color" and
"colour" both occur, and the answer is one bare word.

The two video templates ask about a :class:`Clip`: one such shape moving left, right, up or down
over 4, 6 or 8 frames of 112-196 px, sent as an mp4 (``mp4v``, written by OpenCV's FFmpeg: the
decoder the API reads it with).

Same ``(template, seed)`` -> the same case, byte for byte (``random.Random``, PIL and the codec only), so the
training script, the accuracy test and ``epd up``'s printed examples all draw from one generator.
"""

from __future__ import annotations

import base64
import colorsys
import enum
import io
import math
import random
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

#: shape name -> drawn by :func:`_draw_shape`
SHAPES = ("circle", "square", "triangle")
#: colour name -> RGB fill (each shape's fill is varied around it: :func:`_fill`)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 20),
}
#: colour name -> (hue in degrees, +- range) for fills drawn in HSV
_HUES: dict[str, tuple[float, float]] = {
    "red": (0.0, 14.0),
    "green": (125.0, 18.0),
    "blue": (228.0, 16.0),
    "yellow": (52.0, 8.0),
}
NUMBER_WORDS = ("one", "two", "three")
MIN_SIDE, MAX_SIDE = 64, 448


class Template(enum.StrEnum):
    """The question templates (their exact texts are :data:`QUESTIONS`): four about images, two
    about video clips (:data:`VIDEO_TEMPLATES`)."""

    COLOUR = "colour"
    SHAPE = "shape"
    COUNT = "count"
    WHICH_RED = "which_red"
    DIRECTION = "direction"
    MOVING_COLOUR = "moving_colour"


#: the templates whose case is one video clip (:class:`Clip`); the others ask about images
VIDEO_TEMPLATES = (Template.DIRECTION, Template.MOVING_COLOUR)
#: which way a clip's shape moves (image coordinates: up is towards the top edge)
DIRECTIONS = ("left", "right", "up", "down")


#: the question texts; COLOUR has both spellings
QUESTIONS: dict[Template, tuple[str, ...]] = {
    Template.COLOUR: ("What color is the shape?", "What colour is the shape?"),
    Template.SHAPE: ("What shape is it?",),
    Template.COUNT: ("How many shapes are there?",),
    Template.WHICH_RED: ("Which image has the red shape, the first or the second?",),
    Template.DIRECTION: ("Which way is the shape moving?",),
    Template.MOVING_COLOUR: ("What color is the moving shape?", "What colour is the moving shape?"),
}

#: every answer word the image templates have
IMAGE_ANSWERS = (*COLOURS, *SHAPES, *NUMBER_WORDS, "first", "second")
#: every answer word the templates have
ANSWERS = (*IMAGE_ANSWERS, *DIRECTIONS)


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    cx: float  # centre, pixels
    cy: float
    r: float  # half the bounding box side, pixels
    #: a triangle's height as a share of its bounding box's (1: it fills the box)
    h: float = 1.0


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: tuple[int, int, int]
    items: tuple[Item, ...]
    #: per-shape fill offset from its colour's RGB, drawn with the scene so rendering is a pure function
    jitter: tuple[tuple[int, int, int], ...]
    #: pixel noise on the whole image: +- this much per channel (0: none), drawn from ``noise_seed``
    noise: int = 0
    noise_seed: int = 0
    #: drawn this many times larger and scaled down (anti-aliased edges); 1: hard edges
    supersample: int = 1

    def render(self) -> Any:
        """The scene as a PIL RGB image."""
        from PIL import Image, ImageDraw

        k = self.supersample
        img = Image.new("RGB", (self.width * k, self.height * k), self.background)
        draw = ImageDraw.Draw(img)
        for item, jit in zip(self.items, self.jitter, strict=True):
            _draw_shape(draw, item, self.fill(item, jit), k)
        if k > 1:
            img = img.resize((self.width, self.height), Image.Resampling.BOX)
        if self.noise:
            import numpy as np

            noise = np.random.default_rng(self.noise_seed).integers(
                -self.noise, self.noise + 1, (self.height, self.width, 3)
            )
            img = Image.fromarray(np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8))
        return img

    @staticmethod
    def fill(item: Item, jitter: tuple[int, int, int]) -> tuple[int, ...]:
        """The RGB ``item`` is filled with (before noise)."""
        return tuple(max(0, min(255, c + j)) for c, j in zip(COLOURS[item.colour], jitter, strict=True))

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.render().save(buf, format="PNG")
        return buf.getvalue()

    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png()).decode("ascii")


def _draw_shape(draw: Any, item: Item, fill: tuple[int, ...], k: int = 1) -> None:
    x, y, r = item.cx * k, item.cy * k, item.r * k
    if item.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif item.shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
    else:  # an upright triangle on the bounding box's base, its apex h of the box's height up
        draw.polygon(((x, y - r + 2 * r * (1 - item.h)), (x + r, y + r), (x - r, y + r)), fill=fill)


def _jitter(rng: random.Random, colour: str) -> tuple[int, int, int]:
    """A fill for ``colour``, as the offset from its RGB: half the time per-channel jitter (+-30) on
    a brightness-scaled RGB, else a colour drawn in HSV around its hue."""
    base = COLOURS[colour]
    if rng.random() < 0.5:
        scale = rng.uniform(0.8, 1.12)
        rgb = [min(255, round(c * scale)) + rng.randint(-30, 30) for c in base]
    else:
        hue, spread = _HUES[colour]
        low_v = 0.8 if colour == "yellow" else 0.55
        h = (hue + rng.uniform(-spread, spread)) % 360 / 360
        rgb = [round(255 * c) for c in colorsys.hsv_to_rgb(h, rng.uniform(0.6, 1.0), rng.uniform(low_v, 1.0))]
    dr, dg, db = (max(0, min(255, c)) - b for c, b in zip(rgb, base, strict=True))
    return dr, dg, db


def _background(rng: random.Random) -> tuple[int, int, int]:
    """A light background: white a fifth of the time, else a grey of 185-250, lightly tinted half the time."""
    if rng.random() < 0.2:
        return (255, 255, 255)
    grey = rng.randint(185, 250)
    tint = [rng.randint(-10, 10) for _ in range(3)] if rng.random() < 0.5 else [0, 0, 0]
    r, g, b = (max(0, min(255, grey + t)) for t in tint)
    return r, g, b


def random_scene(
    rng: random.Random,
    n_shapes: int,
    *,
    colours: list[str] | None = None,
    shapes: list[str] | None = None,
    log_sides: bool = False,
) -> Scene:
    """A scene with ``n_shapes`` non-overlapping shapes (``colours`` / ``shapes``: per shape, else drawn).
    ``log_sides``: each side drawn log-uniformly (more small and elongated pictures) instead of uniformly."""
    if log_sides:
        width, height = (round(math.exp(rng.uniform(math.log(MIN_SIDE), math.log(MAX_SIDE)))) for _ in range(2))
    else:
        width, height = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
    if rng.random() < 0.3:  # a third of the scenes: square-ish (a side drawn near the other)
        height = max(MIN_SIDE, min(MAX_SIDE, round(width * rng.uniform(0.8, 1.25))))
    side = min(width, height)
    items: list[Item] = []
    for i in range(n_shapes):
        for _attempt in range(200):
            # shapes are 14-40% (one shape: up to 64%) of the short side across, at least 12 px
            r = max(6.0, side * rng.uniform(0.07, 0.32 if n_shapes == 1 else 0.20))
            cx, cy = rng.uniform(r + 1, width - r - 1), rng.uniform(r + 1, height - r - 1)
            gap = 0.06 * side
            if all(math.hypot(cx - o.cx, cy - o.cy) > (r + o.r) * math.sqrt(2) + gap for o in items):
                break
        else:  # cannot place it: start the scene again
            return random_scene(rng, n_shapes, colours=colours, shapes=shapes, log_sides=log_sides)
        items.append(
            Item(
                shape=shapes[i] if shapes else rng.choice(SHAPES),
                colour=colours[i] if colours else rng.choice(list(COLOURS)),
                cx=cx,
                cy=cy,
                r=r,
                h=rng.uniform(0.8, 1.0),
            )
        )
    jitter = tuple(_jitter(rng, item.colour) for item in items)
    background = _background(rng)
    noise = rng.choice((0, 0, 0, 4, 8, 12))
    noise_seed = rng.randrange(2**32)
    supersample = rng.choice((1, 3))
    return Scene(width, height, background, tuple(items), jitter, noise, noise_seed, supersample)


#: a clip's frame sides (even: the mp4 codec's), frame counts and rates
CLIP_MIN_SIDE, CLIP_MAX_SIDE = 112, 196
CLIP_FRAMES = (4, 6, 8)
CLIP_FPS = (2.0, 4.0, 8.0)


@dataclass(frozen=True)
class Clip:
    """A short video: ``scene``'s one shape moving ``step`` pixels a frame towards ``direction``
    over ``frames`` frames at ``fps`` (frame 0 is ``scene``; each frame's pixel noise is its own)."""

    scene: Scene
    direction: str
    step: float
    frames: int
    fps: float

    @property
    def width(self) -> int:
        return self.scene.width

    @property
    def height(self) -> int:
        return self.scene.height

    def frame(self, k: int) -> Scene:
        """Frame ``k`` as a scene (the shape moved ``k`` steps)."""
        dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[self.direction]
        item = self.scene.items[0]
        moved = Item(
            item.shape, item.colour, item.cx + dx * k * self.step, item.cy + dy * k * self.step, item.r, item.h
        )
        return Scene(
            self.scene.width,
            self.scene.height,
            self.scene.background,
            (moved,),
            self.scene.jitter,
            self.scene.noise,
            (self.scene.noise_seed + k) % 2**32,
            self.scene.supersample,
        )

    def render(self) -> list[Any]:
        """The frames as PIL RGB images."""
        return [self.frame(k).render() for k in range(self.frames)]

    def mp4(self) -> bytes:
        """The clip as an mp4 (:func:`mp4_bytes`)."""
        return mp4_bytes(self.render(), self.fps)

    def data_url(self) -> str:
        return "data:video/mp4;base64," + base64.b64encode(self.mp4()).decode("ascii")

    def reversed(self) -> Clip:
        """The same clip played backwards: the shape moves the other way."""
        other = {"left": "right", "right": "left", "up": "down", "down": "up"}[self.direction]
        last = self.frame(self.frames - 1)
        return Clip(last, other, self.step, self.frames, self.fps)


def mp4_bytes(frames: list[Any], fps: float, fourcc: str = "mp4v", suffix: str = ".mp4") -> bytes:
    """``frames`` (PIL RGB images of one size, its sides even) as a video file written by OpenCV's
    FFmpeg (the build the API decodes with): ``mp4v`` in mp4 by default. Deterministic."""
    import tempfile
    from pathlib import Path

    import cv2
    import numpy as np

    width, height = frames[0].size
    with tempfile.TemporaryDirectory(prefix="epd-clip-") as tmp:
        path = Path(tmp) / f"clip{suffix}"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*fourcc), fps, (width, height))
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV cannot write a {fourcc} clip here (no FFmpeg in its build?)")
        for image in frames:
            writer.write(np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1]))
        writer.release()
        return path.read_bytes()


def random_clip(rng: random.Random) -> Clip:
    """A clip of one shape (drawn as :func:`random_scene` draws one) moving in a straight line
    over 30-60% of the room it has along its axis, inside the frame throughout."""
    width, height = (2 * rng.randint(CLIP_MIN_SIDE // 2, CLIP_MAX_SIDE // 2) for _ in range(2))
    frames, fps = rng.choice(CLIP_FRAMES), rng.choice(CLIP_FPS)
    direction = rng.choice(DIRECTIONS)
    side = min(width, height)
    r = side * rng.uniform(0.08, 0.2)
    along, across = (width, height) if direction in ("left", "right") else (height, width)
    room = along - 2 * r - 2
    travel = room * rng.uniform(0.3, 0.6)
    start = rng.uniform(r + 1, along - r - 1 - travel)  # the lowest coordinate the shape is at
    if direction in ("left", "up"):
        start += travel  # it starts at the high end and moves down the axis
    other = rng.uniform(r + 1, across - r - 1)
    cx, cy = (start, other) if direction in ("left", "right") else (other, start)
    item = Item(rng.choice(SHAPES), rng.choice(list(COLOURS)), cx, cy, r, rng.uniform(0.8, 1.0))
    jitter = (_jitter(rng, item.colour),)
    background = _background(rng)
    noise = rng.choice((0, 0, 0, 4, 8))
    scene = Scene(width, height, background, (item,), jitter, noise, rng.randrange(2**32), rng.choice((1, 3)))
    return Clip(scene, direction, travel / (frames - 1), frames, fps)


class Drawing(Protocol):
    """What a case asks about: a picture drawn by a generator (this module's :class:`Scene`, or the
    independent test generator's, ``tests/shapes_testgen.py``)."""

    def render(self) -> Any: ...

    def data_url(self) -> str: ...


D = TypeVar("D", bound=Drawing)


@dataclass(frozen=True)
class Case(Generic[D]):
    """One question about one or two scenes, and its answer."""

    template: Template
    scenes: tuple[D, ...]
    question: str
    #: the question text comes after the image part(s)
    text_last: bool
    answer: str

    @property
    def video(self) -> bool:
        """Whether the case asks about a video clip (:data:`VIDEO_TEMPLATES`), not images."""
        return self.template in VIDEO_TEMPLATES

    def content(self, image_part: Any = None) -> list[dict[str, Any]]:
        """The user message's content parts in order: OpenAI ``image_url`` parts with inline PNG
        data URLs (a video case: one ``video_url`` part, an inline mp4) - or ``image_part(scene)``
        parts - and the question text."""
        kind = "video_url" if self.video else "image_url"
        media = [image_part(s) if image_part else {"type": kind, kind: {"url": s.data_url()}} for s in self.scenes]
        text = [{"type": "text", "text": self.question}]
        return [*media, *text] if self.text_last else [*text, *media]

    def chat_request(self, model: str, *, max_tokens: int = 8) -> dict[str, Any]:
        """A greedy ``/v1/chat/completions`` body asking this case (one user turn, :meth:`content`);
        a video case samples its clip at the clip's own rate (``media_io_kwargs``): every frame."""
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": self.content()}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        if self.video:
            body["media_io_kwargs"] = {"video": {"fps": self.scenes[0].fps}}  # type: ignore[attr-defined]  # a clip
        return body

    def correct(self, reply: str) -> bool:
        """Whether a model's reply is the answer: the bare word, a final period allowed."""
        return reply.strip().rstrip(".").strip().lower() == self.answer


def make_case(template: Template, seed: int, *, log_sides: bool = False) -> Case[Any]:
    """The case of ``template`` number ``seed`` (deterministic; ``log_sides``: see :func:`random_scene`;
    a video template's clip, :func:`random_clip`, does not take it)."""
    rng = random.Random(f"epd-shapes|{template.value}|{seed}")
    question = rng.choice(QUESTIONS[template])
    text_last = rng.random() < 0.5
    if template in VIDEO_TEMPLATES:
        clip = random_clip(rng)
        answer = clip.direction if template is Template.DIRECTION else clip.scene.items[0].colour
        return Case(template, (clip,), question, text_last, answer)
    if template is Template.COLOUR:
        scene = random_scene(rng, 1, log_sides=log_sides)
        return Case(template, (scene,), question, text_last, scene.items[0].colour)
    if template is Template.SHAPE:
        scene = random_scene(rng, 1, log_sides=log_sides)
        return Case(template, (scene,), question, text_last, scene.items[0].shape)
    if template is Template.COUNT:
        n = rng.randint(1, 3)
        return Case(template, (random_scene(rng, n, log_sides=log_sides),), question, text_last, NUMBER_WORDS[n - 1])
    # WHICH_RED: exactly one of the two images has a red shape (one), the other none
    red_first = rng.random() < 0.5
    scenes = []
    for has_red in (red_first, not red_first):
        n = rng.randint(1, 3)
        colours = [rng.choice(["green", "blue", "yellow"]) for _ in range(n)]
        if has_red:
            colours[rng.randrange(n)] = "red"
        scenes.append(random_scene(rng, n, colours=colours, log_sides=log_sides))
    return Case(template, tuple(scenes), question, text_last, "first" if red_first else "second")


def swapped(case: Case[D]) -> Case[D]:
    """A WHICH_RED case with its two images in the other order (and the other answer)."""
    if case.template is not Template.WHICH_RED:
        raise ValueError("only the two-image template can be swapped")
    other = "second" if case.answer == "first" else "first"
    return Case(case.template, case.scenes[::-1], case.question, case.text_last, other)


#: the example ``epd up`` prints for the demo model: a green triangle on light grey, 160x120
EXAMPLE = Case(
    Template.SHAPE,
    (Scene(160, 120, (235, 235, 235), (Item("triangle", "green", 80.0, 62.0, 40.0),), ((0, 0, 0),)),),
    "What shape is it?",
    text_last=True,
    answer="triangle",
)


#: the video example ``epd up`` prints for the demo model: a red circle moving right on light grey,
#: 8 frames of 160x120 at 4 fps
EXAMPLE_VIDEO = Case(
    Template.DIRECTION,
    (
        Clip(
            Scene(160, 120, (235, 235, 235), (Item("circle", "red", 44.0, 60.0, 22.0),), ((0, 0, 0),)),
            "right",
            10.0,
            8,
            4.0,
        ),
    ),
    "Which way is the shape moving?",
    text_last=True,
    answer="right",
)


def describe(scene: Scene | Clip) -> str:
    """``scene`` in words, e.g. "a green triangle on a 160x120 image", "a red circle moving right
    in a 160x120 clip of 8 frames at 4 fps"."""
    if isinstance(scene, Clip):
        (item,) = scene.scene.items
        return (
            f"a {item.colour} {item.shape} moving {scene.direction} in a {scene.width}x{scene.height} clip "
            f"of {scene.frames} frames at {scene.fps:g} fps"
        )
    things = ", ".join(f"a {i.colour} {i.shape}" for i in scene.items)
    return f"{things} on a {scene.width}x{scene.height} image"
