"""TransformersEngine on the tiny Qwen2-VL and LLaVA models: bit-exact against HF generate()."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from shared.engines.base import EncodedImage, GenerationStats, SamplingParams
from shared.engines.transformers_engine import (
    DecodeState,
    IncrementalDetokenizer,
    StopStringMatcher,
    TransformersEngine,
    check_image_count,
    count_image_placeholders,
)
from shared.errors import EngineError, InvalidRequest, UnsupportedContent
from shared.fingerprint import encoder_fingerprint
from shared.tools.models.tiny import build_tiny_model
from tests.stackutil import noise_image

ARCHS = ["qwen2_vl", "llava"]
N_TOKENS = 16
GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


# 64x48 and 56x56 both give a 4x4 Qwen2-VL patch grid (same token count: swappable features).
IMAGES = {"wide": noise_image(1, (64, 48)), "square": noise_image(2, (56, 56)), "thin": noise_image(3, (90, 40))}


def _user(*parts):
    return {"role": "user", "content": list(parts)}


IMG = {"type": "image"}


def _text(t: str):
    return {"type": "text", "text": t}


CASES = {
    "one-image": ([_user(IMG, _text("What is in this image?"))], ["wide"]),
    "system-nonsquare": (
        [{"role": "system", "content": "Answer briefly."}, _user(_text("Describe this:"), IMG)],
        ["thin"],
    ),
    "two-images": ([_user(IMG, _text("Compare the first image"), IMG, _text("with the second."))], ["square", "thin"]),
    "multi-turn": (
        [
            _user(IMG, _text("What color?")),
            {"role": "assistant", "content": "Red."},
            _user(_text("And the shape?")),
        ],
        ["square"],
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {arch: build_tiny_model(tmp_path_factory.mktemp(f"engine-{arch}"), arch=arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def engine(request, model_dirs) -> TransformersEngine:
    return TransformersEngine(model_dirs[request.param], threads=1)


@pytest.fixture(scope="module")
def qwen(model_dirs) -> TransformersEngine:
    return TransformersEngine(model_dirs["qwen2_vl"], threads=1)


def _run(engine, messages, encoded, params=GREEDY, stats=None):
    events = list(engine.generate(messages, encoded, params, stats))
    return [e.token_id for e in events], "".join(e.text for e in events), events


def _hf_generate(engine, messages, pil_images, max_new_tokens=N_TOKENS):
    from transformers import GenerationConfig

    text = engine.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = engine.processor(text=text, images=pil_images, return_tensors="pt")
    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=engine.tokenizer.pad_token_id
    )
    with torch.inference_mode():
        out = engine.model.generate(**inputs, generation_config=gen_cfg)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_hf_generate(engine, case):
    messages, names = CASES[case]
    pil = [IMAGES[n] for n in names]
    encoded = engine.encode(pil)
    stats = GenerationStats()
    ids, text, events = _run(engine, messages, encoded, stats=stats)
    ref = _hf_generate(engine, messages, pil)
    assert len(ref) == N_TOKENS
    assert ids == ref
    assert [e.finish_reason for e in events] == [None] * (N_TOKENS - 1) + ["length"]
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert stats.completion_tokens == N_TOKENS
    assert stats.prompt_tokens > sum(e.n_tokens for e in encoded)
    assert stats.prefill_s > 0 and stats.decode_s > 0


def test_encode_shapes(engine):
    encoded = engine.encode([IMAGES["wide"], IMAGES["thin"]])
    for item in encoded:
        assert item.features.ndim == 2 and item.features.shape[1] == engine.hidden_size
        assert item.features.is_contiguous() and item.features.device.type == "cpu"
        assert item.features.dtype == torch.float32
    if engine.arch == "qwen2_vl":
        assert encoded[0].grid_thw == (1, 4, 4) and encoded[0].n_tokens == 4
        t, h, w = encoded[1].grid_thw
        assert encoded[1].n_tokens == t * h * w // 4 and h != w
    else:
        assert all(e.grid_thw is None and e.n_tokens == 36 for e in encoded)
    # Per-image encoding: the same image alone or in a batch gives identical features.
    alone = engine.encode([IMAGES["thin"]])[0]
    assert torch.equal(alone.features, encoded[1].features)


def test_other_images_features_change_the_output(engine):
    """Negative control: the equality test above could fail."""
    messages, _ = CASES["one-image"]
    wide, square = engine.encode([IMAGES["wide"], IMAGES["square"]])
    assert wide.n_tokens == square.n_tokens
    ids_wide, _, _ = _run(engine, messages, [wide])
    ids_square, _, _ = _run(engine, messages, [square])
    assert ids_wide != ids_square
    assert _hf_generate(engine, messages, [IMAGES["wide"]]) != ids_square


def test_mrope_delta_matters(qwen):
    """Decoding with rope_delta forced to 0 gives different tokens: the offset is load-bearing."""
    messages, names = CASES["two-images"]
    encoded = qwen.encode([IMAGES[n] for n in names])
    state = qwen.prefill(messages, encoded, GREEDY)
    assert state.rope_delta < 0
    good = [e.token_id for e in qwen.decode(state, GREEDY)]
    bad_state = qwen.prefill(messages, encoded, GREEDY)
    bad_state.rope_delta = 0
    bad = [e.token_id for e in qwen.decode(bad_state, GREEDY)]
    assert good[0] == bad[0]  # the first token comes from prefill
    assert good != bad


def test_features_roundtrip_through_safetensors_bytes(engine):
    from safetensors.torch import load, save

    messages, names = CASES["two-images"]
    encoded = engine.encode([IMAGES[n] for n in names])
    blobs = [save({"features": e.features}) for e in encoded]
    restored = [EncodedImage(features=load(b)["features"], grid_thw=e.grid_thw) for b, e in zip(blobs, encoded)]
    assert all(torch.equal(a.features, b.features) for a, b in zip(encoded, restored))
    assert _run(engine, messages, encoded)[0] == _run(engine, messages, restored)[0]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)])
def test_decode_state_roundtrip_through_safetensors_bytes(engine, sampling):
    """Prefill in one place, serialize the state, decode elsewhere: same tokens and text."""
    from safetensors.torch import load, save

    messages, names = CASES["one-image"]
    encoded = engine.encode([IMAGES[n] for n in names])
    direct_ids, direct_text, _ = _run(engine, messages, encoded, sampling)

    state = engine.prefill(messages, encoded, sampling)
    tensors, meta = state.to_tensors()
    blob = save(tensors, metadata=meta)
    restored = DecodeState.from_tensors(load(blob), _safetensors_metadata(blob), engine.config)
    events = list(engine.decode(restored, sampling))
    assert [e.token_id for e in events] == direct_ids
    assert "".join(e.text for e in events) == direct_text


def _safetensors_metadata(blob: bytes) -> dict[str, str]:
    import json
    import struct

    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n])["__metadata__"]


def test_decode_state_rejects_wrong_layer_count(engine):
    messages, names = CASES["one-image"]
    state = engine.prefill(messages, engine.encode([IMAGES[n] for n in names]), GREEDY)
    tensors, meta = state.to_tensors()
    tensors.pop("kv.0.k")
    with pytest.raises(EngineError):
        DecodeState.from_tensors(tensors, meta, engine.config)


def test_seeded_sampling_is_reproducible(engine):
    messages, names = CASES["one-image"]
    encoded = engine.encode([IMAGES[n] for n in names])
    params = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = _run(engine, messages, encoded, params)[0]
    b = _run(engine, messages, encoded, params)[0]
    c = _run(engine, messages, encoded, replace(params, seed=4321))[0]
    greedy = _run(engine, messages, encoded)[0]
    assert a == b
    assert a != c
    assert a != greedy
    # seed=None draws a fresh random seed per request
    d = _run(engine, messages, encoded, replace(params, seed=None))[0]
    e = _run(engine, messages, encoded, replace(params, seed=None))[0]
    assert d != e


def test_tiny_top_p_is_greedy(engine):
    messages, names = CASES["one-image"]
    encoded = engine.encode([IMAGES[n] for n in names])
    nucleus = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    assert _run(engine, messages, encoded, nucleus)[0] == _run(engine, messages, encoded)[0]


def test_stop_strings_truncate(engine):
    messages, names = CASES["one-image"]
    encoded = engine.encode([IMAGES[n] for n in names])
    ids, full_text, _ = _run(engine, messages, encoded)
    assert len(full_text) >= 8, full_text
    stop = full_text[4:7]
    expected = full_text[: full_text.index(stop)]
    ids2, text2, events = _run(engine, messages, encoded, replace(GREEDY, stop=("\x00never\x00", stop)))
    assert text2 == expected
    assert events[-1].finish_reason == "stop"
    assert ids2 == ids[: len(ids2)] and len(ids2) < len(ids)
    # A stop string that never appears changes nothing.
    ids3, text3, events3 = _run(engine, messages, encoded, replace(GREEDY, stop=("\x00never\x00",)))
    assert (ids3, text3, events3[-1].finish_reason) == (ids, full_text, "length")


def test_eos_stops_unless_ignored(engine):
    messages, names = CASES["one-image"]
    encoded = engine.encode([IMAGES[n] for n in names])
    ids, _, _ = _run(engine, messages, encoded)
    saved = engine.eos_token_ids
    try:
        # Pretend the 4th generated token is EOS.
        engine.eos_token_ids = frozenset({ids[3]})
        k = ids.index(ids[3])
        stopped, _, events = _run(engine, messages, encoded, replace(GREEDY, ignore_eos=False))
        assert stopped == ids[: k + 1] and events[-1].finish_reason == "stop"
        kept, _, _ = _run(engine, messages, encoded, GREEDY)
        assert kept == ids
    finally:
        engine.eos_token_ids = saved


def test_max_tokens_one(engine):
    messages, names = CASES["one-image"]
    encoded = engine.encode([IMAGES[n] for n in names])
    ids, text, events = _run(engine, messages, encoded, replace(GREEDY, max_tokens=1))
    assert len(events) == 1 and events[0].finish_reason == "length"
    assert ids == _run(engine, messages, encoded)[0][:1]


def test_placeholder_count_mismatch_raises(engine):
    one = CASES["one-image"][0]
    two = CASES["two-images"][0]
    encoded = engine.encode([IMAGES["wide"], IMAGES["square"]])
    assert count_image_placeholders(two) == 2
    assert count_image_placeholders([{"role": "user", "content": "hi"}]) == 0
    with pytest.raises(InvalidRequest):
        check_image_count(one, 2)
    with pytest.raises(InvalidRequest):
        list(engine.generate(one, encoded, GREEDY))
    with pytest.raises(InvalidRequest):
        list(engine.generate(two, encoded[:1], GREEDY))
    with pytest.raises(InvalidRequest):
        list(engine.generate([{"role": "user", "content": "no image"}], encoded[:1], GREEDY))
    # An image token typed as text is not an image slot.
    token = "<|image_pad|>" if engine.arch == "qwen2_vl" else "<image>"
    with pytest.raises(InvalidRequest):
        list(engine.generate([_user(_text(f"look {token}"))], [], GREEDY))


def test_bad_inputs_raise_clear_errors(engine):
    messages = CASES["one-image"][0]
    good = engine.encode([IMAGES["wide"]])[0]
    h = engine.hidden_size
    bad_items = [
        EncodedImage(features=torch.zeros(good.n_tokens, h + 1), grid_thw=good.grid_thw),  # wrong width
        EncodedImage(features=torch.zeros(good.n_tokens + 1, h), grid_thw=good.grid_thw),  # wrong count
        EncodedImage(features=torch.zeros(good.n_tokens, h, dtype=torch.long), grid_thw=good.grid_thw),
        EncodedImage(features=torch.full((good.n_tokens, h), float("nan")), grid_thw=good.grid_thw),
        EncodedImage(features=torch.zeros(h), grid_thw=good.grid_thw),
    ]
    if engine.arch == "qwen2_vl":
        bad_items.append(EncodedImage(features=good.features, grid_thw=None))
        bad_items.append(EncodedImage(features=good.features, grid_thw=(1, 3, 3)))
    for item in bad_items:
        with pytest.raises(InvalidRequest):
            list(engine.generate(messages, [item], GREEDY))
    for params in (
        replace(GREEDY, max_tokens=0),
        replace(GREEDY, temperature=-1.0),
        replace(GREEDY, top_p=0.0),
        replace(GREEDY, max_tokens=10**9),
    ):
        with pytest.raises(InvalidRequest):
            list(engine.generate(messages, [good], params))
    with pytest.raises(UnsupportedContent):
        list(engine.generate([_user({"type": "audio"})], [], GREEDY))
    with pytest.raises(InvalidRequest):
        list(engine.generate([{"role": "wizard", "content": "hi"}], [], GREEDY))
    with pytest.raises(InvalidRequest):
        list(engine.generate([], [], GREEDY))
    with pytest.raises(InvalidRequest):
        engine.encode(["not an image"])  # type: ignore[list-item]


def test_text_only_prompt(engine):
    ids, text, events = _run(engine, [{"role": "user", "content": "Hello there"}], [])
    assert len(ids) == N_TOKENS and events[-1].finish_reason == "length"


def test_identity_and_fingerprint(engine, model_dirs):
    folder = model_dirs[engine.arch]
    assert engine.name == "transformers"
    assert engine.model_id == folder.name
    assert engine.encoder_fingerprint == encoder_fingerprint(folder, dtype="float32", engine="transformers")
    # Controls: the fingerprint tells encoders apart (other weights, other dtype).
    other = model_dirs["llava" if engine.arch == "qwen2_vl" else "qwen2_vl"]
    assert encoder_fingerprint(other, dtype="float32", engine="transformers") != engine.encoder_fingerprint
    assert encoder_fingerprint(folder, dtype="bfloat16", engine="transformers") != engine.encoder_fingerprint
    assert TransformersEngine.__init__.__kwdefaults__["threads"] == 1


def test_unknown_dtype_or_folder(tmp_path, model_dirs):
    with pytest.raises(EngineError):
        TransformersEngine(model_dirs["llava"], dtype="int8")
    with pytest.raises(EngineError):
        TransformersEngine(tmp_path)


# -- pure helpers -------------------------------------------------------------------------------


def test_stop_matcher_holds_back_possible_prefixes():
    m = StopStringMatcher(["END", "xyz"])
    assert m.feed("abc E") == ("abc ", False)  # "E" could start "END"
    assert m.feed("N") == ("", False)
    assert m.feed("D tail") == ("", True)  # text stops right before "END"
    m = StopStringMatcher(["END"])
    assert m.feed("E") == ("", False)
    assert m.feed("x") == ("Ex", False)  # no longer a prefix: released
    assert m.feed("EN") == ("", False)
    assert m.finish() == "EN"
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)


def test_incremental_detokenizer_matches_full_decode(model_dirs):
    from transformers import AutoTokenizer

    for arch in ARCHS:
        tok = AutoTokenizer.from_pretrained(model_dirs[arch])
        rng = random.Random(0)
        for _ in range(300):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 24))]
            det = IncrementalDetokenizer(tok)
            parts = [det.add(i) for i in ids]
            parts.append(det.flush())
            assert "".join(parts) == tok.decode(ids, skip_special_tokens=True), (arch, ids)
        # Multi-byte characters are emitted whole.
        det = IncrementalDetokenizer(tok)
        ids = tok("héllo 😀 wörld", add_special_tokens=False)["input_ids"]
        parts = [det.add(i) for i in ids] + [det.flush()]
        assert "".join(parts) == "héllo 😀 wörld"
        assert all("\ufffd" not in p for p in parts)
