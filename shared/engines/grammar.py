"""Structured output: grammar-constrained decoding with xgrammar, the library behind vLLM's default
structured-output backend, so both engines constrain a completion the same way.

* :func:`structured_output` - the API's side: turn ``response_format`` json_object / json_schema
  (or a named tool's parameters) into the wire :class:`~shared.protocol.StructuredOutput`, with the
  checks that need no grammar library (shape, size, nesting, the JSON-schema features xgrammar
  does not enforce). Torch-free, like the rest of this module at import time.
* :func:`vllm_structured_outputs` - the vLLM engine's side: the ``StructuredOutputsParams`` for a
  ``StructuredOutput`` (vLLM compiles and applies the grammar itself).
* :class:`GrammarCompiler` / :class:`GrammarConstraint` - the transformers engine's side: one
  compiler per tokenizer and logits width (:func:`compiler_for`), one constraint per request that
  masks the logits row before sampling (:meth:`GrammarConstraint.mask`), follows the sampled
  tokens (:meth:`~GrammarConstraint.accept`) and can be rebuilt from the tokens a request already
  produced (:meth:`~GrammarConstraint.replay`: the E|P|D decode side, a redelivered job).

Matching vLLM (``vllm/v1/structured_output/backend_xgrammar.py``, 0.32):

* ``json_schema`` compiles the schema with ``compile_json_schema(schema, any_whitespace=True)``
  and xgrammar's other defaults (``strict_mode=True``: no properties beyond the schema's unless it
  allows them); ``json_object`` compiles the schema ``{"type": "object"}`` the same way (vLLM's
  choice: any JSON *object*, not any JSON value).
* The stop tokens the grammar allows once the JSON is complete are the request's: vLLM passes
  ``SamplingParams.all_stop_token_ids`` (the tokenizer's EOS, the generation config's EOS ids,
  the request's ``stop_token_ids``) as ``override_stop_tokens``; pass the engine's EOS ids plus the
  request's ``stop_token_ids`` here. Once the grammar accepted a stop token it is terminated and
  masks nothing more (vLLM fills a full bitmask then).
* The bitmask is applied to the raw logits, before any other logits processing (logit bias,
  penalties, temperature) and before the logprobs are taken: vLLM masks the logits in the model
  runner, before its sampler.
* The logits width (the model's vocabulary size, which may exceed the tokenizer's) is the
  ``vocab_size`` of the tokenizer info and the bitmask (vLLM: ``model_config.get_vocab_size()``).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from shared.errors import EngineError, InvalidRequest
from shared.protocol import MAX_STRUCTURED_SCHEMA_BYTES, StructuredKind, StructuredOutput

if TYPE_CHECKING:  # torch and xgrammar (which imports torch and transformers) load on first use
    import torch
    import xgrammar
    from vllm.sampling_params import StructuredOutputsParams

#: Objects and arrays may nest at most this deep in a schema (vLLM's
#: ``MAX_STRUCTURED_OUTPUT_JSON_NESTING``; grammar conversion cost grows steeply with nesting).
MAX_SCHEMA_NESTING = 64

#: The schema vLLM compiles for ``json_object`` (any JSON object).
JSON_OBJECT_SCHEMA = '{"type": "object"}'

#: Memory bound of one compiler's cache of compiled grammars (per schema).
COMPILE_CACHE_BYTES = 64 * 1024 * 1024


# -- the API's side: response_format -> StructuredOutput ----------------------------------------


def structured_output(kind: str, schema: Any = None, *, param: str = "response_format") -> StructuredOutput:
    """The wire constraint of ``kind`` (``json_object`` / ``json_schema``) with ``schema`` (the
    parsed JSON schema, an object; None for json_object). Raises InvalidRequest (``param``) for an
    unknown kind, a schema that is not a JSON object, too large (``MAX_STRUCTURED_SCHEMA_BYTES``),
    nested deeper than ``MAX_SCHEMA_NESTING`` or using features xgrammar would not enforce. The
    schema is kept as compact JSON text in its own key order (the grammar emits an object's
    properties in the schema's order, as vLLM does). A schema xgrammar then cannot compile (an
    unknown type, a dangling ``$ref``) is refused by the engine (:meth:`GrammarCompiler.compile`,
    or vLLM), also as InvalidRequest; :func:`check_grammar` runs that check up front."""
    try:
        k = StructuredKind(kind)
    except ValueError:
        raise InvalidRequest(
            f"unsupported structured output type {kind!r}; supported: {', '.join(StructuredKind)}", param=param
        ) from None
    if k == StructuredKind.JSON_OBJECT:
        if schema is not None:
            raise InvalidRequest("json_object takes no schema", param=param)
        return StructuredOutput(kind=k)
    if not isinstance(schema, dict):
        raise InvalidRequest(f"the JSON schema must be a JSON object, got {type(schema).__name__}", param=param)
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", param=param) from None
    if len(text.encode()) > MAX_STRUCTURED_SCHEMA_BYTES:
        raise InvalidRequest(
            f"the JSON schema is larger than {MAX_STRUCTURED_SCHEMA_BYTES} bytes as compact JSON", param=param
        )
    if _nesting_exceeds(schema, MAX_SCHEMA_NESTING):
        raise InvalidRequest(
            f"the JSON schema is nested too deeply: objects and arrays may nest at most {MAX_SCHEMA_NESTING} levels",
            param=param,
        )
    reason = unsupported_feature(schema)
    if reason is not None:
        raise InvalidRequest(f"the JSON schema uses a feature the grammar engine cannot enforce: {reason}", param=param)
    return StructuredOutput(kind=k, schema=text)


def _nesting_exceeds(doc: Any, limit: int) -> bool:
    """Whether ``doc`` nests objects and arrays deeper than ``limit`` (vLLM's measure)."""
    level: list[Any] = [doc]
    for _ in range(limit):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


# xgrammar 0.2.8 accepts these string formats (vLLM's STRING_SUPPORTED_FORMATS).
_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _pattern_and_length(node: dict[str, Any]) -> bool:
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)


