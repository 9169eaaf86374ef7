"""Which model families each engine serves - the one list, and the start-up check that refuses
any other family - plus the facts about a family that the layers below the engines need, read
from ``config.json`` alone (no torch, no transformers: the CLI, the API and the vLLM connectors
use them).

A family is the ``model_type`` of the model folder's ``config.json``. A family is listed for an
engine only once an equality test proves it there (greedy tokens equal to a reference that uses
none of the project's code; see ``docs/models.md`` for the support matrix and the tests behind
each cell). Every other family is refused when the engine starts, naming what is supported: an
engine that loads a family it was never checked on can answer with wrong tokens and no error.
On the transformers engine, a family is also a module of ``shared.engines.families``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.config import EngineKind
from shared.errors import EngineError, UnsupportedContent

#: engine name -> the ``model_type`` values it serves
SUPPORTED_FAMILIES: dict[str, tuple[str, ...]] = {
    EngineKind.TRANSFORMERS: ("gemma3", "internvl", "llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
    EngineKind.VLLM: ("internvl", "llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
}


#: engine name -> the families it serves video for (each held by a test: against transformers' own
#: ``generate`` on the same frames - tests/test_video_engine.py, tests/test_video_stack.py -, and
#: against a plain vLLM run on the file - tests/test_vllm_families.py)
VIDEO_FAMILIES: dict[str, tuple[str, ...]] = {
    EngineKind.TRANSFORMERS: ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
    EngineKind.VLLM: ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
}


#: engine name -> the families whose videos are encoded in segments (``EPD_VIDEO_SEGMENT_FRAMES``):
#: their vision tower attends within a temporal patch (Qwen2-VL and Qwen2.5-VL: ``cu_seqlens`` per
#: grid row, and Qwen2.5-VL's windows within it), so a segment's features are its part of the whole
#: video's (tests/test_video_segments.py; vLLM's towers as well, vllm/model_executor/models/qwen2_vl.py
#: and qwen2_5_vl.py). On the vLLM engine the PD worker joins the segments' EC objects into the video's
#: own for its connector (tests/test_vllm_families.py). Not Qwen3-VL, though its tower attends within a
#: temporal patch too (``cu_seqlens`` per frame, its learned position embedding interpolated per frame
#: grid: transformers' modeling_qwen3_vl.py ``Qwen3VLVisionModel.forward``, vLLM's qwen3_vl.py
#: ``prepare_encoder_metadata``): its video processor sizes every frame by the whole video's length
#: (``smart_resize(num_frames, ...)`` in video_processing_qwen3_vl.py: ``size``'s min and max pixels
#: are the video's budget over all its frames), so a segment encoded alone has another frame size -
#: another grid - than its part of the whole video (tests/test_video_segments.py
#: ``test_qwen3_vl_frame_size_depends_on_the_video_length``). Its joins are ready (deepstack columns,
#: the whole video's timestamps); what it lacks is a segment encoded at its video's frame size.
VIDEO_SEGMENT_FAMILIES: dict[str, tuple[str, ...]] = {
    EngineKind.TRANSFORMERS: ("qwen2_5_vl", "qwen2_vl"),
    EngineKind.VLLM: ("qwen2_5_vl", "qwen2_vl"),
}


def _video_processor_setting(model_dir: str | Path, name: str, kind: type) -> Any:
    """Setting ``name`` of the folder's video processor - ``video_preprocessor_config.json``, else the
    ``video_processor`` entry of ``processor_config.json`` - read as JSON; None when neither has it
    (as a ``kind``)."""
    folder = Path(model_dir)
    for file, section_key in (("video_preprocessor_config.json", None), ("processor_config.json", "video_processor")):
        path = folder / file
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise EngineError(f"{path} does not read as JSON: {exc}") from exc
        section = config.get(section_key) if section_key else config
        if isinstance(section, dict) and isinstance(section.get(name), kind):
            return section[name]
    return None


def video_temporal_patch(model_dir: str | Path) -> int:
    """Frames per temporal patch of the folder's video processor (``temporal_patch_size``; 1 when
    it says none)."""
    patch = _video_processor_setting(model_dir, "temporal_patch_size", int)
    return 1 if patch is None else int(patch)


def check_video(engine: str, model_type: str) -> None:
    """Raise :class:`UnsupportedContent` unless ``engine`` serves video for ``model_type`` (the
    API asks before it fetches a video: a 400 naming the families that take video)."""
    if model_type not in VIDEO_FAMILIES.get(engine, ()):
        served = list(VIDEO_FAMILIES.get(engine, ()))
        raise UnsupportedContent(
            f"this model ({model_type} on the {engine} engine) takes no video input; video is served for "
            f"{served or 'no family'} on the {engine} engine (docs/models.md)",
            param="messages",
        )


def video_processor_of(model_dir: str | Path) -> str | None:
    """The class name of the folder's video processor (``video_processor_type``); None when it has none."""
    name = _video_processor_setting(model_dir, "video_processor_type", str)
    return None if name is None else str(name)


def model_config_of(model_dir: str | Path) -> dict[str, Any]:
    """``model_dir``'s ``config.json`` (read as JSON: nothing is imported)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineError(f"no config.json in model folder {model_dir}") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path} does not read as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise EngineError(f"{path} is not a JSON object")
    return config


def model_type_of(model_dir: str | Path) -> str:
    """The ``model_type`` in ``model_dir``'s ``config.json``."""
    model_type = model_config_of(model_dir).get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise EngineError(f"{Path(model_dir) / 'config.json'} names no model_type")
    return model_type


def check_family(engine: str, model_dir: str | Path) -> str:
    """Return the family of ``model_dir`` when ``engine`` serves it, else raise
    :class:`EngineError` naming the families it does serve."""
    model_type = model_type_of(model_dir)
    supported = SUPPORTED_FAMILIES.get(engine, ())
    if model_type not in supported:
        raise EngineError(
            f"unsupported model_type {model_type!r} for the {engine} engine; supported: {list(supported)}"
            " (docs/models.md)"
        )
    return model_type


#: per family: the largest width:height (either way) its image processor takes, exclusive (the
#: Qwen-VL processors' ``smart_resize`` refuses 200:1 and beyond); families not named take any
MAX_ASPECT_RATIO: dict[str, float] = {"qwen2_vl": 200.0, "qwen2_5_vl": 200.0, "qwen3_vl": 200.0}


def max_aspect_ratio(model_type: str) -> float | None:
    """The family's limit on an image's aspect ratio (:data:`MAX_ASPECT_RATIO`), None for none.
    The API refuses an image beyond it (a 400 naming the limit) before any job is queued."""
    return MAX_ASPECT_RATIO.get(model_type)


def feature_width(config: Mapping[str, Any]) -> int:
    """Columns of one image's features (an EC object's second dimension) for a model of this
    ``config.json``: the LM's hidden size, times ``1 + k`` for Qwen3-VL's ``k`` deepstack layers
    (their features travel beside the main ones, vLLM's layout and the transformers engine's)."""
    text = config.get("text_config") or config
    hidden = int(text.get("hidden_size") or config["hidden_size"])
    deepstack = (config.get("vision_config") or {}).get("deepstack_visual_indexes") or ()
    return hidden * (1 + len(deepstack))
