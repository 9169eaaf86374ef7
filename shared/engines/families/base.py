"""The model-family seam of the transformers engine: what differs between VLM families, behind
one small interface, one module per family (chosen once, from the model's ``config.json``).

What a family decides:

* the transformers class to load (``model_class``);
* how the vision tower runs on images (:meth:`VisionFamily.image_features`) and what an image's
  features are: one ``[n_tokens, feature_width]`` tensor per image - for a family whose LM takes
  several tensors per image (Qwen3-VL's deepstack features) they travel side by side in its
  columns, in vLLM's layout, so the EC objects, stores and connectors stay family-blind;
* how many placeholder tokens an image expands to (:meth:`VisionFamily.expected_tokens`);
* the LM's position ids, at prefill and per decode step (1-D, or M-RoPE over the image grid);
* how features reach the LM: transformers' own ``mm_encoder_outputs`` (what ``forward`` builds
  from ``get_image_features``), so placement and any per-family masks stay transformers' code.

Everything else of the engine (prompt rendering, sampling, the decode loop, KV handoff) is
family-blind.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage, VideoFrames
from shared.errors import InvalidImage, InvalidRequest, InvalidVideo
from shared.families import feature_width
from shared.protocol import MediaKind


class VisionFamily(ABC):
    """One model family on the transformers engine (see the module docstring). Built once per
    engine, after its model is loaded; every method runs in the engine's compute thread."""

    #: the transformers class (``transformers.<name>``) of the whole model
    model_class: str = ""
    #: whether several images can share one vision-tower forward (when batch invariance is off)
    #: - ``True``: any sizes together; ``False``: only images of one pixel shape
    concatenates_images: bool = False
    #: whether the family takes video (:meth:`video_features`; its placeholder ``video_token_id``)
    takes_video: bool = False

    def __init__(self, model: Any, config: Any, processor: Any):
        self.model = model
        self.config = config
        self.processor = processor
        self.hidden_size = int(config.get_text_config(decoder=True).hidden_size)

    # -- the vision side -----------------------------------------------------------------------

    @property
    def feature_width(self) -> int:
        """Columns of an image's feature tensor (:func:`shared.families.feature_width`: the LM's
        hidden size, unless the family packs more than one tensor per image)."""
        return feature_width(self.config.to_dict())

    def image_pixels(self, image: Any) -> dict[str, Any]:
        """The image processor's outputs for one RGB PIL image (what :meth:`image_features` takes);
        :class:`InvalidImage` when the processor refuses it."""
        try:
            return self.processor.image_processor(images=[image], return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise InvalidImage(f"image cannot be preprocessed: {exc}") from exc

    def video_pixels(self, frames: Any) -> dict[str, Any]:
        """The video processor's outputs for one video's sampled frames (``[n, h, w, 3]`` RGB, taken
        as sampled: no sampling here), what :meth:`video_features` takes; :class:`InvalidVideo` when
        the processor refuses them."""
        try:
            return self.processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
        except (ValueError, TypeError) as exc:
            raise InvalidVideo(f"video cannot be preprocessed: {exc}") from exc

    def grid_of(self, kind: str, pixels: Mapping[str, Any]) -> tuple[int, int, int] | None:
        """The (t, h, w) patch grid of one item from its processor outputs (None: the family has
        none - 1-D positions)."""
        return None

    def prompt_item(
        self, kind: str, pixels: Mapping[str, Any], video: VideoFrames | None = None
    ) -> EncodedImage | None:
        """One item as the prompt sees it, without encoding it: its grid (:meth:`grid_of`), a
        video's :meth:`video_timestamps` (``video``: its frames and their metadata), and a features
        tensor of no columns with as many rows as the family's processor gives it placeholder
        tokens (:meth:`expected_tokens`) - what :meth:`expand` needs to count it (the API's
        ``/tokenize``). None when the count is not knowable before encoding."""
        timestamps = self.video_timestamps(video) if video is not None else None
        item = EncodedImage(
            features=torch.empty(0, 0), grid_thw=self.grid_of(kind, pixels), kind=kind, timestamps=timestamps
        )
        n = self.expected_tokens(item)
        return None if n is None else dataclasses.replace(item, features=torch.empty(n, 0))

    @abstractmethod
    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        """One vision-tower forward over ``pixels`` (the image processor's outputs, one dict per
        image), one :class:`EncodedImage` per image, in order."""

    def video_features(self, pixels: dict[str, Any], fps: float) -> EncodedImage:
        """One vision-tower forward over one video (the video processor's outputs for its sampled
        frames, which stand for ``fps`` frames a second): its :class:`EncodedImage`, ``kind`` video."""
        raise InvalidRequest(f"this model ({type(self).__name__}) takes no video")

    def video_timestamps(self, video: VideoFrames) -> tuple[float, ...] | None:
        """What the prompt says of a video's time (:attr:`EncodedImage.timestamps`), from its frames'
        metadata: None here (a family that writes no time into the prompt)."""
        return None

    @abstractmethod
    def expected_tokens(self, item: EncodedImage) -> int | None:
        """The placeholder count the family's processor gives this image (``None``: not knowable)."""

    def check_image(self, i: int, item: EncodedImage) -> None:
        """Raise :class:`InvalidRequest` when ``item`` cannot be this family's media item ``i``
        (its kind, its layout; the feature shape is checked by the engine)."""
        if item.kind != MediaKind.IMAGE:
            raise InvalidRequest(f"images[{i}] is a {item.kind}: this model takes images only")
        if item.grid_thw is not None:
            raise InvalidRequest(f"images[{i}].grid_thw must be None for this model")

    # -- the prompt ----------------------------------------------------------------------------

    @property
    def placeholder_id(self) -> int:
        """The token the chat template writes for each image (checked against the image count)."""
        return int(self.config.image_token_id)

    @property
    def video_placeholder_id(self) -> int | None:
        """The token the chat template writes for each video (None: the family takes none)."""
        return int(self.config.video_token_id) if self.takes_video else None

    def placeholders(self) -> dict[str, int]:
        """Each media kind the family takes -> its placeholder token."""
        out = {MediaKind.IMAGE.value: self.placeholder_id}
        if self.video_placeholder_id is not None:
            out[MediaKind.VIDEO.value] = self.video_placeholder_id
        return out

    def expand(self, text: str, ids: list[int], images: Sequence[EncodedImage], add_special_tokens: bool) -> list[int]:
        """The prompt's token ids with each item's placeholder expanded to its ``n_tokens``
        tokens, as the family's processor does. ``ids`` is ``text`` tokenized (placeholders
        checked; the items in the order of their placeholders, each kind in its own order).
        Here: each placeholder replaced by :meth:`image_ids` or the video placeholder repeated
        (the processor replaces the placeholder string, then tokenizes; special tokens split the
        text, so doing it by id is identical)."""
        by_kind = {kind: iter([im for im in images if im.kind == kind]) for kind in self.placeholders()}
        kind_of = {token: kind for kind, token in self.placeholders().items()}
        expanded: list[int] = []
        for t in ids:
            kind = kind_of.get(t)
            if kind is None:
                expanded.append(t)
            elif kind == MediaKind.VIDEO:
                expanded.extend([t] * next(by_kind[kind]).n_tokens)
            else:
                expanded.extend(self.image_ids(next(by_kind[kind]).n_tokens))
        return expanded

    def image_ids(self, n_tokens: int) -> list[int]:
        """The ids an image of ``n_tokens`` features stands as in the prompt: here, the placeholder
        repeated."""
        return [self.placeholder_id] * n_tokens

    def max_context(self) -> int | None:
        """A limit of the family on the context the engine serves (None: the model's own)."""
        return None

    # -- the LM side ---------------------------------------------------------------------------

    def encoder_outputs(self, images: Sequence[EncodedImage], dtype: torch.dtype) -> dict[str, Any]:
        """``mm_encoder_outputs`` of the LM forward for ``images``: what the model's ``forward``
        builds from ``get_image_features`` (here: one feature tensor per image)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        out = {}
        for kind in (MediaKind.IMAGE, MediaKind.VIDEO):
            # (typed as one tensor; forward concatenates the per-item tuple get_*_features returns)
            per_item = tuple(im.features.to(dtype) for im in images if im.kind == kind)
            if per_item:
                out[kind.value] = BaseModelOutputWithPooling(pooler_output=per_item)  # type: ignore[arg-type]  # typed as one tensor
        return out

    def prefill_kwargs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """More arguments of the prefill's LM forward (e.g. a mask's token types)."""
        return {}

    def prefill_positions(self, input_ids: torch.Tensor, images: Sequence[EncodedImage]) -> tuple[torch.Tensor, int]:
        """Position ids of a prompt ``[1, n]`` (shaped as ``generate()`` builds them) and the
        offset of decode positions (0 for 1-D positions)."""
        n = input_ids.shape[1]
        return torch.arange(n, dtype=torch.long).view(1, n), 0

    def decode_positions(self, past_lens: Sequence[int], deltas: Sequence[int]) -> torch.Tensor:
        """Position ids of one decode step of several requests (a row each): ``[n, 1]``."""
        return torch.tensor([[p] for p in past_lens], dtype=torch.long)
