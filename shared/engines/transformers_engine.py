"""Engine backed by Hugging Face ``transformers`` on the CPU (Qwen2-VL and LLaVA families).

The three EPD stages are separate, explicit steps so a later change can run them in different
processes:

* :meth:`TransformersEngine.encode` - image processor + vision tower + projector, one image at
  a time (features of an image never depend on the batch it came in).
* :meth:`TransformersEngine.prefill` - chat template, tokenization, placeholder expansion,
  ``masked_scatter`` of the features, one LM forward over the prompt with explicit position ids,
  first token sampled. Returns a :class:`DecodeState`.
* :meth:`TransformersEngine.decode` - continues from a :class:`DecodeState` token by token with
  incremental detokenization and stop handling, yielding :class:`TokenEvent` items.

With greedy sampling the token ids equal ``model.generate(**processor(text=..., images=...))``
bit for bit, provided every stage runs with the same thread count and dtype. What makes this
hold (see FACTS.md): the same ``lm_head`` call shape (``logits_to_keep=1``), M-RoPE prefill
positions from ``get_rope_index`` and decode positions ``past_len + rope_delta`` (Qwen2-VL
silently uses wrong 1-D positions otherwise), a fresh ``DynamicCache`` per request.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from shared.engines.base import Engine, EncodedImage, GenerationStats, SamplingParams, TokenEvent
from shared.errors import EngineError, InvalidImage, InvalidRequest, UnsupportedContent
from shared.fingerprint import encoder_fingerprint as _encoder_fingerprint

if TYPE_CHECKING:
    from PIL import Image

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: Content part types that stand for one image (in order) in a message.
IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image"})
TEXT_PART_TYPES = frozenset({"text", "input_text"})
_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})

DECODE_STATE_SCHEMA = "epd-decode-state-v1"


# -- messages -----------------------------------------------------------------------------------


def count_image_placeholders(messages: list[dict[str, Any]]) -> int:
    """Number of image parts in ``messages`` (validates the message shape on the way)."""
    return sum(1 for part in _iter_parts(messages) if part["type"] in IMAGE_PART_TYPES)


def check_image_count(messages: list[dict[str, Any]], n_images: int) -> int:
    """Raise :class:`InvalidRequest` unless ``messages`` hold exactly ``n_images`` image parts."""
    n = count_image_placeholders(messages)
    if n != n_images:
        raise InvalidRequest(
            f"messages contain {n} image placeholder(s) but {n_images} image(s) were given", param="messages"
        )
    return n


def check_placeholder_tokens(ids: Sequence[int], image_token_id: int, n_images: int) -> None:
    """Raise :class:`InvalidRequest` unless the tokenized prompt has exactly one image placeholder
    token per image (a literal "<|image_pad|>" typed into a text part would add one)."""
    n_placeholders = sum(1 for t in ids if t == image_token_id)
    if n_placeholders != n_images:
        raise InvalidRequest(
            f"prompt has {n_placeholders} image placeholder tokens for {n_images} image(s); "
            "text parts must not contain image tokens",
            param="messages",
        )


def _iter_parts(messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"messages[{i}].role {role!r} is not one of {sorted(_ROLES)}", param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of parts", param="messages")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequest(f"messages[{i}].content[{j}] must be an object with a type", param="messages")
            ptype = part["type"]
            if ptype in TEXT_PART_TYPES:
                if not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content[{j}].text must be a string", param="messages")
            elif ptype not in IMAGE_PART_TYPES:
                raise UnsupportedContent(
                    f"messages[{i}].content[{j}] has unsupported type {ptype!r}", param="messages"
                )
            yield part


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical form for chat templates: string content, or ``{"type": "text", "text"}`` /
    ``{"type": "image"}`` parts only (URLs and payloads dropped so no template or processor
    ever tries to fetch anything)."""
    list(_iter_parts(messages))  # validate
    out: list[dict[str, Any]] = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            if part["type"] in IMAGE_PART_TYPES:
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        out.append({"role": msg["role"], "content": parts})
    return out


