"""Sampling parity (vLLM ``SamplingParams`` semantics) of the transformers engine on the tiny
Qwen2-VL model: top_k, min_p, presence / frequency / repetition penalties, logit_bias,
min_tokens, stop_token_ids, raw logprobs, completions prompts (``RawPrompt``), validation.

The penalties and logprobs are checked step by step against a reference built from the model's
raw logits along the engine's own output (teacher forcing: one forward over prompt + output)
and HF's ``RepetitionPenaltyLogitsProcessor`` / the OpenAI formulas in numpy.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from shared.engines.base import RawPrompt, SamplingParams
from shared.engines.prompts import MAX_LOGPROBS, validate_params
from shared.engines.transformers_engine import TransformersEngine
from shared.engines.transformers_state import StopStringMatcher
from shared.errors import InvalidRequest
from shared.tools.models.tiny import build_tiny_model

N = 40
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
#: a prompt whose greedy output loops (116 91 90 116 91 90 ... on the tiny model)
LOOPY = [{"role": "user", "content": "a a a a a a a a"}]
PLAIN = [{"role": "user", "content": "Describe the image."}]


@pytest.fixture(scope="module")
async def engine(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("sampling"), arch="qwen2_vl", seed=0)
    engine = TransformersEngine(model_dir, threads=1)
    yield engine
    await engine.aclose()


async def _events(engine, prompt, params):
    return [e async for e in engine.generate(prompt, [], params)]


async def _ids(engine, prompt, params):
    return [e.token_id for e in await _events(engine, prompt, params)]


def _teacher_forced_logits(engine, prompt, tokens) -> tuple[list[int], torch.Tensor]:
    """Prompt ids and the raw logits ``[len(tokens), vocab]`` that predicted each of ``tokens``
    (one forward over prompt + tokens; compute thread)."""
    prompt_ids = engine.build_prompt_ids(prompt, [])
    ids = torch.tensor([prompt_ids + list(tokens)], dtype=torch.long)
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0].float()
    n = len(prompt_ids)
    return prompt_ids, logits[n - 1 : n - 1 + len(tokens)]


async def _reference(engine, prompt, tokens):
    return await engine._call(_teacher_forced_logits, engine, prompt, tokens)


def _reference_process(logits: torch.Tensor, prompt_ids, output_ids, params: SamplingParams, stop_ids=()) -> np.ndarray:
    """The reference of what changes a distribution before the choice: min_tokens, logit_bias,
    HF's repetition penalty (over prompt + output ids), OpenAI frequency / presence (numpy)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits.clone()[None]
    if len(output_ids) < params.min_tokens:
        for t in stop_ids:
            x[0, t] = float("-inf")
    for t, b in params.logit_bias:
        x[0, t] += b
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long)
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, x)
    out = x[0].numpy().astype(np.float64)
    counts = np.bincount(np.array(output_ids, dtype=np.int64), minlength=out.shape[0])[: out.shape[0]]
    out -= params.frequency_penalty * counts
    out -= params.presence_penalty * (counts > 0)
    return out


def _check_greedy_against_reference(prompt_ids, raw, tokens, params, stop_ids=()):
    """Each token is the argmax of the reference-processed raw logits given what came before."""
    for i, tok in enumerate(tokens):
        want = int(np.argmax(_reference_process(raw[i], prompt_ids, tokens[:i], params, stop_ids)))
        assert tok == want, f"step {i}: engine {tok}, reference {want}"


# -- penalties ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.6},
        {"repetition_penalty": 0.7},  # < 1 rewards repeats
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.8},
        {"frequency_penalty": -1.0},
    ],
    ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()),
)
async def test_each_penalty_changes_a_repetitive_output_and_matches_the_reference(engine, penalty):
    plain = await _ids(engine, LOOPY, GREEDY)
    assert len(set(plain)) < len(plain) * 0.75, plain  # it does repeat
    params = replace(GREEDY, **penalty)
    got = await _ids(engine, LOOPY, params)
    assert got != plain
    prompt_ids, raw = await _reference(engine, LOOPY, got)
    _check_greedy_against_reference(prompt_ids, raw, got, params)
    # Negative control: the reference without the penalty does not explain these tokens.
    with pytest.raises(AssertionError):
        _check_greedy_against_reference(prompt_ids, raw, got, GREEDY)


