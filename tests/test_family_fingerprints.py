"""The encoder fingerprint covers every tensor and setting each family's feature path reads
(issue 42): the tensors are found by what the vision path actually uses - the parameters that get
a gradient from an image's features - not by a list of names, so a family whose features read a
tensor outside the known components (LLaVA-OneVision's top-level ``image_newline``) fails here.
Changing one such tensor's bytes, one vision setting of ``config.json`` or the processor's
settings gives a new fingerprint; changing an LM-only tensor does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.engines.families import TRANSFORMERS_FAMILIES
from shared.fingerprint import encoder_fingerprint, is_encoder_tensor, read_safetensors_header
from tests.stackutil import noise_image

FAMILIES = sorted(TRANSFORMERS_FAMILIES)
#: per family: a setting of config.json that changes what its features are
VISION_SETTING = {
    "llava": ("vision_feature_layer", -1),
    "qwen2_vl": ("vision_config.spatial_merge_size", 1),
    "qwen2_5_vl": ("vision_config.window_size", 28),
    "qwen3_vl": ("vision_config.deepstack_visual_indexes", [0]),
    "gemma3": ("mm_tokens_per_image", 4),
    "internvl": ("downsample_ratio", 0.25),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> Path:
    from shared.tools.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny", seed=0)


def _used_by_features(model_dir: Path) -> tuple[set[str], set[str]]:
    """(parameters an image's features depend on, every parameter) of the loaded model."""
    from shared.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(model_dir, threads=1)
    try:
        pixels = engine._preprocess([noise_image(5, (84, 56))])
        with torch.enable_grad():
            (item,) = engine.family.image_features(pixels)
            item.features.square().sum().backward()
        params = dict(engine.model.named_parameters())
        used = {n for n, p in params.items() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
        return used, set(params)
    finally:
        engine._executor.shutdown()


def _flip_first_byte(model_dir: Path, tensor: str) -> None:
    (st,) = model_dir.glob("*.safetensors")
    header, start = read_safetensors_header(st)
    offset = start + header[tensor]["data_offsets"][0]
    data = bytearray(st.read_bytes())
    data[offset] ^= 0xFF
    st.write_bytes(bytes(data))


def test_every_tensor_the_features_read_is_fingerprinted(family_dir):
    used, every = _used_by_features(family_dir)
    assert len(used) > 4, used
    assert [n for n in sorted(used) if not is_encoder_tensor(n)] == []
    # Control: the LM's tensors are not encoder tensors (the check can fail), and get no gradient.
    lm = {n for n in every if "layers" in n and not is_encoder_tensor(n)}
    assert lm and not (lm & used)


def test_a_change_to_what_the_features_read_changes_the_fingerprint(family_dir, tmp_path):
    family = json.loads((family_dir / "config.json").read_text())["model_type"]
    base = encoder_fingerprint(family_dir, dtype="float32", engine="transformers")

    def changed(edit) -> str:
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(family_dir, copy)
        edit(copy)
        return encoder_fingerprint(copy, dtype="float32", engine="transformers")

    (st,) = family_dir.glob("*.safetensors")
    names = [n for n in read_safetensors_header(st)[0] if n != "__metadata__"]
    vision = next(n for n in sorted(names) if is_encoder_tensor(n))
    lm_only = next(n for n in sorted(names) if not is_encoder_tensor(n) and "layers" in n)
    assert changed(lambda d: _flip_first_byte(d, vision)) != base
    assert changed(lambda d: _flip_first_byte(d, lm_only)) == base  # control: the LM is not the encoder's

    def set_setting(d: Path) -> None:
        key, value = VISION_SETTING[family]
        config = json.loads((d / "config.json").read_text())
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        assert node[leaf] != value
        node[leaf] = value
        (d / "config.json").write_text(json.dumps(config))

    assert changed(set_setting) != base

    def set_processor(d: Path) -> None:
        (proc,) = [p for p in d.iterdir() if p.name in ("processor_config.json", "preprocessor_config.json")]
        settings = json.loads(proc.read_text())
        settings["__test__"] = 1
        proc.write_text(json.dumps(settings))

    assert changed(set_processor) != base


def test_llava_onevision_image_newline_and_video_settings_are_the_encoders(tmp_path):
    """What no served family has yet but its next ones read: a top-level ``image_newline`` tensor
    (LLaVA-OneVision / LLaVA-NeXT), and a separate video processor file."""
    from safetensors.torch import save_file

    assert is_encoder_tensor("image_newline") and is_encoder_tensor("model.image_newline")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    tensors = {"image_newline": torch.zeros(4), "vision_tower.w": torch.zeros(2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    base = encoder_fingerprint(tmp_path, dtype="float32", engine="transformers")
    save_file({**tensors, "image_newline": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    assert encoder_fingerprint(tmp_path, dtype="float32", engine="transformers") != base
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert encoder_fingerprint(tmp_path, dtype="float32", engine="transformers") == base
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 2}))
    assert encoder_fingerprint(tmp_path, dtype="float32", engine="transformers") != base
