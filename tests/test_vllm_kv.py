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

pytestmark = pytest.mark.slow

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
