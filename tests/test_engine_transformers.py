"""TransformersEngine on the tiny builds of every family it serves (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
LLaVA): bit-exact against HF generate(), through the engine's async API (its compute thread)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import replace

import pytest
import torch
from PIL import Image

from shared.engines.base import EncodedImage, GenerationStats, KVStateMismatch, SamplingParams
from shared.engines.prompts import check_media, media_kinds
from shared.engines.transformers_engine import TransformersEngine
from shared.engines.transformers_state import DecodeState, IncrementalDetokenizer, StopStringMatcher, ids_decoder
from shared.errors import EngineError, InvalidRequest, UnsupportedContent
from shared.fingerprint import encoder_fingerprint
from shared.store.format import RawTensor
from shared.store.kv import KVObject
from shared.store.tensors import tensor_to_raw
from shared.tools.models.tiny import build_tiny_model
from tests.stackutil import noise_image

ARCHS = ["qwen2_vl", "llava", "qwen2_5_vl", "qwen3_vl", "gemma3", "internvl"]
#: the families whose images are patch grids (M-RoPE positions over them)
GRID_ARCHS = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
#: the token each family's chat template writes for an image
PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>", "internvl": "<IMG_CONTEXT>"}
N_TOKENS = 16
GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


# 64x48 and 56x56 both give a 4x4 Qwen2-VL patch grid (same token count: swappable features).
log = logging.getLogger(__name__)

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
async def engine(request, model_dirs):
    engine = TransformersEngine(model_dirs[request.param], threads=1)
    yield engine
    await engine.aclose()


@pytest.fixture(scope="module")
async def qwen(model_dirs):
    engine = TransformersEngine(model_dirs["qwen2_vl"], threads=1)
    yield engine
    await engine.aclose()


async def _drain(events):
    return [e async for e in events]


async def _run(engine, messages, encoded, params=GREEDY, stats=None):
    events = await _drain(engine.generate(messages, encoded, params, stats))
    return [e.token_id for e in events], "".join(e.text for e in events), events


def _kv_object(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> KVObject:
    """A KV object (as the decode worker loads it) holding a decode state's tensors + metadata."""
    return KVObject(
        request_id="r",
        attempt=0,
        tensors={n: RawTensor(*tensor_to_raw(t)) for n, t in tensors.items()},
        state_metadata=meta,
        state=json.loads(meta["state"]),
        sampling={},
        producer="test",
        created_at=0.0,
        nbytes=0,
    )


def _hf_generate(engine, messages, pil_images, max_new_tokens=N_TOKENS):
    from transformers import GenerationConfig

    text = engine.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # (as the processor's apply_chat_template(tokenize=True): no second BOS after a template's own)
    bos = engine.tokenizer.bos_token
    add_special = not (bos and text.startswith(bos))
    inputs = engine.processor(text=text, images=pil_images, return_tensors="pt", add_special_tokens=add_special)
    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=engine.tokenizer.pad_token_id
    )
    with torch.inference_mode():
        out = engine.model.generate(**inputs, generation_config=gen_cfg)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_greedy_matches_hf_generate(engine, case):
    messages, names = CASES[case]
    pil = [IMAGES[n] for n in names]
    encoded = await engine.encode(pil)
    stats = GenerationStats()
    ids, text, events = await _run(engine, messages, encoded, stats=stats)
    ref = _hf_generate(engine, messages, pil)
    assert len(ref) == N_TOKENS
    assert ids == ref
    assert [e.finish_reason for e in events] == [None] * (N_TOKENS - 1) + ["length"]
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert stats.completion_tokens == N_TOKENS
    assert stats.prompt_tokens > sum(e.n_tokens for e in encoded)
    assert stats.prefill_s > 0 and stats.decode_s > 0


