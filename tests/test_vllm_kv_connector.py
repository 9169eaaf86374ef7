"""S3KVConnector without an engine: its scheduler and worker halves driven the way vLLM 0.32
drives them (``on_new_request`` -> ``update_state_after_alloc`` -> ``build_connector_meta`` each
step -> worker ``save_kv_layer`` / ``wait_for_save`` / ``start_load_kv``), on fake paged caches,
against a real S3 server. The engine-level tests are in ``tests/test_vllm_kv.py``."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from shared.connectors.common import vllm_model_fingerprint
from shared.connectors.params import KV_ATTEMPT, KV_SOURCE, KVHandoff, KVHandoffRequest
from shared.connectors.s3_kv import S3KVConnector
from shared.connectors.s3_kv.layout import STATE_SCHEMA, check_kv_object
from shared.store.format import MissReason, ObjectValidationError, RawTensor
from shared.store.kv import KVStore, decode_kv_object
from shared.store.objects import S3ObjectStore
from shared.tools.infra import EmbeddedS3

AK_ENV, SK_ENV = "EPD_TEST_KVC_AK", "EPD_TEST_KVC_SK"
BLOCK, HEADS, HEAD = 4, 2, 3  # block size, KV heads, head size of the fake cache
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def credentials(s3_server):
    """The session S3 server's credentials, in the env variables the connectors' config names."""
    os.environ[AK_ENV], os.environ[SK_ENV] = s3_server.access_key, s3_server.secret_key
    return s3_server.access_key, s3_server.secret_key


@pytest.fixture(scope="module")
def bucket(s3_server, credentials):
    name = f"kvc-{uuid.uuid4().hex[:10]}"
    S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, name).ensure_bucket()
    return name


def make_connector(model_dir, s3_server, bucket, kv_role, role, **extra):
    """A connector built from what vLLM hands it: a KVTransferConfig, the model, cache and KV cache
    configs. ``extra``: more ``kv_connector_extra_config`` settings."""
    transfer = KVTransferConfig(
        kv_connector="S3KVConnector",
        kv_connector_module_path="shared.connectors.s3_kv",
        kv_role=kv_role,
        kv_connector_extra_config={
            "endpoint": s3_server.endpoint,
            "bucket": bucket,
            "namespace": "ns",
            "access_key_env": AK_ENV,
            "secret_key_env": SK_ENV,
            **extra,
        },
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(model=str(model_dir), revision=None, dtype=torch.float32, use_mla=False),
        cache_config=SimpleNamespace(block_size=BLOCK),
    )
    spec = SimpleNamespace(num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))])
    return S3KVConnector(vllm_config, role, kv_cache_config)


def paged_cache(seed=None):
    """One fake layer cache in the CPU backend's shape [blocks, kv heads, block size, 2 * head size]."""
    if seed is None:
        return torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    return torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=torch.Generator().manual_seed(seed))


def fake_request(prompt, kv_params):
    return SimpleNamespace(
        request_id=f"vllm-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=list(prompt),
        kv_transfer_params=kv_params,
        num_computed_tokens=0,
    )


def new_req(req, block_ids, num_computed=0):
    return SimpleNamespace(
        req_id=req.request_id,
        block_ids=(list(block_ids),),
        prompt_token_ids=req.prompt_token_ids,
        num_computed_tokens=num_computed,
    )


