"""The model families of the transformers engine: one module each behind one interface
(:class:`shared.engines.families.base.VisionFamily`), found by ``model_type``. Which families an
engine serves, and the check at start-up, are :mod:`shared.families`'s."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engines.families.base import VisionFamily

#: ``model_type`` -> the transformers engine's family (``module:class`` in this package); the same
#: families as ``SUPPORTED_FAMILIES["transformers"]`` (tests/test_model_families.py)
TRANSFORMERS_FAMILIES: dict[str, str] = {
    "gemma3": "gemma3:Gemma3",
    "internvl": "internvl:InternVL",
    "llava": "llava:Llava",
    "qwen2_5_vl": "qwen_vl:Qwen25VL",
    "qwen2_vl": "qwen_vl:Qwen2VL",
    "qwen3_vl": "qwen3_vl:Qwen3VL",
}


def family_class(model_type: str) -> type[VisionFamily]:
    """The transformers engine's family of ``model_type`` (one ``check_family`` accepted for the
    transformers engine); it imports torch and transformers."""
    module, name = TRANSFORMERS_FAMILIES[model_type].split(":")
    family: type[VisionFamily] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return family
