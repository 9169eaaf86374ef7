"""Qwen3-VL: Qwen2.5-VL's grid and M-RoPE (interleaved, inside the LM), plus deepstack - the
outputs of some vision layers (``deepstack_visual_indexes``) are added to the hidden states of as
many first LM layers at the image positions. An image's features are therefore ``1 + k`` tensors;
they travel as one ``[n_tokens, hidden * (1 + k)]`` tensor, the main features first, then each
deepstack layer's (vLLM's layout of a Qwen3-VL multimodal embedding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage
from shared.engines.families.qwen_vl import QwenVL


class Qwen3VL(QwenVL):
    model_class = "Qwen3VLForConditionalGeneration"

    @property
    def deepstack_layers(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or ())

    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        res, grids = self._vision(pixels)
        per_image = zip(res.pooler_output, *res.deepstack_features)  # (main, deep_0, ..., deep_k-1) per image
        return [EncodedImage(features=torch.cat(parts, dim=1), grid_thw=g) for parts, g in zip(per_image, grids)]

    def encoder_outputs(self, images: Sequence[EncodedImage], dtype: torch.dtype) -> dict[str, Any]:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        parts = [torch.split(im.features.to(dtype), self.hidden_size, dim=1) for im in images]
        # (typed as tensors; forward takes get_image_features's per-image tuples, as here)
        out = BaseModelOutputWithDeepstackFeatures(
            pooler_output=tuple(p[0] for p in parts),  # type: ignore[arg-type]  # a tuple, as forward takes
            deepstack_features=[tuple(p[1 + k] for p in parts) for k in range(self.deepstack_layers)],  # type: ignore[misc]  # tuples
        )
        return {"image": out}
