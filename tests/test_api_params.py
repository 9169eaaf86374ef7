"""API parameter parity (issue 24): every OpenAI / vLLM request field is honoured or refused by name,
the OpenAI shapes of logprobs, ``n`` choices, ``/v1/completions``, ``/tokenize``, ``/detokenize``,
``/version``, ``/v1/models/{id}`` and errors of every route.

The unit tests need no stack; the ``slow`` ones drive the real E|PD stack (transformers engine, tiny
Qwen2-VL). Two of those need the engines' side of issue 24 (``GenerationJob.prompt`` rendered without
a chat template, ``TokenChunk.logprobs`` filled): ``test_completions_greedy_is_deterministic`` and
``test_logprobs_end_to_end`` fail on a branch without it.
"""

from __future__ import annotations

import httpx
import pytest

from services.api.params import MODELS, PARAMS, Endpoint, fields_of
from services.api.responses import ChoiceResult, StreamShaper, chat_logprobs, completion_logprobs, response_body
from services.api.schemas import parse_chat_request, parse_completion_request
from shared.errors import InvalidRequest, UnknownParameter, UnsupportedParameter
from shared.protocol import ECWanted, EncodeJob, FinalResult, GenerationJob, SamplingSpec, TokenChunk, TokenLogprob
from tests.stackutil import data_url, noise_image, parse_sse, user_message

CHAT_KW = dict(served_model="m", max_images=2, max_tokens_limit=64, default_max_tokens=8)
COMPLETION_KW = dict(served_model="m", max_tokens_limit=64, default_max_tokens=8)
MESSAGES = [{"role": "user", "content": "hi"}]
NOT_A_NOOP = {"not": "a no-op"}


def _parse(endpoint: Endpoint, body: dict):
    if endpoint == Endpoint.CHAT:
        return parse_chat_request({"messages": MESSAGES, **body}, **CHAT_KW)
    return parse_completion_request({"prompt": "hi", **body}, **COMPLETION_KW)


