"""Prompt helpers shared by every engine: message validation and normalization, image
placeholder counting and checking, chat template rendering, sampling parameter validation.

torch-free and vLLM-free: both engines (and anything that only needs to look at messages)
import it without pulling in a model library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

from shared.chat import ROLES
from shared.engines.base import ChatPrompt, Prompt, RawPrompt, SamplingParams
from shared.errors import InvalidRequest, UnsupportedContent
from shared.protocol import MediaKind

#: Content part types that stand for one image (in order) in a message.
IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image"})
#: Content part types that stand for one video (its sampled frames) in a message.
VIDEO_PART_TYPES = frozenset({"video", "video_url"})
TEXT_PART_TYPES = frozenset({"text", "input_text"})
#: The chat roles (``shared.chat.ROLES``: the same set the API validates against).
_ROLES = frozenset(ROLES)


def _iter_parts(messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The content parts of ``messages`` (validating the message shape on the way)."""
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
            elif ptype not in IMAGE_PART_TYPES and ptype not in VIDEO_PART_TYPES:
                raise UnsupportedContent(f"messages[{i}].content[{j}] has unsupported type {ptype!r}", param="messages")
            yield part


def media_kinds(messages: list[dict[str, Any]]) -> list[MediaKind]:
    """The kind of each media part of ``messages``, in order (validates the message shape)."""
    return [
        MediaKind.VIDEO if part["type"] in VIDEO_PART_TYPES else MediaKind.IMAGE
        for part in _iter_parts(messages)
        if part["type"] not in TEXT_PART_TYPES
    ]


def check_media(messages: list[dict[str, Any]], kinds: Sequence[str]) -> None:
    """Raise :class:`InvalidRequest` unless the media parts of ``messages`` are, in order, of
    ``kinds`` (the items given: one per part)."""
    parts = media_kinds(messages)
    if parts != [MediaKind(k) for k in kinds]:
        raise InvalidRequest(
            f"messages hold media parts {[str(k) for k in parts]} but the items given are {[str(k) for k in kinds]}",
            param="messages",
        )


def check_placeholder_tokens(ids: Sequence[int], token_id: int, n_items: int, what: str = "image") -> None:
    """Raise :class:`InvalidRequest` unless the tokenized prompt has exactly one ``what``
    placeholder token per item (a literal "<|image_pad|>" typed into a text part would add one)."""
    n_placeholders = sum(1 for t in ids if t == token_id)
    if n_placeholders != n_items:
        raise InvalidRequest(
            f"prompt has {n_placeholders} {what} placeholder tokens for {n_items} {what}(s); "
            f"text parts must not contain {what} tokens",
            param="messages",
        )