async def test_encode_shapes(engine):
    encoded = await engine.encode([IMAGES["wide"], IMAGES["thin"]])
    for item in encoded:
        assert item.features.ndim == 2 and item.features.shape[1] == engine.feature_width
        assert item.features.is_contiguous() and item.features.device.type == "cpu"
        assert item.features.dtype == torch.float32
    # Qwen3-VL: the main features and two deepstack layers' side by side
    assert engine.feature_width == engine.hidden_size * (3 if engine.arch == "qwen3_vl" else 1)
    if engine.arch in GRID_ARCHS:
        for item in encoded:
            t, h, w = item.grid_thw
            assert item.n_tokens == t * h * w // 4
        assert encoded[1].grid_thw[1] != encoded[1].grid_thw[2]
        if engine.arch != "qwen3_vl":  # 14-px patches (Qwen3-VL's are 16)
            assert encoded[0].grid_thw == (1, 4, 4) and encoded[0].n_tokens == 4
    else:
        tokens = {"llava": [36, 36], "gemma3": [16, 16], "internvl": [28, 12]}[
            engine.arch
        ]  # (InternVL: 6 + 1, 2 + 1 tiles)
        assert [e.n_tokens for e in encoded] == tokens and all(e.grid_thw is None for e in encoded)
    # Per-image encoding: the same image alone or in a batch gives identical features.
    alone = (await engine.encode([IMAGES["thin"]]))[0]
    assert torch.equal(alone.features, encoded[1].features)


def _encode_forwards() -> tuple[float, float]:
    """(vision-tower forwards, images through them) so far (``epd:encode_batch_images``)."""
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value("epd:encode_batch_images_count") or 0.0,
        REGISTRY.get_sample_value("epd:encode_batch_images_sum") or 0.0,
    )


#: Mixed sizes: Qwen2-VL concatenates their patches when they share a forward.
MIXED = [noise_image(10 + i, (64, 48) if i % 2 else (90, 40)) for i in range(8)]


async def test_concurrent_encodes_are_batch_invariant(engine):
    """The default: concurrent encode calls go to the compute thread together, but each image gets
    a vision-tower forward of its own, so its features are its one-image forward's bit for bit -
    on any CPU, whatever else was in flight (shared forwards round differently by batch shape on
    some CPUs: seen on an Intel Xeon, not on an AMD EPYC). A call with an unusable image fails
    alone."""
    from shared.errors import InvalidImage

    assert engine.encode_batch_invariant
    singles = [engine._encode([im])[0] for im in MIXED]  # one forward each, in this thread
    before = _encode_forwards()
    *outs, bad = await asyncio.gather(
        *(engine.encode([im]) for im in MIXED), engine.encode(["not an image"]), return_exceptions=True
    )
    together = await engine.encode(MIXED)  # one call with every image (an aggregated request's way)
    after = _encode_forwards()
    assert isinstance(bad, InvalidImage)
    # One forward per image: the shapes of a forward never depend on the other images.
    assert after[0] - before[0] == after[1] - before[1] == 2 * len(MIXED)
    for single, (out,), joint in zip(singles, outs, together):
        assert torch.equal(single.features, out.features) and single.grid_thw == out.grid_thw
        assert torch.equal(single.features, joint.features)
    # Negative control: the equality could fail - another image's features differ.
    assert not torch.equal(singles[0].features, (await engine.encode([noise_image(99, (90, 40))]))[0].features)


async def test_shared_forwards_when_not_batch_invariant_stay_within_float_rounding(model_dirs):
    """EPD_ENCODE_BATCH_INVARIANT=false: concurrent encodes share forwards (fewer forwards than
    images). Their features equal the one-image forwards up to float32 rounding - bit for bit on
    some CPUs, not on others - which is the tolerance docs/operations.md states."""
    arch = "qwen2_vl"
    shared_engine = TransformersEngine(model_dirs[arch], threads=1, encode_batch_invariant=False)
    try:
        singles = [shared_engine._encode([im])[0] for im in MIXED]
        before = _encode_forwards()
        outs = await asyncio.gather(*(shared_engine.encode([im]) for im in MIXED))
        after = _encode_forwards()
        assert after[1] - before[1] == len(MIXED) and after[0] - before[0] < len(MIXED)  # shared forwards
        worst = max(float((single.features - out.features).abs().max()) for single, (out,) in zip(singles, outs))
        scale = max(float(single.features.abs().max()) for single in singles)
        log.info("shared forwards vs one-image forwards: max |diff| %.2e (max |feature| %.2f)", worst, scale)
        assert worst <= 1e-5 * scale
        for single, (out,) in zip(singles, outs):
            assert single.grid_thw == out.grid_thw
    finally:
        await shared_engine.aclose()


