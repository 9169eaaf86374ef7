"""S3ECConnector driven the way vLLM 0.32's scheduler and workers drive it, against a real S3
server (SeaweedFS), without starting an engine: fast, and every decision point is reachable.

The scheduler-side calls follow ``vllm/v1/core/sched/scheduler.py``: ``ensure_cache_available``
(until True) -> ``has_cache_item`` -> ``update_state_after_alloc`` -> ``build_connector_meta``;
the worker side gets that metadata and fills its encoder cache in ``start_load_caches``. The
requests are stand-ins with the attributes the connector reads (``request_id``, ``mm_features``
with ``identifier`` / ``mm_position`` / ``data``); the positions are vLLM's own PlaceholderRange.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import PlaceholderRange

from shared.connectors.common import ConnectorConfig
from shared.connectors.params import EC_ITEMS, EC_SOURCES
from shared.connectors.s3_ec import S3ECConnector
from shared.connectors.s3_ec.metrics import Event, S3ECStats, Timing, Transfer
from shared.connectors.s3_ec.state import LookupOutcome
from shared.fingerprint import encoder_fingerprint
from shared.store.ec import META_FINGERPRINT, META_SCHEMA, ECStore
from shared.store.format import SCHEMA, MissReason
from shared.store.objects import S3ObjectStore
from tests.stackutil import wait_for

HIDDEN = 96  # tiny Qwen2-VL LM width
AK_ENV, SK_ENV = "EPD_TEST_CONNECTOR_AK", "EPD_TEST_CONNECTOR_SK"


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """The tiny Qwen2-VL with other weights (seed 1): same architecture, other version."""
    from shared.tools.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("models-s1") / "qwen2-vl-tiny", arch="qwen2_vl", size="tiny", seed=1
    )


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    monkeypatch.setenv(AK_ENV, s3_server.access_key)
    monkeypatch.setenv(SK_ENV, s3_server.secret_key)
    return s3_server


@pytest.fixture
def bucket(s3_env):
    name = f"vllm-conn-{uuid.uuid4().hex[:12]}"
    S3ObjectStore(s3_env.endpoint, s3_env.access_key, s3_env.secret_key, name).ensure_bucket()
    return name


def extra_config(s3_server, bucket, **more):
    return {
        "endpoint": s3_server.endpoint,
        "bucket": bucket,
        "namespace": "ns",
        "access_key_env": AK_ENV,
        "secret_key_env": SK_ENV,
        **more,
    }


def make_connector(model_dir, ec_role, role, extra):
    """A connector built from what vLLM hands it: an ECTransferConfig and the model config (its
    ``hf_config``: the folder's config.json)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_config = SimpleNamespace(
        model=str(model_dir),
        revision=None,
        dtype=torch.float32,
        hf_config=SimpleNamespace(to_dict=lambda: config),
    )
    ec = ECTransferConfig(
        ec_connector="S3ECConnector",
        ec_connector_module_path="shared.connectors.s3_ec",
        ec_role=ec_role,
        ec_connector_extra_config=extra,
    )
    return S3ECConnector(SimpleNamespace(ec_transfer_config=ec, model_config=model_config), role)


def feature(identifier, n_tokens, offset=5, with_data=True):
    data = {"pixel_values": SimpleNamespace(data=torch.zeros(1))} if with_data else None
    return SimpleNamespace(
        identifier=identifier, modality="image", data=data, mm_position=PlaceholderRange(offset=offset, length=n_tokens)
    )


def request(*features):
    return SimpleNamespace(request_id=f"req-{uuid.uuid4().hex[:8]}", mm_features=list(features))


def schedule(conn, req, timeout=120.0):
    """Call ensure_cache_available the way the scheduler does each step until it admits the request.
    Returns how many steps it was deferred. ``timeout`` only catches a hang."""
    deferred = 0
    deadline = time.monotonic() + timeout
    while not conn.ensure_cache_available(req, 0):
        deferred += 1
        assert time.monotonic() < deadline, "request never admitted"
        time.sleep(0.005)
    return deferred


def allocate_and_load(conn, worker, req):
    """has_cache_item -> update_state_after_alloc -> build_connector_meta -> worker load, as in one
    engine step. Returns (external-load flags, the worker's encoder cache)."""
    flags = [conn.has_cache_item(f.identifier) for f in req.mm_features]
    for i in range(len(req.mm_features)):
        conn.update_state_after_alloc(req, i)
    meta = conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
    cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    return flags, cache


