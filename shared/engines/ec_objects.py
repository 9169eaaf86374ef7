"""An engine's ``EncodedImage`` <-> an EC object of the store (imports torch; only model workers
use this module): the features tensor is the object's one tensor, the Qwen2-VL image grid its
``grid_thw`` extra."""

from __future__ import annotations

from typing import cast

from shared.engines.base import EncodedImage
from shared.store.format import ECObject
from shared.store.tensors import raw_to_tensor


def encoded_to_extra(item: EncodedImage) -> dict:
    """The EC object's extras: the grid, and for a video its kind and sampled rate (an image's
    object is what it always was)."""
    extra: dict = {"grid_thw": list(item.grid_thw)} if item.grid_thw is not None else {}
    if item.kind != "image":
        extra["kind"] = item.kind
        extra["fps"] = item.fps
    if item.timestamps is not None:  # (Qwen3-VL: each temporal patch's time, written into the prompt)
        extra["timestamps"] = list(item.timestamps)
    return extra


def ec_object_to_encoded(obj: ECObject) -> EncodedImage:
    grid = obj.extra.get("grid_thw")
    fps = obj.extra.get("fps")
    timestamps = obj.extra.get("timestamps")
    return EncodedImage(
        features=raw_to_tensor(obj.data, obj.dtype, obj.shape),
        grid_thw=cast("tuple[int, int, int]", tuple(int(x) for x in grid)) if grid else None,
        kind=str(obj.extra.get("kind", "image")),
        fps=float(fps) if fps is not None else None,
        timestamps=tuple(float(t) for t in timestamps) if isinstance(timestamps, list) else None,
    )
