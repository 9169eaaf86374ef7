"""Batched decode (BatchDecoder) on the tiny Qwen2-VL and LLaVA models: greedy tokens in a batch
equal the same requests decoded alone; requests join and leave between steps; padding, masks and
per-row (M-RoPE) positions are what makes it so (negative controls break each)."""

from __future__ import annotations

import pytest
import torch

from shared.engines.base import SamplingParams
from shared.engines.transformers_batch import BatchDecoder
from shared.engines.transformers_engine import TransformersEngine
from shared.errors import InvalidRequest
from shared.tools.models.tiny import build_tiny_model
from tests.stackutil import noise_image

ARCHS = ["qwen2_vl", "llava"]
N = 24
#: Logits of a request decoded in a batch may differ from the same request decoded alone in the
#: last bits (matmuls with M = rows, attention over padded columns). Measured on these models:
#: max |diff| ~2-3e-6 for logits of magnitude ~4 (a few float32 ulps). Tokens flip only when the
#: top two logits are closer than that; the smallest top-2 margin seen here is ~7e-4.
LOGIT_TOLERANCE = 1e-4


# Different prompt lengths (text only, one image of several sizes, two images) -> padding.
PROMPTS = [
    ("Describe the image.", [(101, (64, 48))]),
    ("What color dominates here in this picture?", [(102, (56, 56))]),
    ("Count.", [(103, (90, 40))]),
    ("Compare these two images please, in detail.", [(104, (56, 84)), (105, (112, 84))]),
    ("Hi", []),
    ("Tell me a long story about the image and many more words here.", [(106, (112, 112))]),
]


@pytest.fixture(scope="module", params=ARCHS)
def engine(request, tmp_path_factory) -> TransformersEngine:
    path = build_tiny_model(tmp_path_factory.mktemp(f"batch-{request.param}"), arch=request.param, seed=0)
    return TransformersEngine(path, threads=1)


@pytest.fixture(scope="module")
def requests_(engine):
    out = []
    for text, specs in PROMPTS:
        parts = [{"type": "image"} for _ in specs] + [{"type": "text", "text": text}]
        out.append(([{"role": "user", "content": parts}], engine.encode([noise_image(s, size) for s, size in specs])))
    return out


def _greedy(max_tokens: int = N, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _single(engine, messages, images, params):
    """Greedy tokens (the engine's own loop) and per-step logits of the request decoded alone."""
    tokens = [e.token_id for e in engine.generate(messages, images, params)]
    state = engine.prefill(messages, images, params)
    logits = []
    while len(state.output_ids) < len(tokens):
        lg = engine.decode_logits(state)
        logits.append(lg.clone())
        state.advance(int(torch.argmax(lg)))
    assert state.output_ids == tokens
    return tokens, logits


def _run_batch(engine, reqs, params_of, joins, decoder_cls=BatchDecoder):
    """Decode ``reqs`` batched; request i joins before step ``joins[i]``. Returns tokens,
    per-step logits and events per request, and the decoder."""
    dec = decoder_cls(engine, record_logits=True)
    tokens = {i: [] for i in range(len(reqs))}
    logits = {i: [] for i in range(len(reqs))}
    events = {i: [] for i in range(len(reqs))}
    step = 0
    while True:
        for i, at in enumerate(joins):
            if at == step:
                messages, images = reqs[i]
                dec.add(i, engine.prefill(messages, images, params_of(i)), params_of(i))
        if not len(dec) and step > max(joins):
            break
        for key, ev in dec.step():
            tokens[key].append(ev.token_id)
            events[key].append(ev)
        for key, lg in dec.last_logits.items():
            logits[key].append(lg)
        step += 1
        assert step < 10 * N
    return tokens, logits, events, dec


def test_batched_greedy_equals_single_with_joins_and_leaves(engine, requests_):
    params_of = lambda i: _greedy(N - 2 * i)  # noqa: E731 - leave at different steps
    joins = [0, 0, 0, 3, 5, 5]
    got, batch_logits, _, dec = _run_batch(engine, requests_, params_of, joins)
    max_diff, min_margin = 0.0, float("inf")
    for i, (messages, images) in enumerate(requests_):
        want, single_logits = _single(engine, messages, images, params_of(i))
        assert got[i] == want, f"request {i}"
        for b, s in zip(batch_logits[i], single_logits):
            max_diff = max(max_diff, float((b - s).abs().max()))
            top2 = torch.topk(s, 2).values
            min_margin = min(min_margin, float(top2[0] - top2[1]))
    assert dec.max_rows_seen == len(requests_)
    assert max_diff < LOGIT_TOLERANCE, max_diff
    assert min_margin > 10 * max_diff  # no near-tie could have flipped a token
    print(f"\n[{engine.arch}] batched vs single: max |logit diff| = {max_diff:.3g}, min top-2 margin = {min_margin:.3g}")


def test_padding_mask_and_positions_matter(engine, requests_):
    """Negative controls: ignoring the padding mask, or dropping the M-RoPE delta, changes tokens."""

    class NoMask(BatchDecoder):
        def _attention_mask(self, mask):
            return torch.ones_like(mask)

    class NoRopeDelta(BatchDecoder):
        def _batch_inputs(self, members):
            mask, pos = super()._batch_inputs(members)
            if pos.dim() == 3:
                pos = pos[:1].expand(4, -1, -1)
            return mask, pos

    joins = [0] * len(requests_)
    good, *_ = _run_batch(engine, requests_, lambda i: _greedy(), joins)
    bad, *_ = _run_batch(engine, requests_, lambda i: _greedy(), joins, decoder_cls=NoMask)
    assert bad != good
    if engine.is_mrope:
        bad, *_ = _run_batch(engine, requests_, lambda i: _greedy(), joins, decoder_cls=NoRopeDelta)
        assert bad != good


def test_a_request_alone_is_bit_identical(engine, requests_):
    messages, images = requests_[3]
    want, single_logits = _single(engine, messages, images, _greedy())
    got, logits, _, dec = _run_batch(engine, [requests_[3]], lambda i: _greedy(), [0])
    assert got[0] == want
    assert dec.max_rows_seen == 1
    assert len(logits[0]) == len(single_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits[0], single_logits))


