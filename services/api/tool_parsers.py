"""Tool-call parsers for ``tool_choice: "auto"``: the model's text -> OpenAI ``tool_calls`` (no I/O
but :func:`chat_template_text`; torch-free).

A parser is chosen once per API process by capability (:func:`parser_for_template`): the model
folder's chat template (the one the workers render) must render ``tools`` and teach the tool-call
format the parser reads (its :attr:`ToolParser.markers`). A template that renders no tools - the
Qwen2-VL / LLaVA ones - has no parser: ``tool_choice: "auto"`` is then a 400.

:class:`HermesToolParser` reads the Hermes / Qwen2.5 / Qwen3 format, as vLLM's ``hermes`` parser
(``vllm/tool_parsers/hermes_tool_parser.py``) does::

    text before the first call<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ..., "arguments": ...}
    </tool_call>

* whole text (:meth:`ToolParser.extract`): ``content`` is the text before the first
  ``<tool_call>`` (None when empty), each call's ``arguments`` its ``arguments`` re-serialized
  (``json.dumps(..., ensure_ascii=False)``); a call whose JSON does not parse (or lacks ``name`` /
  ``arguments``) makes the whole text the content, without calls (vLLM's answer);
* streamed (:meth:`ToolParser.streamer`): content deltas until ``<tool_call>`` starts (a suffix
  that may be the start of the tag is held back), then per call a first delta with ``index``,
  ``id``, ``type`` and ``function.name`` (and ``arguments: ""``), then ``function.arguments``
  pieces - the raw text of the arguments as generated, OpenAI's streaming shape. What was streamed
  cannot be taken back: a call whose JSON breaks after its name was sent stays a call; text after
  the last call is dropped (both as vLLM). At the end (:meth:`HermesStream.finish`) text never sent
  - a held-back partial tag, or calls whose name never appeared - goes out as content when no call
  was streamed, so a text without well-formed calls streams exactly as it reads unstreamed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

#: A chat template that renders the request's tools refers to the ``tools`` variable.
_TOOLS_VARIABLE = re.compile(r"\btools\b")


def make_tool_call_id() -> str:
    """A tool call's id, as vLLM makes them (``make_tool_call_id``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def to_openai(self, call_id: str | None = None) -> dict[str, Any]:
        return {
            "id": call_id or make_tool_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Extracted:
    """What a whole completion holds: its ``content`` (None when empty) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass
class StreamDelta:
    """What one streamed piece of text adds: content and ``delta.tool_calls`` entries (OpenAI's
    shape, ``index`` = the call's position)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolStream(Protocol):
    @property
    def called(self) -> bool:
        """Whether a call was streamed (its first delta sent)."""
        ...

    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta: ...


class ToolParser(Protocol):
    #: the parser's name (vLLM's ``--tool-call-parser`` name)
    name: ClassVar[str]
    #: what a chat template must contain (besides using ``tools``) for this parser to read the
    #: calls it asks the model for
    markers: ClassVar[tuple[str, ...]]

    def extract(self, text: str) -> Extracted: ...

    def streamer(self) -> ToolStream: ...


def _partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (vLLM's ``partial_tag_overlap``)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (vLLM's ``hermes``)."""

    name: ClassVar[str] = "hermes"
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"
    markers: ClassVar[tuple[str, ...]] = (START,)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        if self.START not in text:
            return Extracted(text or None)
        calls = []
        for closed, unclosed in self._CALL.findall(text):
            try:
                call = json.loads(closed or unclosed)
                name, arguments = call["name"], call["arguments"]
                if not isinstance(name, str):
                    raise TypeError(name)
                calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
            except (ValueError, TypeError, KeyError):
                return Extracted(text)  # malformed: the text as it is (vLLM)
        return Extracted(text[: text.find(self.START)] or None, tuple(calls))

    def streamer(self) -> HermesStream:
        return HermesStream()


_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


class HermesStream:
    """One choice's streamed text -> deltas (:class:`HermesToolParser`). Re-reads the whole text
    at each piece, as vLLM's ``extract_tool_calls_streaming`` does, and sends what is new."""

    START = HermesToolParser.START
    END = HermesToolParser.END

    def __init__(self) -> None:
        self.text = ""
        self._sent_content = 0
        #: per call: its name once sent, and the arguments text sent so far
        self._names: list[str] = []
        self._args: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self._names)

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        out = StreamDelta(content=self._content())
        for index, (body, complete) in enumerate(self._calls()):
            entry: dict[str, Any] | None = None
            if index == len(self._names):
                match = _NAME.search(body)
                if match is None:
                    break  # call i+1 waits for call i's name
                self._names.append(match.group(1))
                self._args.append("")
                entry = {
                    "index": index,
                    "id": make_tool_call_id(),
                    "type": "function",
                    "function": {"name": match.group(1), "arguments": ""},
                }
            new = self._arguments_diff(index, body, complete)
            if new:
                if entry is None:
                    entry = {"index": index, "function": {"arguments": ""}}
                entry["function"]["arguments"] = new
            if entry is not None:
                out.tool_calls.append(entry)
        return out

    def finish(self) -> StreamDelta:
        """The end of the text: what was held back goes out as content unless a call was sent."""
        if self.called or self._sent_content >= len(self.text):
            return StreamDelta()
        rest = self.text[self._sent_content :]
        self._sent_content = len(self.text)
        return StreamDelta(content=rest)

    def _content(self) -> str:
        if self.START in self.text:
            end = self.text.index(self.START)
        else:
            end = len(self.text) - _partial_tag_overlap(self.text, self.START)
        if end <= self._sent_content:
            return ""
        piece = self.text[self._sent_content : end]
        self._sent_content = end
        return piece

    def _calls(self) -> list[tuple[str, bool]]:
        """Each ``<tool_call>`` region's JSON text (stripped) and whether it is complete."""
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := self.text.find(self.START, pos)) != -1:
            body_start = start + len(self.START)
            end = self.text.find(self.END, body_start)
            if end != -1:
                out.append((self.text[body_start:end].strip(), True))
                pos = end + len(self.END)
                continue
            raw = self.text[body_start:]
            overlap = _partial_tag_overlap(raw, self.END)
            body = (raw[:-overlap] if overlap else raw).strip()
            # valid JSON without the closing tag: the call is whole, the tag is on its way
            out.append((body, bool(body) and _is_complete_json(body)))
            break
        return out

    def _arguments_diff(self, index: int, body: str, complete: bool) -> str:
        match = _ARGUMENTS.search(body)
        if match is None:
            return ""
        args = body[match.end() :]
        if complete:  # drop the brace that closes the call object
            args = args.rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
        sent = self._args[index]
        if len(args) <= len(sent) or not args.startswith(sent):
            return ""  # nothing new (or not an extension of what was sent: it cannot be taken back)
        self._args[index] = args
        return args[len(sent) :]


