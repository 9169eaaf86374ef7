"""Engine registry: short name -> engine class (imported only when asked for), and the one check
of what a role needs from an engine.

Keeps torch and vLLM out of processes that never build an engine (the API, the CLI). A worker
calls :func:`check_role` before loading anything, so an unsupported role x engine combination
is refused at start-up with a clear message, then :func:`load_engine`.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import TYPE_CHECKING, Any

from shared.config import EngineKind
from shared.errors import EngineError
from shared.topology import Role

if TYPE_CHECKING:
    from shared.config import WorkerSettings
    from shared.engines.base import Engine

log = logging.getLogger(__name__)

ENGINES: dict[str, str] = {
    EngineKind.TRANSFORMERS: "shared.engines.transformers_engine:TransformersEngine",
    EngineKind.VLLM: "shared.engines.vllm_engine:VllmEngine",
}


def engine_class(name: str) -> type[Engine]:
    try:
        target = ENGINES[name]
    except KeyError:
        raise EngineError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _requirements(role: Role) -> list[tuple[str, tuple[type, ...]]]:
    """(what, any-of capability classes) a role needs from its engine."""
    from shared.engines import base

    features = (
        "encoder outputs that move through the worker or through its own EC connector",
        (base.FeaturesThroughWorker, base.FeaturesThroughConnector),
    )
    handoff = (
        "a KV hand-off from prefill to decode workers (through the worker or through its own KV connector)",
        (base.KVStateHandoff, base.KVConnectorHandoff),
    )
    if role in (Role.PREFILL, Role.DECODE):
        return [features, handoff]
    return [features]


def check_role(engine_cls: type[Engine], role: Role) -> None:
    """Refuse, before anything is loaded, an engine that cannot play ``role``."""
    for what, capabilities in _requirements(role):
        if not issubclass(engine_cls, capabilities):
            hint = (
                " E|P|D needs an engine with a KV hand-off; use the e-pd topology with this engine."
                if role in (Role.PREFILL, Role.DECODE)
                else ""
            )
            raise EngineError(
                f"the {engine_cls.name!r} engine cannot run the {role.value!r} role: it does not support {what}.{hint}"
            )


def make_engine(name: str, model_dir: Any, **kwargs: Any) -> Engine:
    return engine_class(name)(model_dir, **kwargs)


def load_engine(settings: WorkerSettings, role: Role) -> Engine:
    """The engine of ``settings.model.engine`` for ``role`` (blocking: call it off the event loop)."""
    model = settings.model
    cls = engine_class(model.engine)
    check_role(cls, role)
    model_dir = model.require_model_path()
    started = time.perf_counter()
    engine = cls(
        model_dir,
        dtype=model.dtype,
        threads=settings.runtime.torch_threads,
        model_id=model.served_model_name(),
        **cls.options_from_settings(settings, role=role),
    )
    log.info(
        "engine %s loaded %s for role %s in %.2fs (encoder fingerprint %s)",
        model.engine,
        model_dir,
        role.value,
        time.perf_counter() - started,
        engine.encoder_fingerprint,
    )
    return engine