async def test_other_images_features_change_the_output(engine):
    """Negative control: the equality test above could fail. (Qwen3-VL's tiny build barely tells
    one noise image from another: its other image is a white one of the same size.)"""
    messages, _ = CASES["one-image"]
    other = {
        "qwen3_vl": Image.new("RGB", (56, 56), "white"),
        "internvl": noise_image(99, (64, 48)),  # (the tile count follows the size: the same size)
    }.get(engine.arch, IMAGES["square"])
    wide, square = await engine.encode([IMAGES["wide"], other])
    assert wide.n_tokens == square.n_tokens
    ids_wide, _, _ = await _run(engine, messages, [wide])
    ids_square, _, _ = await _run(engine, messages, [square])
    assert ids_wide != ids_square
    assert _hf_generate(engine, messages, [IMAGES["wide"]]) != ids_square


async def test_qwen3_vl_deepstack_features_are_load_bearing(model_dirs):
    """Qwen3-VL's deepstack features travel in the feature tensor's last columns and reach the LM:
    zeroing them alone changes the tokens (on a white image: the tiny build's LM barely looks at a
    noise image), and features without them are refused by shape."""
    engine = TransformersEngine(model_dirs["qwen3_vl"], threads=1)
    try:
        messages, _ = CASES["one-image"]
        white = Image.new("RGB", (64, 48), "white")
        (item,) = await engine.encode([white])
        hidden = engine.hidden_size
        assert item.features.shape[1] == 3 * hidden
        good, _, _ = await _run(engine, messages, [item])
        zeroed = item.features.clone()
        zeroed[:, hidden:] = 0
        bad, _, _ = await _run(engine, messages, [EncodedImage(zeroed, item.grid_thw)])
        assert bad != good
        with pytest.raises(InvalidRequest, match=rf"expected \[n_tokens, {3 * hidden}\]"):
            await _run(engine, messages, [EncodedImage(item.features[:, :hidden].contiguous(), item.grid_thw)])
    finally:
        await engine.aclose()


async def test_mrope_delta_matters(qwen):
    """Decoding with rope_delta forced to 0 gives different tokens: the offset is load-bearing."""
    messages, names = CASES["two-images"]
    encoded = await qwen.encode([IMAGES[n] for n in names])
    request = await qwen.prefill(messages, encoded, GREEDY)
    assert request.state.rope_delta < 0
    good = [request.first.token_id] + [e.token_id for e in await _drain(request.continue_here())]
    bad_request = await qwen.prefill(messages, encoded, GREEDY)
    bad_request.state.rope_delta = 0
    bad = [bad_request.first.token_id] + [e.token_id for e in await _drain(bad_request.continue_here())]
    assert good[0] == bad[0]  # the first token comes from prefill
    assert good != bad


async def test_features_roundtrip_through_safetensors_bytes(engine):
    from safetensors.torch import load, save

    messages, names = CASES["two-images"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    blobs = [save({"features": e.features}) for e in encoded]
    restored = [EncodedImage(features=load(b)["features"], grid_thw=e.grid_thw) for b, e in zip(blobs, encoded)]
    assert all(torch.equal(a.features, b.features) for a, b in zip(encoded, restored))
    assert (await _run(engine, messages, encoded))[0] == (await _run(engine, messages, restored))[0]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)])
async def test_decode_state_roundtrip_through_safetensors_bytes(engine, sampling):
    """Prefill in one place, serialize the state, decode elsewhere (the engine's decode of a KV
    object): same tokens and text."""
    from safetensors.torch import load, save

    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    direct_ids, direct_text, _ = await _run(engine, messages, encoded, sampling)

    request = await engine.prefill(messages, encoded, sampling)
    tensors, meta = request.state.to_tensors()
    await request.release()
    blob = save(tensors, metadata=meta)
    restored = DecodeState.from_tensors(load(blob), _safetensors_metadata(blob), engine.config)
    assert restored.output_ids == [request.first.token_id] and restored.emitted == 1
    events = [request.first] + await _drain(
        engine.decode(_kv_object(load(blob), _safetensors_metadata(blob)), sampling)
    )
    assert [e.token_id for e in events] == direct_ids
    assert "".join(e.text for e in events) == direct_text


async def test_export_is_the_decode_state(engine):
    """export() gives the state's tensors as raw tensors + its metadata (the KV object's payload)."""
    messages, names = CASES["one-image"]
    request = await engine.prefill(messages, await engine.encode([IMAGES[n] for n in names]), GREEDY)
    raw, meta = await request.export()
    tensors, want_meta = request.state.to_tensors()
    assert meta == want_meta and set(raw) == set(tensors)
    assert all(raw[n] == RawTensor(*tensor_to_raw(t)) for n, t in tensors.items())
    await request.release()
    await request.release()  # twice is fine
    with pytest.raises(EngineError):
        await request.export()


