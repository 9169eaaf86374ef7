"""Batched decode on the tiny Qwen2-VL and LLaVA models.

* BatchDecoder (run in the engine's compute thread, as the engine runs it): greedy tokens in a
  batch equal the same requests decoded alone; requests join and leave between steps; padding,
  masks and per-row (M-RoPE) positions are what makes it so (negative controls break each).
* The engine's decode loop (``TransformersEngine.decode`` of KV objects): concurrent requests
  are stepped together and each equals ``generate()``; closing one early removes its row; more
  requests than ``max_batch`` wait for a row.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from shared.engines.base import GenerationStats, KVStateMismatch, SamplingParams
from shared.engines.transformers_batch import BatchDecoder
from shared.engines.transformers_engine import TransformersEngine
from shared.errors import InvalidRequest
from shared.store.kv import KVObject
from shared.tools.models.tiny import build_tiny_model
from tests.stackutil import noise_image

ARCHS = ["qwen2_vl", "llava", "qwen3_vl", "gemma3"]
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
def model_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(f"batch-{request.param}"), arch=request.param, seed=0)


@pytest.fixture(scope="module")
async def engine(model_dir):
    engine = TransformersEngine(model_dir, threads=1)
    yield engine
    await engine.aclose()


@pytest.fixture(scope="module")
async def requests_(engine):
    out = []
    for text, specs in PROMPTS:
        parts = [{"type": "image"} for _ in specs] + [{"type": "text", "text": text}]
        out.append(
            ([{"role": "user", "content": parts}], await engine.encode([noise_image(s, size) for s, size in specs]))
        )
    return out


async def _drain(events):
    return [e async for e in events]


async def on_engine(engine, fn, *args):
    """Run ``fn`` in the engine's compute thread (BatchDecoder and the sync steps live there)."""
    return await engine._call(fn, *args)


def _greedy(max_tokens: int = N, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def _single(engine, messages, images, params):
    """Greedy tokens (the engine's own loop) and per-step logits of the request decoded alone."""
    tokens = [e.token_id for e in await _drain(engine.generate(messages, images, params))]
    ids, logits = await on_engine(engine, _single_logits, engine, messages, images, params, len(tokens))
    assert ids == tokens
    return tokens, logits


def _single_logits(engine, messages, images, params, n_tokens):
    state = engine._prefill(messages, images, params)
    logits = []
    while len(state.output_ids) < n_tokens:
        lg = engine.decode_logits(state)
        logits.append(lg.clone())
        state.advance(int(torch.argmax(lg)))
    return state.output_ids, logits


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
                dec.add(i, engine._prefill(messages, images, params_of(i)), params_of(i))
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


async def test_batched_greedy_equals_single_with_joins_and_leaves(engine, requests_):
    params_of = lambda i: _greedy(N - 2 * i)  # noqa: E731 - leave at different steps
    joins = [0, 0, 0, 3, 5, 5]
    got, batch_logits, _, dec = await on_engine(engine, _run_batch, engine, requests_, params_of, joins)
    max_diff, min_margin = 0.0, float("inf")
    for i, (messages, images) in enumerate(requests_):
        want, single_logits = await _single(engine, messages, images, params_of(i))
        assert got[i] == want, f"request {i}"
        for b, s in zip(batch_logits[i], single_logits):
            max_diff = max(max_diff, float((b - s).abs().max()))
            top2 = torch.topk(s, 2).values
            min_margin = min(min_margin, float(top2[0] - top2[1]))
    assert dec.max_rows_seen == len(requests_)
    assert max_diff < LOGIT_TOLERANCE, max_diff
    assert min_margin > 10 * max_diff  # no near-tie could have flipped a token
    print(
        f"\n[{engine.arch}] batched vs single: max |logit diff| = {max_diff:.3g}, min top-2 margin = {min_margin:.3g}"
    )


async def test_padding_mask_and_positions_matter(engine, requests_):
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
    good, *_ = await on_engine(engine, _run_batch, engine, requests_, lambda i: _greedy(), joins)
    bad, *_ = await on_engine(engine, _run_batch, engine, requests_, lambda i: _greedy(), joins, NoMask)
    assert bad != good
    if engine.arch in ("qwen2_vl", "qwen3_vl"):  # M-RoPE
        bad, *_ = await on_engine(engine, _run_batch, engine, requests_, lambda i: _greedy(), joins, NoRopeDelta)
        assert bad != good


async def test_a_request_alone_is_bit_identical(engine, requests_):
    messages, images = requests_[3]
    want, single_logits = await _single(engine, messages, images, _greedy())
    got, logits, _, dec = await on_engine(engine, _run_batch, engine, [requests_[3]], lambda i: _greedy(), [0])
    assert got[0] == want
    assert dec.max_rows_seen == 1
    assert len(logits[0]) == len(single_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits[0], single_logits))