async def test_repetition_penalty_counts_the_prompt_tokens(engine):
    """vLLM's repetition penalty covers prompt tokens too (presence / frequency only outputs):
    the reference restricted to output tokens does not explain the first token."""
    params = replace(GREEDY, repetition_penalty=3.0, max_tokens=8)
    got = await _ids(engine, LOOPY, params)
    prompt_ids, raw = await _reference(engine, LOOPY, got)
    _check_greedy_against_reference(prompt_ids, raw, got, params)
    with pytest.raises(AssertionError):  # mutation: penalize only generated tokens
        _check_greedy_against_reference([], raw, got, params)


async def test_all_penalties_and_bias_together_match_the_reference(engine):
    params = replace(
        GREEDY,
        repetition_penalty=1.3,
        frequency_penalty=1.0,
        presence_penalty=-0.5,  # rewards a token's first repeat: the frequency penalty then counts
        logit_bias=((91, 1.5), (300, -2.0)),
    )
    got = await _ids(engine, LOOPY, params)
    prompt_ids, raw = await _reference(engine, LOOPY, got)
    _check_greedy_against_reference(prompt_ids, raw, got, params)
    for dropped in (
        {"repetition_penalty": 1.0},
        {"frequency_penalty": 0.0},
        {"presence_penalty": 0.0},
        {"logit_bias": ()},
    ):
        with pytest.raises(AssertionError):  # each one matters ...
            _check_greedy_against_reference(prompt_ids, raw, got, replace(params, **dropped))
        assert await _ids(engine, LOOPY, replace(params, **dropped)) != got  # ... to the engine too


# -- logit_bias, top_k, min_p --------------------------------------------------------------------
async def test_logit_bias_forces_a_token(engine):
    plain = await _ids(engine, PLAIN, GREEDY)
    forced = next(t for t in range(50, 100) if t not in plain)
    assert await _ids(engine, PLAIN, replace(GREEDY, logit_bias=((forced, 100.0),))) == [forced] * N
    # also when sampling
    sampled = SamplingParams(max_tokens=N, temperature=1.0, seed=3, ignore_eos=True, logit_bias=((forced, 100.0),))
    assert await _ids(engine, PLAIN, sampled) == [forced] * N
    # a strong negative bias keeps the greedy choice away
    banned = await _ids(engine, PLAIN, replace(GREEDY, logit_bias=((plain[0], -100.0),)))
    assert plain[0] not in banned and banned != plain


async def test_top_k_one_and_min_p_one_are_greedy(engine):
    greedy = await _ids(engine, PLAIN, GREEDY)
    sampled = SamplingParams(max_tokens=N, temperature=1.0, seed=11, ignore_eos=True)
    assert await _ids(engine, PLAIN, replace(sampled, top_k=1)) == greedy
    assert await _ids(engine, PLAIN, replace(sampled, min_p=1.0)) == greedy
    # Negative control: the same seed without the filter samples something else.
    assert await _ids(engine, PLAIN, sampled) != greedy
    # A larger k samples within the k most likely tokens of each step.
    top3 = await _ids(engine, PLAIN, replace(sampled, top_k=3))
    assert top3 != greedy
    prompt_ids, raw = await _reference(engine, PLAIN, top3)
    for i, tok in enumerate(top3):
        assert tok in torch.topk(raw[i], 3).indices.tolist(), f"step {i}"


async def test_min_p_keeps_tokens_near_the_most_likely(engine):
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=5, ignore_eos=True, min_p=0.6)
    got = await _ids(engine, PLAIN, params)
    prompt_ids, raw = await _reference(engine, PLAIN, got)
    for i, tok in enumerate(got):
        probs = torch.softmax(raw[i], -1)
        assert probs[tok] >= 0.6 * probs.max() * (1 - 1e-4), f"step {i}"
    assert got != await _ids(engine, PLAIN, replace(params, min_p=0.0))


