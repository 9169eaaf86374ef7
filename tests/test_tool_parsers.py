"""The Hermes / Qwen2.5 tool-call parser (``services.api.tool_parsers``) and the chat-template gate
that picks it: pure logic, no model, no stack."""

from __future__ import annotations

import json

import pytest

from services.api.tool_parsers import (
    HermesToolParser,
    chat_template_text,
    parser_for_model,
    parser_for_template,
)
from shared.tools.models.tiny import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_TOOLS_CHAT_TEMPLATE

PARSER = HermesToolParser()

ONE = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
)
NESTED = '<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}, "u": "é<"}}\n</tool_call>'
UNCLOSED = 'ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}'  # (the end tag never came)


def _calls(extracted):
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]


def test_whole_text_one_call_and_the_content_before_it():
    out = PARSER.extract(ONE)
    assert out.content == "Let me look."
    assert _calls(out) == [("get_weather", {"city": "Paris", "days": 2})]
    assert out.calls[0].arguments == '{"city": "Paris", "days": 2}'  # re-serialized as vLLM: json.dumps
    call = out.calls[0].to_openai()
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}


def test_whole_text_two_calls_no_content():
    out = PARSER.extract(TWO)
    assert out.content is None
    assert _calls(out) == [("get_weather", {"city": 'Pa"ris', "days": 2}), ("ping", {})]
    assert _calls(PARSER.extract(UNCLOSED)) == [("f", {"x": 1})]
    assert PARSER.extract(NESTED).calls[0].arguments == '{"a": {"b": [1, {"c": "}"}]}, "u": "é<"}'


@pytest.mark.parametrize(
    "text",
    [
        "just text",
        "",
        '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>',  # broken JSON
        '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # name not a string
        '<tool_call>\n["f", {}]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>{"name": "g", "argu',  # 2nd cut
    ],
)
def test_malformed_calls_are_the_text_as_content(text):
    out = PARSER.extract(text)
    assert out.calls == () and out.content == (text or None)


def _stream(pieces: list[str]):
    stream = PARSER.streamer()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for entry in d.tool_calls:
            if "id" in entry:  # the first delta of a call: id, type, name
                assert entry["index"] not in calls and entry["type"] == "function"
                assert entry["id"].startswith("chatcmpl-tool-") and entry["function"]["name"]
                calls[entry["index"]] = {"name": entry["function"]["name"], "arguments": ""}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], stream


def _splits(text: str):
    """Every way to cut ``text`` in two, in three at a few places, and one piece per character."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text), 7):
        for j in range(i, len(text), 5):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text", [ONE, TWO, NESTED, UNCLOSED, "plain text <tool no call", "a < b <tool_cal"])
def test_streaming_split_anywhere_gives_the_same_calls_and_content(text):
    whole = PARSER.extract(text)
    for pieces in _splits(text):
        content, calls, stream = _stream(pieces)
        assert calls == _calls(whole), pieces
        assert content == (whole.content or ""), pieces
        assert stream.called == bool(whole.calls)


def test_streamed_arguments_are_the_generated_text_and_no_tag_leaks():
    content, calls, _ = _stream(list(TWO))
    assert content == ""
    stream = PARSER.streamer()
    pieces = [stream.feed(c) for c in TWO]
    args = "".join(e["function"]["arguments"] for d in pieces for e in d.tool_calls if e["index"] == 0)
    assert args == '{"city": "Pa\\"ris", "days": 2}'  # as generated, not re-serialized
    assert not any("<" in d.content or "tool_call" in d.content for d in pieces)


def test_streaming_a_malformed_call_without_a_name_sends_the_text_as_content():
    text = 'hm <tool_call>\n{"nme": "f", "arguments": {}}\n</tool_call>'
    for pieces in _splits(text):
        content, calls, stream = _stream(pieces)
        assert calls == [] and content == text and not stream.called
    assert PARSER.extract(text).content == text


def test_streaming_a_call_broken_after_its_name_stays_a_call():
    """What was streamed cannot be taken back (vLLM streams the same); unstreamed it is content."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": oops}\n</tool_call>'
    stream = PARSER.streamer()
    deltas = [stream.feed(c) for c in text] + [stream.finish()]
    (first,) = [e for d in deltas for e in d.tool_calls if "id" in e]
    assert first["function"]["name"] == "f" and stream.called
    assert "".join(d.content for d in deltas) == ""
    assert PARSER.extract(text).calls == () and PARSER.extract(text).content == text


# -- the gate: which chat template has which parser ----------------------------------------------
def test_a_template_that_renders_tools_and_asks_for_tool_call_tags_gets_hermes():
    assert parser_for_template(QWEN2_VL_TOOLS_CHAT_TEMPLATE).name == "hermes"
    # negative controls: the Qwen2-VL template renders no tools; a template that renders tools in
    # another format has no parser here; a template that names the tags but no tools neither
    assert parser_for_template(QWEN2_VL_CHAT_TEMPLATE) is None
    assert parser_for_template("{% for t in tools %}{{ t | tojson }}{% endfor %}[TOOL_CALLS]") is None
    assert parser_for_template("<tool_call> {{ messages }}") is None
    assert parser_for_template(None) is None


def test_the_template_is_read_from_the_model_folder_as_the_workers_load_it(tmp_path):
    assert chat_template_text(tmp_path) is None and parser_for_model(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN2_VL_TOOLS_CHAT_TEMPLATE}))
    assert parser_for_model(tmp_path).name == "hermes"
    named = [{"name": "default", "template": "x"}, {"name": "tool_use", "template": QWEN2_VL_TOOLS_CHAT_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert parser_for_model(tmp_path).name == "hermes"
    # the processor's template comes first (the engines render processor.chat_template first)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}))
    assert chat_template_text(tmp_path) == QWEN2_VL_CHAT_TEMPLATE and parser_for_model(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text(QWEN2_VL_TOOLS_CHAT_TEMPLATE)
    assert parser_for_model(tmp_path).name == "hermes"
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert parser_for_model(tmp_path) is None


def test_module_imports_no_model_library():
    import subprocess
    import sys

    code = (
        "import sys, services.api.tool_parsers; "
        "bad = [m for m in ('torch', 'transformers', 'jinja2', 'vllm') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