# -- the table ---------------------------------------------------------------------------------------
def test_every_vllm_and_openai_field_is_classified_and_the_typed_models_are_the_table():
    """Fails when vLLM (or OpenAI's client) adds a request field this table does not classify."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    sources = {
        Endpoint.CHAT: (
            set(ChatCompletionRequest.model_fields),
            set(chat_create_params.CompletionCreateParamsBase.__annotations__),
        ),
        Endpoint.COMPLETIONS: (
            set(CompletionRequest.model_fields),
            set(completion_create_params.CompletionCreateParamsBase.__annotations__),
        ),
    }
    for endpoint, (vllm_fields, openai_fields) in sources.items():
        ours = fields_of(endpoint)
        assert vllm_fields - ours == set(), (endpoint, "vLLM fields not in PARAMS")
        assert openai_fields - {"stream"} - ours == set(), (endpoint, "OpenAI fields not in PARAMS")
        # the typed model has exactly the table's fields of its endpoint
        assert set(MODELS[endpoint].__struct_fields__) == ours, endpoint
    assert all(p.status in ("honoured", "ignored", "refused") for p in PARAMS.values())


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_each_refused_field_is_a_400_naming_it_unless_it_is_a_noop(endpoint):
    refused = [name for name, p in PARAMS.items() if p.status == "refused" and endpoint in p.endpoints]
    assert len(refused) > 20
    for name in refused:
        with pytest.raises(UnsupportedParameter) as err:
            _parse(endpoint, {name: NOT_A_NOOP})
        assert err.value.param == name and err.value.http_status == 400
        for value in PARAMS[name].noop_values(endpoint):  # its defaults change nothing: accepted
            _parse(endpoint, {name: value})
    # a field of neither schema (nor of the other endpoint) is refused by name
    other = "prompt" if endpoint == Endpoint.CHAT else "messages"
    for name in ("frobnicate", other):
        with pytest.raises(UnknownParameter) as err:
            _parse(endpoint, {name: 1})
        assert err.value.param == name
    # the metadata fields are accepted
    for name in [n for n, p in PARAMS.items() if p.status == "ignored" and endpoint in p.endpoints]:
        _parse(endpoint, {name: "x"})


def test_honoured_fields_map_into_the_sampling_spec():
    body = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"12": 5, "3": -100},
        "min_tokens": 2,
        "stop": "x",
        "stop_token_ids": [9, 4],
        "seed": 11,
        "max_completion_tokens": 6,
        "max_tokens": 50,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "n": 3,
    }
    parsed = _parse(Endpoint.CHAT, body)
    assert parsed.sampling == SamplingSpec(
        max_tokens=6,
        temperature=0.5,
        top_p=0.9,
        seed=11,
        stop=("x",),
        ignore_eos=True,
        top_k=7,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((3, -100.0), (12, 5.0)),
        min_tokens=2,
        stop_token_ids=(9, 4),
        logprobs=3,
    )
    assert parsed.n == 3
    for off in (-1, 0, None):
        assert _parse(Endpoint.CHAT, {"top_k": off}).sampling.top_k == 0
    assert _parse(Endpoint.CHAT, {"logprobs": True}).sampling.logprobs == 0
    assert _parse(Endpoint.CHAT, {"logprobs": False}).sampling.logprobs is None
    completion = _parse(Endpoint.COMPLETIONS, {"logprobs": 2, "prompt": [[5, 6, 7]], "best_of": 1})
    assert (completion.sampling.logprobs, completion.prompt, completion.sampling.max_tokens) == (2, (5, 6, 7), 16)
    bad = [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"logit_bias": {"-7": 1}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ]
    for body, param in bad:
        with pytest.raises(InvalidRequest) as err:
            _parse(Endpoint.CHAT, body)
        assert err.value.param == param, body
    for body, param in [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"best_of": 2}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": True}, "logprobs"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            _parse(Endpoint.COMPLETIONS, body)
        assert err.value.param == param, body


#: the sampling defaults a checkpoint's generation_config.json may carry (Qwen2.5-VL's Instruct
#: checkpoints: repetition_penalty 1.05, top_k 1, top_p 0.001), and every other field vLLM reads
MODEL_DEFAULTS = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.1,
    "top_k": 1,
    "top_p": 0.001,
    "min_p": 0.02,
    "presence_penalty": 0.25,
    "frequency_penalty": 0.5,
    "max_new_tokens": 20,
    "eos_token_id": [3, 4],
}


def _model_with_defaults(folder, defaults=MODEL_DEFAULTS):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(defaults))
    return folder


@pytest.mark.parametrize("endpoint", list(Endpoint))
@pytest.mark.parametrize(
    "body",
    [
        {},
        {"temperature": 0},
        {"temperature": 0, "repetition_penalty": 1.0},
        {"top_k": 5, "top_p": 0.9},
        {"max_tokens": 7},
    ],
)
def test_left_out_sampling_fields_take_the_model_s_defaults_as_on_vllm_s_server(tmp_path, endpoint, body):
    """A field the request leaves out takes the model's generation_config.json value (the issue's
    Qwen2.5-VL: a plain vLLM server applied its repetition_penalty 1.05 to a ``temperature: 0``
    request, we did not), a field it gives wins: each field as vLLM's own server code resolves it
    (``ModelConfig.get_diff_sampling_param``, the requests' ``to_sampling_params``)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from services.api.sampling_defaults import load_sampling_defaults

    folder = _model_with_defaults(tmp_path / "model")
    # vLLM's reading of the folder (its own method; ``self`` holds what it reads)
    model_config = SimpleNamespace(
        generation_config="auto",
        override_generation_config={},
        try_get_generation_config=lambda: GenerationConfig.from_pretrained(folder).to_diff_dict(),
    )
    theirs_defaults = ModelConfig.get_diff_sampling_param(model_config)
    if endpoint == Endpoint.CHAT:
        ours = parse_chat_request({"messages": MESSAGES, **body}, **CHAT_KW, defaults=load_sampling_defaults(folder))
        request = ChatCompletionRequest(model="m", messages=MESSAGES, **body)
    else:
        ours = parse_completion_request(
            {"prompt": "hi", **body}, **COMPLETION_KW, defaults=load_sampling_defaults(folder)
        )
        request = CompletionRequest(model="m", prompt="hi", **body)
    theirs = request.to_sampling_params(ours.sampling.max_tokens, theirs_defaults)
    names = ["temperature", "presence_penalty", "frequency_penalty", "repetition_penalty"]
    if ours.sampling.temperature > 0:  # (greedy: vLLM resets top_p / top_k / min_p, which no engine applies then)
        names += ["top_p", "top_k", "min_p"]
    for name in names:
        assert getattr(ours.sampling, name) == pytest.approx(getattr(theirs, name)), name
    # the negative control: the same body without the model's defaults is OpenAI's
    plain = _parse(endpoint, body).sampling
    if "repetition_penalty" not in body:
        assert ours.sampling.repetition_penalty == 1.05 != plain.repetition_penalty
    # max_tokens: the request's, else (chat, or completions' explicit null) the model's max_new_tokens
    if endpoint == Endpoint.CHAT:
        assert ours.sampling.max_tokens == body.get("max_tokens", 20)
    else:
        assert ours.sampling.max_tokens == body.get("max_tokens", 16)  # (16: OpenAI's and vLLM's completions default)
        null = parse_completion_request(
            {"prompt": "hi", "max_tokens": None}, **COMPLETION_KW, defaults=load_sampling_defaults(folder)
        )
        assert null.sampling.max_tokens == 20


def test_the_sampling_defaults_source_is_chosen_and_checked(tmp_path):
    """``EPD_GENERATION_CONFIG``: ``vllm`` takes none, a folder its file, a folder without one or a
    default no request could give stops the API's start-up (not a 400 on every request)."""
    from services.api.sampling_defaults import load_sampling_defaults
    from services.api.schemas import check_sampling_defaults
    from shared.errors import ConfigError

    folder = _model_with_defaults(tmp_path / "model")
    assert load_sampling_defaults(folder).given() == {
        "temperature": 0.1,
        "top_p": 0.001,
        "top_k": 1,
        "min_p": 0.02,
        "presence_penalty": 0.25,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.05,
        "max_tokens": 20,
    }
    assert load_sampling_defaults(folder, "vllm").given() == {}
    other = _model_with_defaults(tmp_path / "other", {"temperature": 0.7})
    assert load_sampling_defaults(folder, str(other)).given() == {"temperature": 0.7}
    # no generation_config.json: config.json's generation fields (vLLM's from_model_config), else none
    bare = tmp_path / "bare"
    bare.mkdir()
    assert load_sampling_defaults(bare).given() == {}
    (bare / "config.json").write_text('{"model_type": "qwen2_vl", "repetition_penalty": 1.1}')
    assert load_sampling_defaults(bare).given() == {"repetition_penalty": 1.1}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        load_sampling_defaults(folder, str(tmp_path / "nowhere"))
    check_sampling_defaults(load_sampling_defaults(folder))
    hot = _model_with_defaults(tmp_path / "hot", {"temperature": 5.0})
    with pytest.raises(ConfigError, match=r"generation_config.json.*'temperature' must be between 0.0 and 2.0"):
        check_sampling_defaults(load_sampling_defaults(hot))
    typo = _model_with_defaults(tmp_path / "typo", {"top_k": "many"})
    with pytest.raises(ConfigError, match="wrong type"):
        load_sampling_defaults(typo)


def test_chat_echo_is_the_last_assistant_message():
    assistant = {"role": "assistant", "content": [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon"}]}
    parsed = parse_chat_request({"messages": [*MESSAGES, assistant], "echo": True}, **CHAT_KW)
    assert parsed.echo_text == "Once\nupon"
    assert parse_chat_request({"messages": MESSAGES, "echo": True}, **CHAT_KW).echo_text == ""  # last is the user's
    assert _parse(Endpoint.COMPLETIONS, {"prompt": "Say", "echo": True}).echo_text == "Say"


# -- response shapes on synthetic chunks -----------------------------------------------------------
def _lp(token_id: int, token: str, logprob: float, top=()) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, token=token, logprob=logprob, top=tuple(top))


def _chunk(seq: int, ids, text: str, lps=()) -> TokenChunk:
    return TokenChunk(request_id="r", attempt=1, seq=seq, token_ids=tuple(ids), text=text, logprobs=tuple(lps))


def _final(ids, text: str) -> FinalResult:
    return FinalResult(
        request_id="r",
        attempt=1,
        token_ids=tuple(ids),
        text=text,
        finish_reason="length",
        prompt_tokens=5,
        completion_tokens=len(ids),
    )


A = _lp(10, "He", -0.1, [(10, "He", -0.1), (11, "Hi", -2.5)])
B = _lp(12, "llo", float("-inf"), [(13, "y", -0.3), (12, "llo", float("-inf"))])


def test_logprob_shapes():
    chat = chat_logprobs([A, B])
    assert chat == {
        "content": [
            {
                "token": "He",
                "logprob": -0.1,
                "bytes": [72, 101],
                "top_logprobs": [
                    {"token": "He", "logprob": -0.1, "bytes": [72, 101]},
                    {"token": "Hi", "logprob": -2.5, "bytes": [72, 105]},
                ],
            },
            {
                "token": "llo",
                "logprob": -9999.0,  # JSON has no -inf
                "bytes": [108, 108, 111],
                "top_logprobs": [
                    {"token": "y", "logprob": -0.3, "bytes": [121]},
                    {"token": "llo", "logprob": -9999.0, "bytes": [108, 108, 111]},
                ],
            },
        ]
    }
    assert chat_logprobs([A], as_ids=True)["content"][0]["token"] == "token_id:10"
    assert completion_logprobs([A, B], offset=3) == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.1, -9999.0],
        "top_logprobs": [{"He": -0.1, "Hi": -2.5}, {"y": -0.3, "llo": -9999.0}],
        "text_offset": [3, 5],
    }
    # with logprobs: 0 the chosen token is still in top_logprobs (OpenAI / vLLM)
    assert completion_logprobs([_lp(1, "a", -1.0)])["top_logprobs"] == [{"a": -1.0}]


