"""The engine contract: what every model backend (transformers, vLLM) offers the workers.

An engine owns one loaded vision-language model. The workers see only this module:

* :class:`Engine` - every engine: ``generate`` is an **async iterator** of :class:`TokenEvent`;
  closing it early (``aclose()``, leaving an ``async for``, cancelling the task that iterates)
  stops the request inside the engine and frees its slot. Compute never runs on the caller's
  event loop: the engine owns its compute (the transformers engine a private thread, vLLM its
  own engine processes).
* **Capabilities** - small abstract mixins an engine class inherits, checked once at start-up
  (``shared.engines.check_role``), in the spirit of vLLM's ``SupportsHMA`` + ``supports_hma()``:

  - how encoder outputs move: :class:`FeaturesThroughWorker` (``encode`` returns features, the
    worker stores and loads them, ``generate`` takes :class:`EncodedImage` items) or
    :class:`FeaturesThroughConnector` (the engine's own EC connector stores and loads them,
    ``produce`` encodes into the store, ``generate`` takes :class:`MediaImage` items);
  - how E|P|D hands a request from prefill to decode: :class:`KVStateHandoff` (the decode
    state passes through the worker as tensors, the worker writes the KV object) or
    :class:`KVConnectorHandoff` (the engine's own KV connector writes and reads it).

  Workers choose their strategies from these once, in ``setup``; no handler asks which engine
  it runs.

Determinism: with greedy sampling the token ids equal ``transformers``' own ``generate()`` on
the same inputs, and the features of one image depend only on that image (not on its batch).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:  # keep torch / PIL out of modules that only need the types
    import torch
    from PIL import Image

    from shared.config import WorkerSettings
    from shared.connectors.params import KVHandoff
    from shared.identity import ModelIdentity
    from shared.protocol import ImageRef, StructuredOutput, TokenLogprob
    from shared.store.format import RawTensor
    from shared.store.kv import KVObject
    from shared.topology import Role
    from shared.video import SampledVideo


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings: the fields of ``shared.protocol.SamplingSpec`` (see there
    for their meaning; vLLM ``SamplingParams`` semantics). ``temperature == 0`` means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    #: the grammar the completion must follow (``shared.engines.grammar``); None: free text
    structured: StructuredOutput | None = None


@dataclass(frozen=True)
class RawPrompt:
    """A completions prompt, passed where a chat request passes its ``messages``: ``text`` used
    verbatim (no chat template; the tokenizer adds its usual special tokens, as vLLM's
    ``/v1/completions`` does) or ``token_ids`` used as they are. Exactly one is set; never images."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with the ``tools`` a request gives its chat template (vLLM passes a chat
    request's tools to ``apply_chat_template``: a template that supports tools describes them in
    the prompt). ``tools``: function definitions as vLLM hands them to the template
    (``{"type": "function", "function": {"name", "description", "parameters"[, "strict"]}}``).
    Plain ``messages`` (a list) stand for a chat prompt without tools."""

    messages: list[dict[str, Any]]
    tools: tuple[dict[str, Any], ...] = ()


#: what ``generate`` / ``prefill`` take as the prompt: chat messages (a list, or a
#: :class:`ChatPrompt` with tools) or a :class:`RawPrompt`
Prompt: TypeAlias = list[dict[str, Any]] | ChatPrompt | RawPrompt


@dataclass
class EncodedImage:
    """Encoder output for one media item - an image, or a video's sampled frames (``kind``) -:
    LM-width features plus the layout the prompt needs.

    ``features`` is ``[n_tokens, hidden]``; ``grid_thw`` is the (t, h, w) patch grid for
    models with M-RoPE (Qwen2-VL; a video's t counts its temporal patches), ``None`` for models
    with 1-D positions (LLaVA). ``fps``: a video's sampled rate (frames a second; the family
    derives its temporal positions from it, e.g. Qwen2.5-VL's seconds per temporal patch), None for
    an image. ``timestamps``: a video's time of each temporal patch in the source video (seconds),
    for a family that writes them into the prompt (Qwen3-VL's ``<t seconds>``), else None.
    """

    features: torch.Tensor
    grid_thw: tuple[int, int, int] | None = None
    kind: str = "image"  # a shared.protocol.MediaKind value
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.features.shape[0])


def join_segments(
    segments: Sequence[EncodedImage], fps: float, timestamps: tuple[float, ...] | None = None
) -> EncodedImage:
    """One video's features from its segments' (in order): their rows concatenated - every column,
    so Qwen3-VL's deepstack layers' features beside the main ones too -, their temporal patches
    added up (each segment's (t, h, w) grid has the video's h and w), at the video's sampled
    ``fps``, with the video's ``timestamps`` (the family's, from the whole video's metadata:
    :func:`video_metadata_of`; never the segments', whose EC objects are keyed by their pixels alone
    and may carry another video's times). Valid for a family whose vision tower attends within a
    temporal patch (``shared.families.VIDEO_SEGMENT_FAMILIES``: the API segments videos of those only)."""
    import torch

    if not segments:
        raise ValueError("join_segments: no segment")
    grids = [s.grid_thw for s in segments]
    if any(s.kind != "video" for s in segments) or any(g is None for g in grids):
        raise ValueError("join_segments: every segment must be a video item with a grid")
    hw = {(g[1], g[2]) for g in grids if g is not None}
    if len(hw) != 1:
        raise ValueError(f"join_segments: the segments' frame grids differ: {sorted(hw)}")
    ((h, w),) = hw
    t = sum(g[0] for g in grids if g is not None)
    return EncodedImage(
        features=torch.cat([s.features for s in segments], dim=0),
        grid_thw=(t, h, w),
        kind="video",
        fps=fps,
        timestamps=timestamps,
    )


@dataclass(frozen=True)
class VideoFrames:
    """A video for an engine: its sampled frames (``[n, height, width, 3]`` RGB ``uint8``, as
    ``shared.video.load_video`` gives them) and the rate they stand for (frames a second); where
    known, which frames of the source they are (``indices``), the source's rate (``source_fps``)
    and frame count (``total_frames``) - the metadata vLLM's loader returns beside its frames, from
    which Qwen3-VL times each temporal patch in the prompt."""

    frames: Any
    fps: float
    indices: tuple[int, ...] | None = None
    source_fps: float | None = None
    total_frames: int | None = None

    @classmethod
    def of(cls, video: SampledVideo) -> VideoFrames:
        """A sampled video (``shared.video.load_video``'s) as an engine takes it, metadata and all."""
        return cls(
            frames=video.frames,
            fps=video.sampled_fps,
            indices=tuple(video.indices),
            source_fps=video.info.fps,
            total_frames=video.info.total_frames,
        )


@dataclass(frozen=True)
class MediaImage:
    """An image for :class:`FeaturesThroughConnector` engines: the decoded RGB image and its content hash, which is
    the item part of the EC key (``shared.media.content_hash_of``)."""

    image: Image.Image
    item_hash: str


@dataclass(frozen=True)
class MediaVideo:
    """A video for :class:`FeaturesThroughConnector` engines: its sampled frames and their content
    hash (``shared.video.video_hash``: the item part of the EC key)."""

    video: VideoFrames
    item_hash: str


#: a media item a :class:`FeaturesThroughConnector` engine takes
ConnectorItem: TypeAlias = "MediaImage | MediaVideo"


def video_metadata_of(ref: ImageRef, frames: Any = None) -> VideoFrames:
    """A segmented video (``ref``) as an engine takes it: ``frames`` (its segments' joined; None:
    its metadata only, ``ref.frames`` frames of no pixels) with the whole video's metadata from its
    ref - its sampled rate, which frames of the source they are, the source's rate and frame count
    (None where the ref has none: an older API's)."""
    import numpy as np

    if frames is None:
        frames = np.zeros((ref.frames, 0, 0, 3), dtype=np.uint8)
    known = bool(ref.source_indices)
    return VideoFrames(
        frames=frames,
        fps=ref.fps,
        indices=tuple(ref.source_indices) if known else None,
        source_fps=ref.source_fps if known else None,
        total_frames=ref.source_frames if known else None,
    )


def join_video_media(segments: Sequence[ConnectorItem], ref: ImageRef) -> MediaVideo:
    """A segmented video (``ref``) as a :class:`FeaturesThroughConnector` engine takes it: its
    segments' frames in order, with the whole video's metadata (:func:`video_metadata_of`: its
    sampled rate, and the source's indices from which Qwen3-VL's prompt times each temporal patch),
    under the video's own item hash (the connector loads one EC object per item: the video's,
    joined from its segments' in the store)."""
    import numpy as np

    if not segments:
        raise ValueError("join_video_media: no segment")
    videos = [s for s in segments if isinstance(s, MediaVideo)]
    if len(videos) != len(segments):
        raise ValueError("join_video_media: every segment must be a video")
    frames = np.concatenate([v.video.frames for v in videos], axis=0)
    return MediaVideo(video=video_metadata_of(ref, frames), item_hash=ref.item_hash)


def connector_item(source: Image.Image | VideoFrames, item_hash: str) -> ConnectorItem:
    """A stored media item (an image, or a video's frames) as a connector engine takes it."""
    if isinstance(source, VideoFrames):
        return MediaVideo(video=source, item_hash=item_hash)
    return MediaImage(image=source, item_hash=item_hash)


async def encode_item(engine: FeaturesThroughWorker, source: Image.Image | VideoFrames) -> EncodedImage:
    """An engine's features for one media item: an image's, or a video's frames'."""
    if isinstance(source, VideoFrames):
        (item,) = await engine.encode_videos([source])
    else:
        (item,) = await engine.encode([source])
    return item


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the newly decodable text (may be empty mid-codepoint).

    The last event of a generation has ``finish_reason`` set ("stop" or "length").
    """

    token_id: int
    text: str
    finish_reason: str | None = None
    #: set when ``SamplingParams.logprobs`` is not None (``shared.protocol.TokenLogprob``)
    logprob: TokenLogprob | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """A loaded model. Engine classes register in :mod:`shared.engines` under a short name."""

    name: str = "base"

    if TYPE_CHECKING:  # what make_engine / load_engine call: every engine takes its model folder and options

        def __init__(self, model_dir: Any, **options: Any) -> None: ...

    @classmethod
    def options_from_settings(cls, settings: WorkerSettings, *, role: Role) -> dict[str, Any]:
        """Engine-specific constructor options from the worker's settings and role. The default
        engine needs none."""
        return {}

    @property
    @abc.abstractmethod
    def model_id(self) -> str:
        """The model name served (``/v1/models``)."""

    @property
    @abc.abstractmethod
    def identity(self) -> ModelIdentity:
        """What this engine serves: model name, folder, dtype, engine kind and their fingerprints
        (``shared.identity``), computed once."""

    @property
    def encoder_fingerprint(self) -> str:
        """Version of the encoder outputs this engine produces and accepts (see shared.fingerprint)."""
        return self.identity.fingerprint

    @abc.abstractmethod
    def generate(
        self,
        messages: Prompt,
        images: Sequence[EncodedImage | ConnectorItem],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Prefill + decode one request (an async generator). ``messages`` use OpenAI roles;
        content is a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}``
        parts, one image item per image part, in order - or a :class:`RawPrompt` (a completions
        request: no chat template, no images) - (:class:`EncodedImage` for
        :class:`FeaturesThroughWorker` engines, :class:`MediaImage` for
        :class:`FeaturesThroughConnector` engines). Fills ``stats`` if given (connector engines
        put ``extra["ec_sources"]``: item hash -> where its features came from). Closing the
        iterator early cancels the request in the engine."""

    @property
    def max_running_requests(self) -> int:
        """Requests this engine works on at once (its batch): a generating worker admits up to
        this many jobs (``shared.admission``; ``EPD_MAX_CONCURRENT_JOBS`` overrides). More would
        only queue inside the engine, where a short prompt cannot overtake."""
        return 1

    @property
    def prefill_tokens_per_step(self) -> int | None:
        """Prompt tokens this engine prefills in one step when it chunks prefills and batches them
        with the running requests (vLLM's ``max_num_batched_tokens``): a generating worker lets
        prompts of more than half of it into the engine two at a time (``shared.admission``;
        ``EPD_LONG_PROMPT_TOKENS`` overrides). ``None``: the engine orders its prefills itself
        (the transformers engine prefills one prompt at a time, the cheapest first)."""
        return None

    @property
    def encode_pixels_per_step(self) -> int | None:
        """Image pixels this engine's vision encoder computes in one step, where its steps bound
        them (vLLM: ``max_num_batched_tokens`` image tokens a step, each of
        ``(patch_size * spatial_merge_size) ** 2`` pixels in the Qwen2-VL family). An encoder worker
        holds two steps' worth of images at once unless ``EPD_ENCODE_PIXEL_BUDGET`` says otherwise:
        more would only wait inside the engine, while in the queue they stay free for another
        encoder or a stealing worker. ``None``: no step bound known (the transformers engine
        encodes its batch in one forward)."""
        return None

    def capacity(self) -> dict[str, Any]:
        """What the engine's capacity was derived from, printed at start-up (e.g. batch size,
        KV cache tokens)."""
        return {"max_running_requests": self.max_running_requests}

    async def aclose(self) -> None:
        """Release the model (vLLM stops its engine processes)."""


# -- capabilities: how encoder outputs move -----------------------------------------------------
class FeaturesThroughWorker(abc.ABC):
    """Encoder outputs pass through the worker: :meth:`encode` returns them, the worker stores
    and loads them, and ``generate`` takes :class:`EncodedImage` items."""

    @abc.abstractmethod
    async def encode(self, images: Sequence[Image.Image]) -> list[EncodedImage]:
        """Run the vision encoder (+ projector) on RGB images, one item per image."""

    async def encode_videos(self, videos: Sequence[VideoFrames]) -> list[EncodedImage]:
        """Run the vision encoder on videos' sampled frames, one item (kind video) per video.
        Here: refused (an engine or family that takes no video)."""
        from shared.errors import InvalidRequest

        raise InvalidRequest(f"this engine ({type(self).__name__}) takes no video", param="messages")

    def video_timestamps(self, video: VideoFrames) -> tuple[float, ...] | None:
        """What the model's prompt says of a video's time (:attr:`EncodedImage.timestamps`), from its
        frames' metadata (a segmented video's joined features get the whole video's). Here: None
        (a model that writes no time into its prompt)."""
        return None


class FeaturesThroughConnector(abc.ABC):
    """Encoder outputs move through the engine's own EC connector and the store: ``generate``
    takes :class:`MediaImage` items (the connector loads each stored output, or the engine
    encodes it when it cannot)."""

    #: Whether ``generate`` also stores the outputs the engine encodes itself (an EC producer as
    #: well as a consumer): what encode stealing needs (``services.prefill.features.Stealer``).
    stores_encodes: bool = False

    @abc.abstractmethod
    async def produce(self, images: Sequence[ConnectorItem]) -> list[int]:
        """Encoder-only: encode each image and have the EC connector store the output under its
        item hash before returning. Returns the feature token count per image."""


# -- capabilities: E|P|D hand-off -----------------------------------------------------------------
class PrefilledRequest(Protocol):
    """A prompt prefilled by a :class:`KVStateHandoff` engine, with its first token sampled."""

    #: The first generated token (``finish_reason`` set when it is also the last).
    first: TokenEvent

    async def export(self) -> tuple[dict[str, RawTensor], dict[str, str]]:
        """The decode state as raw tensors + string metadata (the KV object's payload)."""

    def continue_here(self) -> AsyncIterator[TokenEvent]:
        """Decode the rest in this engine (when the hand-off is impossible): the tokens after
        ``first``. Closing it early cancels."""

    async def release(self) -> None:
        """Drop the state (handed off, or the request ended)."""


class KVStateMismatch(Exception):
    """A valid KV object whose state does not fit this engine's model (shapes, layout)."""


class KVStateHandoff(abc.ABC):
    """E|P|D through the worker: the prefill engine exports the decode state as tensors (the
    worker writes the KV object) and the decode engine continues from the loaded object,
    batching the requests it decodes."""

    @abc.abstractmethod
    async def prefill(
        self,
        messages: Prompt,
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> PrefilledRequest:
        """Prefill the prompt and sample the first token."""

    @abc.abstractmethod
    def decode(
        self, obj: KVObject, params: SamplingParams, stats: GenerationStats | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Continue a handed-off request from its KV object: the tokens after the ones prefill
        emitted (``obj.state["emitted"]``), batched with the other requests this engine decodes.
        Raises :class:`KVStateMismatch` (before any token) when the state does not fit this
        model. Closing the iterator early removes the request from the batch."""


class KVConnectorHandoff(abc.ABC):
    """E|P|D through the engine's own KV connector: the prefill engine's connector stores the
    KV cache; the decode engine's connector loads it (or the engine prefills again when it is
    unusable) and the decode engine samples every output token."""

    @abc.abstractmethod
    async def prefill_for_handoff(
        self,
        messages: Prompt,
        images: Sequence[ConnectorItem],
        params: SamplingParams,
        *,
        request_name: str,
        attempt: int,
        stats: GenerationStats | None = None,
    ) -> KVHandoff:
        """Compute the prompt and have the KV connector store its KV cache as the KV object of
        (``request_name``, ``attempt``). Returns where it is."""

    @abc.abstractmethod
    def generate_from_handoff(
        self,
        messages: Prompt,
        images: Sequence[ConnectorItem],
        params: SamplingParams,
        handoff: KVHandoff,
        stats: GenerationStats | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """``generate`` with the prompt's KV cache loaded from ``handoff`` instead of computed;
        ``stats.extra["kv_source"]`` says what happened ("store", or "recomputed:<reason>")."""