def test_sampling_stop_strings_and_text_in_a_batch(engine, requests_):
    """Seeded sampling, stop strings and EOS behave exactly as alone (same events, same text)."""
    alone_text = "".join(e.text for e in engine.generate(*requests_[0], _greedy()))
    stop = alone_text[len(alone_text) // 2 : len(alone_text) // 2 + 2]
    params = [
        _greedy(stop=(stop,)),
        SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_tokens=N, temperature=1.0, seed=11, ignore_eos=True),
        _greedy(),
        SamplingParams(max_tokens=N, temperature=0.0),  # may stop at EOS
        _greedy(3),
    ]
    _, _, events, _ = _run_batch(engine, requests_, lambda i: params[i], [0, 0, 1, 1, 2, 2])
    for i, (messages, images) in enumerate(requests_):
        alone = list(engine.generate(messages, images, params[i]))
        assert events[i] == alone, f"request {i}"
    assert events[0][-1].finish_reason == "stop"
    assert "".join(e.text for e in events[0]) == alone_text[: alone_text.index(stop)]


def test_remove_gives_back_a_state_that_decodes_on_alone(engine, requests_):
    dec = BatchDecoder(engine)
    for i in (0, 1, 2):
        dec.add(i, engine.prefill(*requests_[i], _greedy()), _greedy())
    for _ in range(5):
        dec.step()
    state = dec.remove(1)
    assert len(dec) == 2 and dec.rows == 2
    rest = [e.token_id for e in engine.decode(state, _greedy())]
    want = [e.token_id for e in engine.generate(*requests_[1], _greedy())]
    assert state.output_ids == want and rest == want[5:]


def test_membership_errors(engine, requests_):
    dec = BatchDecoder(engine, max_batch=2)
    state = engine.prefill(*requests_[4], _greedy())
    with pytest.raises(InvalidRequest):
        dec.add("bad", state, SamplingParams(max_tokens=0))
    dec.add("a", state, _greedy())
    with pytest.raises(ValueError, match="'a' is already in the batch"):
        dec.add("a", engine.prefill(*requests_[4], _greedy()), _greedy())
    dec.add("b", engine.prefill(*requests_[4], _greedy()), _greedy())
    with pytest.raises(ValueError, match=r"batch is full \(2\)"):
        dec.add("c", engine.prefill(*requests_[4], _greedy()), _greedy())
    assert len(dec) == 2  # the refused adds left the batch as it was
    with pytest.raises(KeyError, match="nope"):
        dec.remove("nope")