def test_bodies_of_n_choices_keep_logprobs_aligned_with_their_tokens():
    for endpoint in Endpoint:
        parsed = _parse(
            endpoint, {"n": 2, "logprobs": True if endpoint == Endpoint.CHAT else 1, "return_token_ids": True}
        )
        results = [
            ChoiceResult([_chunk(0, [10], "He", [A]), _chunk(1, [12], "llo", [B])], _final([10, 12], "Hello")),
            ChoiceResult([_chunk(0, [10, 12], "Hello", [A, B])], _final([10, 12], "Hello")),
        ]
        body = response_body("id", parsed, results, 0)
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
        for choice in body["choices"]:
            assert choice["token_ids"] == [10, 12]
            if endpoint == Endpoint.CHAT:
                assert choice["message"]["content"] == "Hello"
                assert [e["token"] for e in choice["logprobs"]["content"]] == ["He", "llo"]
            else:
                assert choice["text"] == "Hello" and choice["logprobs"]["tokens"] == ["He", "llo"]
        # streaming: chunks name their choice; completions' text offsets continue across chunks
        shaper = StreamShaper("id", parsed, 0)
        opening = shaper.opening()
        assert len(opening) == (2 if endpoint == Endpoint.CHAT else 0)
        first = shaper.tokens(1, _chunk(0, [10], "He", [A]))
        second = shaper.tokens(1, _chunk(1, [12], "llo", [B]))
        assert first["choices"][0]["index"] == second["choices"][0]["index"] == 1
        if endpoint == Endpoint.COMPLETIONS:
            assert second["choices"][0]["logprobs"]["text_offset"] == [2]
        else:
            assert second["choices"][0]["logprobs"]["content"][0]["token"] == "llo"
        assert shaper.finish(0, results[0].final)["choices"][0]["finish_reason"] == "length"


