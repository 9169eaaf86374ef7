"""Sampling parity on vLLM (issue 24): every ``SamplingParams`` field reaches vLLM, logprobs come
back aligned with the streamed tokens, completions prompts skip the chat template.

The oracle is vLLM itself: the session's plain reference engine's ``AsyncLLM`` driven directly
with a ``vllm.SamplingParams`` written out here (not through ``VllmEngine.sampling_params``), on the
same prompt. Each setting is also shown to change vLLM's output, so a setting the engine dropped
would make its output differ from the oracle's.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import replace
from typing import Any

import pytest

from shared.engines.base import GenerationStats, RawPrompt, SamplingParams, TokenEvent
from shared.errors import InvalidRequest
from tests.stackutil import engine_messages
from tests.vllmutil import media

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"
PROMPT = RawPrompt(text=TEXT)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
TOL = 1e-5


async def oracle(engine, prompt: dict[str, Any], **kw: Any) -> Any:
    """vLLM's own answer (its final ``CompletionOutput``) for ``prompt`` with ``vllm.SamplingParams(**kw)``,
    from the engine's ``AsyncLLM`` on its own loop."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = VllmSamplingParams(n=1, skip_special_tokens=True, output_kind=RequestOutputKind.FINAL_ONLY, **kw)

    async def run() -> Any:
        final = None
        async for out in engine._llm.generate(prompt, sp, f"oracle-{uuid.uuid4().hex}"):
            final = out
        return final.outputs[0]

    return await engine._on_vllm_loop(run())


def vllm_kwargs(params: SamplingParams) -> dict[str, Any]:
    """``params`` spelled as ``vllm.SamplingParams`` arguments, field by field (the oracle's side)."""
    return dict(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=params.logprobs,
    )


async def ours(engine, params: SamplingParams, prompt=PROMPT, stats: GenerationStats | None = None) -> list[TokenEvent]:
    return [e async for e in engine.generate(prompt, [], params, stats)]


def ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


def top_ids(event: TokenEvent) -> list[int]:
    assert event.logprob is not None
    return [tid for tid, _, _ in event.logprob.top]


def assert_logprobs_equal(events: list[TokenEvent], want: Any, k: int) -> None:
    """Each event's logprob equals vLLM's at its position: the sampled token's value and text, and
    the top ``k`` (vLLM's ranks 1..k) in rank order."""
    assert len(want.logprobs) == len(events)
    for event, position in zip(events, want.logprobs):
        got = event.logprob
        assert got is not None and got.token_id == event.token_id
        chosen = position[event.token_id]
        assert math.isclose(got.logprob, chosen.logprob, abs_tol=TOL)
        assert got.token == chosen.decoded_token
        top = sorted((lp.rank, tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k)
        assert [t[0] for t in got.top] == [tid for _, tid, _ in top]
        assert [t[1] for t in got.top] == [lp.decoded_token for _, _, lp in top]
        for (_, _, value), (_, _, lp) in zip(got.top, top):
            assert math.isclose(value, lp.logprob, abs_tol=TOL)
        assert all(a[2] >= b[2] for a, b in zip(got.top, got.top[1:]))  # most likely first


async def test_logprobs_equal_vllms_and_follow_the_streamed_tokens(vllm_reference):
    engine = vllm_reference
    # greedy: the sampled token is the most likely one
    params = replace(GREEDY, logprobs=5)
    events = await ours(engine, params)
    want = await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(params))
    assert ids(events) == list(want.token_ids) and len(events) == params.max_tokens
    assert_logprobs_equal(events, want, 5)
    assert all(top_ids(e)[0] == e.token_id for e in events)
    # sampled with one alternative: some sampled tokens are not the most likely one (not in `top`)
    params = replace(SAMPLED, temperature=1.5, max_tokens=24, logprobs=1)
    events = await ours(engine, params)
    want = await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(params))
    assert ids(events) == list(want.token_ids)
    assert_logprobs_equal(events, want, 1)
    assert any(top_ids(e)[0] != e.token_id for e in events)
    # logprobs=0: the sampled token only; None: no logprobs at all
    events = await ours(engine, replace(GREEDY, logprobs=0))
    assert all(e.logprob is not None and e.logprob.top == () for e in events)
    assert all(e.logprob is None for e in await ours(engine, GREEDY))


# (name, the setting on top of GREEDY or SAMPLED); `None` values are filled in from the base output
SETTINGS: list[tuple[str, SamplingParams]] = [
    ("presence_penalty", replace(GREEDY, presence_penalty=1.5)),
    ("frequency_penalty", replace(GREEDY, frequency_penalty=1.5)),
    ("repetition_penalty", replace(GREEDY, repetition_penalty=1.8)),
    ("negative_penalties", replace(GREEDY, presence_penalty=-1.0, frequency_penalty=-0.5)),
    ("top_k", replace(SAMPLED, top_k=3)),
    ("top_p", replace(SAMPLED, top_p=0.3)),
    ("min_p", replace(SAMPLED, min_p=0.3)),
    ("seed", replace(SAMPLED, seed=12)),
    ("all_sampled", replace(SAMPLED, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.2)),
]