def step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput with ``new`` requests and ``cached`` (request, new block ids, computed) ones."""
    cached_reqs = SimpleNamespace(
        req_ids=[r.request_id for r, _, _ in cached],
        resumed_req_ids=set(),
        new_block_ids=[(list(b),) if b else None for _, b, _ in cached],
        num_computed_tokens=[c for _, _, c in cached],
    )
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=dict(scheduled or {})
    )


def run_worker_step(worker, meta, layers):
    """What the model runner does around a forward: bind metadata, load, attention layers save, wait."""
    worker.bind_connector_metadata(meta)
    forward_context = SimpleNamespace(no_compile_layers={n: SimpleNamespace(kv_cache=t) for n, t in layers.items()})
    worker.start_load_kv(forward_context)
    for name, tensor in layers.items():
        worker.save_kv_layer(name, tensor, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def decide(sched, req, num_computed=0, timeout=120.0):
    """Ask get_num_new_matched_tokens each 'step' until it stops answering 'not yet' (``timeout``
    only catches a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        n, load_async = sched.get_num_new_matched_tokens(req, num_computed)
        assert load_async is False
        if n is not None:
            return n
        assert time.monotonic() < deadline, "never decided"
        time.sleep(0.005)


def produce(tiny_model_dir, s3_server, bucket, prompt, producer_blocks, name, chunks=(None,)):
    """Prefill side: a request whose prompt is computed in ``chunks`` steps; returns (finished
    kv_transfer_params, the producer's layer caches)."""
    sched = make_connector(tiny_model_dir, s3_server, bucket, "kv_producer", KVConnectorRole.SCHEDULER)
    worker = make_connector(tiny_model_dir, s3_server, bucket, "kv_producer", KVConnectorRole.WORKER)
    layers = {name_: paged_cache(seed) for seed, name_ in enumerate(LAYERS)}
    req = fake_request(prompt, KVHandoffRequest(name, 0).to_params())
    sched.on_new_request(req)
    sched.update_state_after_alloc(req, None, 0)
    if chunks == (None,):
        meta = sched.build_connector_meta(
            step(new=[new_req(req, producer_blocks)], scheduled={req.request_id: len(prompt)})
        )
        run_worker_step(worker, meta, layers)
    else:  # chunked prefill: first chunk with the first blocks, later chunks add blocks
        first, second = chunks
        n_first_blocks = -(-first // BLOCK)
        meta = sched.build_connector_meta(
            step(new=[new_req(req, producer_blocks[:n_first_blocks])], scheduled={req.request_id: first})
        )
        assert meta.saves == []  # the prompt is not complete yet
        run_worker_step(worker, meta, layers)
        meta = sched.build_connector_meta(
            step(cached=[(req, producer_blocks[n_first_blocks:], first)], scheduled={req.request_id: second})
        )
        assert len(meta.saves) == 1
        run_worker_step(worker, meta, layers)
    _, params = sched.request_finished(req, list(producer_blocks))
    return params, layers


def consumer(tiny_model_dir, s3_server, bucket, **extra):
    """(scheduler half, worker half) of a decode engine's connector."""
    return tuple(
        make_connector(tiny_model_dir, s3_server, bucket, "kv_consumer", role, **extra)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    )


def stored(tiny_model_dir, s3_server, bucket, prompt):
    """Finished prefill params of ``prompt`` (blocks 1, 2, 3 in the producer) and the producer's caches."""
    return produce(tiny_model_dir, s3_server, bucket, prompt, [1, 2, 3], f"req-{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("chunks", [(None,), (6, 5)], ids=["one-step", "chunked"])
def test_producer_to_consumer_moves_the_prompt_blocks(tiny_model_dir, s3_server, bucket, chunks):
    prompt = list(range(100, 111))  # 11 tokens: blocks of 4 -> 3 blocks, the last one partly filled
    producer_blocks, consumer_blocks = [7, 2, 11], [3, 9, 5]
    name = f"req-{uuid.uuid4().hex[:8]}"
    params, src = produce(tiny_model_dir, s3_server, bucket, prompt, producer_blocks, name, chunks)
    handoff = KVHandoff.from_params(params)
    assert handoff is not None and handoff.prompt_tokens == len(prompt) and handoff.request == name
    assert handoff.key.endswith(f"/{name}-0")

    sched, worker = consumer(tiny_model_dir, s3_server, bucket)
    req = fake_request(prompt, params)
    assert decide(sched, req) == len(prompt) - 1  # all but the last token, whose logits vLLM needs
    sched.update_state_after_alloc(req, None, len(prompt) - 1)
    meta = sched.build_connector_meta(step(new=[new_req(req, consumer_blocks)]))
    dst = {name_: paged_cache() for name_ in LAYERS}
    run_worker_step(worker, meta, dst)
    assert worker.get_block_ids_with_load_errors() == set()
    for name_ in LAYERS:
        for p, c in zip(producer_blocks, consumer_blocks):
            assert torch.equal(dst[name_][c], src[name_][p])
        untouched = sorted(set(range(NUM_BLOCKS)) - set(consumer_blocks))
        assert not dst[name_][untouched].any()  # nothing else written
    assert sched.request_finished(req, consumer_blocks)[1] == {KV_SOURCE: "store"}


def test_a_local_prefix_hit_loads_only_the_rest(tiny_model_dir, s3_server, bucket):
    prompt = list(range(200, 211))
    params, src = stored(tiny_model_dir, s3_server, bucket, prompt)
    sched, worker = consumer(tiny_model_dir, s3_server, bucket)
    req = fake_request(prompt, params)
    assert decide(sched, req, num_computed=BLOCK) == len(prompt) - 1 - BLOCK  # vLLM's cache had block 0
    sched.update_state_after_alloc(req, None, len(prompt) - 1 - BLOCK)
    meta = sched.build_connector_meta(step(new=[new_req(req, [8, 9, 10], num_computed=BLOCK)]))
    dst = {name_: paged_cache() for name_ in LAYERS}
    run_worker_step(worker, meta, dst)
    for name_ in LAYERS:
        assert not dst[name_][8].any()  # the locally cached block is left alone
        assert torch.equal(dst[name_][9], src[name_][2]) and torch.equal(dst[name_][10], src[name_][3])


def test_requests_without_handoff_params_are_ignored(tiny_model_dir, s3_server, bucket):
    sched, _ = consumer(tiny_model_dir, s3_server, bucket)
    assert sched.get_num_new_matched_tokens(fake_request([1, 2, 3], None), 0) == (0, False)
    producer = make_connector(tiny_model_dir, s3_server, bucket, "kv_producer", KVConnectorRole.SCHEDULER)
    req = fake_request([1, 2, 3, 4, 5], None)
    producer.on_new_request(req)
    producer.update_state_after_alloc(req, None, 0)
    meta = producer.build_connector_meta(step(new=[new_req(req, [0, 1])], scheduled={req.request_id: 5}))
    assert meta.saves == [] and producer.request_finished(req, [0, 1]) == (False, None)


def test_unusable_objects_are_not_loaded(tiny_model_dir, s3_server, bucket):
    prompt = list(range(300, 311))
    params, _ = stored(tiny_model_dir, s3_server, bucket, prompt)
    sched, _ = consumer(tiny_model_dir, s3_server, bucket)
    other_prompt = fake_request(prompt[:-1] + [999], params)  # the object was computed for another prompt
    assert decide(sched, other_prompt) == 0
    assert sched.request_finished(other_prompt, [])[1] == {KV_SOURCE: "recomputed:item_mismatch"}
    handoff = KVHandoff.from_params(params)
    missing = fake_request(
        prompt,
        KVHandoff(
            handoff.key.removesuffix("-0") + "-1",
            handoff.request,
            1,  # no object
            handoff.prompt_tokens,
        ).to_params(),
    )
    assert decide(sched, missing) == 0
    assert sched.request_finished(missing, [])[1] == {KV_SOURCE: "recomputed:not_found"}
    forged = fake_request(
        prompt,
        KVHandoff(
            "ns/kv/0000/elsewhere-0",
            handoff.request,
            0,  # not this model's key
            handoff.prompt_tokens,
        ).to_params(),
    )
    assert decide(sched, forged) == 0
    assert sched.request_finished(forged, [])[1] == {KV_SOURCE: "recomputed:fingerprint_mismatch"}
    malformed = fake_request(prompt, {**params, KV_ATTEMPT: -1})
    assert decide(sched, malformed) == 0
    assert sched.request_finished(malformed, [])[1] == {KV_SOURCE: "recomputed:item_mismatch"}
    good = fake_request(prompt, params)  # control: the same object for its own prompt loads
    assert decide(sched, good) == len(prompt) - 1


def test_a_failed_block_write_is_reported_for_recomputation(tiny_model_dir, s3_server, bucket):
    prompt = list(range(400, 411))
    params, _ = stored(tiny_model_dir, s3_server, bucket, prompt)
    sched, worker = consumer(tiny_model_dir, s3_server, bucket)
    req = fake_request(prompt, params)
    assert decide(sched, req) == len(prompt) - 1
    sched.update_state_after_alloc(req, None, len(prompt) - 1)
    meta = sched.build_connector_meta(step(new=[new_req(req, [4, 5, 6])]))
    wrong = {name_: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD) for name_ in LAYERS}  # another cache layout
    run_worker_step(worker, meta, wrong)
    assert worker.get_block_ids_with_load_errors() == {4, 5, 6}
    assert not any(t.any() for t in wrong.values())  # nothing half-written
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_connector_worker_meta()))
    assert sched.request_finished(req, [4, 5, 6])[1] == {KV_SOURCE: "recomputed:shape_mismatch"}


