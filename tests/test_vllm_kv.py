"""E|P|D on vLLM, engine level: a vLLM prefill engine (KV producer) stores each prompt's KV cache
through S3KVConnector in a real S3 server, a vLLM decode engine (KV consumer, another set of
processes) loads it through ``kv_transfer_params`` and decodes.

Reference: a plain vLLM engine run aggregated in this process on the same prompts and images.
"""

from __future__ import annotations

import uuid

import pytest

from shared.connectors.params import KVHandoff
from shared.engines.base import GenerationStats
from shared.fingerprint import model_fingerprint
from shared.store.format import RawTensor
from shared.store.kv import KVStore, kv_prefix
from shared.store.objects import S3ObjectStore
from tests.stackutil import engine_messages
from tests.vllmutil import CASES, GREEDY, generate, media, s3_connector_config, started_engines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

AK_ENV, SK_ENV = "EPD_TEST_VLLM_KV_AK", "EPD_TEST_VLLM_KV_SK"


@pytest.fixture(scope="module")
def store_config(s3_server):
    return s3_connector_config(s3_server, namespace="vkv", ak_env=AK_ENV, sk_env=SK_ENV)


@pytest.fixture(scope="module")
def engines(vllm_reference, tiny_model_dir, vllm_work_dir, store_config):
    """(prefill, decode) engines, started together. The decode engine has no prefix cache, so
    every request that is not loaded from the store is computed in full (nothing left over from
    an earlier test can stand in for a load)."""
    common = dict(dtype="float32", model_id="qwen2-vl-tiny", work_dir=vllm_work_dir, ec_extra_config=store_config)
    with started_engines(
        tiny_model_dir,
        dict(kv_role="kv_producer", **common),
        dict(kv_role="kv_consumer", engine_args={"enable_prefix_caching": False}, **common),
    ) as pair:
        yield pair


@pytest.fixture(scope="module")
def kv_store(s3_server, store_config, tiny_model_dir):
    raw = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, store_config["bucket"])
    fp = model_fingerprint(tiny_model_dir, dtype="float32", engine="vllm")
    return KVStore(raw, namespace=store_config["namespace"], fingerprint=fp, producer="test", max_object_bytes=1 << 30)


async def handoff(prefill, text, items, name=None) -> tuple[KVHandoff, GenerationStats]:
    name = name or f"kv-{uuid.uuid4().hex[:12]}"
    stats = GenerationStats()
    stored = await prefill.prefill_for_handoff(
        engine_messages(text, len(items)), items, GREEDY, request_name=name, attempt=0, stats=stats
    )
    return stored, stats


async def decode(engine, text, items, stored: KVHandoff):
    stats = GenerationStats()
    events = [
        e async for e in engine.generate_from_handoff(engine_messages(text, len(items)), items, GREEDY, stored, stats)
    ]
    return [e.token_id for e in events], stats.extra.get("kv_source")


def load(kv_store, stored: KVHandoff):
    return kv_store.load(stored.key, request_id=stored.request, attempt=stored.attempt)


@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
async def test_decode_from_the_stored_kv_equals_aggregated(engines, vllm_reference, kv_store, name, text, specs):
    prefill, decoder = engines
    items = [media(seed, size) for seed, size in specs]
    stored, stats = await handoff(prefill, text, items)
    assert stored.key == kv_store.key(stored.request, 0)  # one key scheme with the workers
    assert stored.prompt_tokens == stats.prompt_tokens > 0
    obj = load(kv_store, stored)
    assert obj.state["num_tokens"] == stats.prompt_tokens and obj.state["block_size"] == 32

    got, source = await decode(decoder, text, items, stored)
    want, _ = await generate(vllm_reference, text, items)
    assert source == "store"
    assert got == want


async def test_scrambled_kv_values_change_the_output(engines, vllm_reference, kv_store):
    """Negative control for the equality above: the decode engine really computes from the loaded
    KV - the same object with other values (re-signed, so it validates) gives other tokens."""
    import torch

    from shared.store.tensors import raw_to_tensor, tensor_to_raw

    prefill, decoder = engines
    text, specs = CASES[0][1], CASES[0][2]
    items = [media(seed, size) for seed, size in specs]
    stored, _ = await handoff(prefill, text, items)
    obj = load(kv_store, stored)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, raw in obj.tensors.items():
        t = raw_to_tensor(raw.data, raw.dtype, raw.shape)
        if name.startswith("kv."):
            t = torch.randn(t.shape, generator=gen) * t.std()
        tensors[name] = RawTensor(*tensor_to_raw(t))
    key, blob = kv_store.encode(stored.request, 0, tensors, obj.state_metadata, obj.sampling)
    kv_store.put(key, blob)

    got, source = await decode(decoder, text, items, stored)
    assert source == "store"
    assert got != (await generate(vllm_reference, text, items))[0]


def _flip_a_byte(kv_store, key):
    blob = bytearray(kv_store.store.get(key, max_bytes=1 << 30))
    blob[-9] ^= 0xFF
    kv_store.store.put(key, bytes(blob))


@pytest.mark.parametrize(
    "fault,reason",
    [
        ("deleted", "not_found"),
        ("corrupted", "checksum_mismatch"),
        ("other_prompt", "item_mismatch"),
    ],
)
async def test_unusable_kv_is_prefilled_again_with_the_same_output(engines, vllm_reference, kv_store, fault, reason):
    prefill, decoder = engines
    text, specs = CASES[1][1], CASES[1][2]
    items = [media(seed, size) for seed, size in specs]
    if fault == "other_prompt":  # a valid object, but computed for another request's prompt
        stored, _ = await handoff(prefill, "Something else entirely.", [media(99, (56, 56))])
    else:
        stored, _ = await handoff(prefill, text, items)
        if fault == "deleted":
            kv_store.delete(stored.key)
        else:
            _flip_a_byte(kv_store, stored.key)

    got, source = await decode(decoder, text, items, stored)
    assert source == f"recomputed:{reason}"
    assert got == (await generate(vllm_reference, text, items))[0]


