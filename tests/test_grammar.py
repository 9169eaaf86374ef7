"""Structured output (``shared.engines.grammar``): the wire constraint, its checks, and the xgrammar
constraint of the transformers engine on the tiny Qwen2-VL model's tokenizer and real logits.

xgrammar's JSON grammar admits raw control characters inside strings (vLLM's output has them
too), which ``json.loads`` refuses by default: outputs are parsed with ``strict=False``."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared import protocol
from shared.engines.grammar import (
    MAX_SCHEMA_NESTING,
    GrammarCompiler,
    check_grammar,
    compiler_for,
    structured_output,
    unsupported_feature,
    vllm_structured_outputs,
)
from shared.errors import EngineError, InvalidRequest
from shared.protocol import MAX_STRUCTURED_SCHEMA_BYTES, SamplingSpec, StructuredKind, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["name", "age", "ok", "tag"],
}


# -- the wire constraint and the API-side checks (no tokenizer) ---------------------------------


def test_structured_output_keeps_the_schema_and_its_key_order() -> None:
    so = structured_output("json_schema", {"type": "object", "properties": {"b": {}, "a": {}}})
    assert so.kind == StructuredKind.JSON_SCHEMA
    # compact and in the client's order: xgrammar emits properties in schema order (as vLLM does)
    assert so.schema == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert structured_output("json_object") == StructuredOutput(kind=StructuredKind.JSON_OBJECT)


def test_structured_output_travels_in_a_generation_job() -> None:
    so = structured_output("json_schema", PERSON)
    job = protocol.GenerationJob(
        request_id="r1",
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        images=(),
        fingerprint="f",
        sampling=SamplingSpec(temperature=0.0, structured=so),
        stream=False,
        deadline=1.0,
        created_at=0.0,
    )
    back = protocol.decode(protocol.encode(job), protocol.GenerationJob)
    assert back.sampling.structured == so
    assert json.loads(back.sampling.structured.schema) == PERSON
    assert SamplingSpec().structured is None


def _job_with(structured: dict) -> bytes:
    job = protocol.GenerationJob(
        request_id="r1",
        model="m",
        messages=[],
        images=(),
        fingerprint="f",
        sampling=SamplingSpec(),
        stream=False,
        deadline=1.0,
        created_at=0.0,
    )
    raw = msgspec.to_builtins(job)
    raw["sampling"]["structured"] = structured
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize(
    "structured",
    [
        {"kind": "grammar"},  # a kind this worker does not know: refused, not dropped
        {"kind": "json_schema", "schema": ""},
        {"kind": "json_object", "schema": "{}"},
        {"kind": "json_schema", "schema": "x" * (MAX_STRUCTURED_SCHEMA_BYTES + 1)},
    ],
    ids=["unknown-kind", "no-schema", "object-with-schema", "too-large"],
)
def test_a_job_with_an_unusable_constraint_is_refused(structured: dict) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(_job_with(structured), protocol.GenerationJob)


def test_model_worker_maps_the_constraint() -> None:
    from shared.model_worker import sampling_params

    so = structured_output("json_object")
    assert sampling_params(SamplingSpec(structured=so), seed=None).structured == so
    assert sampling_params(SamplingSpec(), seed=None).structured is None


def _deep(levels: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"x": node}}
    return node


@pytest.mark.parametrize(
    "kind,schema,needle",
    [
        ("xml", None, "unsupported structured output type 'xml'"),
        ("json_object", {"type": "object"}, "json_object takes no schema"),
        ("json_schema", None, "must be a JSON object"),
        ("json_schema", [{"type": "string"}], "must be a JSON object"),
        ("json_schema", {"type": "number", "minimum": float("nan")}, "not valid JSON"),
        ("json_schema", {"enum": ["x" * MAX_STRUCTURED_SCHEMA_BYTES]}, "larger than"),
        ("json_schema", _deep(MAX_SCHEMA_NESTING), "nested too deeply"),
        ("json_schema", {"type": "number", "multipleOf": 3}, "multipleOf"),
        ("json_schema", {"type": "array", "uniqueItems": True}, "uniqueItems"),
        ("json_schema", {"type": "string", "format": "credit-card"}, "string format 'credit-card'"),
        ("json_schema", {"allOf": [{"type": "string"}, {"enum": ["a"]}]}, "allOf"),
    ],
)
def test_structured_output_refuses(kind: str, schema, needle: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        structured_output(kind, schema, param="tools")
    assert needle in err.value.message
    assert err.value.param == "tools"


def test_the_checks_accept_what_xgrammar_enforces() -> None:
    """Negative control of the refusals above: close relatives pass."""
    assert unsupported_feature(PERSON) is None
    assert unsupported_feature({"type": "string", "format": "date-time"}) is None
    assert unsupported_feature({"allOf": [{"type": "string"}]}) is None
    assert unsupported_feature({"properties": {"n": {"type": "number", "multipleOf": 2}}}) == "multipleOf"  # nested
    structured_output("json_schema", _deep(MAX_SCHEMA_NESTING // 2 - 1))


@pytest.mark.parametrize(
    "schema,needle",
    [
        ({"type": "foo"}, 'Unsupported type "foo"'),
        ({"$ref": "#/defs/x"}, "Cannot find field defs"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ],
)
def test_a_schema_xgrammar_refuses_is_an_invalid_request(schema, needle: str) -> None:
    so = structured_output("json_schema", schema)  # passes the light checks
    with pytest.raises(InvalidRequest) as err:
        check_grammar(so)
    assert err.value.param == "response_format"
    assert needle in err.value.message and ".cc:" not in err.value.message  # no C++ source location
    check_grammar(structured_output("json_schema", PERSON))  # negative control


def test_vllm_mapping() -> None:
    pytest.importorskip("vllm")
    so = structured_output("json_schema", PERSON)
    p = vllm_structured_outputs(so)
    assert p.json == so.schema and p.json_object is None
    p = vllm_structured_outputs(structured_output("json_object"))
    assert p.json_object is True and p.json is None


# -- the transformers engine's constraint, on the tiny model ------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vocab(lm) -> int:
    return int(lm.config.text_config.vocab_size)


@pytest.fixture(scope="module")
def stops(tok, lm) -> list[int]:
    """vLLM's ``all_stop_token_ids``: the tokenizer's EOS plus the generation config's EOS ids."""
    gen = lm.generation_config.eos_token_id
    return sorted({tok.eos_token_id, *(gen if isinstance(gen, list) else [gen])})