# -- routes without a stack ------------------------------------------------------------------------
def test_routes_answer_in_openai_shape_without_a_stack(tiny_model_dir):
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from shared.config import ApiSettings

    app = create_app(ApiSettings(model_path=tiny_model_dir, model_name="tiny"))
    client = TestClient(app)  # (no lifespan: these routes need no NATS)

    def error(resp, status, code, param=None):
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["param"] == param
        return err

    error(client.get("/no/such/route"), 404, "not_found")
    resp = client.get("/v1/chat/completions")
    error(resp, 405, "method_not_allowed")
    assert "POST" in resp.headers["allow"]
    error(client.get("/debug/requests", params={"since_s": "soon"}), 400, "invalid_request", "since_s")
    error(client.get("/v1/models/gpt-17"), 404, "model_not_found", "model")
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/version").json()["version"]

    # /tokenize and /detokenize: the tokenizer loads on the first call, torch-free until then
    text = "Hello world, hello!"
    tok = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0 and tok["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    bare = client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": text}], "add_generation_prompt": False}
    ).json()
    assert chat["count"] > bare["count"] > tok["count"]  # the template, and its generation prompt
    error(client.post("/tokenize", json={"prompt": text, "frobnicate": 1}), 400, "unknown_parameter", "frobnicate")
    error(
        client.post("/tokenize", json={"prompt": text, "chat_template": "x"}),
        400,
        "unsupported_parameter",
        "chat_template",
    )
    error(client.post("/detokenize", json={"tokens": [10**9]}), 400, "invalid_request", "tokens")


