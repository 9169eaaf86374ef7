"""LLaVA (1.5): a CLIP tower on one fixed-size crop, a fixed number of tokens per image, 1-D
positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage
from shared.engines.families.base import VisionFamily


class Llava(VisionFamily):
    model_class = "LlavaForConditionalGeneration"
    concatenates_images = False  # images of one pixel shape are stacked (its processor makes one size)

    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        res = self.model.get_image_features(
            pixel_values=torch.cat([px["pixel_values"] for px in pixels]),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            return_dict=True,
        )
        return [EncodedImage(features=f.reshape(-1, f.shape[-1])) for f in res.pooler_output]

    def expected_tokens(self, item: EncodedImage) -> int | None:
        proc = self.processor
        patch = getattr(proc, "patch_size", None)
        crop = getattr(proc.image_processor, "crop_size", None)
        if not patch or not crop:
            return None
        ch = crop["height"] if isinstance(crop, dict) else crop.height
        cw = crop["width"] if isinstance(crop, dict) else crop.width
        n = (ch // patch) * (cw // patch) + int(getattr(proc, "num_additional_image_tokens", 0) or 0)
        if getattr(proc, "vision_feature_select_strategy", None) == "default":
            n -= 1
        return n
