"""Which families each engine serves (shared.engines.families): a family not proven on an
engine is refused when the engine starts, naming the supported ones - before the engine loads
anything (vLLM is not started: its folders are not even made)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shared.engines.families import SUPPORTED_FAMILIES, check_family, model_type_of
from shared.errors import EngineError


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
    supported = "['llava', 'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl']"
    message = f"unsupported model_type 'gemma3' for the vllm engine; supported: {supported}"
    with pytest.raises(EngineError, match=re.escape(message)):
        VllmEngine(folder, work_dir=work_dir)
    assert not work_dir.exists()  # refused before vLLM's folders (and vLLM) were set up


@pytest.mark.parametrize("model_type", ["gemma3", "internvl"])
def test_transformers_engine_refuses_what_it_does_not_serve(tmp_path, model_type):
    from shared.engines.transformers_engine import TransformersEngine

    folder = _folder(tmp_path, model_type)
    supported = "['llava', 'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl']"
    message = f"unsupported model_type {model_type!r} for the transformers engine; supported: {supported}"
    with pytest.raises(EngineError, match=re.escape(message)):
        TransformersEngine(folder)


def test_supported_families_per_engine():
    assert SUPPORTED_FAMILIES == {
        "transformers": ("llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
        "vllm": ("llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
    }


def test_every_family_served_on_vllm_has_its_equality_test():
    """A family joins the vLLM list with its case in the equality test (Qwen2-VL: the tiny model of
    the other tests/test_vllm_*.py)."""
    from tests.test_vllm_families import FAMILIES

    assert set(SUPPORTED_FAMILIES["vllm"]) == {"qwen2_vl", *FAMILIES}


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
