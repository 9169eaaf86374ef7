"""Gemma 3: a SigLIP tower on one fixed-size image (pan-and-scan crops off), its patch grid
average-pooled to ``mm_tokens_per_image`` soft tokens; the chat template writes one
``<start_of_image>`` per image, which the processor expands to ``\\n\\n<start_of_image>`` + the soft
tokens + ``<end_of_image>\\n\\n`` (text-level: the newlines are tokenized with their neighbours); in
the prefill, the image's tokens attend to each other both ways (``token_type_ids``); 1-D
positions. Its LM interleaves sliding-window layers with global ones: the engine serves a context
up to the sliding window (a longer one would be cut in the sliding layers' caches, which the KV
handoff and the batched decode do not model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage
from shared.engines.families.base import VisionFamily


class Gemma3(VisionFamily):
    model_class = "Gemma3ForConditionalGeneration"
    concatenates_images = False  # one size: its processor resizes every image to the tower's

    @property
    def placeholder_id(self) -> int:
        return int(self.config.boi_token_id)

    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        res = self.model.get_image_features(pixel_values=torch.cat([px["pixel_values"] for px in pixels]))
        return [EncodedImage(features=f) for f in res.pooler_output]

    def expected_tokens(self, item: EncodedImage) -> int | None:
        return int(self.config.mm_tokens_per_image)

    def expand(self, text: str, ids: list[int], images: Sequence[EncodedImage], add_special_tokens: bool) -> list[int]:
        """The processor's way: each ``<start_of_image>`` of the text replaced by its full image
        sequence, then the whole text tokenized (``ids``: the text's ids, placeholders checked)."""
        boi = self.processor.boi_token
        head, *rest = text.split(boi)
        expanded = head + "".join(self.processor.full_image_sequence + part for part in rest)
        out: list[int] = self.processor.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return out

    def encoder_outputs(self, images: Sequence[EncodedImage], dtype: torch.dtype) -> dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # (forward takes one [images, tokens, hidden] tensor: every image has the same token count)
        features = torch.stack([im.features.to(dtype) for im in images])
        return {"image": BaseModelOutputWithPooling(pooler_output=features)}  # type: ignore[arg-type]  # a float Tensor, typed FloatTensor

    def prefill_kwargs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """The image tokens, for the mask that lets them attend to each other both ways."""
        return {"token_type_ids": (input_ids == int(self.config.image_token_id)).long()}

    def max_context(self) -> int | None:
        text = self.config.get_text_config(decoder=True)
        if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
            return int(text.sliding_window)
        return None
