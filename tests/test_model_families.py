"""Which families each engine serves (shared.families): a family not proven on an
engine is refused when the engine starts, naming the supported ones - before the engine loads
anything (vLLM is not started: its folders are not even made)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shared.errors import EngineError
from shared.families import SUPPORTED_FAMILIES, check_family, feature_width, model_type_of


def _folder(tmp_path: Path, model_type: str) -> Path:
    """A model folder that is only a config.json (what the check reads)."""
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_vllm_engine_refuses_an_unproven_family_before_starting_vllm(tmp_path):
    from shared.engines.vllm_engine import VllmEngine

    folder = _folder(tmp_path, "gemma3")
    work_dir = tmp_path / "vllm"
    supported = "['internvl', 'llava', 'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl']"
    message = f"unsupported model_type 'gemma3' for the vllm engine; supported: {supported}"
    with pytest.raises(EngineError, match=re.escape(message)):
        VllmEngine(folder, work_dir=work_dir)
    assert not work_dir.exists()  # refused before vLLM's folders (and vLLM) were set up


@pytest.mark.parametrize("model_type", ["llava_onevision", "idefics3"])
def test_transformers_engine_refuses_what_it_does_not_serve(tmp_path, model_type):
    from shared.engines.transformers_engine import TransformersEngine

    folder = _folder(tmp_path, model_type)
    supported = "['gemma3', 'internvl', 'llava', 'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl']"
    message = f"unsupported model_type {model_type!r} for the transformers engine; supported: {supported}"
    with pytest.raises(EngineError, match=re.escape(message)):
        TransformersEngine(folder)


def test_supported_families_per_engine():
    assert SUPPORTED_FAMILIES == {
        "transformers": ("gemma3", "internvl", "llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
        "vllm": ("internvl", "llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
    }


def test_every_family_served_on_vllm_has_its_equality_test():
    """A family joins the vLLM list with its case in the equality test against a plain vLLM run."""
    from tests.test_vllm_families import FAMILIES

    assert set(SUPPORTED_FAMILIES["vllm"]) == set(FAMILIES)


def test_check_family_reads_the_folders_model_type(tmp_path):
    assert check_family("vllm", _folder(tmp_path, "qwen3_vl")) == "qwen3_vl"
    with pytest.raises(EngineError, match=r"supported: \[\]"):
        check_family("no-such-engine", tmp_path / "qwen3_vl")


def test_model_type_of_bad_folders(tmp_path):
    with pytest.raises(EngineError, match="no config.json"):
        model_type_of(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match="does not read as JSON"):
        model_type_of(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(EngineError, match="names no model_type"):
        model_type_of(tmp_path)


def test_the_transformers_list_is_its_family_modules():
    from shared.engines.families import TRANSFORMERS_FAMILIES

    assert SUPPORTED_FAMILIES["transformers"] == tuple(sorted(TRANSFORMERS_FAMILIES))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3", "internvl"])
def test_feature_width_is_what_the_engine_encodes(tmp_path, family):
    """shared.families.feature_width (what the vLLM EC connector checks objects against) is the
    width of the transformers engine's features - and of vLLM's Qwen3-VL cache (96 x 3, seen)."""
    from PIL import Image

    from shared.engines.transformers_engine import TransformersEngine
    from shared.tools.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / family, arch=family, seed=0)
    width = feature_width(json.loads((folder / "config.json").read_text()))
    hidden = json.loads((folder / "config.json").read_text()).get("text_config", {}).get("hidden_size")
    assert width == 3 * hidden if family == "qwen3_vl" else width == hidden
    engine = TransformersEngine(folder, threads=1)
    try:
        (item,) = engine._encode([Image.new("RGB", (56, 56), "white")])
        assert item.features.shape[1] == width == engine.feature_width
    finally:
        engine._executor.shutdown()


def test_video_is_served_only_where_a_test_holds_it():
    """The API asks ``check_video`` before fetching a video: a family or engine without video is
    a 400 naming where video is served (the families in tests/test_video_engine.py and
    tests/test_video_stack.py)."""
    from shared.errors import UnsupportedContent
    from shared.families import VIDEO_FAMILIES, check_video
    from tests.test_video_engine import FAMILIES as ENGINE_VIDEO_FAMILIES
    from tests.test_vllm_families import FAMILIES as VLLM_FAMILIES

    assert set(VIDEO_FAMILIES["transformers"]) == set(ENGINE_VIDEO_FAMILIES)
    # (test_vllm_families holds each vLLM family's video against a plain vLLM run, or its refusal)
    assert set(VIDEO_FAMILIES["vllm"]) <= set(VLLM_FAMILIES)
    check_video("transformers", "qwen2_vl")
    check_video("vllm", "qwen2_5_vl")
    for engine, family in (("transformers", "llava"), ("transformers", "gemma3"), ("vllm", "internvl")):
        with pytest.raises(UnsupportedContent, match=f"{family} on the {engine} engine"):
            check_video(engine, family)