def unsupported_feature(schema: Any) -> str | None:
    """The first JSON-schema feature in ``schema`` that xgrammar 0.2.8 would silently not enforce
    (None if there is none): vLLM's ``has_xgrammar_unsupported_json_features``, which makes vLLM
    refuse such a schema with its xgrammar backend (its ``auto`` backend would switch to another
    library instead; this project refuses on both engines)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        types = _types(node)
        if types & {"integer", "number"} and "multipleOf" in node:
            return "multipleOf"
        if "array" in types:
            for key in ("uniqueItems", "contains", "minContains", "maxContains"):
                if key in node:
                    return f"{key} on an array"
        if "string" in types:
            if "format" in node and node["format"] not in _STRING_FORMATS:
                return f"string format {node['format']!r}"
            if _pattern_and_length(node):
                return "pattern or format together with minLength / maxLength"
        if "object" in types and "propertyNames" in node:
            names = node.get("propertyNames")
            if isinstance(names, dict) and _pattern_and_length(names):
                return "propertyNames with a pattern or format and a length bound"
            for key in ("patternProperties", "properties"):
                if key in node:
                    return f"propertyNames together with {key}"
            if node.get("unevaluatedProperties", True) is not True:
                return "propertyNames together with unevaluatedProperties"
        if "object" in types and isinstance(node.get("patternProperties"), dict):
            if "properties" in node:
                return "patternProperties together with properties"
            if len(node["patternProperties"]) > 1:
                return "more than one patternProperties entry"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) >= 2:
            return "allOf with more than one branch"
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return None


def _schema_text(so: StructuredOutput) -> str:
    return JSON_OBJECT_SCHEMA if so.kind == StructuredKind.JSON_OBJECT else so.schema


def _clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ location prefix (``[12:00:00] /project/cpp/x.cc:12: ``)."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.replace("Check failed: (error.empty()) is false: ", "")


def _invalid_schema(exc: BaseException, param: str) -> InvalidRequest:
    return InvalidRequest(f"the JSON schema cannot be turned into a grammar: {_clean_error(exc)}", param=param)


def check_grammar(so: StructuredOutput, *, param: str = "response_format") -> None:
    """Convert ``so`` to a grammar without a tokenizer (what vLLM's request validation does),
    raising InvalidRequest if xgrammar refuses it. Imports xgrammar (and with it torch)."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(_schema_text(so), any_whitespace=True)
    except RuntimeError as exc:
        raise _invalid_schema(exc, param) from None


# -- the vLLM engine's side ---------------------------------------------------------------------


def vllm_structured_outputs(so: StructuredOutput) -> StructuredOutputsParams:
    """vLLM's ``SamplingParams.structured_outputs`` for ``so``: ``json=<schema text>`` or
    ``json_object=True``. vLLM then compiles it with its structured-output backend; start the
    engine with ``structured_outputs_config={"backend": "xgrammar"}`` so a schema xgrammar refuses
    is refused (its default ``auto`` would fall back to another library)."""
    from vllm.sampling_params import StructuredOutputsParams

    if so.kind == StructuredKind.JSON_OBJECT:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=so.schema)


