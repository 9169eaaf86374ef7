"""OpenAI chat-completions and completions request parsing and validation (no I/O).

Turns a JSON body into a :class:`ParsedRequest`: first the parameter table
(``services.api.params.PARAMS``: a field of neither OpenAI's nor vLLM's schema is refused, and so is a
refused one set to anything that changes the result), then the endpoint's typed model
(``msgspec.convert``: a wrong type is refused naming the field), then the ranges. Chat messages
become typed messages (``shared.chat.ChatMessage``, the one place chat messages are validated)
whose image parts are ``ImagePart`` placeholders, with the image URLs in placeholder order.
Every rejection is a typed ``shared.errors`` exception naming the offending parameter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.api.params import (
    MODELS,
    PARAMS,
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    RequestModel,
    fields_of,
)
from services.api.sampling_defaults import SamplingDefaults
from services.api.tool_parsers import ToolParser
from shared.chat import ChatMessage, FunctionCall, ImagePart, Part, TextPart, ToolCall, VideoPart, check_role
from shared.engines.grammar import structured_output
from shared.errors import (
    ConfigError,
    InvalidRequest,
    InvalidVideo,
    ModelNotFound,
    TooManyImages,
    UnknownParameter,
    UnsupportedContent,
    UnsupportedParameter,
)
from shared.protocol import MAX_TOOLS, MAX_TOOLS_BYTES, MediaKind, SamplingSpec, StructuredOutput
from shared.video import VideoSampling

MAX_STOP_SEQUENCES = 4
#: the most choices (``n``) of one request: each is a generation job
MAX_N = 16
#: the most alternatives per token (``logprobs`` / ``top_logprobs``), vLLM's default limit
MAX_LOGPROBS = 20
#: ``/v1/completions`` without ``max_tokens`` (OpenAI's and vLLM's default)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class ParsedRequest:
    model: str
    messages: list[ChatMessage]
    #: the request's images and videos, in placeholder order
    media: list[MediaURL]
    sampling: SamplingSpec
    stream: bool
    include_usage: bool = False
    return_token_ids: bool = False
    body: dict[str, Any] = field(default_factory=dict)
    endpoint: Endpoint = Endpoint.CHAT
    #: how the request's videos are sampled (``media_io_kwargs``; the server's defaults fill the rest)
    video_sampling: VideoSampling = field(default_factory=VideoSampling)
    #: ``/v1/completions``: the prompt (text, or token ids)
    prompt: str | tuple[int, ...] | None = None
    #: choices (``n``): one generation job each
    n: int = 1
    #: what ``echo`` puts before each choice's text (completions with a token-id prompt: the API
    #: detokenizes it before answering); "" without echo
    echo: bool = False
    echo_text: str = ""
    #: logprob tokens as ``token_id:<id>`` (``return_tokens_as_token_ids``)
    tokens_as_ids: bool = False
    #: the chat template's ``tools``: function definitions as compact JSON text (:func:`parse_tools`)
    tools: tuple[str, ...] = ()
    #: a named ``tool_choice``: the function whose arguments the completion is (answered as
    #: ``tool_calls``); None otherwise
    tool_name: str | None = None
    #: ``tool_choice: "auto"``: the parser that reads the completion's calls
    #: (``services.api.tool_parsers``); None otherwise
    tool_parser: ToolParser | None = None
    #: ``parallel_tool_calls: false``: at most one call is answered (vLLM keeps the first)
    parallel_tool_calls: bool = True

    @property
    def image_urls(self) -> list[str]:
        """Every media URL (images and videos), in placeholder order."""
        return [m.url for m in self.media]


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


#: The type errors of fields whose messages predate the typed models (kept word for word).
_TYPE_MESSAGES = {
    "messages": "'messages' must be a non-empty list",
    "stream": "'stream' must be a boolean",
    "stream_options": "'stream_options' must be an object",
    "seed": "'seed' must be a non-negative integer",
    "stop": f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings",
    "temperature": "'temperature' must be a number",
    "top_p": "'top_p' must be a number",
}
_PATH = re.compile(r" - at `\$\.([A-Za-z0-9_]+)")


def typed_request(body: dict[str, Any], endpoint: Endpoint) -> RequestModel:
    """``body`` as ``endpoint``'s typed model, after the parameter table's checks: an unknown field
    is an :class:`UnknownParameter`, a refused one set to a value that is not a no-op an
    :class:`UnsupportedParameter`, a wrong type an :class:`InvalidRequest` - each naming the field."""
    known = fields_of(endpoint)
    for name in body:
        if name not in known:
            raise UnknownParameter(f"Unrecognized request argument supplied: {name}", param=name)
    for name, value in body.items():
        param = PARAMS[name]
        if param.status == "refused" and not param.is_noop(value, endpoint):
            allowed = " or ".join(json.dumps(v) for v in param.noop_values(endpoint) if v is not None)
            raise UnsupportedParameter(
                f"'{name}' is not supported by this server"
                + (f" ({param.why})" if param.why else "")
                + f": leave it out{' or set it to ' + allowed if allowed else ''}",
                param=name,
            )
    try:
        return msgspec.convert(body, MODELS[endpoint], strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text)
        wrong = m.group(1) if m else None
        message = _TYPE_MESSAGES.get(wrong or "") or (f"'{wrong}': {text}" if wrong else text)
        raise InvalidRequest(message, param=wrong) from None


def _number(value: float | None, name: str, default: float, lo: float, hi: float) -> float:
    if value is None:
        return default
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return float(value)


@dataclass(frozen=True)
class MediaURL:
    """One media part of a request, in placeholder order: its kind and its URL."""

    kind: MediaKind
    url: str


def _parse_content(
    content: Any, index: int, media: list[MediaURL], max_images: int, max_videos: int
) -> str | list[Part]:
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
        elif kind in ("image_url", "video_url"):
            media_kind = MediaKind.IMAGE if kind == "image_url" else MediaKind.VIDEO
            spec = part.get(kind)
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise InvalidRequest(f"{where}.{kind}.url must be a non-empty string", param="messages")
            limit = max_images if media_kind is MediaKind.IMAGE else max_videos
            if sum(1 for m in media if m.kind is media_kind) >= limit:
                raise TooManyImages(f"at most {limit} {media_kind}s per request", param="messages")
            media.append(MediaURL(media_kind, url))
            parts.append(ImagePart() if media_kind is MediaKind.IMAGE else VideoPart())
        else:
            raise UnsupportedContent(
                f"{where}: content part type '{kind}' is not supported (supported: text, image_url, video_url)",
                param="messages",
            )
    return parts


#: Why a tool conversation or ``tool_choice: "auto"`` is refused for a model without a tool parser.
NO_TOOL_TEMPLATE = (
    "this model's chat template renders no tool calls this server can parse (supported: the Hermes / "
    "Qwen2.5 `<tool_call>` format, chosen when the template renders `tools` and asks for `<tool_call>`)"
)


def _tool_calls(value: Any, i: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (OpenAI's shape; ``arguments`` JSON text, or an object
    as vLLM also takes); null or [] -> none."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list", param="messages")
    calls = []
    for j, call in enumerate(value):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise InvalidRequest(f"{where} must be an object", param="messages")
        if call.get("type", "function") != "function":
            raise InvalidRequest(f"{where}.type must be 'function'", param="messages")
        if not isinstance(call.get("id"), str):
            raise InvalidRequest(f"{where}.id must be a string", param="messages")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"{where}.function.name must be a non-empty string", param="messages")
        arguments = fn.get("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        elif arguments is None:
            arguments = ""
        elif not isinstance(arguments, str):
            raise InvalidRequest(f"{where}.function.arguments must be a JSON string", param="messages")
        elif arguments:
            # The template gets the arguments as an object: text that is not one is refused here
            # rather than rendered as {} (vLLM's silent fallback).
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise InvalidRequest(f"{where}.function.arguments must be a JSON object as text", param="messages")
        calls.append(ToolCall(id=call["id"], function=FunctionCall(name=fn["name"], arguments=arguments)))
    return tuple(calls)


def _tool_fields(message: dict[str, Any], role: str, i: int, tools_ok: bool) -> dict[str, Any]:
    """A message's ``tool_calls`` (assistant) / ``tool_call_id`` (tool), checked: a tool
    conversation needs a chat template that renders one (``tools_ok``)."""
    calls = _tool_calls(message.get("tool_calls"), i)
    call_id = message.get("tool_call_id")
    if calls and role != "assistant":
        raise InvalidRequest(f"messages[{i}].tool_calls is for assistant messages only", param="messages")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest(f"messages[{i}].tool_call_id must be a non-empty string", param="messages")
    elif call_id is not None:
        raise InvalidRequest(f"messages[{i}].tool_call_id is for tool messages only", param="messages")
    if (calls or role == "tool") and not tools_ok:
        what = "role 'tool'" if role == "tool" else "tool_calls"
        raise UnsupportedContent(f"messages[{i}]: {what} cannot be rendered: {NO_TOOL_TEMPLATE}", param="messages")
    return {"tool_calls": calls, "tool_call_id": call_id if role == "tool" else None}


def parse_media_io_kwargs(value: Any) -> VideoSampling:
    """vLLM's ``media_io_kwargs``: ``{"video": {"num_frames": N, "fps": F}}`` (either or both; the
    server's defaults fill what is not given). Any other key is refused by name."""
    if value is None:
        return VideoSampling()
    if not isinstance(value, dict):
        raise InvalidRequest("'media_io_kwargs' must be an object", param="media_io_kwargs")
    for key in value:
        if key != "video":
            raise UnsupportedParameter(
                f"'media_io_kwargs.{key}' is not supported (supported: video.num_frames, video.fps)",
                param=f"media_io_kwargs.{key}",
            )
    video = value.get("video")
    if video is None:
        return VideoSampling()
    if not isinstance(video, dict):
        raise InvalidRequest("'media_io_kwargs.video' must be an object", param="media_io_kwargs.video")
    for key in video:
        if key not in ("num_frames", "fps"):
            raise UnsupportedParameter(
                f"'media_io_kwargs.video.{key}' is not supported (supported: num_frames, fps)",
                param=f"media_io_kwargs.video.{key}",
            )
    try:
        return VideoSampling(num_frames=video.get("num_frames"), fps=video.get("fps"))
    except InvalidVideo as exc:
        raise InvalidRequest(f"'media_io_kwargs.video': {exc.message}", param="media_io_kwargs.video") from None


