"""Engine registry: short name -> dotted class path, imported only when asked for.

Keeps torch (and later vLLM) out of processes that never build an engine, such as the API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.engines.base import Engine

ENGINES: dict[str, str] = {
    "transformers": "shared.engines.transformers_engine:TransformersEngine",
    "vllm": "shared.engines.vllm_engine:VllmEngine",
}


def engine_class(name: str) -> type["Engine"]:
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def make_engine(name: str, model_dir: Any, **kwargs: Any) -> "Engine":
    return engine_class(name)(model_dir, **kwargs)