def _safetensors_metadata(blob: bytes) -> dict[str, str]:
    import struct

    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n])["__metadata__"]


async def test_decode_state_rejects_wrong_layer_count(engine):
    messages, names = CASES["one-image"]
    request = await engine.prefill(messages, await engine.encode([IMAGES[n] for n in names]), GREEDY)
    tensors, meta = request.state.to_tensors()
    tensors.pop("kv.0.k")
    with pytest.raises(EngineError):
        DecodeState.from_tensors(tensors, meta, engine.config)
    # The engine's decode refuses it before any token.
    events = engine.decode(_kv_object(tensors, meta), GREEDY)
    with pytest.raises(KVStateMismatch):
        await events.__anext__()


async def test_seeded_sampling_is_reproducible(engine):
    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    params = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = (await _run(engine, messages, encoded, params))[0]
    b = (await _run(engine, messages, encoded, params))[0]
    c = (await _run(engine, messages, encoded, replace(params, seed=4321)))[0]
    greedy = (await _run(engine, messages, encoded))[0]
    assert a == b
    assert a != c
    assert a != greedy
    # seed=None draws a fresh random seed per request
    d = (await _run(engine, messages, encoded, replace(params, seed=None)))[0]
    e = (await _run(engine, messages, encoded, replace(params, seed=None)))[0]
    assert d != e


async def test_tiny_top_p_is_greedy(engine):
    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    nucleus = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    assert (await _run(engine, messages, encoded, nucleus))[0] == (await _run(engine, messages, encoded))[0]


async def test_stop_strings_truncate(engine):
    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    ids, full_text, _ = await _run(engine, messages, encoded)
    assert len(full_text) >= 8, full_text
    stop = full_text[4:7]
    expected = full_text[: full_text.index(stop)]
    ids2, text2, events = await _run(engine, messages, encoded, replace(GREEDY, stop=("\x00never\x00", stop)))
    assert text2 == expected
    assert events[-1].finish_reason == "stop"
    assert ids2 == ids[: len(ids2)] and len(ids2) < len(ids)
    # A stop string that never appears changes nothing.
    ids3, text3, events3 = await _run(engine, messages, encoded, replace(GREEDY, stop=("\x00never\x00",)))
    assert (ids3, text3, events3[-1].finish_reason) == (ids, full_text, "length")


async def test_eos_stops_unless_ignored(engine):
    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    ids, _, _ = await _run(engine, messages, encoded)
    saved = engine.eos_token_ids
    try:
        # Pretend the 4th generated token is EOS.
        engine.eos_token_ids = frozenset({ids[3]})
        k = ids.index(ids[3])
        stopped, _, events = await _run(engine, messages, encoded, replace(GREEDY, ignore_eos=False))
        assert stopped == ids[: k + 1] and events[-1].finish_reason == "stop"
        kept, _, _ = await _run(engine, messages, encoded, GREEDY)
        assert kept == ids
    finally:
        engine.eos_token_ids = saved


async def test_max_tokens_one(engine):
    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    ids, text, events = await _run(engine, messages, encoded, replace(GREEDY, max_tokens=1))
    assert len(events) == 1 and events[0].finish_reason == "length"
    assert ids == (await _run(engine, messages, encoded))[0][:1]


async def test_closing_generate_early_stops_generation(engine):
    """A long generation closed after 2 tokens (or whose task is cancelled) stops: no further
    steps run for it, and the engine serves the next request promptly."""
    messages, names = CASES["one-image"]
    encoded = await engine.encode([IMAGES[n] for n in names])
    t0 = time.perf_counter()
    ids, _, _ = await _run(engine, messages, encoded, replace(GREEDY, max_tokens=8))
    eight_tokens_s = time.perf_counter() - t0

    long = replace(GREEDY, max_tokens=200)
    stats = GenerationStats()
    t0 = time.perf_counter()
    events = engine.generate(messages, encoded, long, stats)
    got = [await events.__anext__(), await events.__anext__()]
    await events.aclose()
    assert [e.token_id for e in got] == ids[:2]
    # The next request runs right away (nothing of the long one is queued in front of it) ...
    assert (await _run(engine, messages, encoded, replace(GREEDY, max_tokens=8)))[0] == ids
    assert time.perf_counter() - t0 < 20 * eight_tokens_s + 5
    # ... and the closed generation never stepped again.
    assert stats.completion_tokens == 2

    # Cancelling the task that iterates stops it too.
    stats = GenerationStats()
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(messages, encoded, long, stats):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    n = stats.completion_tokens
    assert n < 200
    assert (await _run(engine, messages, encoded, replace(GREEDY, max_tokens=8)))[0] == ids
    assert stats.completion_tokens <= n + 1  # at most the step that was in flight