@pytest.fixture
def pausable_s3(credentials, tmp_path):
    """A SeaweedFS of this test's own (same credentials as the session's, so the connectors' env
    names work), which the test may pause with SIGSTOP; it is resumed and stopped afterwards."""
    access_key, secret_key = credentials
    server = EmbeddedS3(tmp_path / "s3", access_key=access_key, secret_key=secret_key)
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def test_a_fetch_slower_than_the_timeout_is_prefilled_again(tiny_model_dir, pausable_s3):
    """The store stops answering (its process is paused) while the decode side fetches a stored
    object: after ``fetch_timeout_s`` the connector answers 0 external tokens - vLLM prefills the
    whole prompt itself, as for any unusable object - instead of blocking the scheduler on the
    fetch, and the request's ``kv_source`` says why."""
    bucket = f"kvc-slow-{uuid.uuid4().hex[:8]}"
    S3ObjectStore(pausable_s3.endpoint, pausable_s3.access_key, pausable_s3.secret_key, bucket).ensure_bucket()
    prompt = list(range(500, 511))
    params, _ = stored(tiny_model_dir, pausable_s3, bucket, prompt)
    sched, _ = consumer(tiny_model_dir, pausable_s3, bucket, fetch_timeout_s=1.0)
    req = fake_request(prompt, params)
    os.kill(pausable_s3.pid, signal.SIGSTOP)
    try:
        assert decide(sched, req) == 0  # decided while the store still has not answered
        sched.update_state_after_alloc(req, None, 0)
        assert sched.build_connector_meta(step(new=[new_req(req, [1, 2, 3])])).loads == []
        assert sched.request_finished(req, [1, 2, 3])[1] == {KV_SOURCE: "recomputed:timeout"}
    finally:
        os.kill(pausable_s3.pid, signal.SIGCONT)
    # Control: with the store answering again, the same object loads for the same prompt.
    again = fake_request(prompt, params)
    assert decide(sched, again) == len(prompt) - 1
    assert sched.request_finished(again, [])[1] == {KV_SOURCE: "store"}


