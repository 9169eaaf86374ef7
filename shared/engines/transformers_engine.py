"""Engine backed by Hugging Face ``transformers`` on the CPU (the families of
``shared.engines.families``: what differs between them is one module each behind ``VisionFamily``).

The public API is the async contract of :mod:`shared.engines.base`; every torch call runs in
the engine's one private compute thread (a single-worker executor), never on the caller's
event loop, and never two at a time. The EPD stages are separate, explicit steps:

* :meth:`TransformersEngine.encode` - image processor + vision tower + projector, one image at
  a time (features of an image never depend on the batch it came in).
* :meth:`TransformersEngine.prefill` - chat template, tokenization, placeholder expansion, one
  LM forward over the prompt with the features as transformers' ``mm_encoder_outputs`` and
  explicit position ids (the family's), first token sampled. Returns a
  :class:`TransformersPrefilled` around a :class:`DecodeState`.
* decoding - token by token with incremental detokenization and stop handling
  (:class:`DecodeStream`), in the engine's batched decode loop
  (``shared.engines.transformers_batch``): one forward per step over every running request,
  whether it was prefilled here (``generate``, ``continue_here``) or handed off as a KV object
  (``decode``). A request alone in the loop decodes with the single-request step bit for bit.

Compute-thread hops are FIFO, and prefills take turns one at a time, the cheapest prompt first
(:meth:`TransformersEngine.prefill`), so the decode loop steps between two prefills and a short
prompt is not stuck behind every long one queued before it. Closing a token iterator early stops
its work after the step in flight.

With greedy sampling the token ids equal ``model.generate(**processor(text=..., images=...))``
bit for bit, provided every stage runs with the same thread count and dtype. What makes this
hold (see FACTS.md): the same ``lm_head`` call shape (``logits_to_keep=1``), M-RoPE prefill
positions from ``get_rope_index`` and decode positions ``past_len + rope_delta`` (the Qwen-VL
families silently use wrong 1-D positions otherwise), a fresh ``DynamicCache`` per request.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shared import metrics
from shared.config import DecodeSettings, WorkerSettings
from shared.engines.base import (
    EncodedImage,
    Engine,
    FeaturesThroughWorker,
    GenerationStats,
    KVStateHandoff,
    KVStateMismatch,
    Prompt,
    RawPrompt,
    SamplingParams,
    TokenEvent,
    VideoFrames,
)
from shared.engines.families import family_class
from shared.engines.grammar import GrammarCompiler, GrammarConstraint, compiler_for
from shared.engines.prompts import (
    chat_parts,
    check_media,
    check_placeholder_tokens,
    check_raw_prompt,
    prompt_cost,
    render_chat_prompt,
    validate_params,
)
from shared.engines.transformers_state import (
    GREEDY_TEMPERATURE,
    DecodeState,
    DecodeStream,
    byte_fallback_token_ids,
    decode_state_to_raw,
    kv_object_to_state,
    min_tokens_stop_ids,
    sample_into,
    special_token_ids_of,
)
from shared.errors import EngineError, InvalidImage, InvalidRequest
from shared.families import check_family
from shared.identity import ModelIdentity
from shared.topology import Role

if TYPE_CHECKING:
    from PIL import Image

    from shared.store.format import RawTensor
    from shared.store.kv import KVObject

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: Content part types that stand for one image (in order) in a message.


# -- prefilled request --------------------------------------------------------------------------


class TransformersPrefilled:
    """A prefilled request of :class:`TransformersEngine` (a ``PrefilledRequest``): the decode
    state with its first token already emitted (``state.emitted == 1``)."""

    def __init__(
        self, engine: TransformersEngine, stream: DecodeStream, first: TokenEvent, stats: GenerationStats | None
    ):
        self._engine = engine
        self._stream: DecodeStream | None = stream
        self._stats = stats
        self.first = first

    @property
    def state(self) -> DecodeState:
        return self._live().state

    def _live(self) -> DecodeStream:
        if self._stream is None:
            raise EngineError("the prefilled request was released")
        return self._stream

    async def export(self) -> tuple[dict[str, RawTensor], dict[str, str]]:
        """The decode state as raw tensors + metadata (``decode_state_to_raw``)."""
        return await self._engine._call(decode_state_to_raw, self._live().state)

    def continue_here(self) -> AsyncIterator[TokenEvent]:
        """The tokens after ``first``, decoded in this engine's batched decode loop with every
        other running request (alone, the single-request step bit for bit); updates the stats
        given to :meth:`TransformersEngine.prefill`."""
        stream = self._live()
        return self._engine._decode_batched(stream.state, stream.params, self._stats)

    async def release(self) -> None:
        if self._stream is not None:
            self._stream.state.cache = None  # the KV cache is the bulk of it
            self._stream = None


# -- engine -------------------------------------------------------------------------------------


class TransformersEngine(Engine, FeaturesThroughWorker, KVStateHandoff):
    """A Qwen2-VL or LLaVA model folder loaded with ``transformers`` (CPU).

    The constructor loads the model in the calling thread (blocking: call it off the event
    loop); everything after that goes through the private compute thread. ``max_batch``: most
    requests :meth:`decode` steps together (more wait for a free row). ``encode_batch_invariant``
    (the default): every image gets a vision-tower forward of its own, so its features never
    depend on which images were encoded with it (see :meth:`encode`)."""

    name = "transformers"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        threads: int | None = 1,
        model_id: str | None = None,
        max_batch: int = 16,
        encode_batch_invariant: bool = True,
        max_model_len: int | None = None,
    ):
        import transformers
        from transformers import AutoProcessor

        from shared.admission import PrioritySlots
        from shared.engines.transformers_batch import BatchDecoder, DecodeLoop, EncodeBatcher

        self.model_dir = Path(model_dir)
        if dtype not in _DTYPES:
            raise EngineError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        if not (self.model_dir / "config.json").is_file():
            raise EngineError(f"no config.json in model folder {self.model_dir}")
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]
        self.threads = threads
        self.encode_batch_invariant = encode_batch_invariant
        if threads is not None:
            # Bit identity across stages needs the same intra-op thread count everywhere.
            torch.set_num_threads(int(threads))
        self._model_id = model_id or self.model_dir.name
        self._identity = ModelIdentity(model=self._model_id, model_path=self.model_dir, dtype=dtype, engine=self.name)

        t0 = time.perf_counter()
        self.arch: str = check_family(self.name, self.model_dir)
        family = family_class(self.arch)
        self.processor = AutoProcessor.from_pretrained(self.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.model = getattr(transformers, family.model_class).from_pretrained(self.model_dir, dtype=self.dtype).eval()
        self.config = self.model.config
        #: what differs between model families (vision tower, features, placeholders, positions)
        self.family = family(self.model, self.config, self.processor)
        self.text_config = self.config.get_text_config(decoder=True)
        self.hidden_size: int = int(self.text_config.hidden_size)
        #: columns of an image's features (the hidden size, times 1 + deepstack layers on Qwen3-VL)
        self.feature_width: int = self.family.feature_width
        self.image_token_id: int = int(self.config.image_token_id)
        limits = [
            (
                int(getattr(self.text_config, "max_position_embeddings", 1 << 30)),
                "max_position_embeddings in the model's config.json",
            )
        ]
        family_len = self.family.max_context()
        if family_len is not None:
            limits.append(
                (family_len, f"the sliding window of the {self.arch} LM: the transformers engine stays within it")
            )
        if max_model_len:
            limits.append((max_model_len, "EPD_MAX_MODEL_LEN"))
        #: the context served: prompt + max_tokens of a request stay within it (EPD_MAX_MODEL_LEN lowers the model's);
        #: what sets it, for the error that names it
        self.max_positions, self.max_positions_source = min(limits, key=lambda limit: limit[0])
        #: the logits' width (vLLM's ``get_vocab_size``): token ids in sampling params stay below it
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids: frozenset[int] = self._stop_token_ids()
        self.byte_token_ids: frozenset[int] = byte_fallback_token_ids(self.tokenizer)
        self.special_token_ids: frozenset[int] = special_token_ids_of(self.tokenizer)
        self.chat_template: str | None = getattr(self.processor, "chat_template", None) or getattr(
            self.tokenizer, "chat_template", None
        )
        if not self.chat_template:
            raise EngineError(f"model folder {self.model_dir} has no chat template")
        #: structured output (``shared.engines.grammar``): xgrammar over this tokenizer and the logits width
        self.grammar: GrammarCompiler = compiler_for(self.tokenizer, self.vocab_size)

        # The one compute thread: torch work stays off the event loop and is never concurrent.
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="transformers-engine",
            initializer=functools.partial(torch.set_num_threads, int(threads)) if threads is not None else None,
        )
        self._closed = False
        self._keys = itertools.count()
        self._decode_loop = DecodeLoop(BatchDecoder(self, max_batch=max_batch), self._executor)
        self._encode_batcher = EncodeBatcher(self)
        self._prefill_turns = PrioritySlots(1)
        logger.info(
            "loaded %s (%s, %s, threads=%s) in %.2fs",
            self.model_dir,
            self.arch,
            dtype,
            threads,
            time.perf_counter() - t0,
        )

    @classmethod
    def options_from_settings(cls, settings: WorkerSettings, *, role: Role) -> dict[str, Any]:
        """The decode batch: a decode worker's ``max_batch_size``; a generating worker's
        ``max_concurrent_jobs`` when set (its admission slots are the batch's rows). Every role:
        ``EPD_ENCODE_BATCH_INVARIANT`` and the context served (``EPD_MAX_MODEL_LEN``)."""
        invariant: dict[str, Any] = {
            "encode_batch_invariant": settings.runtime.encode_batch_invariant,
            "max_model_len": settings.model.max_model_len,
        }
        if role is Role.DECODE:
            assert isinstance(settings, DecodeSettings), "the decode role is the decode service's"
            return {"max_batch": settings.max_batch_size, **invariant}
        slots = getattr(settings, "max_concurrent_jobs", None)
        return {"max_batch": slots, **invariant} if slots else invariant

    # -- Engine API ---------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    @property
    def max_running_requests(self) -> int:
        """The decode batch's rows: every running request decodes in one forward per step."""
        return self._decode_loop.decoder.max_batch

    def capacity(self) -> dict[str, Any]:
        return {
            "max_running_requests": self.max_running_requests,  # the decode batch's rows
            "encode_batch_pixels": self._encode_batcher.max_pixels,
            "encode_batch_invariant": self.encode_batch_invariant,
            "torch_threads": self.threads,
        }

    async def encode(self, images: Sequence[Image.Image]) -> list[EncodedImage]:
        """Image processor + vision tower + projector. Concurrent calls are taken together into
        the compute thread (up to :data:`ENCODE_BATCH_PIXELS`). Batch-invariant (the default): each
        image still gets a forward of its own, so its features are exactly its one-image forward's
        whatever else was encoded with it - in an aggregated request with other images, in an
        encoder's batch - on any CPU, given the same torch thread count. Otherwise the images of a
        batch share forwards (Qwen2-VL: patches concatenated; LLaVA: same-shape images stacked), and
        the matmuls' row blocking, which differs by batch shape and CPU, can change features in the
        last bits (seen: up to 1.2e-6 on an Intel Xeon, none on an AMD EPYC). An image that cannot
        be preprocessed fails only its own call (:class:`InvalidImage`)."""
        pixels = await self._call(self._preprocess, images)
        return await self._encode_batcher.submit(pixels, sum(img.width * img.height for img in images))

    async def encode_videos(self, videos: Sequence[VideoFrames]) -> list[EncodedImage]:
        """Video processor + vision tower + projector, one forward per video (in the compute
        thread): one :class:`EncodedImage` of kind video each. The frames are taken as sampled
        (``shared.video``: vLLM's loader's frames); the processor resizes them and groups them
        into temporal patches. A family without video refuses (:class:`InvalidRequest`)."""
        if not self.family.takes_video:
            raise InvalidRequest(f"this model ({self.arch}) takes no video", param="messages")
        return [await self._call(self._encode_video, video) for video in videos]

    def video_timestamps(self, video: VideoFrames) -> tuple[float, ...] | None:
        """The family's (Qwen3-VL: each temporal patch's time in the source)."""
        return self.family.video_timestamps(video)

    def _encode_video(self, video: VideoFrames) -> EncodedImage:
        pixels = self.family.video_pixels(video.frames)
        try:
            with torch.no_grad():
                item = self.family.video_features(pixels, video.fps)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise EngineError(f"encoding a video failed: {exc}") from exc
        features = item.features.detach().to("cpu").contiguous()
        return dataclasses.replace(item, features=features, timestamps=self.family.video_timestamps(video))

    async def generate(  # type: ignore[override]  # encoded images only: its features come through the worker
        self,
        messages: Prompt,
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Prefill + decode (see the module docstring). ``messages``: chat messages, or a
        :class:`RawPrompt` (no chat template, no images). Input errors (:class:`InvalidRequest`)
        are raised by the first ``__anext__``, before any event."""
        request = await self.prefill(messages, images, params, stats)
        try:
            yield request.first
            if request.first.finish_reason is None:
                async for event in request.continue_here():
                    yield event
        finally:
            await request.release()

    async def prefill(
        self,
        messages: Prompt,
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> TransformersPrefilled:
        """Run the prompt through the LM and sample (and emit) the first token. Prefills take
        turns, the cheapest prompt first (``shared.admission.PrioritySlots``: shortest-prefill-first
        with ageing), one at a time: each runs between two steps of the decode loop, so a short
        prompt waits for at most one long prefill, not for every one queued before it."""
        cost = prompt_cost(messages, [img.n_tokens for img in images])
        async with self._prefill_turns.slot(cost):
            stream, first = await self._call(self._prefill_first, messages, images, params, stats)
        return TransformersPrefilled(self, stream, first, stats)

    async def decode(
        self, obj: KVObject, params: SamplingParams, stats: GenerationStats | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Continue a handed-off request in the batched decode loop (see the base class).
        ``stats``: ``completion_tokens`` counts every output token (prefill's too),
        ``decode_s`` is the time from joining to the last event, ``extra
        ["decode_batch_rows_max"]`` the most rows of a step this request was part of."""
        validate_params(params, vocab_size=self.vocab_size)
        state = await self._call(self._handed_off_state, obj, params)
        if stats is not None:
            stats.prompt_tokens = state.prompt_tokens
        async for event in self._decode_batched(state, params, stats):
            yield event

    async def _decode_batched(
        self, state: DecodeState, params: SamplingParams, stats: GenerationStats | None
    ) -> AsyncIterator[TokenEvent]:
        """The events after ``state.emitted`` from the batched decode loop (:meth:`decode`)."""
        t0 = time.perf_counter()
        already = state.emitted
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        self._decode_loop.join(key, state, params, asyncio.get_running_loop(), queue)
        rows_max, n = 0, 0
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                event, rows = item
                n += 1
                rows_max = max(rows_max, rows)
                if stats is not None:
                    stats.completion_tokens = already + n
                    stats.decode_s = time.perf_counter() - t0
                    stats.extra["decode_batch_rows_max"] = rows_max
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self._decode_loop.leave(key)  # no-op once finished; frees the row when closed early

    async def aclose(self) -> None:
        """Fail what the decode loop still holds and shut the compute thread down (after the
        call in flight)."""
        if self._closed:
            return
        self._closed = True
        self._decode_loop.close()
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        self.model = None

    # -- compute thread plumbing ----------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the compute thread (keeping the caller's context: request ids in logs)."""
        if self._closed:
            raise EngineError("the engine is closed")
        ctx = contextvars.copy_context()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, fn, *args)
        except RuntimeError as exc:
            if self._closed:  # shut down between the check and the submit
                raise EngineError("the engine is closed") from exc
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                # aclose() dropped the queued call; the caller was not cancelled
                raise EngineError("the engine was closed") from None
            raise

    # -- compute thread: prompt ----------------------------------------------------------------

    def render_prompt(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> str:
        """The chat template applied to ``messages`` (and ``tools``) with ``add_generation_prompt=True``."""
        return render_chat_prompt(self.processor, self.chat_template, messages, tools)

    def expected_image_tokens(self, item: EncodedImage) -> int | None:
        """Token count the processor would give this image, or ``None`` if it cannot be known."""
        return self.family.expected_tokens(item)

    def _check_images(self, images: Sequence[EncodedImage]) -> None:
        for i, item in enumerate(images):
            if not isinstance(item, EncodedImage):
                raise InvalidRequest(f"images[{i}] is not an EncodedImage ({type(item).__name__})")
            f = item.features
            if not isinstance(f, torch.Tensor):
                raise InvalidRequest(f"images[{i}].features is not a tensor")
            if f.ndim != 2 or f.shape[0] < 1 or f.shape[1] != self.feature_width:
                raise InvalidRequest(
                    f"images[{i}].features has shape {tuple(f.shape)}, expected [n_tokens, {self.feature_width}]"
                )
            if not f.is_floating_point():
                raise InvalidRequest(f"images[{i}].features has non-float dtype {f.dtype}")
            if not bool(torch.isfinite(f).all()):
                raise InvalidRequest(f"images[{i}].features contain NaN or inf")
            self.family.check_image(i, item)
            expected = self.expected_image_tokens(item)
            if expected is not None and expected != f.shape[0]:
                raise InvalidRequest(f"images[{i}] has {f.shape[0]} feature rows, expected {expected}")

    def raw_prompt_ids(self, prompt: RawPrompt, images: Sequence[EncodedImage]) -> list[int]:
        """A completions prompt's token ids: its text tokenized with the tokenizer's usual special
        tokens (as vLLM's ``/v1/completions``), or its token ids as they are. No images; an image
        placeholder token in it is refused (there are no features to put there)."""
        check_raw_prompt(prompt, len(images))
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token id {bad[0]} is out of the vocabulary (size {self.vocab_size})", param="prompt"
                )
        else:
            ids = list(self.tokenizer(prompt.text)["input_ids"])
            if not ids:
                raise InvalidRequest("prompt text gives no tokens", param="prompt")
        if any(token in ids for token in self.family.placeholders().values()):
            raise InvalidRequest("a completions prompt cannot contain image placeholder tokens", param="prompt")
        return ids

    def build_prompt_ids(self, messages: Prompt, images: Sequence[EncodedImage]) -> list[int]:
        """Prompt token ids with each image placeholder expanded to its ``n_tokens`` image tokens,
        exactly as the family's HF processor does (``VisionFamily.expand``). A :class:`RawPrompt`:
        :meth:`raw_prompt_ids`."""
        if isinstance(messages, RawPrompt):
            return self.raw_prompt_ids(messages, images)
        messages, tools = chat_parts(messages)
        self._check_images(images)
        check_media(messages, [im.kind for im in images])
        text = self.render_prompt(messages, tools)
        bos = getattr(self.tokenizer, "bos_token", None)
        # The processor tokenizes with add_special_tokens=True; a template that already
        # renders BOS would get it twice, so skip the automatic one then.
        add_special = not (bos and text.startswith(bos))
        ids: list[int] = self.tokenizer(text, add_special_tokens=add_special)["input_ids"]
        for kind, token in self.family.placeholders().items():
            check_placeholder_tokens(ids, token, sum(1 for im in images if im.kind == kind), kind)
        return self.family.expand(text, ids, images, add_special)

    # -- compute thread: encode / prefill / decode ----------------------------------------------

    def _encode(self, images: Sequence[Image.Image]) -> list[EncodedImage]:
        """Encode ``images`` now, in this thread (one forward per shape group)."""
        return self._encode_pixels(self._preprocess(images))

    def _preprocess(self, images: Sequence[Image.Image]) -> list[Any]:
        """The image processor's tensors, one dict per image (InvalidImage names the bad one)."""
        from PIL import Image as PILImage

        out = []
        for i, img in enumerate(images):
            if not isinstance(img, PILImage.Image):
                raise InvalidImage(f"images[{i}] is not a PIL image ({type(img).__name__})")
            if img.width < 1 or img.height < 1:
                raise InvalidImage(f"images[{i}] is empty ({img.width}x{img.height})")
            if img.mode != "RGB":
                img = img.convert("RGB")
            try:
                out.append(self.family.image_pixels(img))
            except InvalidImage as exc:
                raise InvalidImage(f"images[{i}]: {exc.message}") from exc
        return out

    def _encode_pixels(self, pixels: Sequence[Any]) -> list[EncodedImage]:
        """Vision tower + projector over preprocessed images: batch-invariant, one forward per
        image; else as few forwards as the family allows (any sizes together, or images of one
        pixel shape: LLaVA's processor makes them all one size)."""
        if not pixels:
            return []
        out: list[EncodedImage | None] = [None] * len(pixels)
        if self.encode_batch_invariant:
            groups = [[i] for i in range(len(pixels))]
        elif self.family.concatenates_images:
            groups = [list(range(len(pixels)))]
        else:
            by_shape: dict[tuple[int, ...], list[int]] = {}
            for i, px in enumerate(pixels):
                by_shape.setdefault(tuple(px["pixel_values"].shape[1:]), []).append(i)
            groups = list(by_shape.values())
        for group in groups:
            try:
                # no_grad rather than inference_mode: the features leave the engine, and callers
                # may modify them in place (not allowed on inference tensors outside inference mode)
                with torch.no_grad():
                    encoded = self.family.image_features([pixels[i] for i in group])
            except (RuntimeError, ValueError, IndexError) as exc:
                raise EngineError(f"encoding {len(group)} image(s) failed: {exc}") from exc
            for i, item in zip(group, encoded):
                out[i] = dataclasses.replace(item, features=item.features.detach().to("cpu").contiguous())
            metrics.ENCODE_BATCH_IMAGES.observe(len(group))
        return out  # type: ignore[return-value]  # every slot was filled by the loop above

    def _prefill_first(
        self,
        messages: Prompt,
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None,
    ) -> tuple[DecodeStream, TokenEvent]:
        """Prefill, then emit the first token's event."""
        state = self._prefill(messages, images, params, stats)
        stream = DecodeStream(self, state, params)
        first = stream.emit()
        if stats is not None:
            stats.completion_tokens = state.emitted
        return stream, first

    def _prefill(
        self,
        messages: Prompt,
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> DecodeState:
        """Run the prompt through the LM and sample the first token (not emitted yet)."""
        from transformers import DynamicCache

        validate_params(params, vocab_size=self.vocab_size)
        constraint = self._constraint(params)
        t0 = time.perf_counter()
        ids = self.build_prompt_ids(messages, images)
        n_prompt = len(ids)
        if n_prompt + params.max_tokens > self.max_positions:
            # (vLLM's wording, naming what sets the limit)
            raise InvalidRequest(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{self.max_positions} tokens ({self.max_positions_source}) and your request has {n_prompt} input "
                f"tokens ({params.max_tokens} > {self.max_positions} - {n_prompt})",
                param="max_tokens",
            )
        input_ids = torch.tensor([ids], dtype=torch.long)
        try:
            with torch.inference_mode():
                position_ids, rope_delta = self.family.prefill_positions(input_ids, images)
                features = self.family.encoder_outputs(images, self.dtype) if images else None
                # Full layers, also for a family's sliding-window layers: the context served stays
                # within the window (VisionFamily.max_context), where a full layer holds what a
                # sliding one would, and the KV handoff and the batched decode need one length
                # for every layer.
                cache = DynamicCache()
                out = self.model(
                    input_ids=input_ids,
                    mm_encoder_outputs=features,
                    position_ids=position_ids,
                    **self.family.prefill_kwargs(input_ids),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        except (RuntimeError, ValueError, IndexError) as exc:
            raise EngineError(f"prefill failed: {exc}") from exc

        generator = None
        seed = params.seed
        if params.temperature >= GREEDY_TEMPERATURE:
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
            generator = torch.Generator(device="cpu").manual_seed(seed)
        state = DecodeState(
            cache=out.past_key_values,
            past_len=n_prompt,
            last_token=-1,
            rope_delta=rope_delta,
            prompt_tokens=n_prompt,
            output_ids=[],
            generator=generator,
            seed=seed,
            prompt_ids=ids,
            grammar=constraint,
        )
        first = sample_into(state, out.logits[0, -1], params, min_tokens_stop_ids(self.eos_token_ids, params))
        state.output_ids.append(first)
        state.last_token = first
        if stats is not None:
            stats.prompt_tokens = n_prompt
            stats.prefill_s = time.perf_counter() - t0
        return state

    def _decode_positions(self, state: DecodeState) -> torch.Tensor:
        return self.family.decode_positions([state.past_len], [state.rope_delta])

    def decode_logits(self, state: DecodeState) -> torch.Tensor:
        """Compute thread only (the batch decoder's single-row step). Feed ``state.last_token``
        through the LM (extending ``state.cache``) and return the next-token logits ``[vocab]``.
        ``state``'s token fields are not advanced: see :meth:`DecodeState.advance`."""
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([[state.last_token]], dtype=torch.long),
                position_ids=self._decode_positions(state),
                past_key_values=state.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        state.cache = out.past_key_values
        return out.logits[0, -1]

    def _constraint(self, params: SamplingParams) -> GrammarConstraint | None:
        """A fresh grammar constraint of ``params.structured`` (None without one); its stop tokens
        are vLLM's ``all_stop_token_ids``: the EOS ids (also with ``ignore_eos``) and the request's
        ``stop_token_ids``. A schema xgrammar refuses is an InvalidRequest."""
        if params.structured is None:
            return None
        return self.grammar.constraint(params.structured, min_tokens_stop_ids(self.eos_token_ids, params))

    def _handed_off_state(self, obj: KVObject, params: SamplingParams) -> DecodeState:
        """The decode state of a KV object with its grammar constraint rebuilt: replayed over the
        tokens the prefill side sampled (the constraint itself does not travel)."""
        state = self._state_from_object(obj)
        constraint = self._constraint(params)
        if constraint is not None:
            state.grammar = constraint.replay(state.output_ids)
        return state

    def _state_from_object(self, obj: KVObject) -> DecodeState:
        """The decode state of a validated KV object; KVStateMismatch when it does not fit."""
        try:
            return kv_object_to_state(obj, self.config)
        except (EngineError, ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise KVStateMismatch(str(exc)) from exc

    # -- helpers --------------------------------------------------------------------------------

    def _stop_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for src in (gen_eos, self.text_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id and im_end is not None:
            ids.add(im_end)
        return frozenset(ids)
