"""vLLM engines through the store, no epd-serve service involved: a vLLM EC producer engine
(encoder-only) -> S3ECConnector -> the real S3 server -> a vLLM EC consumer engine, compared
token for token (greedy) with a plain vLLM engine (no connector) on the same prompts. Closing a
generation early aborts the request in vLLM.

Engines are module-scoped (producer, consumer) or session-scoped (the plain reference): starting
one takes ~40 s here. The consumer loads ``tests.vllm_faults.FaultInjectingECConnector`` - the
project's connector unchanged unless a test leaves a fault instruction for an item.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from prometheus_client import REGISTRY

from shared.engines.base import SamplingParams
from shared.store.ec import ECStore
from shared.store.objects import S3ObjectStore
from tests.stackutil import engine_messages, wait_for
from tests.vllmutil import CASES, FAULT_DIR_ENV, GREEDY, generate, media, s3_connector_config, started_engines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

AK_ENV, SK_ENV = "EPD_TEST_VLLM_AK", "EPD_TEST_VLLM_SK"


@pytest.fixture(scope="module")
def store_config(s3_server):
    return s3_connector_config(s3_server, namespace="vllm", ak_env=AK_ENV, sk_env=SK_ENV)


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ec-faults")


@pytest.fixture(scope="module")
def engines(vllm_reference, tiny_model_dir, vllm_work_dir, store_config, fault_dir):
    """(producer, consumer), started together. vLLM's processes inherit the fault dir variable."""
    os.environ[FAULT_DIR_ENV] = str(fault_dir)
    common = dict(dtype="float32", model_id="qwen2-vl-tiny", work_dir=vllm_work_dir, ec_extra_config=store_config)
    try:
        with started_engines(
            tiny_model_dir,
            dict(ec_role="ec_producer", **common),
            dict(ec_role="ec_consumer", connector=("FaultInjectingECConnector", "tests.vllm_faults"), **common),
        ) as pair:
            yield pair
    finally:
        os.environ.pop(FAULT_DIR_ENV, None)


@pytest.fixture(scope="module")
def ec_store(engines, s3_server, store_config):
    producer, _ = engines
    raw = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, store_config["bucket"])
    return ECStore(raw, namespace=store_config["namespace"], fingerprint=producer.encoder_fingerprint, producer="test")


def test_engines_agree_on_the_encoder_version(vllm_reference, engines, tiny_model_dir):
    from shared.fingerprint import encoder_fingerprint

    producer, consumer = engines
    want = encoder_fingerprint(tiny_model_dir, dtype="float32", engine="vllm")  # what the API computes
    assert producer.encoder_fingerprint == consumer.encoder_fingerprint == vllm_reference.encoder_fingerprint == want


@pytest.mark.parametrize("name,text,specs", CASES, ids=[c[0] for c in CASES])
async def test_consumer_uses_stored_outputs_and_equals_plain_vllm(vllm_reference, engines, ec_store, name, text, specs):
    producer, consumer = engines
    items = [media(seed, size) for seed, size in specs]
    counts = await producer.produce(items)
    for item, n in zip(items, counts):
        obj = ec_store.load(item.item_hash)  # stored, valid, under the vLLM fingerprint
        assert obj.n_tokens == n
    got, stats = await generate(consumer, text, items)
    want, _ = await generate(vllm_reference, text, items)
    assert got == want and len(got) == GREEDY.max_tokens
    assert stats.extra["ec_sources"] == {item.item_hash: "store" for item in items}


async def test_swapped_objects_change_the_output(vllm_reference, engines, ec_store):
    """Negative control: the consumer really used the stored tensors. Image A's object is replaced
    by a valid object holding B's features: the consumer given image A answers like B."""
    producer, consumer = engines
    a, b = media(21, (56, 56)), media(22, (56, 56))
    await producer.produce([a, b])
    obj_b = ec_store.load(b.item_hash)
    ec_store.save(a.item_hash, obj_b.data, dtype=obj_b.dtype, shape=obj_b.shape)
    got, stats = await generate(consumer, "Describe the image.", [a])
    assert stats.extra["ec_sources"] == {a.item_hash: "store"}
    want_b, _ = await generate(vllm_reference, "Describe the image.", [b])
    want_a, _ = await generate(vllm_reference, "Describe the image.", [a])
    assert want_a != want_b
    assert got == want_b


def _lookups(outcome: str, reason: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "epd:ec_connector_lookups_total",
            {"model_name": "qwen2-vl-tiny", "engine": "0", "outcome": outcome, "reason": reason},
        )
        or 0.0
    )


@pytest.mark.parametrize("action,reason,seed", [("delete", "not_found", 41), ("corrupt", "checksum_mismatch", 42)])
async def test_object_lost_after_the_existence_check_still_completes(
    vllm_reference, engines, ec_store, fault_dir, action, reason, seed
):
    producer, consumer = engines
    item = media(seed, (64, 48))
    await producer.produce([item])
    assert ec_store.exists(item.item_hash)
    before = _lookups("fallback", reason)
    (fault_dir / item.item_hash).write_text(action)
    got, stats = await generate(consumer, "Describe the image.", [item])
    assert (fault_dir / f"{item.item_hash}.done").read_text() == action  # the fault hit the load
    assert stats.extra["ec_sources"] == {item.item_hash: f"recomputed:{reason}"}
    want, _ = await generate(vllm_reference, "Describe the image.", [item])
    assert got == want
    # The fallback is counted, with its reason (stats reach this process with the engine's outputs,
    # possibly a little after them).
    wait_for(lambda: _lookups("fallback", reason) >= before + 1, 120, f"the fallback count ({reason})")
    assert _lookups("fallback", reason) == before + 1


