"""ModelIdentity: one owner of a process's model identity, with the fingerprints of shared.fingerprint."""

from __future__ import annotations

import dataclasses

import pytest

from shared.config import ApiSettings
from shared.fingerprint import encoder_fingerprint, model_fingerprint
from shared.identity import ModelIdentity


def test_from_settings_has_the_same_fingerprints(tiny_model_dir, monkeypatch):
    settings = ApiSettings(model_path=tiny_model_dir, dtype="float32", engine="transformers", model_name="tiny")
    identity = ModelIdentity.from_settings(settings.model)
    assert (identity.model, identity.model_path, identity.dtype, identity.engine) == (
        "tiny",
        tiny_model_dir,
        "float32",
        "transformers",
    )
    assert identity.fingerprint == encoder_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")
    assert identity.model_fingerprint == model_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")
    # computed once: a second read does not hash the folder again
    monkeypatch.setattr("shared.identity.encoder_fingerprint", lambda *a, **k: pytest.fail("recomputed"))
    assert identity.fingerprint == encoder_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")
    with pytest.raises(dataclasses.FrozenInstanceError):
        identity.dtype = "bfloat16"  # type: ignore[misc]  # the point: a frozen dataclass refuses it


def test_engine_and_dtype_are_part_of_the_identity(tiny_model_dir):
    base = ModelIdentity(model="m", model_path=tiny_model_dir, dtype="float32", engine="transformers")
    assert dataclasses.replace(base, engine="vllm").fingerprint != base.fingerprint
    assert dataclasses.replace(base, dtype="bfloat16").fingerprint != base.fingerprint
    assert dataclasses.replace(base, model="other name").fingerprint == base.fingerprint


def test_no_model_path_is_a_clear_error():
    with pytest.raises(ValueError, match="EPD_MODEL_PATH"):
        ModelIdentity.from_settings(ApiSettings(model_path=None).model)