# -- stop tokens, min_tokens ---------------------------------------------------------------------
async def test_stop_token_ids_stop_and_stay_out_of_the_text(engine):
    events = await _events(engine, PLAIN, GREEDY)
    ids = [e.token_id for e in events]
    k = next(i for i in range(3, N) if ids[i] not in ids[:i] and events[i].text)
    stop_id = ids[k]
    for ignore_eos in (True, False):
        got = await _events(engine, PLAIN, replace(GREEDY, stop_token_ids=(stop_id,), ignore_eos=ignore_eos))
        assert [e.token_id for e in got] == ids[: k + 1]  # the stop token is in the token ids ...
        assert got[-1].finish_reason == "stop"
        # ... not in the text (the last event flushes what earlier tokens held back, nothing more)
        assert "".join(e.text for e in got) == engine.tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert engine.tokenizer.decode(ids[: k + 1]) != engine.tokenizer.decode(ids[:k])  # control: it has text


async def test_min_tokens_holds_back_eos_and_stop_token_ids(engine):
    greedy = await _ids(engine, PLAIN, GREEDY)
    eos = min(engine.eos_token_ids)
    force_eos = SamplingParams(max_tokens=N, temperature=0.0, logit_bias=((eos, 100.0),))
    # Negative control: the bias makes EOS the first token, which stops at once.
    first = await _events(engine, PLAIN, force_eos)
    assert [e.token_id for e in first] == [eos] and first[-1].finish_reason == "stop" and first[-1].text == ""
    got = await _events(engine, PLAIN, replace(force_eos, min_tokens=5))
    assert [e.token_id for e in got] == greedy[:5] + [eos]  # masked for 5 tokens, then it wins
    assert got[-1].finish_reason == "stop"
    # EOS is held back even with ignore_eos (vLLM masks every stop token), and it then does not stop
    ignored = await _ids(engine, PLAIN, replace(force_eos, min_tokens=5, ignore_eos=True, max_tokens=8))
    assert ignored == greedy[:5] + [eos] * 3
    # stop_token_ids are held back the same way
    stop_id = greedy[0]
    held = await _ids(engine, PLAIN, replace(GREEDY, stop_token_ids=(stop_id,), min_tokens=3, max_tokens=6))
    assert stop_id not in held[:3] and held[0] != greedy[0]
    prompt_ids, raw = await _reference(engine, PLAIN, held)
    _check_greedy_against_reference(
        prompt_ids,
        raw,
        held[: held.index(stop_id) if stop_id in held else len(held)],
        replace(GREEDY, min_tokens=3),
        stop_ids=engine.eos_token_ids | {stop_id},
    )


async def test_min_tokens_ignores_stop_strings_ending_in_its_tokens(engine):
    events = await _events(engine, PLAIN, GREEDY)
    texts = [e.text for e in events]
    offsets = np.cumsum([0] + [len(t) for t in texts]).tolist()  # text length after each token
    full = "".join(texts)
    # a stop string that occurs early and again later
    stop, m = None, 0
    for j, t in enumerate(texts):
        if len(t) >= 1 and "\ufffd" not in t and full.count(t) >= 2:
            first_end = full.index(t) + len(t)
            later = full.find(t, offsets[j + 1])
            if first_end <= offsets[j + 1] and later >= 0:
                stop, m = t, j + 1
                break
    assert stop is not None, texts
    # Control: without min_tokens it stops at the first occurrence.
    early = await _events(engine, PLAIN, replace(GREEDY, stop=(stop,)))
    assert "".join(e.text for e in early) == full[: full.index(stop)] and early[-1].finish_reason == "stop"
    got = await _events(engine, PLAIN, replace(GREEDY, stop=(stop,), min_tokens=m))
    start = full.find(stop, max(0, offsets[m] - len(stop) + 1))  # vLLM: it must end after token m's text
    assert "".join(e.text for e in got) == full[:start] and got[-1].finish_reason == "stop"
    assert len(got) > len(early)


def test_stop_matcher_min_end_and_earliest_completion():
    m = StopStringMatcher(["aa"])
    m.min_end = None  # inside min_tokens: nothing stops, a possible prefix is still held back
    assert m.feed("xaa") == ("xa", False)
    m.min_end = 3
    assert m.feed("a") == ("", True)  # "aa" at 2..4 ends after 3
    m = StopStringMatcher(["bcd", "c"])
    assert m.feed("abcd") == ("ab", True)  # "c" completes first
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("abcd") == ("a", True)  # "bc" completes first although "abcd" starts first


