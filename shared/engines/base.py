"""Engine contract shared by every model backend (transformers today, vLLM later).

An engine owns one loaded vision-language model and exposes the three EPD stages as plain,
synchronous, thread-confined calls. Workers run them in a dedicated executor thread so the
asyncio event loop (NATS heartbeats, acks) never blocks on model compute.

Contract:
* ``encode`` turns decoded RGB images into :class:`EncodedImage` items. The features of one
  image depend only on that image (not on the batch it came in), so the encoder worker and a
  prefill worker that encodes locally produce identical tensors.
* ``generate`` consumes chat messages whose image parts are placeholders (in order) plus one
  :class:`EncodedImage` per placeholder, and yields :class:`TokenEvent` items. With greedy
  sampling the token ids equal ``transformers``' own ``generate()`` on the same inputs.
* The engine is not thread-safe: one caller thread at a time.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:  # keep torch / PIL out of modules that only need the types
    import torch
    from PIL import Image


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI semantics). ``temperature == 0`` means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class EncodedImage:
    """Encoder output for one image: LM-width features plus the layout the prompt needs.

    ``features`` is ``[n_tokens, hidden]``; ``grid_thw`` is the (t, h, w) patch grid for
    models with M-RoPE (Qwen2-VL), ``None`` for models with 1-D positions (LLaVA).
    """

    features: "torch.Tensor"
    grid_thw: tuple[int, int, int] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.features.shape[0])


@dataclass(frozen=True)
class MediaImage:
    """An image for engines whose encoder outputs travel through their own EC connector
    (``Engine.features_via_connector``): the decoded RGB image and its content hash, which is
    the item part of the EC key (``shared.media.content_hash_of``)."""

    image: "Image.Image"
    item_hash: str


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the newly decodable text (may be empty mid-codepoint).

    The last event of a generation has ``finish_reason`` set ("stop" or "length").
    """

    token_id: int
    text: str
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """A loaded model. Subclasses register in :mod:`shared.engines` under a short name."""

    name: str = "base"
    #: False (transformers): encoder outputs pass through the worker - ``encode`` returns them
    #: and ``generate`` takes :class:`EncodedImage` items. True (vLLM): they move through the
    #: engine's own EC connector and the store - :meth:`produce` stores them and ``generate``
    #: takes :class:`MediaImage` items (the engine loads or, failing that, encodes them itself).
    features_via_connector: bool = False
    #: False (transformers): E|P|D hands the decode state over through the worker (``prefill`` /
    #: ``decode`` / a KV object it writes). True (vLLM): through the engine's own KV connector and
    #: the store - ``prefill_for_handoff`` stores it and ``generate(..., kv_params=...)`` loads it.
    kv_via_connector: bool = False
    #: ``generate`` / ``produce`` may run in several threads at once (the engine batches them);
    #: False: one caller thread at a time.
    concurrent: bool = False

    @classmethod
    def options_from_settings(cls, settings: Any, *, role: str) -> dict[str, Any]:
        """Engine-specific constructor options from the worker's settings (``role``: the worker
        role, e.g. "encoder", "pd", "agg"). The default engine needs none."""
        return {}

    @property
    @abc.abstractmethod
    def model_id(self) -> str:
        """The model name served (``/v1/models``)."""

    @property
    @abc.abstractmethod
    def encoder_fingerprint(self) -> str:
        """Version of the encoder outputs this engine produces and accepts (see shared.fingerprint)."""

    @abc.abstractmethod
    def encode(self, images: Sequence["Image.Image"]) -> list[EncodedImage]:
        """Run the vision encoder (+ projector) on RGB images, one item per image."""

    @abc.abstractmethod
    def generate(
        self,
        messages: list[dict[str, Any]],
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> Iterator[TokenEvent]:
        """Prefill + decode. ``messages`` use OpenAI roles; content is a string or a list of
        ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts. Yields tokens as they
        are produced; fills ``stats`` if given."""

    def produce(self, images: Sequence[MediaImage]) -> list[int]:
        """Connector engines: run the encoder on each image and have the EC connector store the
        output under its item hash. Returns the feature token count per image."""
        raise NotImplementedError(f"the {self.name} engine passes encoder outputs through the worker")

    def close(self) -> None:  # pragma: no cover - default no-op
        """Release resources."""