def features_tensor(seed, n_tokens=4):
    return torch.randn(n_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def produce(model_dir, s3_server, bucket, identifier, tensor):
    """Save through a producer's worker-side connector (save_caches after an encoder output)."""
    producer = make_connector(model_dir, "ec_producer", ECConnectorRole.WORKER, extra_config(s3_server, bucket))
    producer.save_caches({identifier: tensor}, identifier)
    return producer


def stats_of(conn) -> S3ECStats:
    """The connector's counters since the last call."""
    return conn.get_ec_connector_stats() or S3ECStats()


HIT, MISS, FALLBACK = LookupOutcome.HIT, LookupOutcome.MISS, LookupOutcome.FALLBACK


def ident() -> str:
    return uuid.uuid4().hex * 2  # 64 hex chars, like a content hash


# -- the happy path: exact bytes, same key scheme and format as the rest of the project ----------
def test_producer_to_consumer_loads_the_exact_tensor(tiny_model_dir, s3_env, bucket):
    item, other = ident(), ident()
    t_item, t_other = features_tensor(1), features_tensor(2)
    produce(tiny_model_dir, s3_env, bucket, item, t_item)
    produce(tiny_model_dir, s3_env, bucket, other, t_other)

    extra = extra_config(s3_env, bucket)
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra)
    worker = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.WORKER, extra)
    req = request(feature(item, 4))
    assert not sched.has_cache_item(item)  # nothing local before the prefetch
    assert schedule(sched, req) >= 1  # deferred while fetching: the step never waits on the network
    flags, cache = allocate_and_load(sched, worker, req)
    assert flags == [True]
    assert torch.equal(cache[item], t_item)
    assert not torch.equal(cache[item], t_other)  # negative control: the tensors differ
    _, params = sched.request_finished(req)
    assert params == {EC_SOURCES: {item: "store"}}
    stats = stats_of(sched)
    assert stats.lookups(HIT) == 1 and stats.bytes(Transfer.GET) == t_item.numel() * 4
    assert len(stats.samples(Timing.FETCH)) == 1

    # One format, one key scheme: the object is a plain EC object under the vLLM fingerprint the
    # API computes from the same folder (EPD_ENGINE=vllm, EPD_DTYPE=float32).
    fp = encoder_fingerprint(tiny_model_dir, dtype="float32", engine="vllm")
    assert sched.fingerprint == fp
    store = ECStore(
        S3ObjectStore(s3_env.endpoint, s3_env.access_key, s3_env.secret_key, bucket),
        namespace="ns",
        fingerprint=fp,
        producer="test",
    )
    obj = store.load(item)
    assert obj.shape == (4, HIDDEN) and obj.dtype == "F32"
    assert torch.equal(torch.frombuffer(bytearray(obj.data), dtype=torch.float32).view(4, HIDDEN), t_item)


def test_producer_reports_items_and_resaves_lost_objects(tiny_model_dir, s3_env, bucket):
    item = ident()
    t = features_tensor(3)
    extra = extra_config(s3_env, bucket)
    sched = make_connector(tiny_model_dir, "ec_producer", ECConnectorRole.SCHEDULER, extra)
    assert not sched.has_cache_item(item)  # a producer always encodes
    req = request(feature(item, 4))
    assert sched.ensure_cache_available(req, 0)
    _, params = sched.request_finished(req)
    assert params[EC_ITEMS][item]["n_tokens"] == 4
    assert params[EC_ITEMS][item]["key"] == f"ns/{sched.fingerprint}/{item}"

    # A repeated request finds the output in vLLM's encoder cache (no encode, no save_caches):
    # start_save_caches stores it again when the store lost it.
    worker = make_connector(tiny_model_dir, "ec_producer", ECConnectorRole.WORKER, extra)
    store = worker.store
    assert not store.exists(item)
    meta = sched.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(mm_features=req.mm_features)])
    )
    assert meta.save_candidates == [item]
    worker.bind_connector_metadata(meta)
    worker.start_save_caches(encoder_cache={item: t})
    assert store.exists(item)


# -- misses and fallbacks: decided before vLLM commits the item; the item is encoded locally ------
def test_missing_object_is_a_miss_and_cached_briefly(tiny_model_dir, s3_env, bucket):
    item = ident()
    sched = make_connector(
        tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket, exists_ttl_s=60)
    )
    req = request(feature(item, 4))
    schedule(sched, req)
    assert not sched.has_cache_item(item)  # -> vLLM schedules the encoder for it
    sched.update_state_after_alloc(req, 0)
    assert sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).loads == []
    assert sched.request_finished(req)[1] == {EC_SOURCES: {item: "recomputed:not_found"}}
    # Within the TTL a second request is not deferred at all (negative answer reused).
    assert schedule(sched, request(feature(item, 4))) == 0
    assert stats_of(sched).lookups(MISS, MissReason.NOT_FOUND) == 2


