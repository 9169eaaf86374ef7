"""Which model families each engine serves: the one list, and the start-up check that refuses
any other family.

A family is the ``model_type`` of the model folder's ``config.json``. A family is listed for an
engine only once an equality test proves it there (greedy tokens equal to a reference that uses
none of the project's code; see ``docs/models.md`` for the support matrix and the tests behind
each cell). Every other family is refused when the engine starts, naming what is supported: an
engine that loads a family it was never checked on can answer with wrong tokens and no error.

On the transformers engine a family is also a module of this package behind one interface
(:class:`shared.engines.families.base.VisionFamily`): :data:`TRANSFORMERS_FAMILIES` names it,
:func:`family_class` finds it. This module itself imports neither torch nor transformers (the
CLI checks a folder with it before anything starts).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import EngineError

if TYPE_CHECKING:
    from shared.engines.families.base import VisionFamily

#: ``model_type`` -> the transformers engine's family (``module:class`` in this package)
TRANSFORMERS_FAMILIES: dict[str, str] = {
    "llava": "llava:Llava",
    "qwen2_5_vl": "qwen_vl:Qwen25VL",
    "qwen2_vl": "qwen_vl:Qwen2VL",
    "qwen3_vl": "qwen3_vl:Qwen3VL",
}

#: engine name -> the ``model_type`` values it serves
SUPPORTED_FAMILIES: dict[str, tuple[str, ...]] = {
    "transformers": tuple(sorted(TRANSFORMERS_FAMILIES)),
    "vllm": ("llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"),
}


def model_type_of(model_dir: str | Path) -> str:
    """The ``model_type`` in ``model_dir``'s ``config.json`` (read as JSON: nothing is imported)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineError(f"no config.json in model folder {model_dir}") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path} does not read as JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise EngineError(f"{path} names no model_type")
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


def family_class(model_type: str) -> type[VisionFamily]:
    """The transformers engine's family of ``model_type`` (one :func:`check_family` accepted for
    the transformers engine); it imports torch and transformers."""
    module, name = TRANSFORMERS_FAMILIES[model_type].split(":")
    family: type[VisionFamily] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return family