# -- the transformers engine's side -------------------------------------------------------------


class GrammarCompiler:
    """Compiles constraints for one tokenizer and logits width. Compiled grammars are cached per
    schema inside (bounded by ``cache_limit_bytes``); build one per engine (:func:`compiler_for`)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        max_threads: int = 1,
        cache_limit_bytes: int = COMPILE_CACHE_BYTES,
    ):
        import xgrammar as xgr

        if vocab_size < len(tokenizer):
            raise EngineError(f"logits width {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=True, cache_limit_bytes=cache_limit_bytes
        )

    def compile(self, so: StructuredOutput, *, param: str = "response_format") -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``so`` (cached). Raises InvalidRequest if xgrammar refuses the schema."""
        try:
            return self._compiler.compile_json_schema(_schema_text(so), any_whitespace=True)
        except RuntimeError as exc:
            raise _invalid_schema(exc, param) from None

    def constraint(
        self, so: StructuredOutput, stop_token_ids: Iterable[int], *, param: str = "response_format"
    ) -> GrammarConstraint:
        """A fresh constraint for one request (nothing accepted yet). ``stop_token_ids``: the
        tokens that end the completion (the engine's EOS ids plus the request's
        ``stop_token_ids``); the grammar allows only them once the JSON is complete."""
        return GrammarConstraint(self.compile(so, param=param), self.vocab_size, stop_token_ids)


_compilers: weakref.WeakKeyDictionary[Any, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The :class:`GrammarCompiler` of ``tokenizer`` and ``vocab_size`` (built on first use, kept
    while the tokenizer lives)."""
    with _compilers_lock:
        per_tokenizer = _compilers.setdefault(tokenizer, {})
        compiler = per_tokenizer.get(vocab_size)
        if compiler is None:
            compiler = per_tokenizer[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


class GrammarConstraint:
    """The grammar state of one request. Per step: :meth:`mask` the raw logits row, sample, then
    :meth:`accept` the sampled token. Not thread-safe (one request, the engine's compute thread)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, stop_token_ids: Iterable[int]):
        import xgrammar as xgr

        stops = sorted({int(t) for t in stop_token_ids})
        self.vocab_size = vocab_size
        self._compiled = compiled
        # vLLM passes None (xgrammar's stop tokens from the tokenizer) for an empty set
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.accepted = 0

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the completion is over, nothing is masked any more."""
        return bool(self._matcher.is_terminated())

    def next_token_bitmask(self) -> torch.Tensor:
        """The allowed next tokens as xgrammar's packed bitmask ``[1, ceil(vocab_size / 32)]``
        int32 (a copy; all ones once terminated)."""
        if self.is_terminated():
            self._bitmask.fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.clone()

    def mask(self, logits_row: torch.Tensor) -> torch.Tensor:
        """Set the logits of the tokens the grammar does not allow next to -inf, in place, and
        return the row. ``logits_row``: ``[vocab_size]`` raw logits (any float dtype, CPU), before
        any other processing. A no-op once terminated."""
        import xgrammar as xgr

        if logits_row.dim() != 1 or logits_row.shape[0] != self.vocab_size:
            raise EngineError(f"logits row of shape {tuple(logits_row.shape)}, the grammar has {self.vocab_size}")
        if self.is_terminated():
            return logits_row
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        if logits_row.is_contiguous():
            xgr.apply_token_bitmask_inplace(logits_row.view(1, -1), self._bitmask, vocab_size=self.vocab_size)
        else:
            row = logits_row.contiguous().view(1, -1)
            xgr.apply_token_bitmask_inplace(row, self._bitmask, vocab_size=self.vocab_size)
            logits_row.copy_(row[0])
        return logits_row

    def accept(self, token_id: int) -> None:
        """Advance over the sampled ``token_id``. Ignored once terminated (as vLLM does). Raises
        EngineError for a token the grammar does not allow: it was sampled from logits that were
        not masked (or all of whose tokens were masked by something else, e.g. ``min_tokens``
        holding back the only allowed stop token)."""
        if self.is_terminated():
            return
        if not self._matcher.accept_token(int(token_id)):
            raise EngineError(f"token {token_id} does not follow the output grammar (after {self.accepted} tokens)")
        self.accepted += 1

    def replay(self, token_ids: Iterable[int]) -> GrammarConstraint:
        """Rebuild the state after ``token_ids`` (all tokens the request sampled so far, in order:
        an E|P|D decode worker's ``DecodeState.output_ids``), from the start. Returns self."""
        self._matcher.reset()
        self.accepted = 0
        for token in token_ids:
            self.accept(token)
        return self