@pytest.fixture(scope="module")
def whitespace_ids(tok) -> list[int]:
    return [i for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()]


def _greedy(
    lm, tok, constraint, stops, *, steps: int, bias: dict[int, float] | None = None, record: list | None = None
):
    """Greedy decoding of a chat prompt with the tiny model: mask (if a constraint), bias, argmax,
    accept. ``bias`` is a client ``logit_bias``: the random-weight model, greedy, would otherwise
    pick whitespace forever (any_whitespace=True, as in vLLM). Returns the token ids, stopping after
    a stop token. ``record`` collects the constraint's bitmask before each step."""
    import torch

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt)["input_ids"]
    out: list[int] = []
    cache = None
    feed = torch.tensor([ids])
    for _ in range(steps):
        with torch.inference_mode():
            res = lm(input_ids=feed, past_key_values=cache, use_cache=True)
        cache = res.past_key_values
        logits = res.logits[0, -1].clone()
        if constraint is not None:
            if record is not None:
                record.append(constraint.next_token_bitmask())
            constraint.mask(logits)
        for token, b in (bias or {}).items():
            logits[token] += b
        nxt = int(torch.argmax(logits))
        if constraint is not None:
            constraint.accept(nxt)
        out.append(nxt)
        if nxt in stops:
            break
        feed = torch.tensor([[nxt]])
    return out


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_greedy_decoding_with_the_mask_follows_the_schema(lm, tok, vocab, stops, whitespace_ids) -> None:
    import jsonschema

    so = structured_output("json_schema", PERSON)
    constraint = compiler_for(tok, vocab).constraint(so, stops)
    no_ws = dict.fromkeys(whitespace_ids, -1e4)
    ids = _greedy(lm, tok, constraint, stops, steps=80, bias=no_ws)
    assert ids[-1] in stops and constraint.is_terminated(), _text(tok, ids)
    doc = json.loads(_text(tok, ids), strict=False)
    jsonschema.validate(doc, PERSON)
    assert list(doc) == ["name", "age", "ok", "tag"]  # the schema's order

    # negative control: the same model and bias without the mask does not produce JSON
    free = _greedy(lm, tok, None, stops, steps=len(ids), bias=no_ws)
    with pytest.raises(ValueError):
        json.loads(_text(tok, free), strict=False)


