"""Structured output and tools (issue 24 item 3), wired: ``response_format`` json_object / json_schema
and a named ``tool_choice`` through the API into the job's ``SamplingSpec.structured``, the transformers
engine's grammar-constrained sampling (raw logits masked before everything else and before the
logprobs, as vLLM), ``tools`` to the chat template, ``tool_calls`` in the body and as streamed deltas,
and the E|P|D hand-off (the decode side replays the prefill's tokens through a fresh constraint).

The tiny random-weight model, greedy, picks whitespace forever inside a JSON grammar (xgrammar allows
any whitespace, as vLLM compiles it): the requests push whitespace tokens down with ``logit_bias``
(as ``tests/test_grammar.py`` does). Its strings may hold raw control characters, which xgrammar's
JSON grammar admits (vLLM's output has them too): outputs are parsed with ``json.loads(strict=False)``.
"""

from __future__ import annotations

import json
import uuid

import httpx
import msgspec
import pytest

from services.api.params import Endpoint
from services.api.responses import ChoiceResult, StreamShaper, response_body
from services.api.schemas import parse_chat_request, parse_completion_request
from shared.engines.base import ChatPrompt, SamplingParams
from shared.engines.grammar import structured_output
from shared.errors import InvalidRequest, UnsupportedParameter
from shared.protocol import FinalResult, GenerationJob, SamplingSpec, StructuredKind, TokenChunk
from tests.stackutil import parse_sse, run_sync, user_message
from tests.test_sampling_epd import (
    Workers,
    _aggregated,
    _job,
    _streamed,
    _want,
)

