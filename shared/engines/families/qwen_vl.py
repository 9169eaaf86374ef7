"""Qwen2-VL and Qwen2.5-VL: dynamic resolution (an image is a (t, h, w) patch grid, merged 2x2
into its tokens), M-RoPE positions over that grid. Qwen2.5-VL's windowed vision attention and its
MLP are inside its vision tower: the same calls serve both."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage
from shared.engines.families.base import VisionFamily
from shared.errors import InvalidRequest
from shared.protocol import MediaKind


class QwenVL(VisionFamily):
    """The Qwen-VL line's grid and M-RoPE (Qwen2-VL, Qwen2.5-VL; Qwen3-VL adds deepstack)."""

    concatenates_images = True  # patches of any sizes concatenated, one grid row per image
    #: whether the temporal positions of a video follow its seconds per temporal patch (Qwen2.5-VL)
    uses_second_per_grid_t = False

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

    def video_features(self, pixels: dict[str, Any], fps: float) -> EncodedImage:
        if not self.takes_video:
            return super().video_features(pixels, fps)
        res = self.model.get_video_features(
            pixel_values_videos=pixels["pixel_values_videos"], video_grid_thw=pixels["video_grid_thw"], return_dict=True
        )
        (features,) = res.pooler_output
        grid = self.grid_of(MediaKind.VIDEO, pixels)
        return EncodedImage(features=features, grid_thw=grid, kind=MediaKind.VIDEO, fps=fps)

    def grid_of(self, kind: str, pixels: Mapping[str, Any]) -> tuple[int, int, int] | None:
        """The processor's ``image_grid_thw`` / ``video_grid_thw`` of the (one) item."""
        t, h, w = (int(x) for x in pixels[f"{kind}_grid_thw"][0].tolist())
        return (t, h, w)

    def expected_tokens(self, item: EncodedImage) -> int | None:
        if item.grid_thw is None:
            return None
        t, h, w = item.grid_thw
        return (t * h * w) // (self.merge * self.merge)

    def check_image(self, i: int, item: EncodedImage) -> None:
        if item.kind not in self.placeholders():
            raise InvalidRequest(f"images[{i}] is a {item.kind}: this model takes images only")
        g = item.grid_thw
        if not (isinstance(g, tuple) and len(g) == 3 and all(isinstance(x, int) and x > 0 for x in g)):
            raise InvalidRequest(f"images[{i}].grid_thw must be three positive ints, got {g!r}")
        if g[1] % self.merge or g[2] % self.merge:
            raise InvalidRequest(f"images[{i}].grid_thw {g} is not divisible by the merge size {self.merge}")
        if item.kind == MediaKind.IMAGE and g[0] != 1:
            raise InvalidRequest(f"images[{i}].grid_thw {g}: an image has one temporal patch")

    def prefill_positions(self, input_ids: torch.Tensor, images: Sequence[EncodedImage]) -> tuple[torch.Tensor, int]:
        """``[4, 1, n]``: the text positions (the attention mask's), then the (t, h, w) M-RoPE
        positions from the model's ``get_rope_index``; the delta decode positions add."""
        n = input_ids.shape[1]
        text_pos = torch.arange(n, dtype=torch.long).view(1, 1, n)
        if not images:
            return torch.cat([text_pos, text_pos.expand(3, 1, n)], dim=0), 0
        # token types: 1 an image's, 2 a video's (get_rope_index walks each kind's grids in order)
        types = (input_ids == self.placeholder_id).to(torch.int32)
        kwargs: dict[str, Any] = {}
        for kind, name in ((MediaKind.IMAGE, "image_grid_thw"), (MediaKind.VIDEO, "video_grid_thw")):
            items = [im for im in images if im.kind == kind]
            if items:
                kwargs[name] = torch.tensor([list(im.grid_thw) for im in items], dtype=torch.long)  # type: ignore[arg-type]  # checked by check_image
        if self.video_placeholder_id is not None:
            types = types + 2 * (input_ids == self.video_placeholder_id).to(torch.int32)
        videos = [im for im in images if im.kind == MediaKind.VIDEO]
        if videos and self.uses_second_per_grid_t:
            # (Qwen2.5-VL's processor: temporal_patch_size / the sampled clip's fps)
            temporal = float(self.processor.video_processor.temporal_patch_size)
            for i, im in enumerate(videos):
                if not (im.fps and im.fps > 0):
                    raise InvalidRequest(f"video {i} has no sampled rate (fps): its temporal positions are unknown")
            seconds = [temporal / im.fps for im in videos]  # type: ignore[operator]  # checked just above
            kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        vision_pos, deltas = self.model.model.get_rope_index(input_ids, mm_token_type_ids=types, **kwargs)
        return torch.cat([text_pos, vision_pos], dim=0), int(deltas.reshape(-1)[0])

    def decode_positions(self, past_lens: Sequence[int], deltas: Sequence[int]) -> torch.Tensor:
        """``[4, n, 1]``: text positions, then ``past_len + delta`` on each M-RoPE axis."""
        text_pos = torch.tensor([[p] for p in past_lens], dtype=torch.long)
        rope = torch.tensor([[p + d] for p, d in zip(past_lens, deltas)], dtype=torch.long)
        return torch.stack([text_pos, rope, rope, rope])


class Qwen2VL(QwenVL):
    model_class = "Qwen2VLForConditionalGeneration"
    takes_video = True


class Qwen25VL(QwenVL):
    model_class = "Qwen2_5_VLForConditionalGeneration"
    takes_video = True
    uses_second_per_grid_t = True