async def test_unstored_item_is_encoded_by_the_consumer(vllm_reference, engines):
    _, consumer = engines
    item = media(51, (56, 56))
    got, stats = await generate(consumer, "What is this?", [item])
    assert stats.extra["ec_sources"] == {item.item_hash: "recomputed:not_found"}
    assert got == (await generate(vllm_reference, "What is this?", [item]))[0]


async def _settled(engine, timeout_s: float = 60.0) -> int:
    """vLLM's number of unfinished requests, once it is 0 (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while (n := await engine.num_unfinished_requests()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return n


async def test_closing_generate_early_aborts_the_request(vllm_reference):
    """A long generation closed after 2 tokens, or whose task is cancelled, is aborted in vLLM
    (no unfinished request is left behind) and the engine serves the next request."""
    item = media(61, (56, 56))
    messages = engine_messages("Describe the image.", 1)
    long = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    want, _ = await generate(vllm_reference, "Describe the image.", [item])
    assert await _settled(vllm_reference) == 0

    events = vllm_reference.generate(messages, [item], long)
    got = [await events.__anext__(), await events.__anext__()]
    assert [e.token_id for e in got] == want[:2]
    assert await vllm_reference.num_unfinished_requests() == 1  # still generating
    await events.aclose()
    assert await _settled(vllm_reference) == 0

    started = asyncio.Event()

    async def consume():
        async for _ in vllm_reference.generate(messages, [item], long):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert await vllm_reference.num_unfinished_requests() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _settled(vllm_reference) == 0
    assert (await generate(vllm_reference, "Describe the image.", [item]))[0] == want


def test_a_cpu_engine_prefills_in_small_steps_unless_it_hands_kv_off(vllm_reference, engines):
    """``EPD_VLLM_MAX_NUM_BATCHED_TOKENS`` unset on a CPU: 256 prompt tokens a step for engines
    without a KV hand-off (started: the reference, the EC producer and consumer), vLLM's own default
    for a KV producer (not checked with chunked prefills); a value set is taken as it is. (The
    choice is held on ``batched_tokens``: three engines started for it cost this tier 81 s.)"""
    from shared.engines.vllm_engine import CPU_MAX_NUM_BATCHED_TOKENS, batched_tokens

    for engine in (vllm_reference, *engines):
        assert engine.vllm_config.scheduler_config.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
        assert engine.prefill_tokens_per_step == CPU_MAX_NUM_BATCHED_TOKENS  # what admission sizes long prompts by
        # what an encoder worker's pixel budget follows: a step's image tokens of 28x28 pixels (patch
        # 14, merged 2x2) - 401,408 pixels, two 448x448 images a budget
        assert engine.encode_pixels_per_step == CPU_MAX_NUM_BATCHED_TOKENS * 28 * 28
    assert batched_tokens(None, max_num_seqs=16, kv_role=None, on_cpu=True) == CPU_MAX_NUM_BATCHED_TOKENS
    assert batched_tokens(None, max_num_seqs=16, kv_role="kv_producer", on_cpu=True) is None  # vLLM's default
    assert batched_tokens(None, max_num_seqs=16, kv_role=None, on_cpu=False) is None  # (a GPU: vLLM's)
    assert batched_tokens(512, max_num_seqs=16, kv_role=None, on_cpu=True) == 512
    assert batched_tokens(None, max_num_seqs=300, kv_role=None, on_cpu=True) == 300  # a token per sequence at least


async def _first_token_order(engine, long_prompt: int | None) -> list[str]:
    """Eight long text prompts (two engine steps each), then a short one, all ready at once and let
    into ``engine`` through the worker's admission (``PrioritySlots`` with ``long_prompt``): the
    order of their first tokens."""
    from shared.admission import PrioritySlots
    from shared.engines.prompts import prompt_cost

    slots = PrioritySlots(16, long_prompt)
    order: list[str] = []
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def one(name: str, text: str) -> None:
        messages = engine_messages(text, 0)
        async with slots.slot(prompt_cost(messages, [])) as slot:
            async for _ in engine.generate(messages, [], params):
                if name not in order:
                    order.append(name)
                    slot.prefilled()

    words = " ".join(f"w{i % 50}" for i in range(engine.prefill_tokens_per_step * 3 // 2))
    tasks = [asyncio.create_task(one(f"long{i}", f"{i} {words}")) for i in range(8)]
    tasks.append(asyncio.create_task(one("short", "a short question")))  # ready with them, last
    await asyncio.gather(*tasks)
    return order


async def test_long_prompts_go_in_two_at_a_time_so_a_short_one_is_not_behind_all_of_them(vllm_reference):
    """``shared.admission``: prompts of more than half the engine's step go into the vLLM engine two
    at a time (``LONG_PROMPTS_AT_ONCE``), so a short prompt ready just after eight of them gets its
    first token after at most those two (and what the engine had scheduled with them). Negative
    control, no such rule: vLLM serves the requests it has first, so the short one comes after all
    eight."""
    from shared.admission import long_prompt_tokens

    ruled = await _first_token_order(vllm_reference, long_prompt_tokens(None, vllm_reference.prefill_tokens_per_step))
    assert ruled.index("short") <= 2, ruled
    unruled = await _first_token_order(vllm_reference, None)
    assert unruled.index("short") >= 7, unruled