async def test_placeholder_count_mismatch_raises(engine):
    one = CASES["one-image"][0]
    two = CASES["two-images"][0]
    encoded = await engine.encode([IMAGES["wide"], IMAGES["square"]])
    assert media_kinds(two) == ["image", "image"]
    assert media_kinds([{"role": "user", "content": "hi"}]) == []
    with pytest.raises(InvalidRequest):
        check_media(one, ["image", "image"])
    with pytest.raises(InvalidRequest):
        await _drain(engine.generate(one, encoded, GREEDY))
    with pytest.raises(InvalidRequest):
        await _drain(engine.generate(two, encoded[:1], GREEDY))
    with pytest.raises(InvalidRequest):
        await _drain(engine.generate([{"role": "user", "content": "no image"}], encoded[:1], GREEDY))
    # An image token typed as text is not an image slot.
    token = PLACEHOLDER.get(engine.arch, "<|image_pad|>")
    with pytest.raises(InvalidRequest):
        await _drain(engine.generate([_user(_text(f"look {token}"))], [], GREEDY))


async def test_bad_inputs_raise_clear_errors(engine):
    messages = CASES["one-image"][0]
    good = (await engine.encode([IMAGES["wide"]]))[0]
    h = engine.feature_width
    bad_items = [
        EncodedImage(features=torch.zeros(good.n_tokens, h + 1), grid_thw=good.grid_thw),  # wrong width
        EncodedImage(features=torch.zeros(good.n_tokens + 1, h), grid_thw=good.grid_thw),  # wrong count
        EncodedImage(features=torch.zeros(good.n_tokens, h, dtype=torch.long), grid_thw=good.grid_thw),
        EncodedImage(features=torch.full((good.n_tokens, h), float("nan")), grid_thw=good.grid_thw),
        EncodedImage(features=torch.zeros(h), grid_thw=good.grid_thw),
    ]
    if engine.arch in GRID_ARCHS:
        bad_items.append(EncodedImage(features=good.features, grid_thw=None))
        bad_items.append(EncodedImage(features=good.features, grid_thw=(1, 3, 3)))
    for item in bad_items:
        with pytest.raises(InvalidRequest):
            await _drain(engine.generate(messages, [item], GREEDY))
    for params in (
        replace(GREEDY, max_tokens=0),
        replace(GREEDY, temperature=-1.0),
        replace(GREEDY, top_p=0.0),
        replace(GREEDY, max_tokens=10**9),
    ):
        with pytest.raises(InvalidRequest):
            await _drain(engine.generate(messages, [good], params))
    with pytest.raises(UnsupportedContent):
        await _drain(engine.generate([_user({"type": "audio"})], [], GREEDY))
    with pytest.raises(InvalidRequest):
        await _drain(engine.generate([{"role": "wizard", "content": "hi"}], [], GREEDY))
    with pytest.raises(InvalidRequest):
        await _drain(engine.generate([], [], GREEDY))
    with pytest.raises(InvalidRequest):
        await engine.encode(["not an image"])  # type: ignore[list-item]  # the wrong type on purpose


async def test_text_only_prompt(engine):
    ids, text, events = await _run(engine, [{"role": "user", "content": "Hello there"}], [])
    assert len(ids) == N_TOKENS and events[-1].finish_reason == "length"


def test_identity_and_fingerprint(engine, model_dirs):
    folder = model_dirs[engine.arch]
    assert engine.name == "transformers"
    assert engine.model_id == folder.name
    assert engine.encoder_fingerprint == encoder_fingerprint(folder, dtype="float32", engine="transformers")
    # Controls: the fingerprint tells encoders apart (other weights, other dtype).
    other = model_dirs["llava" if engine.arch != "llava" else "qwen2_vl"]
    assert encoder_fingerprint(other, dtype="float32", engine="transformers") != engine.encoder_fingerprint
    assert encoder_fingerprint(folder, dtype="bfloat16", engine="transformers") != engine.encoder_fingerprint
    assert TransformersEngine.__init__.__kwdefaults__["threads"] == 1