def test_json_object_gives_an_object(lm, tok, vocab, stops, whitespace_ids) -> None:
    constraint = compiler_for(tok, vocab).constraint(structured_output("json_object"), stops)
    ids = _greedy(lm, tok, constraint, stops, steps=60, bias=dict.fromkeys(whitespace_ids, -1e4))
    assert constraint.is_terminated(), _text(tok, ids)
    assert isinstance(json.loads(_text(tok, ids), strict=False), dict)


def test_after_the_json_only_stop_tokens_are_allowed(tok, vocab, stops) -> None:
    import torch

    compiler = compiler_for(tok, vocab)
    extra_stop = tok.convert_tokens_to_ids("!")  # a request's stop_token_ids join the EOS ids
    for stop_set in (stops, [*stops, extra_stop]):
        constraint = compiler.constraint(structured_output("json_schema", {"enum": [7]}), stop_set)
        for token in tok("7", add_special_tokens=False)["input_ids"]:
            constraint.accept(token)
        logits = torch.zeros(vocab)
        constraint.mask(logits)
        allowed = set(torch.nonzero(logits == 0).flatten().tolist())
        assert allowed == set(stop_set)
        with pytest.raises(EngineError):  # a token outside the grammar is an engine bug, not output
            constraint.accept(tok.convert_tokens_to_ids("8"))
        constraint.accept(stop_set[0])
        assert constraint.is_terminated()
        logits = torch.zeros(vocab)
        constraint.mask(logits)  # terminated: nothing masked any more (vLLM fills a full bitmask)
        assert bool(torch.all(logits == 0))


def test_replay_rebuilds_the_live_state(lm, tok, vocab, stops, whitespace_ids) -> None:
    """The E|P|D decode side (another process: its own compiler) replays the emitted token ids
    and gets the live matcher's mask at every step."""
    import torch

    so = structured_output("json_schema", PERSON)
    live_masks: list = []
    ids = _greedy(
        lm,
        tok,
        compiler_for(tok, vocab).constraint(so, stops),
        stops,
        steps=80,
        bias=dict.fromkeys(whitespace_ids, -1e4),
        record=live_masks,
    )
    assert len(live_masks) == len(ids) > 10
    other = GrammarCompiler(tok, vocab)
    differs = 0
    replayed = other.constraint(so, stops)
    for k in range(len(ids)):
        assert torch.equal(other.constraint(so, stops).replay(ids[:k]).next_token_bitmask(), live_masks[k]), k
        # replay() restarts from scratch on a used constraint too
        assert torch.equal(replayed.replay(ids[:k]).next_token_bitmask(), live_masks[k]), k
        if k and not torch.equal(other.constraint(so, stops).replay(ids[: k - 1]).next_token_bitmask(), live_masks[k]):
            differs += 1
    assert differs > len(ids) // 3  # negative control: one token short gives other masks