def parse_messages(
    messages: Any, *, max_images: int, max_videos: int = 0, tools_ok: bool = False
) -> tuple[list[ChatMessage], list[MediaURL]]:
    """OpenAI chat messages as typed messages, and their media (image and video URLs) in
    placeholder order. ``tools_ok``: the model's chat template renders tool conversations
    (``tool`` messages and an assistant's ``tool_calls``); without it they are refused."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    media: list[MediaURL] = []
    normalized: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = check_role(message.get("role"), f"messages[{i}]")
        tool_fields = _tool_fields(message, role, i, tools_ok)
        content = _parse_content(message.get("content"), i, media if role != "tool" else [], max_images, max_videos)
        if role == "tool" and not isinstance(content, str) and any(not isinstance(p, TextPart) for p in content):
            raise UnsupportedContent(f"messages[{i}]: a tool message holds text only", param="messages")
        normalized.append(ChatMessage(role=role, content=content, **tool_fields))
    return normalized, media


def check_model(model: str, served_model: str) -> None:
    """A request's ``model`` is the one served: else 404 ``model_not_found`` (vLLM's message,
    OpenAI's code), naming the served one."""
    if model != served_model:
        raise ModelNotFound(f"The model `{model}` does not exist (served here: `{served_model}`).", param="model")