async def test_only_handoff_requests_store_kv(engines, kv_store, store_config):
    prefill, _ = engines
    before = {i.key for i in kv_store.store.list(kv_prefix(store_config["namespace"]))}
    stats = GenerationStats()
    [e async for e in prefill.generate(engine_messages("Hello there.", 0), [], GREEDY, stats)]  # a plain request
    assert {i.key for i in kv_store.store.list(kv_prefix(store_config["namespace"]))} == before
    stored, _ = await handoff(prefill, "Hello there.", [])  # control: a hand-off request stores one object
    after = {i.key for i in kv_store.store.list(kv_prefix(store_config["namespace"]))}
    assert after - before == {stored.key}


async def test_engines_refuse_the_wrong_kv_role(engines):
    from shared.errors import EngineError

    prefill, decoder = engines
    with pytest.raises(EngineError, match="KV producer"):
        await decoder.prefill_for_handoff(engine_messages("Hi", 0), [], GREEDY, request_name="x", attempt=0)
    with pytest.raises(EngineError, match="KV consumer"):
        [e async for e in prefill.generate_from_handoff(engine_messages("Hi", 0), [], GREEDY, KVHandoff("k", "x"))]


def _outcome(events) -> list[tuple[int, tuple[int, ...] | None]]:
    """Token ids with the ids of their top logprobs (None without logprobs)."""
    return [(e.token_id, None if e.logprob is None else tuple(t[0] for t in e.logprob.top)) for e in events]


async def test_every_sampling_setting_survives_the_handoff(engines, vllm_reference, kv_store):
    """E|P|D with every sampling setting set (seeded sampling, top-k/p, min-p, penalties,
    logit_bias, min_tokens, stop_token_ids, logprobs): the decode engine samples every token
    itself, from the first, and equals the aggregated engine token for token, logprobs included -
    also when the KV object is unusable and it prefills again. Negative control: the same hand-off
    with any one setting dropped on the decode side only gives other tokens (or logprobs). The
    values are ones where each setting changes this request's tokens (frequency_penalty does not,
    with no token repeated: it gets a greedy request of its own)."""
    import math
    from dataclasses import replace

    from shared.engines.base import SamplingParams

    prefill, decoder = engines
    text, specs = CASES[0][1], CASES[0][2]
    items = [media(seed, size) for seed, size in specs]
    messages = engine_messages(text, len(items))

    async def aggregated(params):
        return [e async for e in vllm_reference.generate(messages, items, params)]

    async def epd(prefill_params, decode_params, *, spoil: bool = False):
        stats = GenerationStats()
        name = f"kv-{uuid.uuid4().hex[:12]}"
        stored = await prefill.prefill_for_handoff(
            messages, items, prefill_params, request_name=name, attempt=0, stats=stats
        )
        if spoil:
            kv_store.delete(stored.key)
        events = [e async for e in decoder.generate_from_handoff(messages, items, decode_params, stored, stats)]
        return events, stats.extra.get("kv_source")

    base = SamplingParams(
        max_tokens=16,
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        ignore_eos=True,
        top_k=8,
        min_p=0.3,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.2,
        logprobs=3,
    )
    free = await aggregated(base)
    base = replace(base, logit_bias=((free[0].token_id, -100.0),))  # bans the first token it drew
    banned = [e.token_id for e in await aggregated(base)]
    stop = next(t for i, t in enumerate(banned) if i >= 2 and t not in banned[:i])
    at = banned.index(stop)
    params = replace(base, stop_token_ids=(stop,), min_tokens=at + 3)
    want = await aggregated(params)
    assert len(want) >= at + 3 and stop not in [e.token_id for e in want][: at + 3]  # min_tokens held it back

    for spoil in (False, True):
        got, source = await epd(params, params, spoil=spoil)
        assert source == ("recomputed:not_found" if spoil else "store")
        assert _outcome(got) == _outcome(want)
        assert [e.finish_reason for e in got] == [e.finish_reason for e in want]
        for g, w in zip(got, want):
            assert g.logprob is not None and w.logprob is not None
            assert math.isclose(g.logprob.logprob, w.logprob.logprob, abs_tol=1e-5)
            assert all(math.isclose(a[2], b[2], abs_tol=1e-5) for a, b in zip(g.logprob.top, w.logprob.top))

    defaults = SamplingParams()
    for field in (
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
        "logprobs",
    ):
        got, source = await epd(params, replace(params, **{field: getattr(defaults, field)}))
        assert source == "store"
        assert _outcome(got) != _outcome(want), f"dropping {field} on the decode side changed nothing"
    got, _ = await epd(params, replace(params, seed=4321))
    assert _outcome(got) != _outcome(want), "another seed on the decode side changed nothing"

    # a negative penalty: this prompt's greedy tokens do not repeat, so only a reward for repeats shows
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=-2.0, logprobs=2)
    want = await aggregated(greedy)
    got, source = await epd(greedy, greedy)
    assert source == "store" and _outcome(got) == _outcome(want)
    got, _ = await epd(greedy, replace(greedy, frequency_penalty=0.0))
    assert _outcome(got) != _outcome(want), "dropping frequency_penalty on the decode side changed nothing"