#: The parsers, in the order they are tried against a chat template.
PARSERS: tuple[ToolParser, ...] = (HermesToolParser(),)


def parser_for_template(template: str | None) -> ToolParser | None:
    """The parser of the tool calls ``template`` asks for: the first of :data:`PARSERS` whose
    markers the template contains, when it renders ``tools`` at all; None otherwise."""
    if not template or not _TOOLS_VARIABLE.search(template):
        return None
    return next((p for p in PARSERS if all(m in template for m in p.markers)), None)


def _template_of(value: Any) -> str | None:
    """A ``chat_template`` entry: a string, or named templates (``[{"name", "template"}]`` or a
    dict) of which a request with tools gets ``tool_use`` (else ``default``), as transformers picks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        chosen = value.get("tool_use") or value.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def chat_template_text(model_dir: str | Path) -> str | None:
    """The chat template the workers render for a model folder (the processor's, else the
    tokenizer's: ``chat_template.jinja``, ``chat_template.json``, ``tokenizer_config.json``), read
    as text - no tokenizer is loaded. None when the folder has none."""
    folder = Path(model_dir)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue
        template = _template_of(data.get("chat_template")) if isinstance(data, dict) else None
        if template:
            return template
    return None


def parser_for_model(model_dir: str | Path) -> ToolParser | None:
    """:func:`parser_for_template` of the model folder's chat template."""
    return parser_for_template(chat_template_text(model_dir))
