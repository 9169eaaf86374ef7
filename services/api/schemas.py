"""OpenAI chat-completions request parsing and validation (no I/O).

Turns a JSON body into a :class:`ParsedRequest`: typed messages (``shared.chat.ChatMessage``, the
one place chat messages are validated) whose image parts are ``ImagePart`` placeholders, the image
URLs in placeholder order, and sampling settings. Every rejection is a typed ``shared.errors``
exception naming the offending parameter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shared.chat import ChatMessage, ImagePart, Part, TextPart, check_role
from shared.errors import InvalidRequest, TooManyImages, UnsupportedContent
from shared.protocol import SamplingSpec

MAX_STOP_SEQUENCES = 4


@dataclass
class ParsedRequest:
    model: str
    messages: list[ChatMessage]
    image_urls: list[str]
    sampling: SamplingSpec
    stream: bool
    include_usage: bool = False
    return_token_ids: bool = False
    body: dict[str, Any] = field(default_factory=dict)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:  # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 message can carry
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"request body is not valid Unicode: {exc.reason} at a {exc.object[exc.start : exc.end]!a}"
        ) from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return float(value)


def _parse_content(content: Any, index: int, image_urls: list[str], max_images: int) -> str | list[Part]:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{index}].content must be a string or a list of parts", param="messages")
    parts: list[Part] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"{where} must be an object with a 'type'", param="messages")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.text must be a string", param="messages")
            parts.append(TextPart(text=part["text"]))
        elif kind == "image_url":
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise InvalidRequest(f"{where}.image_url.url must be a non-empty string", param="messages")
            if len(image_urls) >= max_images:
                raise TooManyImages(f"at most {max_images} images per request", param="messages")
            image_urls.append(url)
            parts.append(ImagePart())
        else:
            raise UnsupportedContent(
                f"{where}: content part type '{kind}' is not supported (supported: text, image_url)",
                param="messages",
            )
    return parts


def parse_chat_request(
    body: dict[str, Any], *, served_model: str, max_images: int, max_tokens_limit: int, default_max_tokens: int
) -> ParsedRequest:
    model = body.get("model", served_model)
    if model != served_model:
        raise InvalidRequest(f"model '{model}' is not served here (available: '{served_model}')", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    if body.get("n", 1) != 1:
        raise InvalidRequest("only n=1 is supported", param="n")

    image_urls: list[str] = []
    normalized: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = check_role(message.get("role"), f"messages[{i}]")
        content = _parse_content(message.get("content"), i, image_urls, max_images)
        normalized.append(ChatMessage(role=role, content=content))

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidRequest(f"'max_tokens' must be an integer in [1, {max_tokens_limit}]", param="max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest(
            f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop"
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidRequest("'seed' must be a non-negative integer", param="seed")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise InvalidRequest("'top_p' must be greater than 0", param="top_p")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")

    sampling = SamplingSpec(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=top_p,
        seed=seed,
        stop=tuple(stop),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    return ParsedRequest(
        model=served_model,
        messages=normalized,
        image_urls=image_urls,
        sampling=sampling,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        body=body,
    )


def recorded_url(url: str) -> str:
    """What the request record keeps of an image URL: scheme, host and path - no query string
    or fragment, which may carry credentials (e.g. a presigned URL's ``X-Amz-Signature``)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return ""
    netloc = parts.netloc.rpartition("@")[2]  # (credentials in URLs are refused anyway)
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_images(body: dict[str, Any], item_hashes: list[str]) -> dict[str, Any]:
    """A copy of the body for the replay record: each image replaced by its item hash (plus, for
    a fetched image, its :func:`recorded_url`)."""
    hashes = iter(item_hashes)
    out = dict(body)
    messages = []
    for message in body.get("messages", []):
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            new_parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    spec = part.get("image_url")
                    url = spec.get("url") if isinstance(spec, dict) else spec
                    ref = {"type": "image_ref", "item_hash": next(hashes)}
                    if isinstance(url, str) and not url.startswith("data:"):
                        ref["url"] = recorded_url(url)
                    new_parts.append(ref)
                else:
                    new_parts.append(part)
            message["content"] = new_parts
        messages.append(message)
    out["messages"] = messages
    return out