def _fault_on_load(conn, action, s3_server, bucket):
    """Apply ``action`` to the real stored object right before the connector's GET, i.e. after its
    existence check said yes (the window between has_cache_item's answer and the load)."""
    raw = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)
    original = conn.connector_scheduler.load_item
    fired = []

    def load(identifier):
        key = conn.store.key(identifier)
        if action == "delete":
            raw.delete(key)
        else:
            blob = bytearray(raw.get(key, max_bytes=1 << 30))
            blob[-1] ^= 0xFF  # one bit pattern in the tensor data; S3 metadata stays valid
            raw.put(key, bytes(blob), metadata={META_SCHEMA: SCHEMA, META_FINGERPRINT: conn.fingerprint})
        fired.append(identifier)
        return original(identifier)

    conn.connector_scheduler.load_item = load
    return fired


@pytest.mark.parametrize("action,reason", [("delete", "not_found"), ("corrupt", "checksum_mismatch")])
def test_object_lost_between_existence_check_and_load_falls_back(tiny_model_dir, s3_env, bucket, action, reason):
    item = ident()
    produce(tiny_model_dir, s3_env, bucket, item, features_tensor(4))
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))
    assert sched.store.exists(item)  # the cheap check says yes ...
    fired = _fault_on_load(sched, action, s3_env, bucket)
    req = request(feature(item, 4))
    schedule(sched, req)  # ... the load fails: decided before commit, no exception
    assert fired == [item]
    assert not sched.has_cache_item(item)
    sched.update_state_after_alloc(req, 0)
    assert sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).loads == []
    assert sched.request_finished(req)[1] == {EC_SOURCES: {item: f"recomputed:{reason}"}}
    assert stats_of(sched).lookups(FALLBACK, MissReason(reason)) == 1


def test_stale_positive_existence_answer_falls_back(tiny_model_dir, s3_env, bucket):
    """has_cache_item said yes for an earlier request (answer cached), the object is deleted, the
    next request's load fails: it falls back instead of loading nothing."""
    item = ident()
    produce(tiny_model_dir, s3_env, bucket, item, features_tensor(5))
    extra = extra_config(s3_env, bucket, exists_ttl_s=600, local_cache_bytes=0)
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra)
    worker = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.WORKER, extra)
    first = request(feature(item, 4))
    schedule(sched, first)
    assert allocate_and_load(sched, worker, first)[0] == [True]
    sched.request_finished(first)
    sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))  # evicts (local cache 0)
    assert not sched.has_cache_item(item)

    S3ObjectStore(s3_env.endpoint, s3_env.access_key, s3_env.secret_key, bucket).delete(sched.store.key(item))
    second = request(feature(item, 4))
    schedule(sched, second)
    flags, cache = allocate_and_load(sched, worker, second)
    assert flags == [False] and cache == {}
    assert sched.request_finished(second)[1] == {EC_SOURCES: {item: "recomputed:not_found"}}
    stats = stats_of(sched)
    assert stats.lookups(HIT) == 1 and stats.lookups(FALLBACK, MissReason.NOT_FOUND) == 1


def test_other_model_weights_never_hit(tiny_model_dir, other_model_dir, s3_env, bucket):
    item = ident()
    produce(tiny_model_dir, s3_env, bucket, item, features_tensor(6))
    extra = extra_config(s3_env, bucket)
    # (no reuse of existence answers: the later copy under its key is looked up again)
    other = make_connector(other_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, {**extra, "exists_ttl_s": 0})
    same = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra)
    assert other.fingerprint != same.fingerprint

    schedule(other, request(feature(item, 4)))
    assert not other.has_cache_item(item)
    stats = stats_of(other)
    assert stats.lookups(MISS, MissReason.NOT_FOUND) == 1 and stats.lookups(HIT) == 0
    # Control: the model that produced it does hit.
    schedule(same, request(feature(item, 4)))
    assert same.has_cache_item(item)

    # Even an object copied under the other model's key is refused by validation.
    raw = S3ObjectStore(s3_env.endpoint, s3_env.access_key, s3_env.secret_key, bucket)
    raw.put(
        other.store.key(item),
        raw.get(same.store.key(item), max_bytes=1 << 30),
        metadata={META_SCHEMA: SCHEMA, META_FINGERPRINT: other.fingerprint},
    )
    req = request(feature(item, 4))
    schedule(other, req)
    assert not other.has_cache_item(item)
    other.update_state_after_alloc(req, 0)  # vLLM allocates it for local encoding
    assert other.request_finished(req)[1] == {EC_SOURCES: {item: "recomputed:fingerprint_mismatch"}}


