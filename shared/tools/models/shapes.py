"""Synthetic shape scenes and the questions the demo model answers (torch-free).

A scene is a plain white or light-grey image, 64-448 px on each side (not only squares), with 1-3
non-overlapping filled shapes; shape in :data:`SHAPES`, colour in :data:`COLOURS`. A
:class:`Case` is one chat turn about one or two scenes, from one of four templates
(:class:`Template`): the question text comes before or after the image part(s), "color" and
"colour" both occur, and the answer is one bare word.

Same ``(template, seed)`` -> the same case, byte for byte (``random.Random`` and PIL only), so the
training script, the accuracy test and ``epd up``'s printed example all draw from one generator.
"""

from __future__ import annotations

import base64
import enum
import io
import math
import random
from dataclasses import dataclass
from typing import Any

#: shape name -> drawn by :func:`_draw_shape`
SHAPES = ("circle", "square", "triangle")
#: colour name -> RGB fill (a little jitter is added per shape)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 20),
}
BACKGROUNDS = ((255, 255, 255), (235, 235, 235), (220, 220, 220))
NUMBER_WORDS = ("one", "two", "three")
MIN_SIDE, MAX_SIDE = 64, 448


class Template(enum.StrEnum):
    """The four question templates (their exact texts are :data:`QUESTIONS`)."""

    COLOUR = "colour"
    SHAPE = "shape"
    COUNT = "count"
    WHICH_RED = "which_red"


#: the question texts; COLOUR has both spellings
QUESTIONS: dict[Template, tuple[str, ...]] = {
    Template.COLOUR: ("What color is the shape?", "What colour is the shape?"),
    Template.SHAPE: ("What shape is it?",),
    Template.COUNT: ("How many shapes are there?",),
    Template.WHICH_RED: ("Which image has the red shape, the first or the second?",),
}

#: every answer word the templates have
ANSWERS = (*COLOURS, *SHAPES, *NUMBER_WORDS, "first", "second")


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    cx: float  # centre, pixels
    cy: float
    r: float  # half the bounding box side, pixels


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: tuple[int, int, int]
    items: tuple[Item, ...]
    #: per-shape fill jitter, drawn with the scene so rendering is a pure function
    jitter: tuple[tuple[int, int, int], ...]

    def render(self) -> Any:
        """The scene as a PIL RGB image."""
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.width, self.height), self.background)
        draw = ImageDraw.Draw(img)
        for item, jit in zip(self.items, self.jitter, strict=True):
            fill = tuple(max(0, min(255, c + j)) for c, j in zip(COLOURS[item.colour], jit, strict=True))
            _draw_shape(draw, item, fill)
        return img

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.render().save(buf, format="PNG")
        return buf.getvalue()

    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png()).decode("ascii")


def _draw_shape(draw: Any, item: Item, fill: tuple[int, ...]) -> None:
    x, y, r = item.cx, item.cy, item.r
    if item.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif item.shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
    else:  # an upright equilateral-ish triangle filling the bounding box
        draw.polygon(((x, y - r), (x + r, y + r), (x - r, y + r)), fill=fill)


def random_scene(
    rng: random.Random, n_shapes: int, *, colours: list[str] | None = None, shapes: list[str] | None = None
) -> Scene:
    """A scene with ``n_shapes`` non-overlapping shapes (``colours`` / ``shapes``: per shape, else drawn)."""
    while True:
        width, height = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
        if max(width, height) <= 3 * min(width, height):  # no extreme strips
            break
    side = min(width, height)
    items: list[Item] = []
    for i in range(n_shapes):
        for _attempt in range(200):
            # shapes are 18-40% (one shape: up to 60%) of the short side across
            r = side * rng.uniform(0.09, 0.30 if n_shapes == 1 else 0.20)
            cx, cy = rng.uniform(r + 1, width - r - 1), rng.uniform(r + 1, height - r - 1)
            gap = 0.06 * side
            if all(math.hypot(cx - o.cx, cy - o.cy) > (r + o.r) * math.sqrt(2) + gap for o in items):
                break
        else:  # cannot place it: start the scene again
            return random_scene(rng, n_shapes, colours=colours, shapes=shapes)
        items.append(
            Item(
                shape=shapes[i] if shapes else rng.choice(SHAPES),
                colour=colours[i] if colours else rng.choice(list(COLOURS)),
                cx=cx,
                cy=cy,
                r=r,
            )
        )
    jitter = tuple(tuple(rng.randint(-12, 12) for _ in range(3)) for _ in items)
    return Scene(width, height, rng.choice(BACKGROUNDS), tuple(items), jitter)  # type: ignore[arg-type]  # 3-tuples


@dataclass(frozen=True)
class Case:
    """One question about one or two scenes, and its answer."""

    template: Template
    scenes: tuple[Scene, ...]
    question: str
    #: the question text comes after the image part(s)
    text_last: bool
    answer: str

    def content(self, image_part: Any = None) -> list[dict[str, Any]]:
        """The user message's content parts in order: OpenAI ``image_url`` parts with inline PNG
        data URLs (or ``image_part(scene)`` parts) and the question text."""
        images = [
            image_part(s) if image_part else {"type": "image_url", "image_url": {"url": s.data_url()}}
            for s in self.scenes
        ]
        text = [{"type": "text", "text": self.question}]
        return [*images, *text] if self.text_last else [*text, *images]

    def chat_request(self, model: str, *, max_tokens: int = 4) -> dict[str, Any]:
        """A greedy ``/v1/chat/completions`` body asking this case (one user turn, :meth:`content`)."""
        return {
            "model": model,
            "messages": [{"role": "user", "content": self.content()}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }

    def correct(self, reply: str) -> bool:
        """Whether a model's reply is the answer: the bare word, a final period allowed."""
        return reply.strip().rstrip(".").strip().lower() == self.answer


def make_case(template: Template, seed: int) -> Case:
    """The case of ``template`` number ``seed`` (deterministic)."""
    rng = random.Random(f"epd-shapes|{template.value}|{seed}")
    question = rng.choice(QUESTIONS[template])
    text_last = rng.random() < 0.5
    if template is Template.COLOUR:
        scene = random_scene(rng, 1)
        return Case(template, (scene,), question, text_last, scene.items[0].colour)
    if template is Template.SHAPE:
        scene = random_scene(rng, 1)
        return Case(template, (scene,), question, text_last, scene.items[0].shape)
    if template is Template.COUNT:
        n = rng.randint(1, 3)
        return Case(template, (random_scene(rng, n),), question, text_last, NUMBER_WORDS[n - 1])
    # WHICH_RED: exactly one of the two images has a red shape (one), the other none
    red_first = rng.random() < 0.5
    scenes = []
    for has_red in (red_first, not red_first):
        n = rng.randint(1, 3)
        colours = [rng.choice(["green", "blue", "yellow"]) for _ in range(n)]
        if has_red:
            colours[rng.randrange(n)] = "red"
        scenes.append(random_scene(rng, n, colours=colours))
    return Case(template, tuple(scenes), question, text_last, "first" if red_first else "second")


def swapped(case: Case) -> Case:
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


def describe(scene: Scene) -> str:
    """``scene`` in words, e.g. "a green triangle on a 160x120 image"."""
    things = ", ".join(f"a {i.colour} {i.shape}" for i in scene.items)
    return f"{things} on a {scene.width}x{scene.height} image"
