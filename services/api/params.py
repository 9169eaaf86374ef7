"""The request parameters of ``/v1/chat/completions`` and ``/v1/completions``: one table, one typed
request model per endpoint.

:data:`PARAMS` classifies every field of OpenAI's and vLLM's (0.32) request schemas of both endpoints:

* ``honoured``: mapped into the job's ``SamplingSpec`` (applied by the engines) or into API behaviour;
* ``ignored``: metadata that changes nothing about the completion (``user``, ...): accepted;
* ``refused``: not implemented here. Left out, or set to a value that changes nothing (:attr:`Param.noop`),
  it is accepted; any other value is a 400 (``unsupported_parameter``) whose ``param`` names it - never
  silently dropped. Turning one into ``honoured`` (structured output, say) is a change of this table.

A field in neither schema is a 400 too (``unknown_parameter``), as OpenAI answers. ``docs/api.md``'s
parameter table is this table; ``tests/test_api_params.py`` checks that every field of vLLM's
``ChatCompletionRequest`` / ``CompletionRequest`` is classified here, and that the typed models below
have exactly the fields the table gives their endpoint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

import msgspec


class Endpoint(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


CHAT = (Endpoint.CHAT,)
COMPLETIONS = (Endpoint.COMPLETIONS,)
BOTH = (Endpoint.CHAT, Endpoint.COMPLETIONS)

Status = Literal["honoured", "ignored", "refused"]


@dataclass(frozen=True)
class Param:
    status: Status
    endpoints: tuple[Endpoint, ...]
    notes: str
    #: ``refused``: the values that change nothing, accepted (absent is always accepted); per
    #: endpoint where the default differs
    noop: tuple[Any, ...] | dict[Endpoint, tuple[Any, ...]] = (None,)
    #: applied by the engines (transformers and vLLM both: ``SamplingSpec``), not by the API
    engine: bool = False
    #: where the field comes from: ``openai``, ``vllm`` or both
    source: tuple[str, ...] = ("openai", "vllm")
    #: the refusal's reason, appended to its message
    why: str = ""

    def noop_values(self, endpoint: Endpoint) -> tuple[Any, ...]:
        return self.noop[endpoint] if isinstance(self.noop, dict) else self.noop

    def is_noop(self, value: Any, endpoint: Endpoint) -> bool:
        # (compared by type too: ``True == 1`` must not make ``priority: true`` a no-op)
        return any(type(value) is type(v) and value == v for v in self.noop_values(endpoint))


def honoured(endpoints: tuple[Endpoint, ...], notes: str, *, engine: bool = False, source=("openai", "vllm")) -> Param:
    return Param("honoured", endpoints, notes, engine=engine, source=source)


def ignored(endpoints: tuple[Endpoint, ...], notes: str, *, source=("openai", "vllm")) -> Param:
    return Param("ignored", endpoints, notes, source=source)


def refused(
    endpoints: tuple[Endpoint, ...],
    notes: str,
    *,
    noop: tuple[Any, ...] | dict[Endpoint, tuple[Any, ...]] = (None,),
    source=("vllm",),
    why: str = "",
) -> Param:
    return Param("refused", endpoints, notes, noop=noop, source=source, why=why)


_NO_STRUCTURED = "structured output is requested with `response_format` here"
_NO_TOOLS = "the deprecated function-calling fields are not implemented: use `tools` / `tool_choice`"
_NO_BEAM = "beam search is not implemented"

#: Every request field of both endpoints, by name (the order of ``docs/api.md``).
PARAMS: dict[str, Param] = {
    # -- what to complete --------------------------------------------------------------------------
    "model": honoured(BOTH, "optional; the served model's id (`EPD_MODEL_NAME`), any other id is a 400"),
    "messages": honoured(
        CHAT,
        "roles `system`, `user`, `assistant`, `developer` (= `system`); text, `image_url` and `video_url` parts "
        "(video where the model takes it: docs/models.md). Where the "
        "model's chat template renders tools: an assistant's `tool_calls` and `tool` messages (`tool_call_id`, "
        "text) - a conversation continuing after a call; elsewhere they are a 400",
    ),
    "prompt": honoured(
        COMPLETIONS,
        "a string (no chat template) or a list of token ids; a list of one of those; several prompts are a 400",
    ),
    # -- sampling (SamplingSpec: both engines apply them) ---------------------------------------------
    "max_tokens": honoured(
        BOTH,
        "[1, `EPD_MAX_TOKENS_LIMIT`]; default chat: the model's `max_new_tokens`, else `EPD_DEFAULT_MAX_TOKENS`; "
        "completions 16 (null: the chat default)",
        engine=True,
    ),
    "max_completion_tokens": honoured(CHAT, "as `max_tokens`, and wins over it", engine=True),
    "temperature": honoured(
        BOTH, "[0, 2]; default: the model's (`EPD_GENERATION_CONFIG`), else 1; 0 = greedy", engine=True
    ),
    "top_p": honoured(BOTH, "(0, 1]; default: the model's, else 1", engine=True),
    "top_k": honoured(
        BOTH, "an integer >= 1, or -1 / 0 = off; default: the model's, else off", engine=True, source=("vllm",)
    ),
    "min_p": honoured(BOTH, "[0, 1]; 0 = off; default: the model's, else 0", engine=True, source=("vllm",)),
    "presence_penalty": honoured(BOTH, "[-2, 2]; 0 = off; default: the model's, else 0", engine=True),
    "frequency_penalty": honoured(BOTH, "[-2, 2]; 0 = off; default: the model's, else 0", engine=True),
    "repetition_penalty": honoured(
        BOTH,
        "> 0 (at most 2); 1 = off; over prompt and output tokens; default: the model's, else 1",
        engine=True,
        source=("vllm",),
    ),
    "logit_bias": honoured(
        BOTH,
        'token id (a string, `"123"`) -> bias in [-100, 100]; an id outside the vocabulary is a 400 from the worker',
        engine=True,
    ),
    "min_tokens": honoured(
        BOTH, "[0, max_tokens]: no EOS / stop before that many tokens", engine=True, source=("vllm",)
    ),
    "stop": honoured(BOTH, "a string or up to 4 non-empty strings; not part of the text", engine=True),
    "stop_token_ids": honoured(BOTH, "token ids that end the completion", engine=True, source=("vllm",)),
    "ignore_eos": honoured(
        BOTH, "generate `max_tokens` whatever the end-of-sequence token", engine=True, source=("vllm",)
    ),
    "seed": honoured(
        BOTH,
        "[0, 2^63); none: derived from the request id (replayable). Choice i of `n` samples with seed + i",
        engine=True,
    ),
    "logprobs": honoured(
        BOTH,
        "chat: a boolean; completions: an integer in [0, 20] (that many alternatives per token)",
        engine=True,
    ),
    "top_logprobs": honoured(CHAT, "[0, 20] alternatives per token; needs `logprobs: true`", engine=True),
    # -- API behaviour --------------------------------------------------------------------------------
    "n": honoured(
        BOTH,
        "[1, 16] choices: one generation job each, sharing the images (one encode job per distinct image)",
    ),
    "best_of": honoured(
        COMPLETIONS, "null or equal to `n` (no re-ranking); anything else is a 400", source=("openai",)
    ),
    "stream": honoured(BOTH, "server-sent events; choice i's chunks carry `index` i"),
    "stream_options": honoured(
        BOTH, "`include_usage: true` adds a last chunk with `usage`; `continuous_usage_stats: true` is a 400"
    ),
    "echo": honoured(
        BOTH,
        "chat: the last message's content is prepended when its role is `assistant` (vLLM); completions: the "
        "prompt is prepended (not with `logprobs`: prompt logprobs are not computed)",
    ),
    "return_token_ids": honoured(
        BOTH, "the completion's token ids in `choices[i].token_ids` (per chunk when streaming)", source=("vllm",)
    ),
    "return_tokens_as_token_ids": honoured(
        BOTH, 'logprob tokens as `"token_id:<id>"` (for tokens that are not valid UTF-8 alone)', source=("vllm",)
    ),
    # -- metadata: accepted, no effect on the completion ----------------------------------------------
    "user": ignored(BOTH, "an end-user id: metadata, not used"),
    "session_id": ignored(BOTH, "a session id: metadata, not used", source=("vllm",)),
    "metadata": ignored(CHAT, "stored-completion tags: metadata, not used", source=("openai",)),
    "safety_identifier": ignored(CHAT, "an end-user id: metadata, not used", source=("openai",)),
    "prompt_cache_key": ignored(CHAT, "a prompt-cache routing hint: not used", source=("openai",)),
    "parallel_tool_calls": honoured(
        CHAT, '`false`: `tool_choice` `"auto"` answers the first call only (vLLM); a named choice makes one call'
    ),
    # -- refused unless set to what changes nothing ----------------------------------------------------
    "response_format": honoured(
        BOTH,
        '`{"type": "text"}`; `{"type": "json_object"}` (any JSON object); `{"type": "json_schema", "json_schema": '
        '{"name", "schema", "strict", "description"}}` (a document valid under `schema`, always strict). '
        "Grammar-constrained decoding with xgrammar (vLLM's default backend) on both engines; a schema the grammar "
        "engine cannot enforce is a 400; not with `min_tokens` > 0 or a named `tool_choice`",
        engine=True,
    ),
    "structured_outputs": refused(BOTH, "", why=_NO_STRUCTURED),
    "guided_json": refused(BOTH, "older vLLM", why=_NO_STRUCTURED),
    "guided_regex": refused(BOTH, "older vLLM", why=_NO_STRUCTURED),
    "guided_choice": refused(BOTH, "older vLLM", why=_NO_STRUCTURED),
    "guided_grammar": refused(BOTH, "older vLLM", why=_NO_STRUCTURED),
    "guided_decoding_backend": refused(BOTH, "older vLLM", why=_NO_STRUCTURED),
    "guided_whitespace_pattern": refused(BOTH, "older vLLM", why=_NO_STRUCTURED),
    "logits_processors": refused(BOTH, "older vLLM", why="custom logits processors are not supported"),
    "tools": honoured(
        CHAT,
        'up to 128 `{"type": "function", "function": {"name", "description", "parameters", "strict"}}`, given to '
        'the chat template (as vLLM does); without `tool_choice` it defaults to `"auto"` (see there)',
        engine=True,
    ),
    "tool_choice": honoured(
        CHAT,
        '`"none"` (tools in the prompt, free text); `"auto"`: the model decides, its calls are read by the tool '
        "parser of its chat template's format (Hermes / Qwen2.5 `<tool_call>`) into `tool_calls` (finish_reason "
        "`tool_calls`, streamed as `delta.tool_calls`) - a 400 where the chat template renders no tools; a named "
        'function `{"type": "function", "function": {"name": ...}}`: its arguments are generated under its '
        '`parameters` schema and answered as `tool_calls` (finish_reason `stop`); `"required"` is a 400',
        engine=True,
    ),
    "functions": refused(CHAT, "deprecated OpenAI field", noop=(None, []), source=("openai",), why=_NO_TOOLS),
    "function_call": refused(CHAT, "deprecated OpenAI field", noop=(None, "none"), source=("openai",), why=_NO_TOOLS),
    "prompt_logprobs": refused(BOTH, "", why="prompt logprobs are not computed"),
    "logprob_token_ids": refused(BOTH, ""),
    "suffix": refused(COMPLETIONS, "", noop=(None, ""), source=("openai", "vllm"), why="insertion is not implemented"),
    "use_beam_search": refused(BOTH, "", noop=(None, False), why=_NO_BEAM),
    "length_penalty": refused(BOTH, "beam search only", noop=(None, 1.0, 1), why=_NO_BEAM),
    "allowed_token_ids": refused(BOTH, ""),
    "bad_words": refused(BOTH, "", noop=(None, [])),
    "include_stop_str_in_output": refused(BOTH, "", noop=(None, False)),
    "skip_special_tokens": refused(BOTH, "special tokens are always skipped", noop=(None, True)),
    "spaces_between_special_tokens": refused(BOTH, "", noop=(None, True)),
    "truncate_prompt_tokens": refused(BOTH, ""),
    "truncation_side": refused(BOTH, ""),
    "watermarking": refused(BOTH, "", noop=(None, False)),
    "repetition_detection": refused(BOTH, ""),
    "thinking_token_budget": refused(BOTH, ""),
    "reasoning_effort": refused(CHAT, "", source=("openai", "vllm"), why="no reasoning model support"),
    "include_reasoning": refused(CHAT, "", noop=(None, True)),
    "verbosity": refused(CHAT, "", source=("openai",)),
    "add_generation_prompt": refused(CHAT, "always true", noop=(None, True)),
    "continue_final_message": refused(CHAT, "", noop=(None, False)),
    "add_special_tokens": refused(
        BOTH,
        "chat false, completions true (the defaults)",
        noop={Endpoint.CHAT: (None, False), Endpoint.COMPLETIONS: (None, True)},
    ),
    "documents": refused(CHAT, ""),
    "chat_template": refused(CHAT, "the model folder's template is used"),
    "chat_template_kwargs": refused(CHAT, "", noop=(None, {})),
    "media_io_kwargs": honoured(
        CHAT,
        '`{"video": {"num_frames": N, "fps": F}}`: how a video is sampled (vLLM\'s loader\'s frames; a model '
        "whose loader samples by fps refuses `num_frames` by name); any other key is a 400",
        source=("vllm",),
    ),
    "mm_processor_kwargs": refused(CHAT, "", noop=(None, {})),
    "prompt_embeds": refused(COMPLETIONS, ""),
    "priority": refused(BOTH, "no priority scheduling", noop=(None, 0)),
    "request_id": refused(BOTH, "the server names requests (`X-Request-Id`)"),
    "cache_salt": refused(BOTH, ""),
    "kv_transfer_params": refused(BOTH, "KV transfer is the server's own (E|P|D)"),
    "ec_transfer_params": refused(BOTH, "encoder-cache transfer is the server's own"),
    "vllm_xargs": refused(BOTH, "", noop=(None, {})),
    "routed_experts_prompt_start": refused(BOTH, "", noop=(None, 0)),
    "return_token_offsets": refused(BOTH, "render endpoints only in vLLM", noop=(None, False)),
    "return_prompt_text": refused(CHAT, "", noop=(None, False)),
    "mm_payload": refused(BOTH, "render endpoints only in vLLM", noop=(None, "tensors")),
    "return_mm_kwargs": refused(BOTH, "deprecated vLLM alias of `mm_payload`"),
    "stream_interval": refused(BOTH, "every token chunk is sent as it comes", noop=(None, 1)),
    "audio": refused(CHAT, "", source=("openai",), why="audio output is not supported"),
    "modalities": refused(CHAT, '`["text"]` only', noop=(None, ["text"]), source=("openai",)),
    "prediction": refused(CHAT, "", source=("openai",)),
    "service_tier": refused(CHAT, '`"auto"` / `"default"` only', noop=(None, "auto", "default"), source=("openai",)),
    "store": refused(CHAT, "nothing is stored for later retrieval", noop=(None, False), source=("openai",)),
    "web_search_options": refused(CHAT, "", source=("openai",)),
    "prompt_cache_retention": refused(CHAT, "", source=("openai",)),
    "prompt_cache_options": refused(CHAT, "", source=("openai",)),
    "moderation": refused(CHAT, "", source=("openai",)),
}


def fields_of(endpoint: Endpoint) -> frozenset[str]:
    """The request fields of ``endpoint`` (a body key outside them is an ``unknown_parameter``)."""
    return frozenset(name for name, p in PARAMS.items() if endpoint in p.endpoints)


# -- the typed request models ----------------------------------------------------------------------
# Honoured fields are typed (``msgspec.convert(..., strict=True)`` checks them: a wrong type is a 400
# naming the field); refused and ignored ones are ``Any``: their values are checked against the
# table (:meth:`Param.is_noop`) before conversion. Ranges are checked in ``services.api.schemas``.


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    #: OpenAI's padding of stream chunks; no padding is added here
    include_obfuscation: bool | None = None


class RequestModel(msgspec.Struct, kw_only=True):
    """The fields both endpoints have."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    user: Any = None
    session_id: Any = None
    #: checked in ``services.api.schemas`` (its messages name the offending part)
    response_format: Any = None
    # refused unless no-op
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    watermarking: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    add_special_tokens: Any = None
    priority: Any = None
    request_id: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    stream_interval: Any = None


class ChatCompletionRequest(RequestModel, kw_only=True):
    """``POST /v1/chat/completions``: OpenAI's and vLLM's fields (:data:`PARAMS`)."""

    #: validated part by part in ``services.api.schemas`` (its messages name the offending part)
    messages: list[Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    parallel_tool_calls: bool | None = None
    #: checked in ``services.api.schemas``
    tools: Any = None
    tool_choice: Any = None
    # refused unless no-op
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    verbosity: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    service_tier: Any = None
    store: Any = None
    web_search_options: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None


class CompletionRequest(RequestModel, kw_only=True):
    """``POST /v1/completions``: OpenAI's and vLLM's fields (:data:`PARAMS`)."""

    #: a string, token ids, or a list of one of those (msgspec unions cannot tell the list kinds
    #: apart: checked in ``services.api.schemas``)
    prompt: Any = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Any = None
    prompt_embeds: Any = None


MODELS: dict[Endpoint, type[RequestModel]] = {
    Endpoint.CHAT: ChatCompletionRequest,
    Endpoint.COMPLETIONS: CompletionRequest,
}