CHAT_KW = dict(served_model="m", max_images=2, max_tokens_limit=64, default_max_tokens=8)
MESSAGES = [{"role": "user", "content": "hi"}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(body: dict):
    return parse_chat_request({"messages": MESSAGES, **body}, **CHAT_KW)


def _loads(text: str):
    return json.loads(text, strict=False)


# -- the API: parameters -> SamplingSpec.structured, tools -> the job ------------------------------
def test_response_format_maps_into_the_sampling_spec():
    assert _chat({}).sampling.structured is None
    assert _chat({"response_format": {"type": "text"}}).sampling.structured is None
    so = _chat({"response_format": {"type": "json_object"}}).sampling.structured
    assert so is not None and so.kind == StructuredKind.JSON_OBJECT
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    so = _chat({"response_format": rf}).sampling.structured
    assert so == structured_output("json_schema", PERSON)
    # completions too (vLLM's CompletionRequest has response_format)
    parsed = parse_completion_request(
        {"prompt": "hi", "response_format": rf}, served_model="m", max_tokens_limit=64, default_max_tokens=8
    )
    assert parsed.sampling.structured == so and parsed.endpoint == Endpoint.COMPLETIONS


def test_tools_and_a_named_tool_choice():
    parsed = _chat({"tools": [WEATHER, NOARGS], "tool_choice": NAMED})
    assert parsed.tool_name == "get_weather"
    # the function's parameters constrain the output
    assert parsed.sampling.structured == structured_output("json_schema", WEATHER["function"]["parameters"])
    assert [json.loads(t)["function"]["name"] for t in parsed.tools] == ["get_weather", "ping"]
    # a function without parameters: any object (vLLM's _params_or_empty_object)
    ping = _chat({"tools": [WEATHER, NOARGS], "tool_choice": {"type": "function", "function": {"name": "ping"}}})
    assert json.loads(ping.sampling.structured.schema) == {"type": "object", "properties": {}}
    # "none": the tools still reach the template, nothing is constrained
    none = _chat({"tools": [WEATHER], "tool_choice": "none"})
    assert none.tool_name is None and none.sampling.structured is None and len(none.tools) == 1
    assert _chat({"tool_choice": "none"}).tools == ()


def test_tools_reach_the_template_as_vllm_dumps_them():
    """vLLM gives the chat template ``[tool.model_dump() for tool in request.tools]``: the same
    dicts here (a template that renders ``tool | tojson`` then renders the same prompt)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    tools = [
        WEATHER,
        NOARGS,
        {"function": {"name": "strict_one", "strict": True, "extra": 1}, "defer_loading": None},
        {"type": "function", "function": {"name": "d", "description": "x", "parameters": {"type": "object"}}},
    ]
    parsed = _chat({"tools": tools, "tool_choice": "none"})
    assert [json.loads(t) for t in parsed.tools] == [
        ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools
    ]


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "required"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 2}},
                }
            },
            "response_format",
            "multipleOf",
        ),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "structured"),
        ({"tools": []}, "tools", "empty"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools", "name"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", "function"),
        ({"tools": [WEATHER] * 129, "tool_choice": "none"}, "tools", "at most"),
        ({"tools": [WEATHER]}, "tool_choice", "default"),  # tools alone: "auto"
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "tool parser"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "'required' is not supported"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "x"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "named function"),
        ({"tool_choice": NAMED}, "tool_choice", "needs 'tools'"),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "response_format",
            "named",
        ),
        ({"tools": [WEATHER], "tool_choice": NAMED, "min_tokens": 1}, "min_tokens", "structured"),
    ],
)
def test_refusals_name_their_parameter(body, param, needle):
    with pytest.raises((InvalidRequest, UnsupportedParameter)) as err:
        _chat(body)
    assert err.value.param == param and err.value.http_status == 400
    assert needle in err.value.message


def test_the_tools_travel_in_the_generation_job_and_become_a_chat_prompt():
    from shared.model_worker import job_prompt

    parsed = _chat({"tools": [WEATHER], "tool_choice": NAMED})
    job = GenerationJob(
        request_id="r",
        model="m",
        messages=MESSAGES,
        images=(),
        fingerprint="",
        sampling=parsed.sampling,
        stream=False,
        deadline=1.0,
        created_at=0.0,
        tools=parsed.tools,
    )
    from shared import protocol

    back = protocol.decode(protocol.encode(job), GenerationJob)
    assert back.tools == parsed.tools
    prompt = job_prompt(back)
    assert isinstance(prompt, ChatPrompt) and prompt.messages == MESSAGES
    assert prompt.tools[0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    assert job_prompt(msgspec.structs.replace(back, tools=())) == MESSAGES  # no tools: plain messages
    with pytest.raises(ValueError):  # bounded
        msgspec.structs.replace(back, tools=("x" * 300_000,))


def test_the_chat_template_renders_the_tools(tiny_model_dir):
    """``render_chat_prompt`` hands the tools to the template as ``tools``; the tiny model's template
    (like Qwen2-VL's) ignores them and renders what it renders without."""
    from transformers import AutoProcessor

    from shared.engines.prompts import render_chat_prompt

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    tool = json.loads(_chat({"tools": [WEATHER], "tool_choice": "none"}).tools[0])
    with_tools = "{% for t in tools or [] %}TOOL {{ t | tojson }}\n{% endfor %}" + processor.chat_template
    rendered = render_chat_prompt(processor, with_tools, MESSAGES, [tool])
    assert rendered.startswith("TOOL ") and '"name": "get_weather"' in rendered
    assert render_chat_prompt(processor, with_tools, MESSAGES) == render_chat_prompt(
        processor, processor.chat_template, MESSAGES
    )
    assert render_chat_prompt(processor, processor.chat_template, MESSAGES, [tool]) == render_chat_prompt(
        processor, processor.chat_template, MESSAGES
    )


# -- response shapes ---------------------------------------------------------------------------
def _chunks(texts: list[str]) -> list[TokenChunk]:
    return [TokenChunk(request_id="r", attempt=1, seq=i, token_ids=(i,), text=t) for i, t in enumerate(texts)]


def test_a_named_tool_choice_is_answered_with_tool_calls():
    parsed = _chat({"tools": [WEATHER], "tool_choice": NAMED, "n": 2})
    args = '{"city": "Paris", "days": 2}'
    finals = [
        FinalResult(
            request_id="r",
            attempt=1,
            token_ids=(1,),
            text=t,
            finish_reason="stop",
            prompt_tokens=3,
            completion_tokens=1,
        )
        for t in (args, "  ")
    ]
    body = response_body("chatcmpl-x", parsed, [ChoiceResult(final=f) for f in finals], 0)
    message = body["choices"][0]["message"]
    assert message["content"] == "" and body["choices"][0]["finish_reason"] == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": args}
    assert body["choices"][1]["message"]["tool_calls"] == []  # blank arguments: no call (vLLM)
    # without a named choice: plain content
    plain = response_body("chatcmpl-y", _chat({}), [ChoiceResult(final=finals[0])], 0)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": args}

    # streaming: vLLM's deltas - the first with id / type / name, then arguments pieces
    shaper = StreamShaper("chatcmpl-x", parsed, 0)
    pieces = ['{"city"', ': "Par', "", 'is", "days": 2}']
    deltas = [d for d in (shaper.tokens(0, c) for c in _chunks(pieces)) if d is not None]
    calls = [d["choices"][0]["delta"]["tool_calls"] for d in deltas]
    assert all(len(c) == 1 and c[0]["index"] == 0 for c in calls)
    assert calls[0][0]["id"].startswith("chatcmpl-tool-") and calls[0][0]["type"] == "function"
    assert calls[0][0]["function"]["name"] == "get_weather"
    assert all(set(c[0]) == {"index", "function"} and set(c[0]["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c[0]["function"]["arguments"] for c in calls) == "".join(pieces)
    assert all("content" not in d["choices"][0]["delta"] for d in deltas)
    # choice 1 gets its own call id
    other = shaper.tokens(1, _chunks(["{"])[0])
    assert other["choices"][0]["delta"]["tool_calls"][0]["id"] != calls[0][0]["id"]
    assert shaper.finish(0, finals[0])["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }


# -- the transformers engine -------------------------------------------------------------------
def _whitespace_ids(tokenizer) -> list[int]:
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]


def _no_whitespace(tokenizer) -> tuple[tuple[int, float], ...]:
    return tuple((i, -100.0) for i in _whitespace_ids(tokenizer))


async def _events(engine, prompt, params):
    return [e async for e in engine.generate(prompt, [], params)]


def test_the_engine_samples_from_masked_logits_and_its_logprobs_are_theirs(reference_engine):
    """The grammar masks the raw logits before the logprobs are taken (vLLM masks in the model
    runner, before its sampler computes the raw logprobs): every alternative with a finite
    logprob is a token the grammar allows there - at the first token only ``{`` and whitespace."""
    import jsonschema

    tok = reference_engine.tokenizer
    so = structured_output("json_schema", PERSON)
    params = SamplingParams(max_tokens=60, temperature=0.0, logit_bias=_no_whitespace(tok), structured=so, logprobs=5)
    events = run_sync(_events(reference_engine, MESSAGES, params))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop", text
    jsonschema.validate(_loads(text), PERSON)
    first = events[0].logprob
    allowed = set(_whitespace_ids(tok)) | {tok.convert_tokens_to_ids("{")}
    finite = [tid for tid, _, lp in first.top if lp > -1e30]
    assert finite and set(finite) <= allowed, [(tok.decode([t]), lp) for t, _, lp in first.top]
    assert first.token_id == tok.convert_tokens_to_ids("{")
    # the logprobs are a distribution over the allowed tokens only
    assert abs(sum(pow(2.718281828459045, lp) for _, _, lp in first.top if lp > -1e30) - 1.0) < 1e-3

    # seeded sampling (temperature, top-p) stays inside the grammar too
    seeded = SamplingParams(
        max_tokens=60, temperature=1.0, top_p=0.9, seed=7, logit_bias=_no_whitespace(tok), structured=so
    )
    text = "".join(e.text for e in run_sync(_events(reference_engine, MESSAGES, seeded)))
    # (a sampled name may hold byte tokens whose text decodes to several U+FFFD: its length is not
    # checked here)
    jsonschema.validate(_loads(text), {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}})


def test_the_engine_refuses_what_cannot_hold(reference_engine):
    so = structured_output("json_object")
    with pytest.raises(InvalidRequest) as err:
        run_sync(_events(reference_engine, MESSAGES, SamplingParams(max_tokens=4, min_tokens=1, structured=so)))
    assert err.value.param == "min_tokens"
    bad = structured_output("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    with pytest.raises(InvalidRequest, match="grammar"):
        run_sync(_events(reference_engine, MESSAGES, SamplingParams(max_tokens=4, structured=bad)))


# -- E|P|D: the constraint continues across the hand-off (in-process workers, real NATS and S3) ---
@pytest.fixture(scope="module")
def env(nats_server, s3_server, tiny_model_dir):
    """The in-process workers' settings (as ``tests/test_sampling_epd.py``)."""
    from tests.stackutil import stack_env

    env, *_ = stack_env(nats_server, s3_server, tiny_model_dir)
    return {k[4:].lower(): v for k, v in env.items()}


def test_epd_with_a_schema_equals_aggregated_token_for_token(env, reference_engine, monkeypatch):
    """Prefill samples the first token under the grammar, the decode worker rebuilds the
    constraint and replays it: the streamed tokens (and logprobs) equal the aggregated engine's.
    Negative control: a decode side that does not replay (a fresh constraint) decodes otherwise."""
    import jsonschema

    from shared.engines.grammar import GrammarConstraint

    tok = reference_engine.tokenizer
    spec = SamplingSpec(
        max_tokens=60,
        temperature=0.0,
        logit_bias=tuple(sorted(_no_whitespace(tok))),
        structured=structured_output("json_schema", PERSON),
        logprobs=2,
    )
    want = _want(run_sync(_aggregated(reference_engine, MESSAGES, spec)))
    jsonschema.validate(_loads(want[1]), PERSON)

    async def main(rid):
        async with Workers(env, reference_engine, "prefill") as w:
            return await w.run(_job(rid, spec, messages=MESSAGES))

    chunks, final, decode_job = run_sync(main(f"so-epd-{uuid.uuid4().hex[:8]}"))
    assert decode_job is not None and decode_job.emitted == 1 and decode_job.sampling == spec
    assert _streamed(chunks) == want
    assert final.finish_reason == "stop" and final.text == want[1]

    # negative control: the decode side skips the replay (its constraint starts from nothing)
    monkeypatch.setattr(GrammarConstraint, "replay", lambda self, token_ids: self)
    chunks2, _, _ = run_sync(main(f"so-epd-noreplay-{uuid.uuid4().hex[:8]}"))
    assert _streamed(chunks2)[0][0] == want[0][0]  # prefill's first token is the same
    assert _streamed(chunks2)[0] != want[0]


# -- through the real stack (E|PD: api + encoder + prefill processes) -------------------------------
def _post(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json={"model": "qwen2-vl-tiny", **body}, timeout=300)


@pytest.fixture(scope="module")
def no_whitespace(tiny_model_dir) -> dict[str, float]:
    from transformers import AutoTokenizer

    return {str(i): -100 for i in _whitespace_ids(AutoTokenizer.from_pretrained(tiny_model_dir))}


@pytest.mark.slow
def test_structured_output_through_the_stack(epd_stack, no_whitespace):
    import jsonschema

    messages = [user_message("Describe a person.", [])]
    base = {"messages": messages, "max_tokens": 60, "temperature": 0, "logit_bias": no_whitespace}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = _post(epd_stack, {**base, "response_format": rf})
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    doc = _loads(choice["message"]["content"])
    jsonschema.validate(doc, PERSON)
    assert list(doc) == ["name", "age", "ok"] and choice["finish_reason"] == "stop"
    # negative control: the same request without response_format is not JSON
    free = _post(epd_stack, base).json()["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        _loads(free)

    obj = _post(epd_stack, {**base, "response_format": {"type": "json_object"}}).json()
    assert isinstance(_loads(obj["choices"][0]["message"]["content"]), dict)

    # a schema xgrammar cannot compile: a 400 from the worker, naming response_format
    dangling = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}
    bad = _post(epd_stack, {**base, "response_format": dangling})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text


@pytest.mark.slow
def test_a_named_tool_call_through_the_stack_streamed_and_not(epd_stack, no_whitespace):
    import jsonschema

    body = {
        "messages": [user_message("What is the weather in Paris?", [])],
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": no_whitespace,
        "tools": [WEATHER, NOARGS],
        "tool_choice": NAMED,
    }
    out = _post(epd_stack, body)
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    arguments = call["function"]["arguments"]
    jsonschema.validate(_loads(arguments), WEATHER["function"]["parameters"])
    # the tools reached the worker with the job, for its chat template
    (job,) = epd_stack.messages_of("stream_generate", GenerationJob, out.json()["id"])
    assert [json.loads(t)["function"]["name"] for t in job.tools] == ["get_weather", "ping"]
    assert job.sampling.structured == structured_output("json_schema", WEATHER["function"]["parameters"])

    # streamed: the deltas reassemble to the same arguments (greedy)
    with httpx.stream(
        "POST", f"{epd_stack.url}/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as resp:
        assert resp.status_code == 200, resp.read()
        events = list(parse_sse(resp.iter_lines()))
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert all("id" not in c for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == arguments
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "stop"

    # the openai client reads the call
    import openai

    client = openai.OpenAI(base_url=f"{epd_stack.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="qwen2-vl-tiny", **body)
    assert chat.choices[0].message.tool_calls[0].function.arguments == arguments


def test_module_imports_no_torch_in_the_api_path():
    """The API's parsing imports the grammar module for its checks, never torch or xgrammar."""
    import subprocess
    import sys

    code = (
        "import sys, services.api.schemas, services.api.responses; "
        "bad = [m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