@pytest.mark.parametrize("name,params", SETTINGS, ids=[s[0] for s in SETTINGS])
async def test_each_setting_samples_as_vllm_does(vllm_reference, name, params):
    """The engine's tokens equal vLLM's for the same setting, and the setting changes vLLM's tokens
    (so dropping it in the engine would fail the first assertion)."""
    engine = vllm_reference
    base = GREEDY if params.temperature == 0 else SAMPLED
    want = await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(params))
    assert ids(await ours(engine, params)) == list(want.token_ids)
    without = await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(base))
    assert list(want.token_ids) != list(without.token_ids), f"{name} has no effect on this prompt"


async def test_token_level_settings(vllm_reference):
    """top_k=1 is greedy; stop_token_ids end the completion at the token (kept, its text not);
    min_tokens holds that stop back; logit_bias forces or bans a token - each equal to vLLM's."""
    engine = vllm_reference
    greedy = ids(await ours(engine, GREEDY))
    assert ids(await ours(engine, replace(SAMPLED, top_k=1))) == greedy
    assert ids(await ours(engine, SAMPLED)) != greedy  # control: the same draw without top_k=1

    # stop_token_ids: the first token from position 2 on that is new in the greedy output
    stop = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    at = greedy.index(stop)
    params = replace(GREEDY, stop_token_ids=(stop,))
    events = await ours(engine, params)
    assert ids(events) == greedy[: at + 1] and events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == engine.tokenizer.decode(greedy[:at], skip_special_tokens=True)
    want = await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(params))
    assert ids(events) == list(want.token_ids) and want.finish_reason == "stop"

    # min_tokens: the stop token is not sampled before min_tokens tokens
    params = replace(GREEDY, stop_token_ids=(stop,), min_tokens=at + 4)
    events = await ours(engine, params)
    assert len(events) >= at + 4 and stop not in ids(events)[: at + 4]
    assert ids(events)[:at] == greedy[:at] and ids(events)[at] != stop
    assert ids(events) == list((await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(params))).token_ids)

    # logit_bias: +100 makes one unseen token every token; -100 bans the first greedy token
    unseen = next(t for t in range(10, engine.vocab_size) if t not in greedy and t != engine.image_token_id)
    events = await ours(engine, replace(GREEDY, logit_bias=((unseen, 100.0),)))
    assert ids(events) == [unseen] * GREEDY.max_tokens
    params = replace(GREEDY, logit_bias=((greedy[0], -100.0), (unseen, 0.5)))
    events = await ours(engine, params)
    assert greedy[0] not in ids(events)
    assert ids(events) == list((await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(params))).token_ids)


async def test_completions_prompt_goes_to_vllm_as_is(vllm_reference):
    """Text: vLLM's TextPrompt (no chat template); token ids: a TokensPrompt; the same tokens."""
    engine = vllm_reference
    stats = GenerationStats()
    by_text = ids(await ours(engine, GREEDY, PROMPT, stats))
    token_ids = tuple(engine.tokenizer(TEXT)["input_ids"])
    assert stats.prompt_tokens == len(token_ids)
    want = await oracle(engine, {"prompt": TEXT}, **vllm_kwargs(GREEDY))
    assert by_text == list(want.token_ids)
    stats = GenerationStats()
    assert ids(await ours(engine, GREEDY, RawPrompt(token_ids=token_ids), stats)) == by_text
    assert stats.prompt_tokens == len(token_ids)
    # control: the chat template would have made another prompt and other tokens
    chat_stats = GenerationStats()
    chat = [e.token_id async for e in engine.generate(engine_messages(TEXT, 0), [], GREEDY, chat_stats)]
    assert chat_stats.prompt_tokens > len(token_ids) and chat != by_text


@pytest.mark.parametrize(
    "prompt,images",
    [
        (RawPrompt(), False),
        (RawPrompt(text="hi", token_ids=(1, 2)), False),
        (RawPrompt(text=""), False),
        (RawPrompt(token_ids=()), False),
        (RawPrompt(token_ids=(1, 10**6)), False),
        (RawPrompt(token_ids=(1, -1)), False),
        (RawPrompt(token_ids=(1, "IMAGE")), False),
        (RawPrompt(text="<|image_pad|> what is this"), False),
        (RawPrompt(text="what is this"), True),
    ],
    ids=[
        "empty",
        "both",
        "empty-text",
        "no-ids",
        "big-id",
        "negative-id",
        "image-token-id",
        "image-token-text",
        "images",
    ],
)
async def test_bad_completions_prompts_are_refused(vllm_reference, prompt, images):
    engine = vllm_reference
    if prompt.token_ids and "IMAGE" in prompt.token_ids:
        prompt = RawPrompt(token_ids=(1, engine.image_token_id))
    items = [media(3, (56, 56))] if images else []
    with pytest.raises(InvalidRequest) as err:
        [e async for e in engine.generate(prompt, items, GREEDY)]
    assert err.value.param == "prompt"
    assert "vLLM rejected" not in str(err.value)