def _template_arguments(arguments: Any) -> dict[str, Any]:
    """A call's ``arguments`` as chat templates take them: an object (vLLM's
    ``_postprocess_messages``: JSON text is parsed). The API refuses arguments that are not a
    JSON object (``services.api.schemas``); a job that holds one anyway renders ``{}``."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _tool_calls(msg: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the template (checked; arguments as objects)."""
    calls = msg.get("tool_calls")
    if not isinstance(calls, list) or msg["role"] != "assistant":
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list on an assistant message", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}] must hold a function with a name", param="messages")
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": _template_arguments(fn.get("arguments"))},
            }
        )
    return out


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical form for chat templates: string content, or ``{"type": "text", "text"}`` /
    ``{"type": "image"}`` / ``{"type": "video"}`` parts only (URLs and payloads dropped so no template or processor
    ever tries to fetch anything). A tool conversation keeps an assistant's ``tool_calls`` (their
    ``arguments`` as objects, as vLLM hands them to the template) and a tool message's
    ``tool_call_id``; a tool message's text parts are joined into one string (vLLM)."""
    list(_iter_parts(messages))  # validate
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        content = msg["content"]
        norm: dict[str, Any]
        if isinstance(content, str):
            norm = {"role": msg["role"], "content": content}
        elif msg["role"] == "tool":
            if any(part["type"] not in TEXT_PART_TYPES for part in content):
                raise UnsupportedContent(f"messages[{i}]: a tool message holds text only", param="messages")
            norm = {"role": "tool", "content": "\n".join(part["text"] for part in content)}
        else:
            parts: list[dict[str, Any]] = []
            for part in content:
                if part["type"] in IMAGE_PART_TYPES:
                    parts.append({"type": "image"})
                elif part["type"] in VIDEO_PART_TYPES:
                    parts.append({"type": "video"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            norm = {"role": msg["role"], "content": parts}
        if msg.get("tool_calls"):
            norm["tool_calls"] = _tool_calls(msg, i)
        if msg.get("tool_call_id") is not None:
            if msg["role"] != "tool" or not isinstance(msg["tool_call_id"], str):
                raise InvalidRequest(f"messages[{i}].tool_call_id must be a string on a tool message", param="messages")
            norm["tool_call_id"] = msg["tool_call_id"]
        out.append(norm)
    return out


#: Patch area of one image token when only the image's size is known (Qwen2-VL: 14 px patches,
#: 2x2 merged; LLaVA-style towers are in the same range).
_PIXELS_PER_IMAGE_TOKEN = 28 * 28


def prompt_cost(messages: Prompt, image_tokens: Sequence[int]) -> int:
    """A cheap estimate of a request's prompt tokens, for ordering prefills (``shared.admission``):
    ~4 characters a text token plus each image's tokens (a :class:`RawPrompt`: its token ids, or
    its text's characters / 4). Not a validation: odd messages cost 0."""
    if isinstance(messages, RawPrompt):
        if messages.token_ids is not None:
            return len(messages.token_ids)
        return len(messages.text or "") // 4
    chars = 0
    if isinstance(messages, ChatPrompt):
        chars += sum(len(json.dumps(tool)) for tool in messages.tools)
        messages = messages.messages
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES
            )
    return chars // 4 + sum(image_tokens)


def image_token_estimate(width: int, height: int) -> int:
    """Image tokens of an image known only by its size (``prompt_cost``)."""
    return max(1, (width * height) // _PIXELS_PER_IMAGE_TOKEN)


def chat_parts(prompt: list[dict[str, Any]] | ChatPrompt) -> tuple[list[dict[str, Any]], tuple[dict[str, Any], ...]]:
    """The messages and tools of a chat prompt (plain messages have no tools)."""
    if isinstance(prompt, ChatPrompt):
        return prompt.messages, prompt.tools
    return prompt, ()


def render_chat_prompt(
    processor: Any,
    chat_template: str | None,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
) -> str:
    """``chat_template`` applied to ``messages`` (one raw placeholder per image part) with
    ``add_generation_prompt=True`` and, when there are any, ``tools`` (as vLLM renders a chat
    request with tools: the template sees them as ``tools``; one that does not use them renders
    the same prompt as without); template errors become :class:`InvalidRequest`."""
    norm = normalize_messages(messages)
    extra: dict[str, Any] = {"tools": [dict(t) for t in tools]} if tools else {}
    try:
        return processor.apply_chat_template(
            norm, chat_template=chat_template, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:  # jinja2 errors (e.g. a template's raise_exception) land here
        raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc


def check_raw_prompt(prompt: RawPrompt, n_images: int) -> None:
    """Raise :class:`InvalidRequest` (``param="prompt"``) unless ``prompt`` has exactly one of
    ``text`` / ``token_ids``, non-empty, and no images come with it (a completions prompt has none)."""
    if not isinstance(prompt, RawPrompt):
        raise InvalidRequest("prompt must be a RawPrompt", param="prompt")
    if (prompt.text is None) == (prompt.token_ids is None):
        raise InvalidRequest("prompt must be either text or token ids", param="prompt")
    if prompt.text is not None and (not isinstance(prompt.text, str) or not prompt.text):
        raise InvalidRequest("prompt text must be a non-empty string", param="prompt")
    if prompt.token_ids is not None:
        ids = prompt.token_ids
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InvalidRequest("prompt token ids must be a non-empty list of non-negative integers", param="prompt")
    if n_images:
        raise InvalidRequest("a completions prompt takes no images", param="prompt")


#: Most alternatives ``logprobs`` may ask for per token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: Penalty ranges (vLLM ``SamplingParams``; OpenAI's for presence / frequency).
_PENALTY_RANGE = (-2.0, 2.0)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_token_ids(ids: Any, vocab_size: int | None, param: str) -> None:
    for t in ids:
        if not _is_int(t) or t < 0:
            raise InvalidRequest(f"{param} must hold non-negative integer token ids, got {t!r}", param=param)
        if vocab_size is not None and t >= vocab_size:
            raise InvalidRequest(f"token id {t} in {param} is out of the vocabulary (size {vocab_size})", param=param)


def validate_params(params: SamplingParams, *, vocab_size: int | None = None) -> None:
    """Raise :class:`InvalidRequest` (naming the parameter) for sampling settings no engine accepts
    (vLLM's ``SamplingParams`` ranges). ``vocab_size``: the model's logits width, when known -
    token ids in ``logit_bias`` / ``stop_token_ids`` must be below it."""
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
    if not _is_int(params.top_k) or params.top_k < -1:
        raise InvalidRequest("top_k must be 0 (all tokens) or a positive integer", param="top_k")
    if not (_is_number(params.min_p) and 0 <= params.min_p <= 1):
        raise InvalidRequest("min_p must be in [0, 1]", param="min_p")
    lo, hi = _PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (_is_number(value) and lo <= value <= hi):
            raise InvalidRequest(f"{name} must be in [{lo:g}, {hi:g}]", param=name)
    if not (_is_number(params.repetition_penalty) and params.repetition_penalty > 0):
        raise InvalidRequest("repetition_penalty must be a finite number > 0", param="repetition_penalty")
    seen: set[int] = set()
    for entry in params.logit_bias:
        if not (isinstance(entry, tuple) and len(entry) == 2 and _is_number(entry[1])):
            raise InvalidRequest("logit_bias must map token ids to finite numbers", param="logit_bias")
        _check_token_ids((entry[0],), vocab_size, "logit_bias")
        if entry[0] in seen:
            raise InvalidRequest(f"logit_bias has token id {entry[0]} twice", param="logit_bias")
        seen.add(entry[0])
    if not _is_int(params.min_tokens) or params.min_tokens < 0:
        raise InvalidRequest("min_tokens must be a non-negative integer", param="min_tokens")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})", param="min_tokens"
        )
    _check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    if params.structured is not None and params.min_tokens > 0:
        # the grammar may allow only a stop token while min_tokens masks it (vLLM has the same conflict)
        raise InvalidRequest(
            "min_tokens cannot be combined with structured output (response_format / a named tool_choice)",
            param="min_tokens",
        )
    if params.logprobs is not None and not (_is_int(params.logprobs) and 0 <= params.logprobs <= MAX_LOGPROBS):
        raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="logprobs")
