"""Every family the transformers engine serves, through the whole stack (issue 42), on every
topology (agg, e-pd, e-p-d: a stack of the tiny builds starts in seconds; e-p-d of two families in
``make test``, the others' in ``make test-matrix``), greedy tokens through
the API equal to transformers' own
``generate`` with the family's own processor and model class (``AutoModelForImageTextToText``,
none of the project's code), for one image at three sizes (two of them not square), two images in
one request and text only. The answers are not empty, and another image gives other tokens (the
negative control: the equality can fail).

One stack per (family, topology), shared by its cases; the references are computed once per
family in this process (one torch thread, as the workers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.stackutil import GREEDY, api_tokens, engine_messages, noise_image, start_stack

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3", "internvl")
#: the families whose e-p-d runs in ``make test`` (the KV hand-off is family-blind; these two carry
#: what a family adds to it: Qwen3-VL's M-RoPE deltas past deepstack, Gemma 3's sliding-window layers);
#: every other family's e-p-d is a ``matrix`` cell (``make test-matrix``), and Qwen2-VL's also runs in
#: tests/test_epd*.py
E_P_D_IN_CI = ("qwen3_vl", "gemma3")
COMBOS = [
    pytest.param(
        (family, topology),
        id=f"{family}-{topology}",
        marks=[pytest.mark.matrix] if topology == "e-p-d" and family not in E_P_D_IN_CI else [],
    )
    for family in FAMILIES
    for topology in ("agg", "e-pd", "e-p-d")
]


def _white(size: tuple[int, int]) -> Image.Image:
    # (the tiny Qwen3-VL gives the same tokens for any two noise images: the other image is not noise)
    return Image.new("RGB", size, (255, 255, 255))


#: name -> (text, images); InternVL's tiny build cuts them into 1, 6 + a thumbnail (its most) and 2 + a
#: thumbnail tiles
CASES: dict[str, tuple[str, list[Image.Image]]] = {
    "small-square": ("Describe the image.", [noise_image(21, (56, 56))]),
    "wide": ("Describe the image.", [noise_image(22, (140, 84))]),
    "tall": ("What is in this picture?", [noise_image(23, (84, 168))]),
    "two-images": ("Compare these two images.", [noise_image(14, (56, 84)), _white((84, 56))]),
    "text-only": ("What is in this image?", []),
}
#: the negative control: "wide"'s question on another image of its size
OTHER = ("Describe the image.", [_white((140, 84))])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    from shared.tools.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_model(root / f, arch=f, size="tiny", seed=0) for f in FAMILIES}


def _hf_tokens(model_dir: Path) -> dict[str, list[int]]:
    """Greedy ids of every case (and OTHER) from transformers alone: the folder's processor and
    chat template, its model class, ``generate`` with EOS ignored (as ``ignore_eos``)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    torch.set_num_threads(1)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to max_tokens
    config = GenerationConfig(
        do_sample=False, max_new_tokens=GREEDY["max_tokens"], eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    out = {}
    for name, (text, images) in {**CASES, "other": OTHER}.items():
        prompt = processor.apply_chat_template(
            engine_messages(text, len(images)), add_generation_prompt=True, tokenize=False
        )
        # (apply_chat_template(tokenize=True)'s rule: no second BOS after a template's own - Gemma 3's)
        bos = processor.tokenizer.bos_token
        add_special = not (bos and prompt.startswith(bos))
        inputs = processor(text=prompt, images=images or None, return_tensors="pt", add_special_tokens=add_special)
        with torch.inference_mode():
            ids = model.generate(**inputs, generation_config=config)
        out[name] = ids[0, inputs["input_ids"].shape[1] :].tolist()
    return out


@pytest.fixture(scope="module")
def references(family_dirs) -> dict[str, dict[str, list[int]]]:
    return {family: _hf_tokens(path) for family, path in family_dirs.items()}


@pytest.fixture(scope="module", params=COMBOS)
def family_stack(request, nats_server, s3_server, family_dirs, tmp_path_factory):
    family, topology = request.param
    running = start_stack(
        nats_server,
        s3_server,
        family_dirs[family],
        tmp_path_factory.mktemp(f"{family}-{topology}-logs"),
        topology=topology,
        EPD_MAX_IMAGES_PER_REQUEST="2",
        # JetStream reserves each stream's max bytes on the session's one server (its storage is
        # bounded by the disk): 18 stacks of the default 64 MiB a stream ran it out for later tests
        EPD_STREAM_MAX_BYTES=str(4 * 1024**2),
    )
    try:
        yield family, running
    finally:
        running.stack.stop()


def test_greedy_tokens_equal_transformers_generate(family_stack, references):
    family, stack = family_stack
    want = references[family]
    got = {name: api_tokens(stack, text, images) for name, (text, images) in {**CASES, "other": OTHER}.items()}
    for name, (ids, body) in got.items():
        assert len(want[name]) == GREEDY["max_tokens"], (family, name)
        assert ids == want[name], (family, name)
        assert body["choices"][0]["message"]["content"].strip(), f"{family} {name}: an empty answer ({ids})"
    # Negative control: another image gives other tokens, in the reference and through the stack.
    assert want["wide"] != want["other"] and got["wide"][0] != got["other"][0]
