"""Qwen3-VL: Qwen2.5-VL's grid and M-RoPE (interleaved, inside the LM), plus deepstack - the
outputs of some vision layers (``deepstack_visual_indexes``) are added to the hidden states of as
many first LM layers at the image positions. An image's features are therefore ``1 + k`` tensors;
they travel as one ``[n_tokens, hidden * (1 + k)]`` tensor, the main features first, then each
deepstack layer's (vLLM's layout of a Qwen3-VL multimodal embedding).

A video is the same: one ``get_video_features`` forward, its main and deepstack features side by
side. Its prompt differs from Qwen2.5-VL's: each temporal patch is written as its time in the
source video, ``<t seconds>`` (text), then ``<|vision_start|>``, the patch's video tokens and
``<|vision_end|>`` - the time is the mean of the patch's first and last frame's (their indices in
the source over its rate), as transformers' processor and vLLM compute it. The patches' M-RoPE
positions are each a grid of its own (t = 1; ``get_rope_index`` splits the video's grid)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage, VideoFrames
from shared.engines.families.qwen_vl import QwenVL
from shared.errors import InvalidRequest
from shared.protocol import MediaKind

#: the source rate transformers' processor assumes when a video's is not known (and vLLM's loader)
UNKNOWN_SOURCE_FPS = 24.0


def patch_timestamps(indices: Sequence[int], source_fps: float, temporal_patch: int) -> tuple[float, ...]:
    """Each temporal patch's time (seconds) in the source video: its frames' ``index / fps``, the
    mean of its first and last - the last patch filled up with the last frame, as the processor
    pads it (transformers' and vLLM's ``_calculate_timestamps``, float for float)."""
    idx = list(indices)
    if len(idx) % temporal_patch:
        idx += [idx[-1]] * (temporal_patch - len(idx) % temporal_patch)
    seconds = [i / source_fps for i in idx]
    return tuple((seconds[i] + seconds[i + temporal_patch - 1]) / 2 for i in range(0, len(seconds), temporal_patch))


class Qwen3VL(QwenVL):
    model_class = "Qwen3VLForConditionalGeneration"
    takes_video = True

    @property
    def deepstack_layers(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or ())

    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        res, grids = self._vision(pixels)
        per_image = zip(res.pooler_output, *res.deepstack_features)  # (main, deep_0, ..., deep_k-1) per image
        return [EncodedImage(features=torch.cat(parts, dim=1), grid_thw=g) for parts, g in zip(per_image, grids)]

    def video_features(self, pixels: dict[str, Any], fps: float) -> EncodedImage:
        res = self.model.get_video_features(
            pixel_values_videos=pixels["pixel_values_videos"], video_grid_thw=pixels["video_grid_thw"], return_dict=True
        )
        ((main, *deep),) = zip(res.pooler_output, *res.deepstack_features)  # one video
        grid = self.grid_of(MediaKind.VIDEO, pixels)
        return EncodedImage(features=torch.cat([main, *deep], dim=1), grid_thw=grid, kind=MediaKind.VIDEO, fps=fps)

    def video_timestamps(self, video: VideoFrames) -> tuple[float, ...]:
        if video.indices is None or len(video.indices) != len(video.frames):
            raise InvalidRequest(
                "this model writes each video frame's time into the prompt: the video's frame indices in its "
                "source are needed (frames stored without them cannot be served)",
                param="messages",
            )
        source_fps = video.source_fps if video.source_fps and video.source_fps > 0 else UNKNOWN_SOURCE_FPS
        return patch_timestamps(video.indices, source_fps, int(self.processor.video_processor.temporal_patch_size))

    def check_image(self, i: int, item: EncodedImage) -> None:
        super().check_image(i, item)
        if item.kind == MediaKind.VIDEO:
            t = item.grid_thw[0] if item.grid_thw is not None else 0
            if item.timestamps is None or len(item.timestamps) != t:
                raise InvalidRequest(
                    f"images[{i}] is a video of {t} temporal patches with timestamps {item.timestamps!r}"
                )

    def expand(self, text: str, ids: list[int], images: Sequence[EncodedImage], add_special_tokens: bool) -> list[int]:
        """The processor's expansion: an image placeholder repeated; a video placeholder replaced, per
        temporal patch, by ``<t seconds>`` (tokenized alone: special tokens border it),
        ``<|vision_start|>``, the patch's video tokens, ``<|vision_end|>``."""
        videos = iter([im for im in images if im.kind == MediaKind.VIDEO])
        stills = iter([im for im in images if im.kind == MediaKind.IMAGE])
        out: list[int] = []
        for t in ids:
            if t == self.video_placeholder_id:
                out.extend(self.video_ids(next(videos)))
            elif t == self.placeholder_id:
                out.extend(self.image_ids(next(stills).n_tokens))
            else:
                out.append(t)
        return out

    def video_ids(self, video: EncodedImage) -> list[int]:
        """The ids one video stands as in the prompt (:meth:`expand`)."""
        assert video.grid_thw is not None and video.timestamps is not None  # (check_image)
        t, h, w = video.grid_thw
        per_patch = (h * w) // (self.merge * self.merge)
        start, end = int(self.processor.vision_start_token_id), int(self.processor.vision_end_token_id)
        tokenizer = self.processor.tokenizer
        out: list[int] = []
        for seconds in video.timestamps:
            out.extend(tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"])
            out.append(start)
            out.extend([int(self.video_placeholder_id)] * per_patch)  # type: ignore[arg-type]  # takes_video
            out.append(end)
        return out

    def encoder_outputs(self, images: Sequence[EncodedImage], dtype: torch.dtype) -> dict[str, Any]:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        out = {}
        for kind in (MediaKind.IMAGE, MediaKind.VIDEO):
            parts = [torch.split(im.features.to(dtype), self.hidden_size, dim=1) for im in images if im.kind == kind]
            if not parts:
                continue
            # (typed as tensors; forward takes get_*_features's per-item tuples, as here)
            out[kind.value] = BaseModelOutputWithDeepstackFeatures(
                pooler_output=tuple(p[0] for p in parts),  # type: ignore[arg-type]  # a tuple, as forward takes
                deepstack_features=[tuple(p[1 + k] for p in parts) for k in range(self.deepstack_layers)],  # type: ignore[misc]  # tuples
            )
        return out
