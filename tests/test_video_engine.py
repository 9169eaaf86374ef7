"""Video on the transformers engine (issue 43, the engine's part): a video's sampled frames
(``shared.video``, vLLM's loader's frames) encoded by the family's video processor and vision
tower, placed at the video placeholder, with M-RoPE over its temporal patches (Qwen2.5-VL: over
their seconds). Greedy tokens equal transformers' own ``generate`` with the folder's processor on
the same frames (none of the project's code), for a video alone, a video beside an image, and two
videos; another clip gives other tokens (the negative control); a family without video refuses one.
Qwen3-VL (its own sampler, vLLM's Qwen3-VL loader's frames): each temporal patch written into the
prompt as its time in the source (``<t seconds>``, from the frames' indices and the source's rate),
its deepstack features beside the video's, each patch its own M-RoPE grid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engines.base import GenerationStats, SamplingParams, VideoFrames
from shared.errors import InvalidRequest
from shared.video import VideoSampler, VideoSampling, load_video
from tests.stackutil import noise_image, run_sync
from tests.test_video import write_clip

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _messages(text: str, kinds: list[str]) -> list[dict]:
    return [{"role": "user", "content": [*({"type": k} for k in kinds), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory) -> dict[str, bytes]:
    """Clips of noise frames: 3 s at 10 fps, another of the same size, and a 1 s one of another size."""
    root = tmp_path_factory.mktemp("clips")
    return {
        name: write_clip(root / f"{name}.mp4", frames, 10.0, size=size, seed=seed)
        for name, frames, size, seed in (("a", 30, (84, 56), 0), ("b", 30, (84, 56), 1), ("c", 10, (56, 84), 2))
    }


#: the family's sampler (vLLM's loader for its video processor)
SAMPLERS = {"qwen2_vl": VideoSampler.QWEN2_VL, "qwen2_5_vl": VideoSampler.QWEN2_VL, "qwen3_vl": VideoSampler.QWEN3_VL}


@pytest.fixture(scope="module")
def clips(family, clip_files) -> dict[str, object]:
    """The clips sampled for the family (its loader: 2 frames a second, at least 4): "a" 6 frames
    (3 temporal patches, 1 s each), "c" 4 (2 patches of 0.5 s - Qwen2.5-VL's temporal positions then
    differ from the 1 s a patch transformers assumes without it). Qwen3-VL's loader spreads them
    over the source (a: frames 0, 6, 12, 17, 23, 29 - patches at 0.3, 1.45 and 2.6 s)."""
    out = {name: load_video(data, SAMPLERS[family[0]], VideoSampling()) for name, data in clip_files.items()}
    assert len(out["a"].indices) == 6 and len(out["c"].indices) == 4 and out["c"].sampled_fps == 4.0
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from shared.engines.transformers_engine import TransformersEngine
    from shared.tools.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny", seed=0)
    engine = TransformersEngine(path, dtype="float32")
    try:
        yield request.param, path, engine
    finally:
        run_sync(engine.aclose())


def _hf_tokens(path: Path, text: str, kinds: list[str], images, videos, max_tokens: int = MAX_TOKENS) -> list[int]:
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig
    from transformers.video_utils import VideoMetadata

    torch.set_num_threads(1)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(_messages(text, kinds), add_generation_prompt=True, tokenize=False)
    metadata = [
        VideoMetadata(total_num_frames=v.info.total_frames, fps=v.info.fps, frames_indices=list(v.indices))
        for v in videos
    ]
    inputs = processor(
        text=prompt,
        images=images or None,
        videos=[v.frames for v in videos] or None,
        video_metadata=metadata or None,
        do_sample_frames=False,
        return_tensors="pt",
    )
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ids = model.generate(**inputs, generation_config=config)
    return ids[0, inputs["input_ids"].shape[1] :].tolist()


def _ours(engine, text: str, kinds: list[str], images, videos) -> list[int]:
    async def run():
        encoded_images = iter(await engine.encode(images))
        encoded_videos = iter(await engine.encode_videos([VideoFrames.of(v) for v in videos]))
        items = [next(encoded_videos) if k == "video" else next(encoded_images) for k in kinds]
        return [e.token_id async for e in engine.generate(_messages(text, kinds), items, GREEDY, GenerationStats())]

    return run_sync(run())


CASES = {
    "video": ("Describe the video.", ["video"], [], ["a"]),
    "image-then-video": ("Compare the picture and the clip.", ["image", "video"], [noise_image(5, (56, 56))], ["c"]),
    "two-videos": ("Compare these clips.", ["video", "video"], [], ["c", "a"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_video_tokens_equal_transformers_generate(family, clips, case):
    name, path, engine = family
    text, kinds, images, names = CASES[case]
    videos = [clips[n] for n in names]
    want = _hf_tokens(path, text, kinds, images, videos)
    assert len(want) == MAX_TOKENS
    assert _ours(engine, text, kinds, images, videos) == want, (name, case)


def test_another_clip_gives_other_tokens(family, clips):
    _, path, engine = family
    a = _ours(engine, "Describe the video.", ["video"], [], [clips["a"]])
    b = _ours(engine, "Describe the video.", ["video"], [], [clips["b"]])
    assert a != b


def test_the_video_is_its_temporal_patches(family, clips):
    """The features are the clip's: 6 frames make 3 temporal patches (Qwen-VL's 2 a patch), at
    the sampled rate (2 fps)."""
    _, _, engine = family
    (item,) = run_sync(engine.encode_videos([VideoFrames.of(clips["a"])]))
    assert item.kind == "video" and item.grid_thw[0] == 3
    assert item.n_tokens == item.grid_thw[0] * item.grid_thw[1] * item.grid_thw[2] // 4
    assert item.fps == 2.0


def test_a_family_without_video_refuses_one(tmp_path, clip_files):
    from shared.engines.transformers_engine import TransformersEngine
    from shared.tools.models.tiny import build_tiny_model

    clips = {"a": load_video(clip_files["a"], VideoSampler.QWEN2_VL, VideoSampling())}
    folder = build_tiny_model(tmp_path / "llava", arch="llava", size="tiny", seed=0)
    engine = TransformersEngine(folder, dtype="float32")
    try:
        with pytest.raises(InvalidRequest, match="takes no video"):
            run_sync(engine.encode_videos([VideoFrames(clips["a"].frames, clips["a"].sampled_fps)]))
    finally:
        run_sync(engine.aclose())


def test_video_parts_must_match_the_items(family, clips):
    _, _, engine = family
    (image,) = run_sync(engine.encode([noise_image(5, (56, 56))]))

    async def run():
        return [e async for e in engine.generate(_messages("hi", ["video"]), [image], GREEDY, GenerationStats())]

    with pytest.raises(InvalidRequest, match=r"media parts \['video'\] but the items given are \['image'\]"):
        run_sync(run())


@pytest.mark.parametrize("case", ["image-then-video", "two-videos"])
def test_video_positions_equal_transformers(family, clips, case):
    """The prefill's M-RoPE positions equal the model's own ``get_rope_index`` on the processor's
    inputs (its ``second_per_grid_ts`` included): greedy tokens of a tiny model can miss a
    temporal position that is off (Qwen2.5-VL's seconds per patch), this cannot."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    name, path, engine = family
    text, kinds, images, names = CASES[case]
    videos = [clips[n] for n in names]
    processor = AutoProcessor.from_pretrained(path)
    prompt = processor.apply_chat_template(_messages(text, kinds), add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=prompt,
        images=images or None,
        videos=[v.frames for v in videos],
        video_metadata=[
            VideoMetadata(total_num_frames=v.info.total_frames, fps=v.info.fps, frames_indices=list(v.indices))
            for v in videos
        ],
        do_sample_frames=False,
        return_tensors="pt",
    )
    extra = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}
    want, want_delta = engine.model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs["video_grid_thw"],
        **extra,
    )

    async def items():
        encoded_images = iter(await engine.encode(images))
        encoded_videos = iter(await engine.encode_videos([VideoFrames.of(v) for v in videos]))
        return [next(encoded_videos) if k == "video" else next(encoded_images) for k in kinds]

    encoded = run_sync(items())
    ids = engine.build_prompt_ids(_messages(text, kinds), encoded)
    assert ids == inputs["input_ids"][0].tolist()
    positions, delta = engine.family.prefill_positions(torch.tensor([ids]), encoded)
    assert torch.equal(positions[1:], want), name
    assert delta == int(want_delta.reshape(-1)[0])