def _check_model(req: RequestModel, served_model: str) -> None:
    check_model(served_model if req.model is None else req.model, served_model)


#: no model defaults: OpenAI's for every field
NO_DEFAULTS = SamplingDefaults()


def _with_defaults(req: RequestModel, defaults: SamplingDefaults) -> RequestModel:
    """``req`` with each sampling field it leaves out set to the model's default (vLLM's priority:
    the request, then the server's default, then OpenAI's)."""
    fills = {
        name: value
        for name in _DEFAULTED
        if getattr(req, name) is None and (value := getattr(defaults, name)) is not None
    }
    return msgspec.structs.replace(req, **fills) if fills else req


#: the request fields a model's generation config gives a default for (``max_tokens`` apart: its
#: default is resolved with the endpoint's own rule)
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_sampling_defaults(defaults: SamplingDefaults) -> None:
    """The model's defaults pass the checks a request's values do (at API start-up): else
    :class:`ConfigError` naming the file and the field, not a 400 on every request."""
    try:
        _sampling(
            ChatCompletionRequest(),
            max_tokens=None,
            max_tokens_limit=2**31,
            max_tokens_source="",
            default_max_tokens=1,
            logprobs=None,
            defaults=defaults,
        )
    except InvalidRequest as exc:
        raise ConfigError(f"{defaults.source}: the model's sampling default is not accepted: {exc}") from None


