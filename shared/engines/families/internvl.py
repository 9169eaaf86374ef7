"""InternVL 3 (the Hugging Face layout, ``model_type`` ``internvl``): its image processor cuts an
image into 1 to ``max_patches`` tiles of the tower's size by the aspect ratio, plus a thumbnail
when there are several; every tile goes through InternViT, a pixel shuffle (a quarter of the
tokens) and the MLP projector, ``image_seq_length`` tokens each. An image's features are its
tiles' tokens in order, one ``[tiles x image_seq_length, hidden]`` tensor; the chat template's
``<IMG_CONTEXT>`` becomes ``<img>`` + those tokens + ``</img>`` (all special tokens: expanded by
id); 1-D positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.engines.base import EncodedImage
from shared.engines.families.base import VisionFamily
from shared.errors import InvalidRequest


class InternVL(VisionFamily):
    model_class = "InternVLForConditionalGeneration"
    concatenates_images = False  # tiles are of one size: images of any tile counts share a forward

    @property
    def tile_tokens(self) -> int:
        return int(self.config.image_seq_length)

    @property
    def max_tiles(self) -> int:
        """Tiles of an image at the most: the processor's ``max_patches``, plus the thumbnail."""
        most = int(getattr(self.processor.image_processor, "max_patches", 1))
        return most + 1 if most > 1 else 1

    def image_features(self, pixels: Sequence[dict[str, Any]]) -> list[EncodedImage]:
        tiles = [int(px["pixel_values"].shape[0]) for px in pixels]
        res = self.model.get_image_features(
            pixel_values=torch.cat([px["pixel_values"] for px in pixels]),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            return_dict=True,
        )
        per_image = torch.split(res.pooler_output, tiles)  # [tiles, tokens, hidden] each
        return [EncodedImage(features=f.reshape(-1, f.shape[-1])) for f in per_image]

    def expected_tokens(self, item: EncodedImage) -> int | None:
        return None  # the tile count follows the image's aspect ratio: checked by check_image

    def check_image(self, i: int, item: EncodedImage) -> None:
        super().check_image(i, item)
        n, per_tile = item.n_tokens, self.tile_tokens
        if n % per_tile or not 1 <= n // per_tile <= self.max_tiles:
            raise InvalidRequest(
                f"images[{i}] has {n} feature rows; this model's images have 1 to {self.max_tiles} tiles of"
                f" {per_tile} tokens"
            )

    def image_ids(self, n_tokens: int) -> list[int]:
        tok = self.processor.tokenizer
        return [int(tok.start_image_token_id), *[self.placeholder_id] * n_tokens, int(tok.end_image_token_id)]

    def encoder_outputs(self, images: Sequence[EncodedImage], dtype: torch.dtype) -> dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # (forward takes the features of every image's tiles as one tensor, in prompt order)
        features = torch.cat([im.features.to(dtype) for im in images])
        return {"image": BaseModelOutputWithPooling(pooler_output=features)}  # type: ignore[arg-type]  # a float Tensor, typed FloatTensor
