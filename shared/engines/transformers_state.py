"""The per-request side of the transformers engine, shared by its single-request decode
(:mod:`shared.engines.transformers_engine`) and its batched decode
(:mod:`shared.engines.transformers_batch`): the decode state and its KV-object form (the E|P|D
hand-off), incremental detokenization, stop strings, the token -> event bookkeeping of one request
(:class:`DecodeStream`) and sampling (:func:`sample_next`, vLLM's sampler semantics). Imports
torch; nothing here imports the engine itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shared.engines.base import SamplingParams, TokenEvent
from shared.engines.prompts import validate_params
from shared.errors import EngineError
from shared.protocol import TokenLogprob
from shared.store.format import RawTensor
from shared.store.tensors import raw_to_tensor, tensor_to_raw

if TYPE_CHECKING:
    from shared.engines.grammar import GrammarConstraint
    from shared.store.kv import KVObject

#: v2: the prompt's token ids travel too (``prompt_ids``: the repetition penalty counts them)
DECODE_STATE_SCHEMA = "epd-decode-state-v2"


# -- decode state -------------------------------------------------------------------------------


@dataclass
class DecodeState:
    """Everything decode needs to continue a request after prefill.

    ``cache`` holds the KV cache of the ``past_len`` positions already run through the LM;
    ``last_token`` (= ``output_ids[-1]``) was sampled from the last logits and is NOT yet in the
    cache. Decode positions are ``past_len + rope_delta`` (``rope_delta`` is 0 for 1-D RoPE).
    ``generator`` is the per-request sampling RNG (``None`` for greedy). ``emitted`` counts
    the ``output_ids`` already turned into events (0 after prefill). ``prompt_ids`` are the
    prompt's token ids (image placeholders expanded): the repetition penalty counts them, and
    the output ids so far carry the presence / frequency penalties and ``min_tokens`` progress,
    so a handed-off state samples on exactly as the aggregated run would. ``logprobs``: output
    index -> :class:`RawLogprob` of a sampled token not emitted yet (never exported: a state is
    exported after every sampled token was emitted).

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
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: dict[int, RawLogprob] = field(default_factory=dict)
    #: the request's grammar (structured output), following ``output_ids``; never exported: the
    #: decode side rebuilds it from the request's constraint and replays ``output_ids``
    grammar: GrammarConstraint | None = field(default=None, repr=False)
    #: cached ``prompt_ids`` as a vocabulary mask (``prompt_mask``)
    _prompt_mask: torch.Tensor | None = field(default=None, repr=False)

    def prompt_mask(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` bool: the token ids that occur in the prompt."""
        mask = self._prompt_mask
        if mask is None or mask.shape[0] != vocab_size:
            mask = token_mask(self.prompt_ids, vocab_size)
            self._prompt_mask = mask
        return mask

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
        """``(tensors, metadata)``: ``kv.{i}.k`` / ``kv.{i}.v`` / ``prompt_ids`` /
        ``generator_state`` and string metadata, ready for
        ``safetensors.torch.save(tensors, metadata=metadata)``."""
        if self.emitted < len(self.output_ids):
            raise EngineError("cannot export a decode state with sampled tokens not emitted yet")
        tensors: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(self.kv_tensors()):
            tensors[f"kv.{i}.k"] = k.contiguous()
            tensors[f"kv.{i}.v"] = v.contiguous()
        tensors["prompt_ids"] = torch.tensor(self.prompt_ids, dtype=torch.int64)
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
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str], config: Any) -> DecodeState:
        """Rebuild a state written by :meth:`to_tensors` (``config``: the model config)."""
        from transformers import DynamicCache

        if metadata.get("schema") != DECODE_STATE_SCHEMA:
            raise EngineError(f"unknown decode state schema {metadata.get('schema')!r}")
        try:
            st = json.loads(metadata["state"])
            n_layers = int(st["n_layers"])
            kv = [(tensors[f"kv.{i}.k"], tensors[f"kv.{i}.v"]) for i in range(n_layers)]
            prompt_ids_t = tensors["prompt_ids"]
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineError(f"malformed decode state: {exc}") from exc
        vocab_size = int(config.get_text_config(decoder=True).vocab_size)
        if prompt_ids_t.dtype != torch.int64 or prompt_ids_t.ndim != 1:
            raise EngineError(f"decode state prompt_ids must be a 1-D int64 tensor, got {prompt_ids_t.dtype}")
        prompt_ids = [int(t) for t in prompt_ids_t.tolist()]
        if len(prompt_ids) != int(st.get("prompt_tokens", -1)) or any(t < 0 or t >= vocab_size for t in prompt_ids):
            raise EngineError("decode state prompt_ids do not match its prompt (length or vocabulary)")
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
            cache=DynamicCache(kv),  # full layers (see TransformersEngine._prefill)
            past_len=int(st["past_len"]),
            last_token=int(st["last_token"]),
            rope_delta=int(st["rope_delta"]),
            prompt_tokens=int(st["prompt_tokens"]),
            output_ids=[int(t) for t in st["output_ids"]],
            generator=generator,
            seed=st["seed"],
            emitted=int(st["emitted"]),
            prompt_ids=prompt_ids,
        )


def decode_state_to_raw(state: DecodeState) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """A ``DecodeState`` as raw tensors + its metadata, for :class:`shared.store.kv.KVStore`."""
    tensors, meta = state.to_tensors()
    return {name: RawTensor(*tensor_to_raw(t)) for name, t in tensors.items()}, meta


def kv_object_to_state(obj: KVObject, config: Any) -> DecodeState:
    """Rebuild the ``DecodeState`` of a validated KV object (``config``: the model config).
    Raises EngineError when the state does not fit the model (layers, heads, shapes)."""
    tensors = {name: raw_to_tensor(t.data, t.dtype, t.shape) for name, t in obj.tensors.items()}
    return DecodeState.from_tensors(tensors, obj.state_metadata, config)


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
        self._decode = ids_decoder(tokenizer)

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


def ids_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``.

    For a tokenizer backed by the ``tokenizers`` library whose ``decode`` and ``_decode`` are
    transformers' own, that is its backend's ``decode`` (transformers' wrapper converts and
    checks the arguments first: ~4 us a call here against ~0.2, and the detokenizer makes two
    calls per token). Any other tokenizer is called as it is."""
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    ):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def special_token_ids_of(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    ids = {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
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
    turn into a stop string. The stop string that completes first wins (ties: the first in
    ``stops``), as in vLLM.

    ``min_end`` (``min_tokens``): only a stop string that ends after this text offset counts;
    ``None`` - none counts yet. The owner sets it once the ``min_tokens``-th token's text is in.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._text = ""
        self._emitted = 0
        self.min_end: int | None = 0

    @property
    def text_length(self) -> int:
        """Characters fed so far."""
        return len(self._text)

    def _first_stop(self) -> int | None:
        """Start of the stop string that completes first (past ``min_end``), if any."""
        if self.min_end is None:
            return None
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stops:
            # It cannot start inside already emitted text (that text was only emitted once no
            # stop string could begin there) and must end after min_end.
            i = self._text.find(s, max(self._emitted, self.min_end - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def feed(self, delta: str) -> tuple[str, bool]:
        self._text += delta
        if not self.stops:
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return out, False
        end = self._first_stop()
        if end is not None:
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


class Vocabulary(Protocol):
    """What :class:`DecodeStream` reads from its engine (the ``TransformersEngine``)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def byte_token_ids(self) -> frozenset[int]: ...

    @property
    def special_token_ids(self) -> frozenset[int]: ...


class DecodeStream:
    """Per-request decode bookkeeping around a :class:`DecodeState`: sampling (:meth:`sample`),
    incremental detokenization, stop strings, stop tokens, EOS, ``min_tokens``, ``max_tokens``
    and logprobs. Model compute is not done here, so the single-request loop (``generate`` /
    ``continue_here``) and the batched one (``decode``, ``shared.engines.transformers_batch``)
    share the exact same token -> event logic.

    Tokens ``output_ids[:emitted]`` were already emitted by an earlier owner of the state
    (prefill in E|P|D, or a worker that died): they are replayed silently through the
    detokenizer and stop matcher so the text continues exactly where that owner stopped.

    Stop tokens (vLLM semantics): a token of ``stop_token_ids`` - or an EOS token unless
    ``ignore_eos`` - ends the completion with finish reason "stop"; it is in the token ids but
    not in the text. Until ``min_tokens`` tokens were generated, EOS and ``stop_token_ids``
    cannot be sampled (their logits are masked, whatever ``ignore_eos``) and no stop string
    ends the completion: only a stop string ending after the ``min_tokens``-th token's text counts.
    """

    def __init__(self, engine: Vocabulary, state: DecodeState, params: SamplingParams):
        validate_params(params)
        self.state = state
        self.params = params
        self._tokenizer = engine.tokenizer
        self._eos = engine.eos_token_ids
        self._stop_ids = frozenset(params.stop_token_ids)
        #: what min_tokens masks (vLLM's ``all_stop_token_ids``: EOS even when it is ignored)
        self.min_tokens_stop_ids = min_tokens_stop_ids(engine.eos_token_ids, params)
        self._detok = IncrementalDetokenizer(engine.tokenizer, engine.byte_token_ids, engine.special_token_ids)
        self._stopper = StopStringMatcher(params.stop)
        if params.min_tokens > 0:
            self._stopper.min_end = None
        self.finish_reason: str | None = None
        for i, tok in enumerate(state.output_ids[: state.emitted]):
            self._feed(tok, i + 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_step(self) -> bool:
        """True when every sampled token was emitted: the next event needs a decode step."""
        return not self.finished and self.state.emitted >= len(self.state.output_ids)

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from its logits ``[vocab]`` (not appended to the state; its logprob,
        when asked for, is kept for its event)."""
        return sample_into(self.state, logits, self.params, self.min_tokens_stop_ids)

    def _is_stop_token(self, tok: int) -> bool:
        return tok in self._stop_ids or (tok in self._eos and not self.params.ignore_eos)

    def _feed(self, tok: int, n_out: int) -> tuple[str, bool]:
        """Token number ``n_out`` (1-based) through the detokenizer and the stop matcher."""
        out = self._stopper.feed(self._detok.add(tok))
        if n_out == self.params.min_tokens:
            self._stopper.min_end = self._stopper.text_length
        return out

    def emit(self) -> TokenEvent:
        """The event of the next not-yet-emitted token of ``state.output_ids``."""
        if self.finished:
            raise EngineError("decode stream already finished")
        state, params = self.state, self.params
        idx = state.emitted
        tok = state.output_ids[idx]
        state.emitted = n_out = idx + 1
        finish: str | None = None
        if self._is_stop_token(tok):  # in the token ids, not in the text
            text, hit_stop = "", False
            finish = "stop"
        else:
            text, hit_stop = self._feed(tok, n_out)
            if hit_stop:
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
        raw = state.logprobs.pop(idx, None)
        logprob = self._token_logprob(tok, raw) if raw is not None else None
        return TokenEvent(token_id=tok, text=text, finish_reason=finish, logprob=logprob)

    def _token_logprob(self, tok: int, raw: RawLogprob) -> TokenLogprob:
        decode = self._tokenizer.decode
        return TokenLogprob(
            token_id=tok,
            token=decode([tok]),
            logprob=raw.logprob,
            top=tuple((i, decode([i]), lp) for i, lp in raw.top),
        )


# -- sampling -----------------------------------------------------------------------------------

#: temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class RawLogprob:
    """A sampled token's log-probability under the raw model logits (``log_softmax``, before
    penalties, bias, temperature, top-k / top-p / min-p: vLLM's default ``raw_logprobs``) and the
    ``k`` most likely tokens' ``(id, logprob)``, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def raw_logprob(logits: torch.Tensor, token: int, k: int) -> RawLogprob:
    """:class:`RawLogprob` of ``token`` under ``logits`` ``[vocab]``."""
    lp = torch.log_softmax(logits.to(dtype=torch.float32), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return RawLogprob(logprob=float(lp[token]), top=top)


def token_mask(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` bool, True at every id of ``ids``."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    if ids:
        mask[torch.tensor(list(ids), dtype=torch.long)] = True
    return mask


def min_tokens_stop_ids(eos_token_ids: frozenset[int], params: SamplingParams) -> frozenset[int]:
    """The tokens ``min_tokens`` keeps from being sampled: EOS (even with ``ignore_eos``, as
    vLLM) and ``stop_token_ids``."""
    return frozenset(eos_token_ids) | frozenset(params.stop_token_ids)


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt_mask: torch.Tensor | None,
    output_ids: Sequence[int],
    stop_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """What changes the distribution before the greedy / random choice, in vLLM's order:
    ``min_tokens`` (stop tokens masked while fewer tokens were generated), ``logit_bias``
    (added), then the penalties - repetition (over prompt + output tokens: positive logits
    divided, negative multiplied), frequency (minus penalty x count in the output), presence
    (minus penalty once per token in the output). ``logits`` ``[vocab]`` float32; a new tensor
    when anything applies."""
    vocab = logits.shape[-1]
    if params.min_tokens and len(output_ids) < params.min_tokens and stop_ids:
        logits = logits.clone()
        logits[torch.tensor(sorted(t for t in stop_ids if t < vocab), dtype=torch.long)] = float("-inf")
    if params.logit_bias:
        logits = logits.clone()
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        logits[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    if _has_penalties(params):
        logits = logits.clone()
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        out_mask = counts > 0
        seen = out_mask if prompt_mask is None else (out_mask | prompt_mask)
        penalty = torch.tensor(params.repetition_penalty, dtype=torch.float32)
        penalties = torch.where(seen, penalty, torch.tensor(1.0, dtype=torch.float32))
        logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
        logits -= torch.tensor(params.frequency_penalty, dtype=torch.float32) * counts
        logits -= torch.tensor(params.presence_penalty, dtype=torch.float32) * out_mask
    return logits


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    prompt_mask: torch.Tensor | None = None,
    output_ids: Sequence[int] = (),
    stop_ids: frozenset[int] = frozenset(),
) -> int:
    """Next token from ``logits`` ``[vocab]`` with vLLM's sampler steps: :func:`process_logits`
    (min_tokens, logit_bias, penalties); greedy argmax for a temperature below
    :data:`GREEDY_TEMPERATURE`; else temperature, min-p, top-k, top-p (nucleus), then a draw with
    ``generator``. ``prompt_mask`` / ``output_ids``: the prompt's tokens (as a vocabulary mask)
    and the tokens generated so far, for the penalties and ``min_tokens``."""
    logits = logits.to(dtype=torch.float32)
    logits = process_logits(logits, params, prompt_mask=prompt_mask, output_ids=output_ids, stop_ids=stop_ids)
    if params.temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(logits, dim=-1))
    scores = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < probs.max() * params.min_p, float("-inf"))
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
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


def sample_into(state: DecodeState, logits: torch.Tensor, params: SamplingParams, stop_ids: frozenset[int]) -> int:
    """:func:`sample_next` for ``state`` (its prompt, its outputs so far, its generator); when
    ``params.logprobs`` is set, the token's :class:`RawLogprob` is kept in ``state.logprobs``
    under its output index. The token is not appended.

    With a grammar (``state.grammar``) the raw logits are masked first - before logit bias,
    penalties, temperature and the logprobs, as vLLM applies the grammar bitmask to the model's
    logits before its sampler - and the grammar accepts the sampled token."""
    grammar = state.grammar
    if grammar is not None:
        logits = grammar.mask(logits.to(dtype=torch.float32, copy=True))
    vocab = logits.shape[-1]
    mask = state.prompt_mask(vocab) if params.repetition_penalty != 1.0 else None
    tok = sample_next(logits, params, state.generator, prompt_mask=mask, output_ids=state.output_ids, stop_ids=stop_ids)
    if params.logprobs is not None:
        state.logprobs[len(state.output_ids)] = raw_logprob(logits, tok, params.logprobs)
    if grammar is not None:
        grammar.accept(tok)
    return tok