# -- decode state -------------------------------------------------------------------------------


@dataclass
class DecodeState:
    """Everything decode needs to continue a request after prefill.

    ``cache`` holds the KV cache of the ``past_len`` positions already run through the LM;
    ``last_token`` (= ``output_ids[-1]``) was sampled from the last logits and is NOT yet in the
    cache. Decode positions are ``past_len + rope_delta`` (``rope_delta`` is 0 for 1-D RoPE).
    ``generator`` is the per-request sampling RNG (``None`` for greedy). ``emitted`` counts
    the ``output_ids`` already turned into events (0 after prefill).

    :meth:`to_tensors` / :meth:`from_tensors` convert to and from plain tensors + a JSON-able
    metadata dict (for safetensors; no pickle).
    """

    cache: Any  # transformers DynamicCache
    past_len: int
    last_token: int
    rope_delta: int
    prompt_tokens: int
    output_ids: list[int]
    generator: torch.Generator | None = None
    seed: int | None = None
    emitted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def advance(self, token: int) -> None:
        """Record ``token`` sampled from the logits of ``last_token`` (which is now in the cache)."""
        self.past_len += 1
        self.last_token = token
        self.output_ids.append(token)

    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)``, each ``[1, n_kv_heads, past_len, head_dim]``."""
        out = []
        for layer in self.cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise EngineError(f"cannot export KV cache layer of type {type(layer).__name__}")
            out.append((layer.keys, layer.values))
        return out

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``(tensors, metadata)``: ``kv.{i}.k`` / ``kv.{i}.v`` / ``generator_state`` and string
        metadata, ready for ``safetensors.torch.save(tensors, metadata=metadata)``."""
        tensors: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(self.kv_tensors()):
            tensors[f"kv.{i}.k"] = k.contiguous()
            tensors[f"kv.{i}.v"] = v.contiguous()
        if self.generator is not None:
            tensors["generator_state"] = self.generator.get_state()
        meta = {
            "schema": DECODE_STATE_SCHEMA,
            "state": json.dumps(
                {
                    "past_len": self.past_len,
                    "last_token": self.last_token,
                    "rope_delta": self.rope_delta,
                    "prompt_tokens": self.prompt_tokens,
                    "output_ids": self.output_ids,
                    "seed": self.seed,
                    "emitted": self.emitted,
                    "n_layers": len(self.cache.layers),
                },
                sort_keys=True,
            ),
        }
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str], config: Any) -> "DecodeState":
        """Rebuild a state written by :meth:`to_tensors` (``config``: the model config)."""
        from transformers import DynamicCache

        if metadata.get("schema") != DECODE_STATE_SCHEMA:
            raise EngineError(f"unknown decode state schema {metadata.get('schema')!r}")
        try:
            st = json.loads(metadata["state"])
            n_layers = int(st["n_layers"])
            kv = [(tensors[f"kv.{i}.k"], tensors[f"kv.{i}.v"]) for i in range(n_layers)]
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineError(f"malformed decode state: {exc}") from exc
        text_cfg = config.get_text_config(decoder=True)
        if n_layers != text_cfg.num_hidden_layers:
            raise EngineError(f"decode state has {n_layers} KV layers, model has {text_cfg.num_hidden_layers}")
        kv_heads = text_cfg.num_key_value_heads or text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        want = (1, kv_heads, st["past_len"], head_dim)
        for k, v in kv:
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise EngineError(f"decode state KV shape {tuple(k.shape)} does not match the model's {want}")
        generator = None
        if "generator_state" in tensors:
            generator = torch.Generator(device="cpu")
            try:
                generator.set_state(tensors["generator_state"])
            except (RuntimeError, TypeError) as exc:
                raise EngineError(f"malformed generator state: {exc}") from exc
        return cls(
            cache=DynamicCache(kv, config=config),
            past_len=int(st["past_len"]),
            last_token=int(st["last_token"]),
            rope_delta=int(st["rope_delta"]),
            prompt_tokens=int(st["prompt_tokens"]),
            output_ids=[int(t) for t in st["output_ids"]],
            generator=generator,
            seed=st["seed"],
            emitted=int(st["emitted"]),
        )