BAD_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("logit_bias", {"logit_bias": ((10**6, 1.0),)}),
    ("logit_bias", {"logit_bias": ((-1, 1.0),)}),
    ("logit_bias", {"logit_bias": ((5, 101.0),)}),
    ("logit_bias", {"logit_bias": ((5, math.nan),)}),
    ("stop_token_ids", {"stop_token_ids": (5, 10**6)}),
    ("top_k", {"top_k": -1}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 17}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("temperature", {"temperature": 2.5}),
]


async def test_settings_vllm_refuses_are_refused_before_it_runs(vllm_reference):
    """InvalidRequest naming the parameter, raised by the engine's own checks (vLLM's refusal would
    say "vLLM rejected" and often name no parameter), on every path that takes settings."""
    engine = vllm_reference
    vocab = engine.vocab_size  # the first id past the vocabulary (vLLM refuses it too)
    at_vocab = [("logit_bias", {"logit_bias": ((vocab, 1.0),)}), ("stop_token_ids", {"stop_token_ids": (vocab,)})]
    for param, change in BAD_SETTINGS + at_vocab:
        params = replace(GREEDY, **change)
        with pytest.raises(InvalidRequest) as err:
            [e async for e in engine.generate(PROMPT, [], params)]
        assert (err.value.param, "vLLM rejected" in str(err.value)) == (param, False), change
        with pytest.raises(InvalidRequest) as err:
            engine.sampling_params(params, max_tokens=1, final_only=True)  # the hand-off prefill's
        assert err.value.param == param
    with pytest.raises(InvalidRequest) as err:
        [e async for e in engine.generate(RawPrompt(token_ids=(1, vocab)), [], GREEDY)]
    assert (err.value.param, "vLLM rejected" in str(err.value)) == ("prompt", False)
    assert await engine.num_unfinished_requests() == 0
    # the limits themselves are accepted (min_tokens == max_tokens, 20 logprobs, the last token id)
    edge = replace(
        GREEDY,
        min_tokens=GREEDY.max_tokens,
        logprobs=20,
        logit_bias=((engine.vocab_size - 1, -100.0),),
        stop_token_ids=(engine.vocab_size - 1,),
        repetition_penalty=0.5,
        presence_penalty=-2.0,
    )
    events = await ours(engine, edge)
    assert len(events) == GREEDY.max_tokens and all(len(top_ids(e)) == 20 for e in events)
    # a hand-off prefill samples one token: min_tokens is capped to it, logprobs are not asked for
    sp = engine.sampling_params(edge, max_tokens=1, final_only=True)
    assert (sp.max_tokens, sp.min_tokens, sp.logprobs) == (1, 1, None)
    assert (sp.presence_penalty, sp.repetition_penalty, sp.stop_token_ids) == (-2.0, 0.5, [engine.vocab_size - 1])


async def test_structured_output_constrains_vllm_as_its_own_backend_does(vllm_reference):
    """``SamplingParams.structured`` reaches vLLM's structured-output backend (xgrammar): greedy
    output follows the schema and equals vLLM's own answer with ``StructuredOutputsParams`` written
    out here; tools reach the chat template (a longer prompt). Control: the same request without
    the constraint is not JSON."""
    import json

    import jsonschema
    from vllm.sampling_params import StructuredOutputsParams

    from shared.engines.base import ChatPrompt
    from shared.engines.grammar import structured_output
    from tests.test_structured import PERSON, _no_whitespace

    engine = vllm_reference
    so = structured_output("json_schema", PERSON)
    params = replace(
        GREEDY, max_tokens=60, ignore_eos=False, logit_bias=_no_whitespace(engine.tokenizer), structured=so
    )
    events = await ours(engine, params)
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text, strict=False), PERSON)
    want = await oracle(
        engine,
        {"prompt": TEXT},
        **{**vllm_kwargs(params), "structured_outputs": StructuredOutputsParams(json=so.schema)},
    )
    assert ids(events) == list(want.token_ids)
    free = "".join(e.text for e in await ours(engine, replace(params, structured=None)))
    with pytest.raises(ValueError):
        json.loads(free, strict=False)
    # tools go through the chat template (vLLM renders a chat request's tools the same way; the tiny
    # model's template ignores them, so a template that prints them stands in for one that uses them)
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": PERSON}}
    plain, with_tools = GenerationStats(), GenerationStats()
    template = engine.chat_template
    engine.chat_template = "{% for t in tools or [] %}TOOL {{ t | tojson }}\n{% endfor %}" + (template or "")
    try:
        await ours(engine, replace(GREEDY, max_tokens=1), engine_messages(TEXT, 0), plain)
        await ours(engine, replace(GREEDY, max_tokens=1), ChatPrompt(engine_messages(TEXT, 0), (tool,)), with_tools)
    finally:
        engine.chat_template = template
    assert with_tools.prompt_tokens > plain.prompt_tokens