#: Seeded sampling, stop strings, EOS: per request (the stop string is filled in from the text).
def _mixed_params(stop: str) -> list[SamplingParams]:
    return [
        _greedy(stop=(stop,)),
        SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_tokens=N, temperature=1.0, seed=11, ignore_eos=True),
        _greedy(),
        SamplingParams(max_tokens=N, temperature=0.0),  # may stop at EOS
        _greedy(3),
    ]


async def test_sampling_stop_strings_and_text_in_a_batch(engine, requests_):
    """Seeded sampling, stop strings and EOS behave exactly as alone (same events, same text)."""
    alone_text = "".join(e.text for e in await _drain(engine.generate(*requests_[0], _greedy())))
    stop = alone_text[len(alone_text) // 2 : len(alone_text) // 2 + 2]
    params = _mixed_params(stop)
    _, _, events, _ = await on_engine(engine, _run_batch, engine, requests_, lambda i: params[i], [0, 0, 1, 1, 2, 2])
    for i, (messages, images) in enumerate(requests_):
        alone = await _drain(engine.generate(messages, images, params[i]))
        assert events[i] == alone, f"request {i}"
    assert events[0][-1].finish_reason == "stop"
    assert "".join(e.text for e in events[0]) == alone_text[: alone_text.index(stop)]


async def test_remove_gives_back_a_state_that_decodes_on_alone(engine, requests_):
    def batch_then_remove():
        dec = BatchDecoder(engine)
        for i in (0, 1, 2):
            dec.add(i, engine._prefill(*requests_[i], _greedy()), _greedy())
        for _ in range(5):
            dec.step()
        state = dec.remove(1)
        assert len(dec) == 2 and dec.rows == 2
        return state

    state = await on_engine(engine, batch_then_remove)
    # The decode loop continues it alone (a batch of one: the single-request step).
    rest = [e.token_id for e in await _drain(engine._decode_batched(state, _greedy(), None))]
    want = [e.token_id for e in await _drain(engine.generate(*requests_[1], _greedy()))]
    assert state.output_ids == want and rest == want[5:]


async def test_membership_errors(engine, requests_):
    def check():
        dec = BatchDecoder(engine, max_batch=2)
        state = engine._prefill(*requests_[4], _greedy())
        with pytest.raises(InvalidRequest):
            dec.add("bad", state, SamplingParams(max_tokens=0))
        dec.add("a", state, _greedy())
        with pytest.raises(ValueError, match="'a' is already in the batch"):
            dec.add("a", engine._prefill(*requests_[4], _greedy()), _greedy())
        dec.add("b", engine._prefill(*requests_[4], _greedy()), _greedy())
        with pytest.raises(ValueError, match=r"batch is full \(2\)"):
            dec.add("c", engine._prefill(*requests_[4], _greedy()), _greedy())
        assert len(dec) == 2  # the refused adds left the batch as it was
        with pytest.raises(KeyError, match="nope"):
            dec.remove("nope")

    await on_engine(engine, check)


# -- the engine's decode loop (TransformersEngine.decode of KV objects) ------------------------
async def _handed_off(engine, messages, images, params):
    """What E|P|D does: prefill (first token emitted), export -> a KV object (as loaded)."""
    request = await engine.prefill(messages, images, params)
    try:
        tensors, meta = await request.export()
    finally:
        await request.release()
    obj = KVObject(
        request_id="r",
        attempt=0,
        tensors=tensors,
        state_metadata=meta,
        state=json.loads(meta["state"]),
        sampling={},
        producer="test",
        created_at=0.0,
        nbytes=0,
    )
    return request.first, obj


async def _decode_all(engine, first, obj, params, stats):
    return [first] + await _drain(engine.decode(obj, params, stats))


async def test_engine_decode_steps_concurrent_requests_together(engine, requests_):
    """Concurrent decodes share the batched loop; each equals generate() event for event."""
    alone_text = "".join(e.text for e in await _drain(engine.generate(*requests_[0], _greedy())))
    stop = alone_text[len(alone_text) // 2 : len(alone_text) // 2 + 2]
    params = _mixed_params(stop)
    params[5] = _greedy()  # every request long enough to overlap the others
    handed = [await _handed_off(engine, *req, params[i]) for i, req in enumerate(requests_)]
    stats = [GenerationStats() for _ in requests_]
    got = await asyncio.gather(
        *(_decode_all(engine, first, obj, params[i], stats[i]) for i, (first, obj) in enumerate(handed))
    )
    for i, (messages, images) in enumerate(requests_):
        assert got[i] == await _drain(engine.generate(messages, images, params[i])), f"request {i}"
        assert stats[i].completion_tokens == len(got[i])
        assert stats[i].prompt_tokens > 0 and stats[i].decode_s > 0
    assert got[0][-1].finish_reason == "stop"
    rows = [s.extra["decode_batch_rows_max"] for s in stats]
    assert max(rows) == len(requests_), rows  # they really were stepped together
    assert engine._decode_loop.active == 0 and len(engine._decode_loop.decoder) == 0


async def test_closing_a_decode_early_removes_its_row(engine, requests_):
    long = _greedy(N)
    (first_a, obj_a), (first_b, obj_b) = [await _handed_off(engine, *requests_[i], long) for i in (1, 3)]
    events_a = engine.decode(obj_a, long)
    got_a = [await events_a.__anext__(), await events_a.__anext__()]
    stats_b = GenerationStats()
    task_b = asyncio.create_task(_decode_all(engine, first_b, obj_b, long, stats_b))
    await events_a.aclose()  # leaves the batch before the next step
    got_b = await task_b
    want_a = await _drain(engine.generate(*requests_[1], long))
    assert [first_a] + got_a == want_a[:3]
    assert got_b == await _drain(engine.generate(*requests_[3], long))
    assert engine._decode_loop.active == 0 and len(engine._decode_loop.decoder) == 0


async def test_decode_of_a_state_that_does_not_fit_raises_before_any_token(engine, requests_):
    _, obj = await _handed_off(engine, *requests_[0], _greedy())
    k = obj.tensors["kv.0.k"]
    state = dict(json.loads(obj.state_metadata["state"]), n_layers=99)
    bad = [
        KVObject(**{**obj.__dict__, "tensors": {n: t for n, t in obj.tensors.items() if n != "kv.0.k"}}),
        KVObject(**{**obj.__dict__, "state_metadata": {**obj.state_metadata, "state": json.dumps(state)}}),
        KVObject(
            **{
                **obj.__dict__,
                "tensors": {
                    **obj.tensors,
                    "kv.0.k": type(k)(
                        k.data[: len(k.data) // 2], k.dtype, (k.shape[0], k.shape[1], k.shape[2] // 2, k.shape[3])
                    ),
                },
            }
        ),
    ]
    for item in bad:
        with pytest.raises(KVStateMismatch):
            await engine.decode(item, _greedy()).__anext__()
    with pytest.raises(InvalidRequest):
        await engine.decode(obj, SamplingParams(max_tokens=0)).__anext__()
    assert engine._decode_loop.active == 0


async def test_more_requests_than_max_batch_wait_for_a_row(model_dir, requests_, monkeypatch):
    """max_batch=2: four concurrent decodes complete (equal to generate()), never more than two
    rows per step; the step delay (the test-side fault hook of tests/fault_workers.py) slows every step."""
    from shared.engines.transformers_batch import BatchDecoder
    from tests.fault_workers import slow_decode_steps

    monkeypatch.setattr(BatchDecoder, "step", BatchDecoder.step)  # restored after the test
    slow_decode_steps(0.02)
    engine = TransformersEngine(model_dir, threads=1, max_batch=2)
    try:
        n = 8
        handed = [await _handed_off(engine, *requests_[i], _greedy(n)) for i in range(4)]
        stats = [GenerationStats() for _ in handed]
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *(_decode_all(engine, first, obj, _greedy(n), stats[i]) for i, (first, obj) in enumerate(handed))
        )
        elapsed = time.perf_counter() - t0
        for i in range(4):
            assert got[i] == await _drain(engine.generate(*requests_[i], _greedy(n))), f"request {i}"
        rows = [s.extra["decode_batch_rows_max"] for s in stats]
        assert max(rows) == 2, rows
        assert engine._decode_loop.decoder.max_rows_seen == 2
        assert elapsed >= 2 * (n - 1) * 0.02  # at least two rounds of n - 1 delayed steps
    finally:
        await engine.aclose()


# -- generate(): E|PD and agg workers decode their requests in the same loop ---------------------------
async def test_concurrent_generate_calls_share_decode_steps_cheapest_prefill_first(engine, requests_):
    """Requests generated at once (a PD worker's admitted jobs) are decoded together in the decode
    loop and each equals the same request generated alone; their prefills ran one at a time, the
    cheapest prompt first after the one that started at once (``shared.admission.PrioritySlots``)."""
    params = _greedy()
    alone = [[e.token_id for e in await _drain(engine.generate(m, i, params))] for m, i in requests_]
    ran: list[int] = []  # prompt tokens of each prefill, in the order they ran
    real = engine._prefill_first

    def recording(messages, images, params, stats):
        ran.append(len(engine.build_prompt_ids(messages, images)))
        return real(messages, images, params, stats)

    engine._prefill_first = recording
    try:
        stats = [GenerationStats() for _ in requests_]
        got = await asyncio.gather(*(_drain(engine.generate(m, i, params, s)) for (m, i), s in zip(requests_, stats)))
    finally:
        del engine._prefill_first
    assert [[e.token_id for e in g] for g in got] == alone
    assert max(s.extra["decode_batch_rows_max"] for s in stats) >= 2  # they did share steps
    arrival = [len(engine.build_prompt_ids(m, i)) for m, i in requests_]
    assert ran[0] == arrival[0] and ran[1:] == sorted(arrival[1:])
    assert sorted(arrival[1:]) != arrival[1:]  # control: arrival order would fail the line above


# -- sampling parity params per row (vLLM semantics; tests/test_sampling_parity.py) --------------
def _v2_params(engine) -> list[SamplingParams]:
    """Every sampling parameter somewhere, different per row."""
    eos = min(engine.eos_token_ids)
    return [
        _greedy(repetition_penalty=1.4, logprobs=3),
        SamplingParams(max_tokens=N, temperature=0.9, seed=7, top_k=5, min_p=0.05, presence_penalty=0.8, logprobs=0),
        _greedy(frequency_penalty=1.0, presence_penalty=-0.5, logit_bias=((5, 2.0), (9, -1.0))),
        SamplingParams(max_tokens=N, temperature=0.0, min_tokens=4, logit_bias=((eos, 100.0),)),  # EOS after 4
        _greedy(stop_token_ids=(7,), min_tokens=2, logit_bias=((7, 30.0),)),
        SamplingParams(max_tokens=N, temperature=1.0, seed=3, ignore_eos=True, top_k=2, repetition_penalty=0.8),
    ]


def _same_events(got, want, what):
    """Same tokens, text and finish; logprobs equal up to batched-vs-alone float rounding."""
    assert [(e.token_id, e.text, e.finish_reason) for e in got] == [
        (e.token_id, e.text, e.finish_reason) for e in want
    ], what
    for a, b in zip(got, want):
        assert (a.logprob is None) == (b.logprob is None), what
        if a.logprob is not None:
            assert a.logprob.token_id == b.logprob.token_id and a.logprob.token == b.logprob.token
            assert a.logprob.logprob == pytest.approx(b.logprob.logprob, abs=LOGIT_TOLERANCE)
            assert [t for t, _, _ in a.logprob.top] == [t for t, _, _ in b.logprob.top], what
            assert [v for _, _, v in a.logprob.top] == pytest.approx(
                [v for _, _, v in b.logprob.top], abs=LOGIT_TOLERANCE
            )


async def test_mixed_sampling_parameters_per_row_equal_alone(engine, requests_):
    """Penalties, logit bias, min_tokens, stop token ids, top-k / min-p and logprobs are applied
    per row: each request of a batch gives exactly its events alone."""
    params = _v2_params(engine)
    _, _, events, dec = await on_engine(engine, _run_batch, engine, requests_, lambda i: params[i], [0, 0, 1, 1, 2, 2])
    assert dec.max_rows_seen >= 4
    for i, (messages, images) in enumerate(requests_):
        _same_events(events[i], await _drain(engine.generate(messages, images, params[i])), f"request {i}")
    eos = min(engine.eos_token_ids)
    assert [e.token_id for e in events[3]][4:] == [eos] and events[3][-1].finish_reason == "stop"
    assert events[4][-1].token_id == 7 and len(events[4]) >= 3 and events[4][-1].finish_reason == "stop"
    assert all(e.logprob is not None and len(e.logprob.top) == 3 for e in events[0])
    # Negative control: the rows' params swapped give other events.
    _, _, swapped, _ = await on_engine(
        engine, _run_batch, engine, requests_, lambda i: params[(i + 1) % 6], [0, 0, 1, 1, 2, 2]
    )
    assert [[e.token_id for e in swapped[i]] for i in range(6)] != [[e.token_id for e in events[i]] for i in range(6)]


async def test_handed_off_requests_with_every_parameter_decode_as_generate(engine, requests_):
    """E|P|D inside one engine: prefill + export, then concurrent decodes of the KV objects in the
    batched loop - the state carries prompt ids (repetition penalty), output ids (presence /
    frequency, min_tokens) and the RNG, so each equals generate()."""
    params = _v2_params(engine)
    handed = [await _handed_off(engine, *req, params[i]) for i, req in enumerate(requests_)]
    got = await asyncio.gather(
        *(_decode_all(engine, first, obj, params[i], None) for i, (first, obj) in enumerate(handed))
    )
    for i, (messages, images) in enumerate(requests_):
        _same_events(got[i], await _drain(engine.generate(messages, images, params[i])), f"request {i}")
