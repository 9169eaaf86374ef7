"""The model identity of a process: which model it serves and the versions of what it stores.

One :class:`ModelIdentity` per process, built once and handed to what needs it (the API's store,
handlers, the EC lifecycle's fingerprint registry, the vLLM connectors), so the fingerprints are
computed in one place (:mod:`shared.fingerprint`) and never twice:

* the API and the model workers: :meth:`ModelIdentity.from_settings` (``EPD_MODEL_PATH``,
  ``EPD_DTYPE``, ``EPD_ENGINE``, the served model name);
* an engine: its ``identity`` (what it loaded, in its dtype, under its name);
* the vLLM connectors in vLLM's processes: ``shared.connectors.common.vllm_identity`` (the
  folder and dtype vLLM loaded, engine ``vllm``).

Each fingerprint is computed on first use and kept: the encoder fingerprint (EC object keys)
reads the vision-tower weights, the model fingerprint (KV object keys) every weight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.fingerprint import encoder_fingerprint, model_fingerprint

if TYPE_CHECKING:
    from shared.config import ModelSettings


@dataclass(frozen=True)
class ModelIdentity:
    """A served model: its name, folder, compute dtype and engine, and the fingerprints of those."""

    #: the model name served (``/v1/models``, ``GenerationJob.model``)
    model: str
    #: the local model folder the fingerprints are computed from
    model_path: Path
    #: compute dtype (``EPD_DTYPE`` spelling: ``float32``, ``bfloat16``, ...)
    dtype: str
    #: engine kind (``transformers``, ``vllm``)
    engine: str

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> ModelIdentity:
        """The identity a process configured by ``settings`` serves (raises ValueError without
        ``EPD_MODEL_PATH``)."""
        return cls(
            model=settings.served_model_name(),
            model_path=settings.require_model_path(),
            dtype=settings.dtype,
            engine=settings.engine,
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """The encoder fingerprint: the version of EC objects (``shared.fingerprint.encoder_fingerprint``)."""
        return encoder_fingerprint(self.model_path, dtype=self.dtype, engine=self.engine)

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """The model fingerprint: the version of KV objects (``shared.fingerprint.model_fingerprint``;
        reads every weight byte once)."""
        return model_fingerprint(self.model_path, dtype=self.dtype, engine=self.engine)

    def describe(self) -> str:
        """For logs: ``<model> (<engine>, <dtype>, encoder fingerprint <fp>)``."""
        return f"{self.model} ({self.engine}, {self.dtype}, encoder fingerprint {self.fingerprint})"
