"""``tool_choice: "auto"`` and tool conversations (issue 24 item 3): the API answers a model's calls
with its tool parser where the chat template renders tools (``services.api.tool_parsers``), refuses
them (400) where it does not, and carries tool conversations to the workers' chat template.

Unit tests of the request parsing, the response shapes (whole and streamed), the wire form and the
engines' message normalization; stack tests through the real API on a copy of the tiny model whose
chat template is a Qwen2.5-style tool template (``shared.tools.models.tiny.QWEN2_VL_TOOLS_CHAT_TEMPLATE``):
agg, and one disaggregated (e-pd). Random weights never write ``<tool_call>``: through the stack the
answers are content, and what shows the tools reached the worker is its prompt's token count, equal
to the chat template rendered here with the tools (and not without them).
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from services.api.responses import ChoiceResult, StreamShaper, response_body
from services.api.schemas import parse_chat_request, parse_tokenize_request
from services.api.tool_parsers import HermesToolParser
from shared import protocol
from shared.chat import ChatMessage, FunctionCall, ToolCall
from shared.engines.prompts import normalize_messages
from shared.errors import InvalidRequest, UnsupportedContent, UnsupportedParameter
from shared.protocol import FinalResult, GenerationJob, ProtocolError, SamplingSpec, TokenChunk
from tests.stackutil import parse_sse, start_stack

HERMES = HermesToolParser()
KW = dict(served_model="m", max_images=2, max_tokens_limit=64, default_max_tokens=8)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ],
}
ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"}
CONVERSATION = [ASK, CALLED, ANSWER]


def _chat(body: dict, parser=HERMES):
    return parse_chat_request({"messages": [ASK], **body}, **KW, tool_parser=parser)


# -- the request -------------------------------------------------------------------------------------
def test_auto_is_parsed_where_the_template_has_a_parser_and_refused_naming_tool_choice_where_not():
    for body in ({"tools": [WEATHER], "tool_choice": "auto"}, {"tools": [WEATHER]}):
        parsed = _chat(body)
        assert parsed.tool_parser is HERMES and parsed.tool_name is None and parsed.sampling.structured is None
        with pytest.raises(UnsupportedParameter) as err:
            _chat(body, parser=None)
        assert err.value.param == "tool_choice" and err.value.http_status == 400
        assert "chat template renders no tool calls" in err.value.message
    # "none" and a named choice: no parser involved
    assert _chat({"tools": [WEATHER], "tool_choice": "none"}).tool_parser is None
    named = _chat({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.tool_parser is None and named.tool_name == "get_weather"
    # "required" stays a 400 (a call is not forced here), with or without a parser
    for parser in (HERMES, None):
        with pytest.raises(UnsupportedParameter) as err:
            _chat({"tools": [WEATHER], "tool_choice": "required"}, parser=parser)
        assert err.value.param == "tool_choice"
    assert _chat({"tools": [WEATHER], "parallel_tool_calls": False}).parallel_tool_calls is False
    assert _chat({"tools": [WEATHER]}).parallel_tool_calls is True


def test_a_tool_conversation_is_parsed_into_typed_messages_and_their_wire_form():
    parsed = parse_chat_request({"messages": CONVERSATION, "tools": [WEATHER]}, **KW, tool_parser=HERMES)
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    assert parsed.messages[1:] == [
        ChatMessage(role="assistant", content="", tool_calls=(call,)),
        ChatMessage(role="tool", content="sunny, 22 C", tool_call_id="call_1"),
    ]
    assert [m.to_wire() for m in parsed.messages] == [
        ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    "type": "function",
                }
            ],
        },
        {"role": "tool", "content": "sunny, 22 C", "tool_call_id": "call_1"},
    ]
    # arguments given as an object (vLLM takes it) travel as JSON text
    as_object = {
        **CALLED,
        "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "f", "arguments": {"a": 1}}}],
    }
    parsed = parse_chat_request({"messages": [ASK, as_object]}, **KW, tool_parser=HERMES)
    assert parsed.messages[1].tool_calls[0].function.arguments == '{"a": 1}'
    # an empty tool_calls list is no call (vLLM drops it): allowed without a parser too
    plain = parse_chat_request({"messages": [ASK, {**CALLED, "tool_calls": []}]}, **KW)
    assert plain.messages[1].to_wire() == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    "messages, error, needle",
    [
        ([ASK, {"role": "tool", "content": "x"}], InvalidRequest, "tool_call_id"),
        ([{**ASK, "tool_calls": CALLED["tool_calls"]}], InvalidRequest, "assistant messages only"),
        ([{**ASK, "tool_call_id": "c"}], InvalidRequest, "tool messages only"),
        ([ASK, {**CALLED, "tool_calls": [{"id": "c", "function": {}}]}], InvalidRequest, "name"),
        ([ASK, {**CALLED, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], InvalidRequest, "id"),
        (
            [ASK, {**CALLED, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}],
            InvalidRequest,
            "JSON",
        ),
        (  # not rendered as {} (vLLM's fallback): the client's broken call is its error
            [ASK, {**CALLED, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1, 2]"}}]}],
            InvalidRequest,
            "JSON object",
        ),
        (
            [ASK, {**CALLED, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{nope"}}]}],
            InvalidRequest,
            "JSON object",
        ),
        (
            [ASK, {**ANSWER, "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}],
            UnsupportedContent,
            "text only",
        ),
    ],
)
def test_malformed_tool_messages_are_refused_naming_messages(messages, error, needle):
    with pytest.raises(error) as err:
        parse_chat_request({"messages": messages}, **KW, tool_parser=HERMES)
    assert err.value.param == "messages" and needle in err.value.message


def test_tool_conversations_are_refused_where_the_template_renders_no_tools():
    for messages in ([ASK, CALLED], [ASK, ANSWER], CONVERSATION):
        with pytest.raises(UnsupportedContent) as err:
            parse_chat_request({"messages": messages}, **KW)
        assert err.value.param == "messages" and "chat template renders no tool calls" in err.value.message
        with pytest.raises(UnsupportedContent):
            parse_tokenize_request({"messages": messages}, served_model="m")
    tok = parse_tokenize_request({"messages": CONVERSATION, "tools": [WEATHER]}, served_model="m", tool_parser=HERMES)
    assert tok.tools[0]["function"]["name"] == "get_weather" and tok.messages[2]["tool_call_id"] == "call_1"
    with pytest.raises(InvalidRequest) as err:
        parse_tokenize_request({"prompt": "x", "tools": [WEATHER]}, served_model="m")
    assert err.value.param == "tools"


# -- the wire and the engines' messages --------------------------------------------------------------
def _job(messages):
    return GenerationJob(
        v=protocol.generation_schema(messages),
        request_id="r",
        model="m",
        messages=messages,
        images=(),
        fingerprint="f",
        sampling=SamplingSpec(),
        stream=False,
        deadline=1.0,
        created_at=0.0,
    )


def test_a_tool_conversation_travels_in_a_v3_job_that_a_v2_worker_refuses(monkeypatch):
    wire = [m.to_wire() for m in parse_chat_request({"messages": CONVERSATION}, **KW, tool_parser=HERMES).messages]
    job = _job(wire)
    assert job.v == protocol.TOOL_MESSAGES_SCHEMA == 3
    assert protocol.decode(protocol.encode(job), GenerationJob).messages == wire
    plain = _job([ASK])
    assert plain.v == protocol.SAMPLING_SCHEMA == 2  # jobs without tool messages: readable by v2 workers
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", 2)  # a worker of the previous schema
    assert protocol.decode(protocol.encode(plain), GenerationJob).messages == [ASK]
    with pytest.raises(ProtocolError, match="v3 is newer"):
        protocol.decode(protocol.encode(job), GenerationJob)


def test_the_engines_hand_the_template_the_calls_arguments_as_objects():
    wire = [
        ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
            ],
        },
        {
            "role": "tool",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_call_id": "a",
        },
    ]
    norm = normalize_messages(wire)
    # vLLM's _postprocess_messages: JSON text -> object; not a JSON object -> {} (the turn can go on)
    assert [c["function"]["arguments"] for c in norm[1]["tool_calls"]] == [{"x": [1]}, {}, {}]
    assert norm[2] == {"role": "tool", "content": "a\nb", "tool_call_id": "a"}  # text parts joined (vLLM)
    assert normalize_messages([ASK]) == [ASK]


# -- the answer ----------------------------------------------------------------------------------------
CALL_TEXT = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL_TEXT + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def _final(text: str, finish_reason: str = "stop") -> FinalResult:
    return FinalResult(
        request_id="r",
        attempt=1,
        token_ids=(1,),
        text=text,
        finish_reason=finish_reason,
        prompt_tokens=3,
        completion_tokens=1,
    )


def _body(parsed, text, finish_reason="stop"):
    return response_body("chatcmpl-x", parsed, [ChoiceResult(final=_final(text, finish_reason))], 0)["choices"][0]


def test_auto_answers_the_parsed_calls_with_finish_reason_tool_calls():
    parsed = _chat({"tools": [WEATHER]})
    choice = _body(parsed, TWO_CALLS)
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])
    # parallel_tool_calls false: the first call only (vLLM)
    one = _body(_chat({"tools": [WEATHER], "parallel_tool_calls": False}), TWO_CALLS)["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in one] == [{"city": "Paris"}]
    # no call: the text as content, the finish reason as it was; a call cut by max_tokens stays "length"
    assert _body(parsed, "just words") == {
        "index": 0,
        "message": {"role": "assistant", "content": "just words"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert _body(parsed, CALL_TEXT, "length")["finish_reason"] == "length"
    # only calls: content null (vLLM)
    assert _body(parsed, CALL_TEXT[len("Checking.") :])["message"]["content"] is None
    # negative control: the same text without auto is plain content
    assert _body(_chat({"tools": [WEATHER], "tool_choice": "none"}), CALL_TEXT)["message"] == {
        "role": "assistant",
        "content": CALL_TEXT,
    }


def _chunks(pieces):
    return [TokenChunk(request_id="r", attempt=1, seq=i, token_ids=(i,), text=t) for i, t in enumerate(pieces)]


def _streamed(parsed, pieces, finish_reason="stop"):
    shaper = StreamShaper("chatcmpl-x", parsed, 0)
    out = [d for d in (shaper.tokens(0, c) for c in _chunks(pieces)) if d is not None]
    out.append(shaper.finish(0, _final("".join(pieces), finish_reason)))
    return [d["choices"][0] for d in out]


def test_auto_streams_content_then_tool_call_deltas_as_openai_sends_them():
    parsed = _chat({"tools": [WEATHER]})
    for pieces in (list(TWO_CALLS), [TWO_CALLS[:20], TWO_CALLS[20:45], TWO_CALLS[45:]], [TWO_CALLS]):
        choices = _streamed(parsed, pieces)
        assert choices[-1]["finish_reason"] == "tool_calls" and all(c["finish_reason"] is None for c in choices[:-1])
        deltas = [c["delta"] for c in choices]
        assert "".join(d.get("content", "") for d in deltas) == "Checking."
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        firsts = [e for e in entries if "id" in e]
        assert [(e["index"], e["type"], e["function"]["name"]) for e in firsts] == [
            (0, "function", "get_weather"),
            (1, "function", "get_weather"),
        ]
        args = ["".join(e["function"]["arguments"] for e in entries if e["index"] == i) for i in (0, 1)]
        assert [json.loads(a) for a in args] == [{"city": "Paris"}, {"city": "Rome"}]
        # no content after the first call starts: the tags never reach the client
        first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
        assert not any("content" in d for d in deltas[first_call + 1 :])
    # parallel_tool_calls false: call 0's deltas only
    single = _streamed(_chat({"tools": [WEATHER], "parallel_tool_calls": False}), list(TWO_CALLS))
    assert {e["index"] for c in single for e in c["delta"].get("tool_calls", [])} == {0}
    # text without calls: content, a held-back "<tool" included at the end, the finish reason kept
    plain = _streamed(parsed, ["a <to", "ol"], "length")
    assert "".join(c["delta"].get("content", "") for c in plain) == "a <tool"
    assert plain[-1]["finish_reason"] == "length"


# -- through the stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tools_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with the Qwen2.5-style tool template (same weights and tokenizer)."""
    from shared.tools.models.tiny import QWEN2_VL_TOOLS_CHAT_TEMPLATE, write_chat_template

    folder = tmp_path_factory.mktemp("models") / "qwen2-vl-tiny-tools"
    shutil.copytree(tiny_model_dir, folder)
    write_chat_template(folder, QWEN2_VL_TOOLS_CHAT_TEMPLATE)
    return folder