def test_placeholder_count_mismatch_falls_back(tiny_model_dir, s3_env, bucket):
    item = ident()
    produce(tiny_model_dir, s3_env, bucket, item, features_tensor(7, n_tokens=4))
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))
    req = request(feature(item, 6))  # the prompt has room for 6 embeddings, the object has 4
    schedule(sched, req)
    assert not sched.has_cache_item(item)
    assert stats_of(sched).lookups(FALLBACK, MissReason.SHAPE_MISMATCH) == 1


def test_a_families_feature_width_is_checked_exactly(tmp_path_factory, s3_env, bucket):
    """Qwen3-VL's EC objects hold the main and two deepstack layers' features side by side (3 x
    hidden columns, vLLM's layout): an object of that width is used; one of the main features
    alone (the hidden size, which the check used to take for the width) or of twice the width (a
    multiple, which it let through) falls back."""
    from shared.tools.models.tiny import build_tiny_model

    qwen3 = build_tiny_model(tmp_path_factory.mktemp("qwen3") / "qwen3-vl-tiny", arch="qwen3_vl", seed=0)
    hidden = json.loads((qwen3 / "config.json").read_text())["text_config"]["hidden_size"]
    whole, main_only, doubled = ident(), ident(), ident()
    produce(qwen3, s3_env, bucket, whole, torch.randn(4, 3 * hidden))
    produce(qwen3, s3_env, bucket, main_only, torch.randn(4, hidden))
    produce(qwen3, s3_env, bucket, doubled, torch.randn(4, 6 * hidden))
    sched = make_connector(qwen3, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))
    schedule(sched, request(feature(whole, 4)))
    assert sched.has_cache_item(whole)
    for wrong in (main_only, doubled):
        schedule(sched, request(feature(wrong, 4)))
        assert not sched.has_cache_item(wrong)
    assert stats_of(sched).lookups(FALLBACK, MissReason.SHAPE_MISMATCH) == 2


def test_bad_identifier_never_reaches_the_store(tiny_model_dir, s3_env, bucket):
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))
    req = request(feature("../../etc/passwd", 4))
    assert schedule(sched, req) == 0
    assert stats_of(sched).data == {"lookups": {"miss": {"bad_identifier": 1}}}
    producer = produce(tiny_model_dir, s3_env, bucket, "a/b", features_tensor(8))
    assert stats_of(producer).events(Event.SAVE_SKIPPED) == 1


def test_store_down_and_slow_store_fall_back(tiny_model_dir, s3_env, bucket):
    from shared.tools.infra import free_port

    down = make_connector(
        tiny_model_dir,
        "ec_consumer",
        ECConnectorRole.SCHEDULER,
        {**extra_config(s3_env, bucket), "endpoint": f"127.0.0.1:{free_port()}"},
    )
    req = request(feature(ident(), 4))
    schedule(down, req)
    assert stats_of(down).lookups(MISS, MissReason.STORE_ERROR) == 1

    # A fetch that outlasts fetch_timeout_s: the load is held until the test releases it, so the
    # request is admitted (falling back to local encoding) while the fetch is still running.
    item = ident()
    produce(tiny_model_dir, s3_env, bucket, item, features_tensor(9))
    slow = make_connector(
        tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket, fetch_timeout_s=0.5)
    )
    original, release = slow.connector_scheduler.load_item, threading.Event()
    slow.connector_scheduler.load_item = lambda i: (release.wait(300), original(i))[1]
    req = request(feature(item, 4))
    try:
        schedule(slow, req)
        assert not release.is_set()  # admitted without waiting for the fetch
        assert not slow.has_cache_item(item)
        slow.update_state_after_alloc(req, 0)
        assert slow.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).loads == []
        assert slow.request_finished(req)[1] == {EC_SOURCES: {item: "recomputed:timeout"}}
        assert stats_of(slow).lookups(FALLBACK, MissReason.TIMEOUT) == 1
    finally:
        release.set()