def test_fingerprint_is_the_workers_model_fingerprint(tiny_model_dir):
    from shared.fingerprint import model_fingerprint

    config = SimpleNamespace(model=str(tiny_model_dir), revision=None, dtype=torch.float32)
    assert vllm_model_fingerprint(config) == model_fingerprint(tiny_model_dir, dtype="float32", engine="vllm")
    assert vllm_model_fingerprint(config) != model_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")


# -- object checks ----------------------------------------------------------------------------------
@pytest.fixture
def kv_store(s3_server, bucket):
    raw = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)
    return KVStore(raw, namespace="unit", fingerprint="f" * 24, producer="test", max_object_bytes=1 << 20)


def _object(kv_store, *, tokens=(5, 6, 7), block_size=32, layers=None, dtype="F32", schema=STATE_SCHEMA):
    layers = layers or {"l0": (2, 32, 8), "l1": (2, 32, 8)}
    tensors = {
        f"kv.{name}": RawTensor(np.zeros((1, *shape), np.float32).tobytes(), dtype, (1, *shape))
        for name, shape in layers.items()
    }
    tensors["token_ids"] = RawTensor(np.asarray(tokens, np.int64).tobytes(), "I64", (len(tokens),))
    state = {"engine": "vllm", "num_tokens": len(tokens), "block_size": block_size}
    _, blob = kv_store.encode("unit", 0, tensors, {"schema": schema, "state": json.dumps(state)}, {})
    return decode_kv_object(blob, fingerprint=kv_store.fingerprint, request_id="unit", attempt=0)


def test_kv_object_checks(kv_store):
    layout = {"l0": (2 * 32 * 8, "F32"), "l1": (2 * 32 * 8, "F32")}
    tensors, n = check_kv_object(_object(kv_store), (5, 6, 7, 8), 32, layout)  # a prefix of the prompt
    assert n == 3 and set(tensors) == {"kv.l0", "kv.l1"}
    cases = [
        (_object(kv_store), (5, 6, 9, 8), MissReason.ITEM_MISMATCH),  # another prompt
        (_object(kv_store), (5, 6), MissReason.ITEM_MISMATCH),  # longer than the prompt
        (_object(kv_store, block_size=16), (5, 6, 7), MissReason.SHAPE_MISMATCH),
        (_object(kv_store, layers={"l0": (2, 32, 8)}), (5, 6, 7), MissReason.SHAPE_MISMATCH),  # a layer short
        (_object(kv_store, layers={"l0": (2, 32, 4), "l1": (2, 32, 4)}), (5, 6, 7), MissReason.SHAPE_MISMATCH),
        (_object(kv_store, dtype="I32"), (5, 6, 7), MissReason.SHAPE_MISMATCH),
        (_object(kv_store, schema="transformers-decode-state"), (5, 6, 7), MissReason.SCHEMA_MISMATCH),
    ]
    for obj, prompt, reason in cases:
        with pytest.raises(ObjectValidationError) as err:
            check_kv_object(obj, prompt, 32, layout)
        assert err.value.reason is reason, (prompt, err.value)
