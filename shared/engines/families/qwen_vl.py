"""Qwen2-VL and Qwen2.5-VL: dynamic resolution (an image is a (t, h, w) patch grid, merged 2x2
into its tokens), M-RoPE positions over that grid. Qwen2.5-VL's windowed vision attention and its
MLP are inside its vision tower: the same calls serve both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage
from shared.engines.families.base import VisionFamily
from shared.errors import InvalidRequest


class QwenVL(VisionFamily):
    """The Qwen-VL line's grid and M-RoPE (Qwen2-VL, Qwen2.5-VL; Qwen3-VL adds deepstack)."""

    concatenates_images = True  # patches of any sizes concatenated, one grid row per image

    @property
    def merge(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def _vision(self, pixels: Sequence[dict[str, Any]]) -> tuple[Any, list[tuple[int, int, int]]]:
        grid = torch.cat([px["image_grid_thw"] for px in pixels])
        res = self.model.get_image_features(
            pixel_values=torch.cat([px["pixel_values"] for px in pixels]), image_grid_thw=grid, return_dict=True
        )
        return res, [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]

    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        res, grids = self._vision(pixels)
        return [EncodedImage(features=f, grid_thw=g) for f, g in zip(res.pooler_output, grids)]

    def expected_tokens(self, item: EncodedImage) -> int | None:
        if item.grid_thw is None:
            return None
        t, h, w = item.grid_thw
        return (t * h * w) // (self.merge * self.merge)

    def check_image(self, i: int, item: EncodedImage) -> None:
        g = item.grid_thw
        if not (isinstance(g, tuple) and len(g) == 3 and all(isinstance(x, int) and x > 0 for x in g)):
            raise InvalidRequest(f"images[{i}].grid_thw must be three positive ints, got {g!r}")
        if g[1] % self.merge or g[2] % self.merge:
            raise InvalidRequest(f"images[{i}].grid_thw {g} is not divisible by the merge size {self.merge}")

    def prefill_positions(self, input_ids: torch.Tensor, images: Sequence[EncodedImage]) -> tuple[torch.Tensor, int]:
        """``[4, 1, n]``: the text positions (the attention mask's), then the (t, h, w) M-RoPE
        positions from the model's ``get_rope_index``; the delta decode positions add."""
        n = input_ids.shape[1]
        text_pos = torch.arange(n, dtype=torch.long).view(1, 1, n)
        if not images:
            return torch.cat([text_pos, text_pos.expand(3, 1, n)], dim=0), 0
        image_token_id = int(self.config.image_token_id)
        grid = torch.tensor([list(im.grid_thw) for im in images], dtype=torch.long)  # type: ignore[arg-type]  # checked by check_image
        vision_pos, deltas = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == image_token_id).to(torch.int32), image_grid_thw=grid
        )
        return torch.cat([text_pos, vision_pos], dim=0), int(deltas.reshape(-1)[0])

    def decode_positions(self, past_lens: Sequence[int], deltas: Sequence[int]) -> torch.Tensor:
        """``[4, n, 1]``: text positions, then ``past_len + delta`` on each M-RoPE axis."""
        text_pos = torch.tensor([[p] for p in past_lens], dtype=torch.long)
        rope = torch.tensor([[p + d] for p, d in zip(past_lens, deltas)], dtype=torch.long)
        return torch.stack([text_pos, rope, rope, rope])


class Qwen2VL(QwenVL):
    model_class = "Qwen2VLForConditionalGeneration"


class Qwen25VL(QwenVL):
    model_class = "Qwen2_5_VLForConditionalGeneration"