def _tools_stack(nats_server, s3_server, model_dir, tmp_path_factory, topology):
    return start_stack(
        nats_server, s3_server, model_dir, tmp_path_factory.mktemp(f"tools-{topology}-logs"), topology=topology
    )


@pytest.fixture(scope="module")
def tools_agg_stack(nats_server, s3_server, tools_model_dir, tmp_path_factory):
    running = _tools_stack(nats_server, s3_server, tools_model_dir, tmp_path_factory, "agg")
    try:
        yield running
    finally:
        running.stack.stop()


def _post(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json={"model": "qwen2-vl-tiny", **body}, timeout=300)


def _prompt_tokens(model_dir, messages, tools=None) -> int:
    """The prompt's token count as rendered here with transformers (arguments as objects, as vLLM
    hands them to the template) - independent of the API's and the workers' code."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = json.loads(json.dumps(messages))
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if m.get("content") is None:
            m["content"] = ""
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.mark.slow
def test_auto_is_refused_naming_tool_choice_for_a_template_without_tools(api_only_stack):
    for body in ({"tools": [WEATHER], "tool_choice": "auto"}, {"tools": [WEATHER]}, {"messages": CONVERSATION}):
        resp = httpx.post(
            f"{api_only_stack.url}/v1/chat/completions",
            json={"messages": [ASK], **body},
            headers={"Authorization": "Bearer sk-test-1"},
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == ("messages" if "messages" in body else "tool_choice")
        assert "chat template renders no tool calls" in error["message"]


@pytest.mark.slow
def test_auto_with_a_tool_template_answers_and_the_worker_rendered_the_tools(tools_agg_stack, tools_model_dir):
    stack = tools_agg_stack
    resp = _post(stack, {"messages": [ASK], "tools": [WEATHER], "tool_choice": "auto", **GREEDY})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    # the worker's prompt is the template rendered WITH the tools (and not without them)
    with_tools = _prompt_tokens(tools_model_dir, [ASK], [WEATHER])
    assert body["usage"]["prompt_tokens"] == with_tools != _prompt_tokens(tools_model_dir, [ASK])
    # /tokenize renders the same prompt
    tok = httpx.post(f"{stack.url}/tokenize", json={"messages": [ASK], "tools": [WEATHER]}, timeout=60)
    assert tok.status_code == 200 and tok.json()["count"] == with_tools, tok.text
    (job,) = stack.messages_of("stream_generate", GenerationJob, body["id"])
    assert [json.loads(t)["function"]["name"] for t in job.tools] == ["get_weather"] and job.v == 2

    # streamed: the same content (greedy), as content deltas
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/chat/completions",
        json={"model": "qwen2-vl-tiny", "messages": [ASK], "tools": [WEATHER], "stream": True, **GREEDY},
        timeout=300,
    ) as streamed:
        assert streamed.status_code == 200, streamed.read()
        events = list(parse_sse(streamed.iter_lines()))
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
    assert not any("tool_calls" in d for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == choice["finish_reason"]


def _conversation_renders(stack, model_dir):
    resp = _post(stack, {"messages": CONVERSATION, "tools": [WEATHER], **GREEDY})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    # the worker rendered the call and the tool's answer: the reference rendering's token count,
    # which differs from the conversation without the assistant's call
    expected = _prompt_tokens(model_dir, CONVERSATION, [WEATHER])
    without_call = _prompt_tokens(model_dir, [ASK, {"role": "assistant", "content": ""}, ANSWER], [WEATHER])
    assert body["usage"]["prompt_tokens"] == expected != without_call
    tok = httpx.post(f"{stack.url}/tokenize", json={"messages": CONVERSATION, "tools": [WEATHER]}, timeout=60)
    assert tok.status_code == 200 and tok.json()["count"] == expected, tok.text
    (job,) = stack.messages_of("stream_generate", GenerationJob, body["id"])
    assert job.v == protocol.TOOL_MESSAGES_SCHEMA and job.messages[2]["tool_call_id"] == "call_1"
    return body


@pytest.mark.slow
def test_a_tool_conversation_renders_and_answers(tools_agg_stack, tools_model_dir):
    body = _conversation_renders(tools_agg_stack, tools_model_dir)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_a_tool_conversation_disaggregated(nats_server, s3_server, tools_model_dir, tmp_path_factory, tools_agg_stack):
    """e-pd: the same conversation through an encoder and a prefill+decode worker renders the same
    prompt and answers what agg answers (greedy)."""
    running = _tools_stack(nats_server, s3_server, tools_model_dir, tmp_path_factory, "e-pd")
    try:
        split = _conversation_renders(running, tools_model_dir)
        auto = _post(running, {"messages": [ASK], "tools": [WEATHER], "tool_choice": "auto", **GREEDY})
        assert auto.status_code == 200, auto.text
    finally:
        running.stack.stop()
    agg = _post(tools_agg_stack, {"messages": CONVERSATION, "tools": [WEATHER], **GREEDY})
    assert split["choices"][0]["message"] == agg.json()["choices"][0]["message"]
    assert split["usage"] == agg.json()["usage"]