def test_the_mask_holds_whatever_the_logits(tok, vocab, stops, whitespace_ids) -> None:
    """Sampled from random logits (and a model vocabulary wider than the tokenizer's), every
    token is one the grammar allows; the finished documents follow the schema."""
    import jsonschema
    import torch

    wide = vocab + 37
    compiler = GrammarCompiler(tok, wide)
    so = structured_output("json_schema", PERSON)
    finished = 0
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        constraint = compiler.constraint(so, stops)
        out: list[int] = []
        for _ in range(200):
            logits = torch.randn(wide, generator=g) * 4
            logits[whitespace_ids] -= 1e4
            constraint.mask(logits)
            assert bool(torch.all(torch.isinf(logits[len(tok) :])))  # padded ids are never allowed
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            constraint.accept(token)  # raises for a token outside the grammar
            out.append(token)
            if constraint.is_terminated():
                break
        if constraint.is_terminated():
            finished += 1
            jsonschema.validate(json.loads(_text(tok, out), strict=False), PERSON)
    assert finished >= 6


def test_shape_and_vocab_checks(tok, vocab, stops) -> None:
    import torch

    with pytest.raises(EngineError):
        GrammarCompiler(tok, len(tok) - 1)
    constraint = compiler_for(tok, vocab).constraint(structured_output("json_object"), stops)
    with pytest.raises(EngineError):
        constraint.mask(torch.zeros(vocab + 1))
    assert compiler_for(tok, vocab) is compiler_for(tok, vocab)
    # a non-contiguous row is masked in place too
    rows = torch.zeros(vocab, 2)
    constraint.mask(rows[:, 0])
    assert int(torch.isinf(rows[:, 0]).sum()) == vocab - 1 and bool(torch.all(rows[:, 1] == 0))


def test_masks_equal_vllms_xgrammar_backend(lm, tok, vocab, stops, whitespace_ids) -> None:
    """vLLM's own backend (``XgrammarBackend.compile_grammar``, as its scheduler calls it) gives
    the same bitmask at every step of a constrained decode, for json_schema and json_object."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import torch
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        model_config=SimpleNamespace(hf_config=lm.config),
        speculative_config=None,
    )
    backend = XgrammarBackend(config, tokenizer=tok, vocab_size=vocab)
    bitmask = backend.allocate_token_bitmask(1)
    cases = [
        (structured_output("json_schema", PERSON), StructuredOutputOptions.JSON),
        (structured_output("json_object"), StructuredOutputOptions.JSON_OBJECT),
    ]
    for so, option in cases:
        masks: list = []
        ids = _greedy(
            lm,
            tok,
            compiler_for(tok, vocab).constraint(so, stops),
            stops,
            steps=80,
            bias=dict.fromkeys(whitespace_ids, -1e4),
            record=masks,
        )
        theirs = backend.compile_grammar(option, vllm_structured_outputs(so).json or "", stop_token_ids=set(stops))
        for k, token in enumerate(ids):
            theirs.fill_bitmask(bitmask, 0)
            assert torch.equal(bitmask, masks[k]), (so.kind, k)
            assert theirs.accept_tokens("r", [token])
        assert theirs.is_terminated()


def test_every_sampling_spec_field_reaches_the_engine():
    """``sampling_params`` carries each wire field over by name: a spec with every field off its
    default gives engine params with those values (a field dropped on the way fails here)."""
    from shared.model_worker import sampling_params

    spec = SamplingSpec(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=("x",),
        ignore_eos=True,
        top_k=4,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((5, 1.0),),
        min_tokens=2,
        stop_token_ids=(9,),
        logprobs=2,
        structured=structured_output("json_object"),
    )
    defaults = SamplingSpec()
    fields = msgspec.structs.asdict(spec)
    assert all(v != getattr(defaults, k) for k, v in fields.items())  # every field set off its default
    params = sampling_params(spec, seed=11)
    assert {k: getattr(params, k) for k in fields} == {**fields, "seed": 11}
