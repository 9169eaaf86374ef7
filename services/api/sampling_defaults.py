"""The model's sampling defaults: what a request that leaves a sampling field out gets.

vLLM's OpenAI server (``--generation-config auto``, its default) takes every sampling field a
request leaves out from the model folder's ``generation_config.json`` - the fields
``vllm.config.ModelConfig.get_diff_sampling_param`` lists, ``max_new_tokens`` as ``max_tokens`` -
and OpenAI's default only where the file has none. A checkpoint's file carries its authors'
choice: Qwen2-VL's and Qwen2.5-VL's Instruct checkpoints ship ``repetition_penalty: 1.05`` (with
``top_k: 1``), so a request with only ``temperature: 0`` is penalised on a plain vLLM server. The
API resolves them here, once, for both engines: a job carries every field explicitly, and the
engines never read the file themselves (the transformers engine would not apply it, the vLLM
engine's ``SamplingParams`` take no defaults from it).

``EPD_GENERATION_CONFIG`` chooses the source as vLLM's ``--generation-config`` does: ``auto`` (the
model folder's file, else the generation fields of its ``config.json``), ``vllm`` (none: OpenAI's
defaults), or a folder holding a ``generation_config.json``. Read as JSON, without transformers
(the API imports no torch at start-up); transformers' ``GenerationConfig`` has no defaults of its
own for these fields (all ``None``), so its ``to_diff_dict`` - what vLLM reads - holds exactly the
values the file sets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from shared.errors import ConfigError

#: ``EPD_GENERATION_CONFIG`` values that are not a folder
AUTO = "auto"
NONE = "vllm"

#: generation_config field -> the request field it is the default of (vLLM's list)
FIELDS: dict[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """The model's default of each sampling field a request may leave out (None: OpenAI's)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    #: where they were read (for the start-up log and errors)
    source: str = ""

    def given(self) -> dict[str, Any]:
        """The fields the model sets (for the start-up log and ``/v1/models``-style reports)."""
        return {f: v for f in self.__struct_fields__ if f != "source" and (v := getattr(self, f)) is not None}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def load_sampling_defaults(model_dir: str | Path, generation_config: str = AUTO) -> SamplingDefaults:
    """The sampling defaults ``generation_config`` (``EPD_GENERATION_CONFIG``) gives for the model in
    ``model_dir``. Raises :class:`ConfigError` for a file that is not JSON, a folder without the file,
    or a value of the wrong type (a value out of a field's range is the API's check, at start-up)."""
    if generation_config == NONE:
        return SamplingDefaults(source="none (EPD_GENERATION_CONFIG=vllm)")
    if generation_config == AUTO:
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():  # (vLLM: GenerationConfig.from_model_config(config.json))
            path = Path(model_dir) / "config.json"
            if not path.is_file():
                return SamplingDefaults(source="none (no generation_config.json)")
    else:
        path = Path(generation_config) / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"EPD_GENERATION_CONFIG={generation_config}: no generation_config.json in that folder")
    data = _read(path)
    values = {ours: data[theirs] for theirs, ours in FIELDS.items() if data.get(theirs) is not None}
    try:
        return msgspec.convert({**values, "source": str(path)}, SamplingDefaults, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: a sampling default of the wrong type ({exc})") from None