def _sampling(
    req: RequestModel,
    *,
    max_tokens: int | None,
    max_tokens_limit: int,
    max_tokens_source: str,
    default_max_tokens: int,
    logprobs: int | None,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> SamplingSpec:
    """The ``SamplingSpec`` of a typed request (ranges checked here, with the existing messages). A
    field the request leaves out takes the model's default (``defaults``: its generation config, as
    vLLM's server does), else OpenAI's."""
    req = _with_defaults(req, defaults)
    if max_tokens is None:
        max_tokens = min(defaults.max_tokens or default_max_tokens, max_tokens_limit)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidRequest(
            f"'max_tokens' must be an integer in [1, {max_tokens_limit}]: {max_tokens_limit} is {max_tokens_source}",
            param="max_tokens",
        )
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES or not all(stop):
        raise InvalidRequest(
            f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop"
        )
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidRequest("'seed' must be a non-negative integer", param="seed")
    top_p = _number(req.top_p, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise InvalidRequest("'top_p' must be greater than 0", param="top_p")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise InvalidRequest(f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k}", param="top_k")
    repetition_penalty = _number(req.repetition_penalty, "repetition_penalty", 1.0, 0.0, 2.0)
    if repetition_penalty <= 0:
        raise InvalidRequest("'repetition_penalty' must be greater than 0", param="repetition_penalty")
    min_tokens = req.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest(
            f"'min_tokens' must be an integer in [0, max_tokens = {max_tokens}], got {min_tokens}", param="min_tokens"
        )
    stop_token_ids = req.stop_token_ids or []
    if any(t < 0 for t in stop_token_ids):
        raise InvalidRequest("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=_number(req.temperature, "temperature", 1.0, 0.0, 2.0),
        top_p=top_p,
        seed=req.seed,
        stop=tuple(stop),
        ignore_eos=bool(req.ignore_eos),
        top_k=max(top_k, 0),
        min_p=_number(req.min_p, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(req.presence_penalty, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(req.frequency_penalty, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        min_tokens=min_tokens,
        stop_token_ids=tuple(stop_token_ids),
        logprobs=logprobs,
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0:
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}", param="logit_bias"
            )
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise InvalidRequest(f"'logit_bias' values must be between -100 and 100, got {value}", param="logit_bias")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _logprobs(value: int | None, name: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}]", param=name)
    return value


def _common(req: RequestModel) -> tuple[int, bool, bool]:
    """``n``, ``stream`` and ``include_usage`` (checked)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be an integer in [1, {MAX_N}]", param="n")
    stream = bool(req.stream)
    options = req.stream_options
    if options is not None and options.continuous_usage_stats:
        raise UnsupportedParameter(
            "'stream_options.continuous_usage_stats' is not supported by this server: usage comes in the last chunk",
            param="stream_options",
        )
    return n, stream, bool(options is not None and options.include_usage)


def _echo_text(messages: list[ChatMessage]) -> str:
    """vLLM's chat ``echo``: the last message's text when it is the assistant's (the role answering)."""
    last = messages[-1]
    if last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content if isinstance(p, TextPart))


_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_response_format(value: Any) -> StructuredOutput | None:
    """``response_format`` as the job's constraint: ``text`` (or absent) -> None, ``json_object``
    -> any JSON object, ``json_schema`` -> a document valid under ``json_schema.schema`` (vLLM's
    ``JsonSchemaResponseFormat``: ``name``, ``schema``, ``description``, ``strict``; the grammar is
    always strict). Raises InvalidRequest (``param="response_format"``)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        raise InvalidRequest("'response_format' must be an object with a 'type'", param="response_format")
    if kind not in _RESPONSE_FORMATS:
        raise InvalidRequest(
            f"'response_format' type {kind!r} is not supported; supported: {', '.join(_RESPONSE_FORMATS)}",
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return structured_output("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "'response_format' of type json_schema needs a 'json_schema' object", param="response_format"
        )
    if not isinstance(spec.get("name"), str):
        raise InvalidRequest("'response_format.json_schema.name' must be a string", param="response_format")
    for key, types in (("description", (str,)), ("strict", (bool,))):
        if spec.get(key) is not None and not isinstance(spec[key], types):
            raise InvalidRequest(
                f"'response_format.json_schema.{key}' must be a {types[0].__name__}", param="response_format"
            )
    if spec.get("schema") is None:
        raise InvalidRequest("'response_format.json_schema.schema' is required", param="response_format")
    return structured_output("json_schema", spec["schema"])


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """One ``tools`` entry as vLLM gives it to the chat template (``ChatCompletionToolsParam
    .model_dump()``: ``type``, and the function's ``name``, ``description`` and ``parameters``
    - null when not given - plus ``strict`` when given)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{where} must be an object", param="tools")
    if tool.get("type", "function") != "function":
        raise InvalidRequest(f"{where}.type must be 'function', got {tool.get('type')!r}", param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{where}.function must be an object", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.function.name must be a non-empty string", param="tools")
    for key, types in (("description", (str,)), ("parameters", (dict,)), ("strict", (bool,))):
        if fn.get(key) is not None and not isinstance(fn[key], types):
            raise InvalidRequest(f"{where}.function.{key} must be a {types[0].__name__}", param="tools")
    out: dict[str, Any] = {"name": name, "description": fn.get("description"), "parameters": fn.get("parameters")}
    if fn.get("strict") is not None:
        out["strict"] = fn["strict"]
    return {"type": "function", "function": out}


def parse_tools(value: Any) -> list[dict[str, Any]]:
    """``tools`` as the chat template gets them (:func:`_tool`); [] when absent. An empty list is
    refused, as vLLM and OpenAI do."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be a list of tools", param="tools")
    if not value:
        raise InvalidRequest(
            "'tools' must not be an empty array: give at least one tool or leave it out", param="tools"
        )
    if len(value) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' holds {len(value)} tools; at most {MAX_TOOLS}", param="tools")
    return [_tool(tool, i) for i, tool in enumerate(value)]


def _tools_text(tools: list[dict[str, Any]]) -> tuple[str, ...]:
    text = tuple(json.dumps(t, ensure_ascii=False, separators=(",", ":"), allow_nan=False) for t in tools)
    if sum(len(t.encode()) for t in text) > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"'tools' are larger than {MAX_TOOLS_BYTES} bytes as compact JSON", param="tools")
    return text


_NAME_IT = 'name the function (`{"type": "function", "function": {"name": ...}}`) or set "none"'


def parse_tool_choice(
    value: Any, tools: list[dict[str, Any]], *, given: bool, parser: ToolParser | None = None
) -> tuple[str | None, bool]:
    """``(name, auto)``: the function a named ``tool_choice`` forces (None otherwise), and whether
    the choice is ``"auto"`` - the model decides, ``parser`` reads its calls. ``given``: whether the
    body has the field (vLLM: tools without ``tool_choice`` mean ``"auto"``). ``"auto"`` without a
    parser (the model's chat template renders no tool-call format parsed here) and ``"required"``
    are refused, naming ``tool_choice``; a name outside ``tools`` too."""
    if not given or value is None:
        value = "auto" if tools else "none"
    if value == "none":
        return None, False
    if not tools:
        raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
    default = "" if given else " (the default when 'tools' are given)"
    if value == "auto":
        if parser is None:
            raise UnsupportedParameter(
                f"'tool_choice' 'auto'{default} needs a tool parser for the model's output: {NO_TOOL_TEMPLATE}; "
                + _NAME_IT,
                param="tool_choice",
            )
        return None, True
    if value == "required":
        raise UnsupportedParameter(
            "'tool_choice' 'required' is not supported by this server (a call is not forced); "
            + ('use "auto" or ' if parser is not None else "")
            + _NAME_IT,
            param="tool_choice",
        )
    usage = '; use {"type": "function", "function": {"name": "my_function"}}'
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise InvalidRequest(
            f'\'tool_choice\' must be "none", "auto", "required" or a named function{usage}', param="tool_choice"
        )
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'tool_choice.function.name' must be a non-empty string{usage}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(f"'tool_choice' names {name!r}, which is not one of the 'tools'", param="tool_choice")
    return name, False


def _tool_schema(tools: list[dict[str, Any]], name: str) -> StructuredOutput:
    """The constraint of a named tool's arguments: its ``parameters``, or any object (vLLM's
    ``_params_or_empty_object``)."""
    params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    return structured_output("json_schema", params or {"type": "object", "properties": {}}, param="tools")


def _constrain(
    sampling: SamplingSpec, response_format: Any, tools: list[dict[str, Any]], tool_name: str | None
) -> SamplingSpec:
    """``sampling`` with the request's constraint (response_format, or a named tool's arguments)."""
    structured = parse_response_format(response_format)
    if tool_name is not None:
        if structured is not None:
            raise InvalidRequest(
                "'response_format' cannot be combined with a named 'tool_choice' (the tool's parameters constrain "
                "the output)",
                param="response_format",
            )
        structured = _tool_schema(tools, tool_name)
    if structured is None:
        return sampling
    if sampling.min_tokens > 0:
        raise InvalidRequest(
            "'min_tokens' cannot be combined with structured output (response_format / a named tool_choice): "
            "the grammar may allow only the end of the completion",
            param="min_tokens",
        )
    return msgspec.structs.replace(sampling, structured=structured)


def parse_chat_request(
    body: dict[str, Any],
    *,
    served_model: str,
    max_images: int,
    max_tokens_limit: int,
    default_max_tokens: int,
    tool_parser: ToolParser | None = None,
    max_tokens_source: str = "EPD_MAX_TOKENS_LIMIT",
    max_videos: int = 0,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> ParsedRequest:
    """A ``/v1/chat/completions`` body. ``tool_parser``: the served model's
    (``services.api.tool_parsers.parser_for_model``; None: its chat template renders no tool calls
    parsed here - ``tool_choice: "auto"`` and tool conversations are refused). ``defaults``: the
    model's sampling defaults (``services.api.sampling_defaults``)."""
    req = typed_request(body, Endpoint.CHAT)
    assert isinstance(req, ChatCompletionRequest)
    _check_model(req, served_model)
    messages, media = parse_messages(
        req.messages, max_images=max_images, max_videos=max_videos, tools_ok=tool_parser is not None
    )
    video_sampling = parse_media_io_kwargs(req.media_io_kwargs)
    n, stream, include_usage = _common(req)
    top_logprobs = _logprobs(req.top_logprobs, "top_logprobs")
    if top_logprobs and not req.logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(
        req,
        max_tokens=max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_tokens_source=max_tokens_source,
        default_max_tokens=default_max_tokens,
        logprobs=(top_logprobs or 0) if req.logprobs else None,
        defaults=defaults,
    )
    tools = parse_tools(req.tools)
    tool_name, auto = parse_tool_choice(req.tool_choice, tools, given="tool_choice" in body, parser=tool_parser)
    sampling = _constrain(sampling, req.response_format, tools, tool_name)
    return ParsedRequest(
        model=served_model,
        messages=messages,
        media=media,
        video_sampling=video_sampling,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=bool(req.return_token_ids),
        body=body,
        endpoint=Endpoint.CHAT,
        n=n,
        echo=bool(req.echo),
        echo_text=_echo_text(messages) if req.echo else "",
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        tools=_tools_text(tools),
        tool_name=tool_name,
        tool_parser=tool_parser if auto else None,
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def parse_prompt(prompt: Any) -> str | tuple[int, ...]:
    """A completions prompt: a string or token ids (or a list of exactly one of those)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        if len(prompt) > 1:
            raise UnsupportedParameter(
                f"'prompt' holds {len(prompt)} prompts: one prompt per request is supported (send one request each)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        return prompt
    if _is_token_ids(prompt):
        if any(t < 0 for t in prompt):
            raise InvalidRequest("'prompt' token ids must be non-negative", param="prompt")
        return tuple(prompt)
    raise InvalidRequest("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")


def parse_completion_request(
    body: dict[str, Any],
    *,
    served_model: str,
    max_tokens_limit: int,
    default_max_tokens: int,
    max_tokens_source: str = "EPD_MAX_TOKENS_LIMIT",
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> ParsedRequest:
    """A ``/v1/completions`` body (``default_max_tokens``: what an explicit ``max_tokens: null``
    means, unless the model's ``defaults`` set one; absent, it is 16 as in OpenAI and vLLM)."""
    req = typed_request(body, Endpoint.COMPLETIONS)
    assert isinstance(req, CompletionRequest)
    _check_model(req, served_model)
    prompt = parse_prompt(req.prompt)
    n, stream, include_usage = _common(req)
    if req.best_of is not None and req.best_of != n:
        raise UnsupportedParameter(
            f"'best_of' ({req.best_of}) must equal 'n' ({n}) or be left out: completions are not re-ranked here",
            param="best_of",
        )
    logprobs = _logprobs(req.logprobs, "logprobs")
    if req.echo and logprobs is not None:
        raise UnsupportedParameter(
            "'echo' with 'logprobs' needs the prompt's logprobs, which this server does not compute", param="echo"
        )
    max_tokens = req.max_tokens if "max_tokens" in body else min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_tokens_limit)
    sampling = _sampling(
        req,
        max_tokens=max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_tokens_source=max_tokens_source,
        default_max_tokens=default_max_tokens,
        logprobs=logprobs,
        defaults=defaults,
    )
    sampling = _constrain(sampling, req.response_format, [], None)
    return ParsedRequest(
        model=served_model,
        messages=[],
        media=[],
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=bool(req.return_token_ids),
        body=body,
        endpoint=Endpoint.COMPLETIONS,
        prompt=prompt,
        n=n,
        echo=bool(req.echo),
        echo_text=prompt if req.echo and isinstance(prompt, str) else "",
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
    )


@dataclass
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``)."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_strs: bool
    #: ``tools`` for the chat template (:func:`parse_tools`)
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: the chat's image and video parts, in placeholder order (loaded and counted as a chat request's)
    media: list[MediaURL] = field(default_factory=list)
    #: how its videos are sampled (``media_io_kwargs``, :func:`parse_media_io_kwargs`, as in a chat request)
    video_sampling: VideoSampling = field(default_factory=VideoSampling)