# -- the real stack --------------------------------------------------------------------------------
def _post(stack, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json={"model": "qwen2-vl-tiny", **body}, timeout=300, **kw)


@pytest.mark.slow
def test_refusals_over_http_and_the_openai_client(epd_stack):
    import openai

    for path, body, param in [
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",  # (tools without tool_choice: "auto", which needs a tool parser)
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "guided_json": {}}, "guided_json"),
        ("/v1/chat/completions", {"messages": MESSAGES, "frobnicate": True}, "frobnicate"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ]:
        resp = _post(epd_stack, path, body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param and resp.headers["x-request-id"]

    client = openai.OpenAI(base_url=f"{epd_stack.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="qwen2-vl-tiny", messages=MESSAGES, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="qwen2-vl-tiny", messages=MESSAGES, response_format={"type": "structural_tag"}
        )
    assert err.value.status_code == 400 and err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="qwen2-vl-tiny", prompt="hi", suffix="x")
    assert err.value.body["param"] == "suffix"
    assert [m.id for m in client.models.list()] == ["qwen2-vl-tiny"]
    assert client.models.retrieve("qwen2-vl-tiny").id == "qwen2-vl-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


@pytest.mark.slow
def test_n_choices_share_one_encode_job(epd_stack):
    """n=2 with one image: two generation jobs (seeds 7 and 8), ONE encode job, two choices."""
    image = noise_image(2401, (56, 56))
    body = {
        "messages": [user_message("Describe.", [data_url(image)])],
        "n": 2,
        "seed": 7,
        "max_tokens": 4,
        "ignore_eos": True,
    }
    resp = _post(epd_stack, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    rid = out["id"]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 8
    jobs = [epd_stack.messages_of("stream_generate", GenerationJob, r) for r in (rid, f"{rid}-1")]
    assert [[j.sampling.seed for j in js] for js in jobs] == [[7], [8]]
    assert jobs[0][0].images == jobs[1][0].images and len(jobs[0][0].images) == 1
    encodes = [
        m
        for _, _, m in epd_stack.stream_messages("stream_encode")
        if isinstance(m, EncodeJob) and m.request_id.startswith(rid)
    ]
    assert len(encodes) == 1, encodes
    # ...and the second choice did not ask for it again (a re-queued job, dropped as a duplicate, says ECWanted)
    assert epd_stack.messages_of("stream_control", ECWanted, f"{rid}-1") == []

    # streaming: every chunk names its choice; each choice finishes once; usage covers both
    with httpx.stream(
        "POST",
        f"{epd_stack.url}/v1/chat/completions",
        json={"model": "qwen2-vl-tiny", **body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=300,
    ) as r:
        assert r.status_code == 200
        events = list(parse_sse(r.iter_lines()))
    finishes = [c["index"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(finishes) == [0, 1]
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
    assert events[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.slow
def test_sampling_fields_reach_the_generation_job(epd_stack):
    body = {
        "messages": MESSAGES,
        "max_tokens": 3,
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "logit_bias": {"7": 2.5},
        "min_tokens": 1,
        "stop_token_ids": [3],
        "seed": 5,
        "user": "someone",
    }
    resp = _post(epd_stack, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    (job,) = epd_stack.messages_of("stream_generate", GenerationJob, resp.json()["id"])
    s = job.sampling
    assert (s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (5, 0.1, 0.5, 0.25, 1.1)
    assert (s.logit_bias, s.min_tokens, s.stop_token_ids, s.seed) == (((7, 2.5),), 1, (3,), 5)


@pytest.mark.slow
def test_tokenize_counts_what_the_model_is_given(epd_stack):
    """/tokenize of a text-only chat counts the prompt tokens the worker reports for it."""
    messages = [{"role": "user", "content": "Count these tokens, please."}]
    tok = _post(epd_stack, "/tokenize", {"messages": messages}).json()
    resp = _post(epd_stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert tok["count"] == resp.json()["usage"]["prompt_tokens"]
    assert _post(epd_stack, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"].endswith("assistant\n")


@pytest.mark.slow
def test_completions_greedy_is_deterministic(epd_stack):
    """Needs the engines' GenerationJob.prompt (issue 24, engine side)."""
    body = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True}
    first = _post(epd_stack, "/v1/completions", body)
    assert first.status_code == 200, first.text
    second = _post(epd_stack, "/v1/completions", body).json()
    out = first.json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 5
    assert out["choices"][0]["text"] == second["choices"][0]["text"]
    assert out["choices"][0]["text"].startswith("The quick brown fox")  # echo
    (job,) = epd_stack.messages_of("stream_generate", GenerationJob, out["id"])
    assert (job.prompt, job.messages, job.images) == ("The quick brown fox", [], ())


@pytest.mark.slow
def test_logprobs_end_to_end(epd_stack):
    """Needs the engines' TokenChunk.logprobs (issue 24, engine side): one entry per token."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = _post(epd_stack, "/v1/chat/completions", body).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 4
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    # greedy: the chosen token is the most likely one
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)


def test_the_docs_table_is_the_table():
    """docs/api.md has one row per PARAMS field, with its status for each endpoint."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in doc.splitlines() if line.startswith("| `")}
    for name, param in PARAMS.items():
        assert name in rows, f"{name} is not in docs/api.md's parameter table"
        cells = [c.strip() for c in rows[name].split("|")[2:4]]
        for endpoint, cell in zip(Endpoint, cells, strict=True):
            want = param.status if endpoint in param.endpoints else "—"
            assert cell.startswith(want), (name, endpoint, cell)