# -- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 5])
async def test_logprobs_are_raw_log_softmax_of_the_model_logits(engine, k):
    params = replace(GREEDY, logprobs=k, repetition_penalty=1.5, logit_bias=((91, 2.0),), max_tokens=12)
    events = await _events(engine, LOOPY, params)
    tokens = [e.token_id for e in events]
    prompt_ids, raw = await _reference(engine, LOOPY, tokens)
    processed_differs = False
    for i, e in enumerate(events):
        lp = torch.log_softmax(raw[i], -1)
        assert e.logprob is not None and e.logprob.token_id == e.token_id
        assert e.logprob.token == engine.tokenizer.decode([e.token_id])
        assert e.logprob.logprob == pytest.approx(float(lp[e.token_id]), abs=1e-4)
        assert len(e.logprob.top) == k
        top = torch.topk(lp, k)
        assert [t for t, _, _ in e.logprob.top] == top.indices.tolist()
        assert [v for _, _, v in e.logprob.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [v for _, _, v in e.logprob.top] == sorted((v for _, _, v in e.logprob.top), reverse=True)
        assert all(text == engine.tokenizer.decode([t]) for t, text, _ in e.logprob.top)
        processed = np.log(np.exp(x := _reference_process(raw[i], prompt_ids, tokens[:i], params)) / np.exp(x).sum())
        processed_differs |= abs(processed[e.token_id] - e.logprob.logprob) > 1e-3
    assert processed_differs  # control: logprobs after penalties and bias would be other numbers
    assert all(e.logprob is None for e in await _events(engine, LOOPY, replace(params, logprobs=None)))


# -- completions prompts -------------------------------------------------------------------------
async def test_raw_prompt_text_and_token_ids(engine):
    text = "Describe the image."
    ids = engine.tokenizer(text)["input_ids"]
    by_text = await _ids(engine, RawPrompt(text=text), GREEDY)
    by_ids = await _ids(engine, RawPrompt(token_ids=tuple(ids)), GREEDY)
    assert by_text == by_ids
    # No chat template: the chat request of the same text is another prompt.
    assert by_text != await _ids(engine, PLAIN, GREEDY)
    prompt_ids, raw = await _reference(engine, RawPrompt(text=text), by_text)
    assert prompt_ids == ids
    _check_greedy_against_reference(prompt_ids, raw, by_text, GREEDY)


@pytest.mark.parametrize(
    "prompt",
    [
        RawPrompt(),
        RawPrompt(text="a", token_ids=(1,)),
        RawPrompt(text=""),
        RawPrompt(token_ids=()),
        RawPrompt(token_ids=(1, -2)),
        RawPrompt(token_ids=(10**6,)),
    ],
)
async def test_bad_raw_prompts_are_refused(engine, prompt):
    with pytest.raises(InvalidRequest) as exc:
        await _events(engine, prompt, GREEDY)
    assert exc.value.param == "prompt"


async def test_raw_prompt_takes_no_images_or_image_tokens(engine):
    image_token = engine.tokenizer.convert_ids_to_tokens(engine.image_token_id)
    with pytest.raises(InvalidRequest, match="image"):
        await _events(engine, RawPrompt(text=f"look {image_token}"), GREEDY)
    with pytest.raises(InvalidRequest, match="image"):
        await _events(engine, RawPrompt(token_ids=(5, engine.image_token_id)), GREEDY)


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, param",
    [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": ((380, 1.0),)}, "logit_bias"),  # the tiny model's vocabulary is 380
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((3, float("inf")),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": N + 1}, "min_tokens"),
        ({"stop_token_ids": (380,)}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ],
)
async def test_out_of_range_params_are_refused_naming_the_param(engine, change, param):
    assert engine.vocab_size == 380
    with pytest.raises(InvalidRequest) as exc:
        await _events(engine, PLAIN, replace(GREEDY, **change))
    assert exc.value.param == param


def test_validate_params_accepts_the_edges():
    for params in (
        replace(GREEDY, top_k=-1),  # vLLM's "disabled"
        replace(GREEDY, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01),
        replace(GREEDY, logit_bias=((379, -100.0),), stop_token_ids=(0, 379), min_tokens=N, logprobs=MAX_LOGPROBS),
    ):
        validate_params(params, vocab_size=380)
    # without a vocabulary size only the sign of token ids is checked
    validate_params(replace(GREEDY, logit_bias=((10**6, 1.0),)))