def test_item_without_local_input_is_reported_unavailable(tiny_model_dir, s3_env, bucket):
    """vLLM fails what take_unavailable_requests returns; only a request that cannot encode the
    item itself (no pixels in it) ends up there."""
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))
    req = request(feature(ident(), 4, with_data=False))

    def reported():  # one scheduler step: the admission check, then vLLM takes the failed requests
        admitted = sched.ensure_cache_available(req, 0)
        failed = sched.take_unavailable_requests()
        assert failed or not admitted, "admitted without its input, and never reported unavailable"
        return failed

    assert wait_for(reported, 120, "the request to be reported unavailable", interval=0.005) == {req.request_id}
    assert sched.take_unavailable_requests() == set()  # reported once
    ok = request(feature(ident(), 4))
    schedule(sched, ok)
    assert sched.take_unavailable_requests() == set()


def test_a_request_reported_unavailable_stays_unadmitted_until_taken(tiny_model_dir, s3_env, bucket):
    """The unavailable decision holds across admission checks: a later check (before vLLM takes
    the request through take_unavailable_requests) does not admit it without its input."""
    sched = make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))
    req = request(feature(ident(), 4, with_data=False))

    def decided():
        admitted = sched.ensure_cache_available(req, 0)
        assert not admitted, "admitted without its input"
        state = sched.connector_scheduler.request_state(req.request_id)
        return state is not None and state.unavailable  # (white box: the decision is made)

    wait_for(decided, 120, "the miss to be decided", interval=0.005)
    assert sched.ensure_cache_available(req, 0) is False  # every item decided earlier: still not admitted
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.take_unavailable_requests() == {req.request_id}


# -- configuration and metrics -------------------------------------------------------------------
def test_config_is_validated(tiny_model_dir, s3_env, bucket, monkeypatch):
    with pytest.raises(ValueError, match="unknown ec_connector_extra_config"):
        ConnectorConfig.from_extra({"endpoint": "x:1", "secret_key": "inline secrets are refused"})
    with pytest.raises(ValueError, match="namespace"):
        ConnectorConfig.from_extra({"namespace": "a/b"})
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        ConnectorConfig.from_extra({"fetch_timeout_s": "soon"})
    with pytest.raises(ValueError, match="unknown ec_connector_extra_config"):
        ConnectorConfig.from_extra({"s3_endpoint": "x:1", "s3_secret_key": "inline secrets are refused"})
    assert ConnectorConfig.from_extra({"secure": "true", "exists_ttl_s": "1.5"}).store.s3_secure is True
    assert ConnectorConfig.from_extra({"s3_secure": "true"}).store.s3_secure is True
    monkeypatch.delenv(SK_ENV)
    with pytest.raises(ValueError, match=SK_ENV):
        make_connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, extra_config(s3_env, bucket))


def test_stats_reach_prometheus():
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    prom = S3ECConnector.build_prom_metrics(
        SimpleNamespace(ec_transfer_config=None), types, ["model_name", "engine"], {0: ["m-test", "0"]}
    )
    stats = S3ECStats()
    stats.count_lookup(HIT, n=2)
    other = S3ECStats()
    other.count_lookup(FALLBACK, MissReason.CHECKSUM_MISMATCH)
    other.add_bytes(Transfer.GET, 100)
    other.observe(Timing.FETCH, 0.01)
    other.observe(Timing.FETCH, 0.02)
    # the counters cross processes as plain data
    stats.aggregate(S3ECConnector.build_ec_connector_stats(other.data))
    reduced = stats.reduce()
    assert reduced["lookup_hit"] == 2 and reduced["lookup_fallback_checksum_mismatch"] == 1
    assert reduced["bytes_get"] == 100 and reduced["seconds_fetch_n"] == 2
    prom.observe(stats.data, 0)
    value = REGISTRY.get_sample_value
    assert (
        value("epd:ec_connector_lookups_total", {"model_name": "m-test", "engine": "0", "outcome": "hit", "reason": ""})
        == 2
    )
    assert (
        value(
            "epd:ec_connector_lookups_total",
            {"model_name": "m-test", "engine": "0", "outcome": "fallback", "reason": "checksum_mismatch"},
        )
        == 1
    )
    assert value("epd:ec_connector_bytes_total", {"model_name": "m-test", "engine": "0", "direction": "get"}) == 100
    assert value("epd:ec_connector_seconds_count", {"model_name": "m-test", "engine": "0", "op": "fetch"}) == 2


def test_api_process_never_imports_vllm_or_torch():
    """The engine registry names the vLLM engine by a string and the engine module imports vLLM only
    when an engine is built: the API (and anything importing the registry) stays free of both."""
    import subprocess
    import sys

    code = (
        "import sys, services.api.app, shared.engines, shared.engines.vllm_engine, shared.model_worker; "
        "print(','.join(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