#: ``/tokenize`` fields: honoured ones -> their type; refused ones (vLLM's chat-template knobs) are
#: accepted only as their no-op defaults
_TOKENIZE_FIELDS: dict[str, Any] = {
    "model": (str, type(None)),
    "prompt": (str,),
    "messages": (list,),
    "add_special_tokens": (bool, type(None)),
    "add_generation_prompt": (bool, type(None)),
    "continue_final_message": (bool, type(None)),
    "return_token_strs": (bool, type(None)),
    "tools": (list, type(None)),
    "media_io_kwargs": (dict, type(None)),
}
_TOKENIZE_REFUSED: dict[str, tuple[Any, ...]] = {
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
}


def _check_fields(body: dict[str, Any], fields: dict[str, Any], refused_fields: dict[str, tuple[Any, ...]]) -> None:
    for name, value in body.items():
        if name in refused_fields:
            if value not in refused_fields[name]:
                raise UnsupportedParameter(f"'{name}' is not supported by this server", param=name)
        elif name not in fields:
            raise UnknownParameter(f"Unrecognized request argument supplied: {name}", param=name)
        elif type(value) not in fields[name]:
            raise InvalidRequest(f"'{name}' has the wrong type ({type(value).__name__})", param=name)


def parse_tokenize_request(
    body: dict[str, Any],
    *,
    served_model: str,
    tool_parser: ToolParser | None = None,
    max_images: int = 1 << 30,
    max_videos: int = 1 << 30,
) -> TokenizeRequest:
    """A ``/tokenize`` body: ``prompt`` (text; special tokens added unless ``add_special_tokens``
    is false) or ``messages`` (the chat template, with ``tools`` when given - as a chat request
    renders them). A chat's image and video parts are parsed as a chat request's (the same limits,
    ``media_io_kwargs`` the same way): the route loads them and counts each one's placeholder tokens
    as the engine expands them. ``media_io_kwargs`` is for a chat only. Tool conversations need a
    model with a tool parser, as in a chat request."""
    _check_fields(body, _TOKENIZE_FIELDS, _TOKENIZE_REFUSED)
    check_model(body.get("model") or served_model, served_model)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("give either 'prompt' or 'messages'", param="prompt")
    chat = "messages" in body
    messages = None
    media: list[MediaURL] = []
    if chat:
        parsed, media = parse_messages(
            body["messages"], max_images=max_images, max_videos=max_videos, tools_ok=tool_parser is not None
        )
        messages = [m.to_wire() for m in parsed]
    elif body.get("tools"):
        raise InvalidRequest("'tools' are for 'messages' (the chat template)", param="tools")
    elif body.get("media_io_kwargs"):
        raise InvalidRequest("'media_io_kwargs' is for 'messages' (a prompt has no media)", param="media_io_kwargs")
    video_sampling = parse_media_io_kwargs(body.get("media_io_kwargs"))
    tools = parse_tools(body.get("tools") or None)
    add_generation_prompt = body.get("add_generation_prompt")
    continue_final = bool(body.get("continue_final_message"))
    if add_generation_prompt and continue_final:
        raise InvalidRequest(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true", param="continue_final_message"
        )
    add_special = body.get("add_special_tokens")
    return TokenizeRequest(
        prompt=body.get("prompt"),
        messages=messages,
        add_special_tokens=(not chat) if add_special is None else add_special,
        add_generation_prompt=(not continue_final) if add_generation_prompt is None else add_generation_prompt,
        continue_final_message=continue_final,
        return_token_strs=bool(body.get("return_token_strs")),
        tools=tools,
        media=media,
        video_sampling=video_sampling,
    )


def parse_detokenize_request(body: dict[str, Any], *, served_model: str) -> list[int]:
    """A ``/detokenize`` body: ``{"tokens": [...]}`` (+ ``model``)."""
    _check_fields(body, {"model": (str, type(None)), "tokens": (list,)}, {})
    check_model(body.get("model") or served_model, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise InvalidRequest("'tokens' must be a list of token ids (non-negative integers)", param="tokens")
    return tokens


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
    if "messages" not in body:  # (a completions request: no images)
        return out
    messages = []
    for message in body.get("messages", []):
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            new_parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in ("image_url", "video_url"):
                    spec = part.get(part["type"])
                    url = spec.get("url") if isinstance(spec, dict) else spec
                    kind = "image_ref" if part["type"] == "image_url" else "video_ref"
                    ref = {"type": kind, "item_hash": next(hashes)}
                    if isinstance(url, str) and not url.startswith("data:"):
                        ref["url"] = recorded_url(url)
                    new_parts.append(ref)
                else:
                    new_parts.append(part)
            message["content"] = new_parts
        messages.append(message)
    out["messages"] = messages
    return out