# -- detokenization and stop strings ------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (``ids[prefix:]`` against ``ids[prefix:read]``) so the cost per token
    is constant, and holds text back while it may still change:

    * while it ends in an incomplete UTF-8 sequence (U+FFFD) - byte-level BPE (GPT-2 / Qwen2);
    * while the newest token is a byte-fallback token (``<0xNN>``, SentencePiece / Llama): the
      ``ByteFallback`` decoder decodes a whole run of byte tokens at once and turns *every* byte
      of an invalid run into U+FFFD, so even an earlier valid byte (``#``) may change.

    Concatenating every :meth:`add` result and :meth:`flush` gives exactly
    ``tokenizer.decode(ids, skip_special_tokens=True)``.
    """

    def __init__(
        self,
        tokenizer: Any,
        byte_token_ids: frozenset[int] | None = None,
        special_token_ids: frozenset[int] | None = None,
    ):
        self._tok = tokenizer
        self._byte_ids = byte_token_ids if byte_token_ids is not None else byte_fallback_token_ids(tokenizer)
        self._special_ids = special_token_ids if special_token_ids is not None else special_token_ids_of(tokenizer)
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._in_byte_run = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        # Skipped special tokens vanish before decoding, so a byte run continues across them.
        if token_id not in self._special_ids:
            self._in_byte_run = token_id in self._byte_ids
        if self._in_byte_run:
            return ""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


def special_token_ids_of(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
    ids = {int(i) for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False)}
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None)
    return frozenset(ids)


def byte_fallback_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens (``<0x00>`` .. ``<0xFF>``); empty for
    byte-level BPE vocabularies."""
    ids = set()
    for b in range(256):
        tid = tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>")
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return frozenset(ids)


class StopStringMatcher:
    """OpenAI ``stop`` semantics over a text stream.

    :meth:`feed` returns the text that can be emitted now: everything before the first stop
    string (and ``True`` once one is found), otherwise all text except a tail that could still
    turn into a stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._text = ""
        self._emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        self._text += delta
        if not self.stops:
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return out, False
        # A stop string cannot start inside already emitted text (that text was only emitted
        # once no stop string could begin there), so search from the emission point.
        hits = [i for i in (self._text.find(s, self._emitted) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out = self._text[self._emitted : end]
            self._emitted = end
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._text) - self._emitted), hold, -1):
                if self._text.endswith(s[:k]):
                    hold = k
                    break
        end = len(self._text) - hold
        out = self._text[self._emitted : end]
        self._emitted = end
        return out, False

    def finish(self) -> str:
        """Release the held-back tail (the stream ended without a stop string)."""
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out


class DecodeStream:
    """Per-request decode bookkeeping around a :class:`DecodeState`: incremental
    detokenization, stop strings, EOS and ``max_tokens``. Model compute is not done here, so
    the single-request loop (:meth:`TransformersEngine.decode`) and the batched one
    (``shared.engines.transformers_batch``) share the exact same token -> event logic.

    Tokens ``output_ids[:emitted]`` were already emitted by an earlier owner of the state
    (prefill in E|P|D, or a worker that died): they are replayed silently through the
    detokenizer and stop matcher so the text continues exactly where that owner stopped.
    """

    def __init__(self, engine: "TransformersEngine", state: DecodeState, params: SamplingParams):
        validate_params(params)
        self.state = state
        self.params = params
        self._eos = engine.eos_token_ids
        self._detok = IncrementalDetokenizer(engine.tokenizer, engine.byte_token_ids, engine.special_token_ids)
        self._stopper = StopStringMatcher(params.stop)
        self.finish_reason: str | None = None
        for tok in state.output_ids[: state.emitted]:
            self._stopper.feed(self._detok.add(tok))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_step(self) -> bool:
        """True when every sampled token was emitted: the next event needs a decode step."""
        return not self.finished and self.state.emitted >= len(self.state.output_ids)

    def emit(self) -> TokenEvent:
        """The event of the next not-yet-emitted token of ``state.output_ids``."""
        if self.finished:
            raise EngineError("decode stream already finished")
        state, params = self.state, self.params
        idx = state.emitted
        tok = state.output_ids[idx]
        state.emitted = n_out = idx + 1
        text, hit_stop = self._stopper.feed(self._detok.add(tok))
        finish: str | None = None
        if hit_stop:
            finish = "stop"
        elif tok in self._eos and not params.ignore_eos:
            finish = "stop"
        elif n_out >= params.max_tokens:
            finish = "length"
        if finish is not None and not hit_stop:
            # Release held-back text: the stream ends here without a stop string; a stop
            # string may still complete inside the flushed tail.
            tail, hit_tail = self._stopper.feed(self._detok.flush())
            text += tail
            if not hit_tail:
                text += self._stopper.finish()
            else:
                finish = "stop"
        self.finish_reason = finish
        return TokenEvent(token_id=tok, text=text, finish_reason=finish)


# -- sampling -----------------------------------------------------------------------------------


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token from ``logits`` ``[vocab]``: greedy argmax for temperature 0, else temperature +
    top-p (nucleus) sampling with ``generator``."""
    logits = logits.to(dtype=torch.float32)
    if params.temperature == 0:
        return int(torch.argmax(logits, dim=-1))
    scores = logits / params.temperature
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first one is
        # always kept).
        drop = (cum - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, sorted_idx, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def validate_params(params: SamplingParams) -> None:
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise InvalidRequest("max_tokens must be a positive integer", param="max_tokens")
    if not (isinstance(params.temperature, (int, float)) and math.isfinite(params.temperature)):
        raise InvalidRequest("temperature must be a finite number", param="temperature")
    if params.temperature < 0:
        raise InvalidRequest("temperature must be >= 0", param="temperature")
    if not (isinstance(params.top_p, (int, float)) and 0 < params.top_p <= 1):
        raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0 or params.seed >= 2**63):
        raise InvalidRequest("seed must be an integer in [0, 2**63)", param="seed")
    if not all(isinstance(s, str) for s in params.stop):
        raise InvalidRequest("stop must be a list of strings", param="stop")


def render_chat_prompt(processor: Any, chat_template: str, messages: list[dict[str, Any]]) -> str:
    """``chat_template`` applied to ``messages`` (one raw placeholder per image part) with
    ``add_generation_prompt=True``; template errors become :class:`InvalidRequest`."""
    norm = normalize_messages(messages)
    try:
        return processor.apply_chat_template(norm, chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # jinja2 errors (e.g. a template's raise_exception) land here
        raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc


# -- engine -------------------------------------------------------------------------------------


class TransformersEngine(Engine):
    """A Qwen2-VL or LLaVA model folder loaded with ``transformers`` (CPU)."""

    name = "transformers"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        threads: int | None = 1,
        model_id: str | None = None,
    ):
        from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration
        from transformers import Qwen2VLForConditionalGeneration

        self.model_dir = Path(model_dir)
        if dtype not in _DTYPES:
            raise EngineError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        if not (self.model_dir / "config.json").is_file():
            raise EngineError(f"no config.json in model folder {self.model_dir}")
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]
        self.threads = threads
        if threads is not None:
            # Bit identity across stages needs the same intra-op thread count everywhere.
            torch.set_num_threads(int(threads))
        self._model_id = model_id or self.model_dir.name
        self._fingerprint: str | None = None

        t0 = time.perf_counter()
        config = AutoConfig.from_pretrained(self.model_dir)
        classes = {"qwen2_vl": Qwen2VLForConditionalGeneration, "llava": LlavaForConditionalGeneration}
        model_cls = classes.get(config.model_type)
        if model_cls is None:
            raise EngineError(f"unsupported model_type {config.model_type!r}; supported: {sorted(classes)}")
        self.arch: str = config.model_type
        self.processor = AutoProcessor.from_pretrained(self.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.model = model_cls.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        self.config = self.model.config
        self.text_config = self.config.get_text_config(decoder=True)
        self.hidden_size: int = int(self.text_config.hidden_size)
        self.image_token_id: int = int(self.config.image_token_id)
        self.max_positions: int = int(getattr(self.text_config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids: frozenset[int] = self._stop_token_ids()
        self.byte_token_ids: frozenset[int] = byte_fallback_token_ids(self.tokenizer)
        self.special_token_ids: frozenset[int] = special_token_ids_of(self.tokenizer)
        self.chat_template: str | None = getattr(self.processor, "chat_template", None) or getattr(
            self.tokenizer, "chat_template", None
        )
        if not self.chat_template:
            raise EngineError(f"model folder {self.model_dir} has no chat template")
        logger.info(
            "loaded %s (%s, %s, threads=%s) in %.2fs",
            self.model_dir,
            self.arch,
            dtype,
            threads,
            time.perf_counter() - t0,
        )

    # -- Engine API ---------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def encoder_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _encoder_fingerprint(self.model_dir, dtype=self.dtype_name, engine=self.name)
        return self._fingerprint

    @property
    def is_mrope(self) -> bool:
        return self.arch == "qwen2_vl"

    def encode(self, images: Sequence["Image.Image"]) -> list[EncodedImage]:
        """Image processor + vision tower + projector, one image per call (batch-independent)."""
        from PIL import Image as PILImage

        out: list[EncodedImage] = []
        for i, img in enumerate(images):
            if not isinstance(img, PILImage.Image):
                raise InvalidImage(f"images[{i}] is not a PIL image ({type(img).__name__})")
            if img.width < 1 or img.height < 1:
                raise InvalidImage(f"images[{i}] is empty ({img.width}x{img.height})")
            if img.mode != "RGB":
                img = img.convert("RGB")
            try:
                pixels = self.processor.image_processor(images=[img], return_tensors="pt")
            except (ValueError, TypeError) as exc:
                raise InvalidImage(f"images[{i}] cannot be preprocessed: {exc}") from exc
            try:
                res, grid_thw = self._encode_pixels(pixels)
            except (RuntimeError, ValueError, IndexError) as exc:
                raise EngineError(f"encoding images[{i}] failed: {exc}") from exc
            feats = res.pooler_output[0]
            feats = feats.reshape(-1, feats.shape[-1]).detach().to("cpu").contiguous()
            out.append(EncodedImage(features=feats, grid_thw=grid_thw))
        return out

    def _encode_pixels(self, pixels: Any) -> tuple[Any, tuple[int, int, int] | None]:
        # no_grad rather than inference_mode: the features leave the engine, and callers may
        # modify them in place (not allowed on inference tensors outside inference mode).
        with torch.no_grad():
            if self.is_mrope:
                grid = pixels["image_grid_thw"]
                res = self.model.get_image_features(
                    pixel_values=pixels["pixel_values"], image_grid_thw=grid, return_dict=True
                )
                grid_thw: tuple[int, int, int] | None = tuple(int(x) for x in grid[0].tolist())  # type: ignore[assignment]
            else:
                res = self.model.get_image_features(
                    pixel_values=pixels["pixel_values"],
                    vision_feature_layer=self.config.vision_feature_layer,
                    vision_feature_select_strategy=self.config.vision_feature_select_strategy,
                    return_dict=True,
                )
                grid_thw = None
        return res, grid_thw

    def generate(
        self,
        messages: list[dict[str, Any]],
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> Iterator[TokenEvent]:
        """Prefill + decode (see the module docstring). This is a generator: input errors
        (:class:`InvalidRequest`) are raised by the first ``next()``, before any event."""
        state = self.prefill(messages, images, params, stats)
        yield from self.decode(state, params, stats)

    # -- prompt ---------------------------------------------------------------------------------

    def render_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The chat template applied to ``messages`` with ``add_generation_prompt=True``."""
        return render_chat_prompt(self.processor, self.chat_template, messages)

    def expected_image_tokens(self, item: EncodedImage) -> int | None:
        """Token count the processor would give this image, or ``None`` if it cannot be known."""
        if self.is_mrope:
            if item.grid_thw is None:
                return None
            merge = int(self.config.vision_config.spatial_merge_size)
            t, h, w = item.grid_thw
            return (t * h * w) // (merge * merge)
        proc = self.processor
        patch = getattr(proc, "patch_size", None)
        crop = getattr(proc.image_processor, "crop_size", None)
        if not patch or not crop:
            return None
        ch = crop["height"] if isinstance(crop, dict) else crop.height
        cw = crop["width"] if isinstance(crop, dict) else crop.width
        n = (ch // patch) * (cw // patch) + int(getattr(proc, "num_additional_image_tokens", 0) or 0)
        if getattr(proc, "vision_feature_select_strategy", None) == "default":
            n -= 1
        return n

    def _check_images(self, images: Sequence[EncodedImage]) -> None:
        for i, item in enumerate(images):
            if not isinstance(item, EncodedImage):
                raise InvalidRequest(f"images[{i}] is not an EncodedImage ({type(item).__name__})")
            f = item.features
            if not isinstance(f, torch.Tensor):
                raise InvalidRequest(f"images[{i}].features is not a tensor")
            if f.ndim != 2 or f.shape[0] < 1 or f.shape[1] != self.hidden_size:
                raise InvalidRequest(
                    f"images[{i}].features has shape {tuple(f.shape)}, expected [n_tokens, {self.hidden_size}]"
                )
            if not f.is_floating_point():
                raise InvalidRequest(f"images[{i}].features has non-float dtype {f.dtype}")
            if not bool(torch.isfinite(f).all()):
                raise InvalidRequest(f"images[{i}].features contain NaN or inf")
            if self.is_mrope:
                g = item.grid_thw
                if g is None or len(g) != 3 or any((not isinstance(x, int)) or x < 1 for x in g):
                    raise InvalidRequest(f"images[{i}].grid_thw must be three positive ints, got {g!r}")
                merge = int(self.config.vision_config.spatial_merge_size)
                if g[1] % merge or g[2] % merge:
                    raise InvalidRequest(f"images[{i}].grid_thw {g} is not divisible by the merge size {merge}")
            expected = self.expected_image_tokens(item)
            if expected is not None and expected != f.shape[0]:
                raise InvalidRequest(f"images[{i}] has {f.shape[0]} feature rows, expected {expected}")

    def build_prompt_ids(self, messages: list[dict[str, Any]], images: Sequence[EncodedImage]) -> list[int]:
        """Prompt token ids with each image placeholder expanded to its ``n_tokens`` copies,
        exactly as the HF processor does (it repeats the placeholder string, then tokenizes;
        special tokens split the text, so repeating at the id level is identical)."""
        check_image_count(messages, len(images))
        self._check_images(images)
        text = self.render_prompt(messages)
        bos = getattr(self.tokenizer, "bos_token", None)
        # The processor tokenizes with add_special_tokens=True; a template that already
        # renders BOS would get it twice, so skip the automatic one then.
        add_special = not (bos and text.startswith(bos))
        ids: list[int] = self.tokenizer(text, add_special_tokens=add_special)["input_ids"]
        check_placeholder_tokens(ids, self.image_token_id, len(images))
        expanded: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                expanded.extend([t] * images[k].n_tokens)
                k += 1
            else:
                expanded.append(t)
        return expanded

    # -- prefill / decode -----------------------------------------------------------------------

    def prefill(
        self,
        messages: list[dict[str, Any]],
        images: Sequence[EncodedImage],
        params: SamplingParams,
        stats: GenerationStats | None = None,
    ) -> DecodeState:
        """Run the prompt through the LM and sample the first token."""
        from transformers import DynamicCache

        validate_params(params)
        t0 = time.perf_counter()
        ids = self.build_prompt_ids(messages, images)
        n_prompt = len(ids)
        if n_prompt + params.max_tokens > self.max_positions:
            raise InvalidRequest(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_positions} tokens",
                param="max_tokens",
            )
        input_ids = torch.tensor([ids], dtype=torch.long)
        try:
            with torch.inference_mode():
                embeds = self.model.get_input_embeddings()(input_ids)
                mask = input_ids == self.image_token_id
                if images:
                    feats = torch.cat([im.features for im in images], dim=0).to(embeds.dtype)
                    embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), feats)
                position_ids, rope_delta = self._prefill_positions(input_ids, mask, images)
                cache = DynamicCache(config=self.config)
                out = self.model(
                    inputs_embeds=embeds,
                    position_ids=position_ids,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        except (RuntimeError, ValueError, IndexError) as exc:
            raise EngineError(f"prefill failed: {exc}") from exc

        generator = None
        seed = params.seed
        if params.temperature > 0:
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
            generator = torch.Generator(device="cpu").manual_seed(seed)
        first = sample_next(out.logits[0, -1], params, generator)
        state = DecodeState(
            cache=out.past_key_values,
            past_len=n_prompt,
            last_token=first,
            rope_delta=rope_delta,
            prompt_tokens=n_prompt,
            output_ids=[first],
            generator=generator,
            seed=seed,
        )
        if stats is not None:
            stats.prompt_tokens = n_prompt
            stats.prefill_s = time.perf_counter() - t0
        return state

    def _prefill_positions(
        self, input_ids: torch.Tensor, image_mask: torch.Tensor, images: Sequence[EncodedImage]
    ) -> tuple[torch.Tensor, int]:
        """Position ids for the prompt, shaped as ``generate()`` builds them, plus the M-RoPE delta."""
        n = input_ids.shape[1]
        text_pos = torch.arange(n, dtype=torch.long).view(1, 1, n)
        if not self.is_mrope:
            return text_pos[0], 0
        if images:
            grid = torch.tensor([list(im.grid_thw) for im in images], dtype=torch.long)  # type: ignore[arg-type]
            vision_pos, deltas = self.model.model.get_rope_index(
                input_ids, mm_token_type_ids=image_mask.to(torch.int32), image_grid_thw=grid
            )
            delta = int(deltas.reshape(-1)[0])
        else:
            vision_pos, delta = text_pos.expand(3, 1, n), 0
        # [4, 1, n]: text positions first (used for the mask), then (t, h, w) M-RoPE positions.
        return torch.cat([text_pos, vision_pos], dim=0), delta

    def _decode_positions(self, state: DecodeState) -> torch.Tensor:
        p = state.past_len
        if not self.is_mrope:
            return torch.tensor([[p]], dtype=torch.long)
        q = p + state.rope_delta
        return torch.tensor([[[p]], [[q]], [[q]], [[q]]], dtype=torch.long)

    def decode_logits(self, state: DecodeState) -> torch.Tensor:
        """Feed ``state.last_token`` through the LM (extending ``state.cache``) and return the
        next-token logits ``[vocab]``. ``state``'s token fields are not advanced: see
        :meth:`DecodeState.advance`."""
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

    def decode_step(self, state: DecodeState, params: SamplingParams) -> int:
        """Feed ``state.last_token`` to the LM, sample the next token, advance ``state``."""
        nxt = sample_next(self.decode_logits(state), params, state.generator)
        state.advance(nxt)
        return nxt

    def decode(
        self, state: DecodeState, params: SamplingParams, stats: GenerationStats | None = None
    ) -> Iterator[TokenEvent]:
        """Emit events for the tokens in ``state`` and keep decoding until a stop condition.

        Finish reasons: ``"stop"`` on an EOS token (unless ``ignore_eos``) or a stop string (the
        text then ends right before it), ``"length"`` after ``max_tokens`` tokens.
        """
        stream = DecodeStream(self, state, params)
        try:
            while True:
                t0 = time.perf_counter()
                if stream.needs_step:
                    self.decode_step(state, params)
                event = stream.emit()
                if stats is not None:
                    stats.completion_tokens = state.emitted
                    stats.decode_s += time.perf_counter() - t0
                yield event
                if event.finish_reason is not None:
                    return
        except (RuntimeError, ValueError, IndexError) as exc:
            raise EngineError(f"decode failed: {exc}") from exc

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

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