async def test_options_and_aclose(model_dirs):
    from shared.config import DecodeSettings, EncoderSettings, PrefillSettings
    from shared.topology import Role

    settings = DecodeSettings(max_batch_size=3, encode_batch_invariant=False)
    assert TransformersEngine.options_from_settings(settings, role=Role.DECODE) == {
        "max_batch": 3,
        "encode_batch_invariant": False,
        "max_model_len": None,
    }
    for role, cls in ((Role.ENCODER, EncoderSettings), (Role.PD, PrefillSettings), (Role.PREFILL, PrefillSettings)):
        settings = cls(encode_batch_invariant=False, max_model_len=64)
        assert TransformersEngine.options_from_settings(settings, role=role) == {
            "encode_batch_invariant": False,
            "max_model_len": 64,  # EPD_MAX_MODEL_LEN: every role's engine serves the same context
        }
    assert TransformersEngine.options_from_settings(PrefillSettings(max_concurrent_jobs=5), role=Role.AGG) == {
        "max_batch": 5,
        "encode_batch_invariant": True,
        "max_model_len": None,
    }
    engine = TransformersEngine(model_dirs["llava"], threads=1, max_batch=3)
    assert engine._decode_loop.decoder.max_batch == 3
    assert len(await engine.encode([IMAGES["wide"]])) == 1
    # A generation in progress ends with an error when the engine closes under it.
    running = engine.generate([{"role": "user", "content": "hi"}], [], replace(GREEDY, max_tokens=200))
    await running.__anext__()
    await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        await _drain(running)
    await engine.aclose()  # idempotent
    assert engine._executor._shutdown  # the compute thread is gone
    with pytest.raises(EngineError, match="closed"):
        await engine.encode([IMAGES["wide"]])
    with pytest.raises(EngineError, match="closed"):
        await _drain(engine.generate([{"role": "user", "content": "hi"}], [], GREEDY))


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


def test_ids_decoder_is_the_backends_decode_only_where_transformers_would_call_it(model_dirs):
    """``ids_decoder``: the tokenizers backend's decode for the models' tokenizers (the same text as
    ``tokenizer.decode``); a tokenizer class with its own ``decode`` is called as it is."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs[ARCHS[0]])
    ids = list(range(100, 140)) + sorted(tok.all_special_ids)[:2]
    fast = ids_decoder(tok)
    assert fast(ids) == tok.decode(ids, skip_special_tokens=True) and fast(ids)
    assert getattr(fast, "__closure__", None) and tok.backend_tokenizer in [c.cell_contents for c in fast.__closure__]

    class Shouting(type(tok)):  # a model-specific tokenizer that post-processes its text
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    tok.__class__ = Shouting
    assert ids_decoder(tok)(ids) == fast(ids).upper() != fast(ids)


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


async def test_gemma3_context_stays_within_its_sliding_window(model_dirs, tmp_path):
    """Gemma 3's sliding-window layers: the engine serves a context up to the window (its caches are
    full layers, which equal sliding ones only within it), and says so when a request is longer."""
    import shutil

    folder = tmp_path / "gemma3-window-64"
    shutil.copytree(model_dirs["gemma3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["sliding_window"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    engine = TransformersEngine(folder, threads=1)
    try:
        assert engine.max_positions == 64 and "sliding window" in engine.max_positions_source
        messages = [{"role": "user", "content": "Hello there"}]
        ids, _, _ = await _run(engine, messages, [], replace(GREEDY, max_tokens=8))
        assert len(ids) == 8
        with pytest.raises(InvalidRequest, match=r"maximum context length is 64 tokens \(the sliding window"):
            await _run(engine, messages, [], replace(GREEDY, max_tokens=60))
    finally:
        await engine.aclose()
    # Control: the tiny build's own window (4096) is its max_position_embeddings: no lower limit.
    own = TransformersEngine(model_dirs["gemma3"], threads=1)
    assert own.max_positions == 4096 and own.max_positions_source.startswith("max_position_embeddings")
    await own.aclose()
