"""The deterministic random-weight model folders (shared.tools.models.tiny)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from shared.fingerprint import is_encoder_tensor, read_safetensors_header
from shared.tools.models.tiny import ARCHS, SIZES, build_tiny_model
from tests.stackutil import noise_image

TINY_ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3", "internvl"]
QWEN_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: arch -> (transformers model class name, processor class name, image tokens of a 64x48 image)
FAMILY = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", 4),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", 4),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", 4),
    "llava": ("LlavaForConditionalGeneration", "LlavaProcessor", 36),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", 16),
    "internvl": ("InternVLForConditionalGeneration", "InternVLProcessor", 28),  # 6 tiles + a thumbnail
}


def _file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, str], Path]:
    """Each tiny arch built twice with seed 0 and once with seed 1."""
    out = {}
    for arch in TINY_ARCHS:
        for seed, copy in ((0, "a"), (0, "b"), (1, "a")):
            out[(arch, seed, copy)] = build_tiny_model(
                tmp_path_factory.mktemp(f"{arch}-s{seed}{copy}"), arch=arch, size="tiny", seed=seed
            )
    return out


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_seed_is_byte_identical(builds, arch):
    a = _file_hashes(builds[(arch, 0, "a")])
    b = _file_hashes(builds[(arch, 0, "b")])
    assert a == b
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "processor_config.json",
    }
    assert expected <= set(a)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_other_seed_changes_only_weights(builds, arch):
    a = _file_hashes(builds[(arch, 0, "a")])
    c = _file_hashes(builds[(arch, 1, "a")])
    assert a["model.safetensors"] != c["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in c.items() if k != "model.safetensors"
    }


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_checkpoint_uses_hub_layout_and_fan_in_init(builds, arch):
    from safetensors.torch import load_file

    folder = builds[(arch, 0, "a")]
    header, _ = read_safetensors_header(folder / "model.safetensors")
    names = [n for n in header if n != "__metadata__"]
    assert header["__metadata__"] == {"format": "pt"}
    assert any(is_encoder_tensor(n) for n in names)
    if arch == "llava":
        assert all(
            n.startswith(("vision_tower.vision_model.", "multi_modal_projector.", "language_model.")) for n in names
        )
    elif arch == "internvl":
        prefixes = ("vision_tower.", "multi_modal_projector.", "language_model.model.", "language_model.lm_head.")
        assert all(n.startswith(prefixes) for n in names)
    elif arch == "gemma3":  # (no lm_head: tied to the token embeddings, as in Gemma 3 checkpoints)
        assert all(
            n.startswith(("vision_tower.vision_model.", "multi_modal_projector.", "language_model.model."))
            for n in names
        )
    elif arch == "qwen3_vl":  # Qwen3-VL checkpoints were published in transformers' newer layout
        assert all(n.startswith(("model.visual.", "model.language_model.", "lm_head.")) for n in names)
        assert any(".deepstack_merger_list." in n for n in names)
    else:
        assert all(
            n.startswith(("visual.", "model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for n in names
        )
    tensors = load_file(folder / "model.safetensors")
    # Fan-in scaled (std ~ 1/sqrt(fan_in)), not HF's std 0.02: a 96-wide LM projection has
    # std ~0.1.
    w = next(
        t for n, t in tensors.items() if n.endswith("layers.0.self_attn.q_proj.weight") and not is_encoder_tensor(n)
    )
    assert 0.07 < float(w.std()) < 0.14
    norms = [t for n, t in tensors.items() if n.endswith("input_layernorm.weight")]
    assert norms and all(bool((t == 1).all()) for t in norms)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_folder_loads_with_transformers(builds, arch):
    import torch
    import transformers
    from transformers import AutoProcessor

    folder = builds[(arch, 0, "a")]
    processor = AutoProcessor.from_pretrained(folder)
    cls_name, processor_name, image_tokens = FAMILY[arch]
    cls = getattr(transformers, cls_name)
    model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg = model.config
    text_cfg = cfg.get_text_config(decoder=True)
    tok = processor.tokenizer
    assert len(tok) == text_cfg.vocab_size
    assert type(processor).__name__ == processor_name
    if arch in QWEN_ARCHS:
        assert processor.video_processor is not None
        for name, attr in [
            ("<|image_pad|>", "image_token_id"),
            ("<|video_pad|>", "video_token_id"),
            ("<|vision_start|>", "vision_start_token_id"),
            ("<|vision_end|>", "vision_end_token_id"),
        ]:
            assert tok.convert_tokens_to_ids(name) == getattr(cfg, attr)
        for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
            assert tok.convert_tokens_to_ids(name) not in (None, tok.unk_token_id)
    elif arch == "internvl":
        assert tok.convert_tokens_to_ids("<IMG_CONTEXT>") == cfg.image_token_id == tok.context_image_token_id
        assert tok.start_image_token == "<img>" and tok.end_image_token == "</img>"
    elif arch == "gemma3":
        assert tok.convert_tokens_to_ids("<image_soft_token>") == cfg.image_token_id == tok.image_token_id
        assert tok.convert_tokens_to_ids("<start_of_image>") == cfg.boi_token_id == tok.boi_token_id
        assert tok.convert_tokens_to_ids("<end_of_image>") == cfg.eoi_token_id == tok.eoi_token_id
        assert tok.bos_token == "<bos>" and tok("a")["input_ids"][0] == tok.bos_token_id
        assert cfg.text_config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    else:
        assert tok.convert_tokens_to_ids("<image>") == cfg.image_token_id
        assert tok.bos_token == "<s>" and tok.eos_token == "</s>"

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if arch in QWEN_ARCHS:
        assert "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
    elif arch == "gemma3":
        assert text == "<bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
    elif arch == "internvl":
        assert "<|im_start|>user\n<IMG_CONTEXT>\nWhat is this?<|im_end|>" in text
    else:
        assert text == "USER: <image>\nWhat is this?\nASSISTANT:"
    inputs = processor(text=text, images=[noise_image(0, (64, 48))], return_tensors="pt")
    n_img = int((inputs["input_ids"] == cfg.image_token_id).sum())
    assert n_img == image_tokens
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=4)
    assert out.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "gemma3", "internvl"])
def test_output_depends_on_the_image(builds, arch):
    """The re-drawn weights make the output follow the image (an equality test against these
    models can fail): two images give two greedy continuations. (The tiny Qwen3-VL gives the same
    tokens for any two noise images - their features average alike - so the other is white.)"""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = builds[(arch, 0, "a")]
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    outs = []
    for image in (noise_image(0, (112, 84)), Image.new("RGB", (112, 84), (255, 255, 255))):
        inputs = processor(text=text, images=[image], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=12)
        outs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    assert outs[0] != outs[1]


@pytest.mark.parametrize("arch", QWEN_ARCHS)
def test_qwen_tiny_image_sizes_stay_small(builds, arch):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(builds[(arch, 0, "a")])
    big = processor.image_processor(images=[noise_image(1, (640, 480))], return_tensors="pt")
    t, h, w = big["image_grid_thw"][0].tolist()
    assert t * h * w // 4 <= 16  # max_pixels 112*112 -> at most 16 image tokens


def test_bench_size_is_about_130m_params(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("bench"), arch="qwen2_vl", size="bench", seed=0)
    header, _ = read_safetensors_header(folder / "model.safetensors")
    counts = {"vision": 0, "lm": 0}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        n = int(np.prod(info["shape"]))
        counts["vision" if is_encoder_tensor(name) else "lm"] += n
    total = counts["vision"] + counts["lm"]
    assert 120e6 < total < 140e6, counts
    assert counts["vision"] > 0.35 * total  # the encoder is a large share of the compute
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["vision_config"]["depth"] == 10 and cfg["vision_config"]["embed_dim"] == 640
    assert cfg["text_config"]["num_hidden_layers"] == 10 and cfg["text_config"]["hidden_size"] == 768
    proc = json.loads((folder / "processor_config.json").read_text())
    assert proc["image_processor"]["size"]["longest_edge"] == 448 * 448


def test_sizes_and_archs_are_described():
    assert set(ARCHS) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3", "internvl"}
    assert all((arch, "tiny") in SIZES for arch in ARCHS)
    assert ("qwen2_vl", "tiny") in SIZES and ("qwen2_vl", "bench") in SIZES and ("llava", "tiny") in SIZES
    assert all(spec.description for spec in SIZES.values())


def test_unknown_arch_or_size_raises(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="size"):
        build_tiny_model(tmp_path, arch="llava", size="bench")
