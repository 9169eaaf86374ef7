"""Prometheus metrics against the running E|PD stack: the EC outcome counters move exactly as
expected for a hit, a miss and a fallback; latency, token, byte, in-flight and consumer-lag
metrics are exposed in vLLM's ``prefix:name`` style on the API and on the workers."""

from __future__ import annotations

import httpx
import pytest

from shared.ecstore.store import ECStore
from shared.ecstore.tensors import encoded_to_extra, tensor_to_raw
from shared.media import content_hash_of
from shared.objectstore import S3ObjectStore
from tests.stackutil import data_url, noise_image, user_message
from tests.test_replay import find_case

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True, return_token_ids=True)
EC = "epd:ec_lookups_total"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, labels): value}."""
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").replace('"', "").split(",") if p)
        out[(name, pairs)] = float(value)
    return out


def value(samples, name: str, **labels: str) -> float:
    want = {(k, v) for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def ec_counts(stack) -> dict[tuple[str, str, str], float]:
    samples = scrape(f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics")
    return {(dict(ls)["source"], dict(ls)["outcome"], dict(ls)["reason"]): v
            for (n, ls), v in samples.items() if n == EC}


def delta(before: dict, after: dict) -> dict:
    keys = set(before) | set(after)
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys if after.get(k, 0.0) != before.get(k, 0.0)}


def ask(stack, image) -> dict:
    resp = stack.chat([user_message("Describe the image.", [data_url(image)])], **GREEDY)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_ec_outcome_counters_for_a_hit_a_miss_and_a_fallback(epd_stack, s3_server, reference_engine):
    # Hit: a new image is encoded by the encoder; the prefill worker loads it from the store.
    image = noise_image(401, (56, 56))
    item = content_hash_of(image)
    before = ec_counts(epd_stack)
    rid = ask(epd_stack, image)["id"]
    moved = delta(before, ec_counts(epd_stack))
    assert moved.pop(("store", "hit", ""), 0) == 1
    # The worker may have looked once before the encoder finished (a not_found miss, then it waits).
    assert moved.pop(("store", "miss", "not_found"), 0) in (0, 1)
    assert moved == {}, moved  # nothing recomputed, no cache hit
    assert find_case(epd_stack, rid).final.ec_sources == {item: "store"}

    # Hit in the worker's local cache: the same image again touches the store not at all.
    before = ec_counts(epd_stack)
    ask(epd_stack, image)
    assert delta(before, ec_counts(epd_stack)) == {("local_cache", "hit", ""): 1}

    # Miss and fallback: a corrupt EC object in the store is a miss with its reason, and the
    # worker recomputes the features locally (counted with the same reason).
    image2 = noise_image(402, (56, 56))
    item2 = content_hash_of(image2)
    store = ECStore(S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, epd_stack.bucket),
                    namespace=epd_stack.namespace, fingerprint=reference_engine.encoder_fingerprint, producer="test")
    encoded = reference_engine.encode([image2])[0]
    raw, dtype, shape = tensor_to_raw(encoded.features)
    store.save(item2, raw, dtype=dtype, shape=shape, extra=encoded_to_extra(encoded))
    key = store.key(item2)
    blob = bytearray(store.store.get(key, max_bytes=1 << 30))
    blob[-3] ^= 0xFF
    store.store.put(key, bytes(blob), metadata=store.store.stat(key).metadata)
    before = ec_counts(epd_stack)
    rid2 = ask(epd_stack, image2)["id"]
    assert delta(before, ec_counts(epd_stack)) == {
        ("store", "miss", "checksum_mismatch"): 1,
        ("recomputed", "hit", "checksum_mismatch"): 1,
    }
    assert find_case(epd_stack, rid2).final.ec_sources == {item2: "recomputed:checksum_mismatch"}


def test_latency_token_byte_and_lag_metrics_are_exposed(epd_stack):
    api_url = f"{epd_stack.url}/metrics"
    worker_url = f"http://127.0.0.1:{epd_stack.prefill_metrics_port}/metrics"
    api0, worker0 = scrape(api_url), scrape(worker_url)
    body = ask(epd_stack, noise_image(403, (56, 56)))
    api1 = scrape(api_url)
    worker1 = scrape(worker_url)  # the lag gauges are set when the worker starts, then every 5 s

    def moved(before, after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # API: one more request in every latency histogram, its tokens counted, TPOT in range.
    for name in ("epd:time_to_first_token_seconds_count", "epd:e2e_request_latency_seconds_count",
                 "epd:time_per_output_token_seconds_count"):
        assert moved(api0, api1, name) == 1, name
    tpot = moved(api0, api1, "epd:time_per_output_token_seconds_sum")
    e2e = moved(api0, api1, "epd:e2e_request_latency_seconds_sum")
    assert 0 < tpot < e2e
    assert moved(api0, api1, "epd:generation_tokens_total") == 6
    assert moved(api0, api1, "epd:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert moved(api0, api1, "epd:media_bytes_total", direction="put") > 0  # the new image was stored
    assert moved(api0, api1, "epd:message_bytes_total", kind="generation_job") > 0
    assert value(api1, "epd:requests_in_flight", service="api") == 0

    # Worker: queue time, bytes it read and published, in-flight, consumer lag.
    assert moved(worker0, worker1, "epd:queue_time_seconds_count", stream="generate") == 1
    assert moved(worker0, worker1, "epd:ec_bytes_total", direction="get") > 0
    assert moved(worker0, worker1, "epd:message_bytes_total", kind="token_chunk") > 0
    assert moved(worker0, worker1, "epd:message_bytes_total", kind="final_result") > 0
    assert value(worker1, "epd:requests_in_flight", service="prefill") == 0
    lag = [ls for n, ls in worker1 if n == "epd:consumer_num_pending"]
    assert lag and dict(lag[0])["consumer"] == "prefill" and dict(lag[0])["stream"] == epd_stack.subjects.stream_generate
    assert value(worker1, "epd:consumer_num_pending", consumer="prefill") == 0


def test_consumer_lag_gauges_follow_a_backlog(nats_server):
    """The lag gauges a worker exports count what waits in its stream and what it holds unacked:
    3 jobs queued with nobody consuming -> pending 3; one taken and not acked -> 2 and 1."""
    import asyncio
    import uuid

    from prometheus_client import REGISTRY

    from shared import protocol
    from shared.config import PrefillSettings
    from shared.jetstream import ensure_topology
    from shared.protocol import Subjects
    from shared.worker import Handler, WorkerRunner

    class Idle(Handler):
        role = "prefill"
        stream_attr = "stream_generate"
        durable = protocol.CONSUMER_PREFILL

        async def setup(self, ctx):  # never called: this test does not consume
            raise AssertionError

        async def handle(self, delivery):
            raise AssertionError

    prefix = f"lag{uuid.uuid4().hex[:8]}"
    settings = PrefillSettings(nats_url=nats_server.url, subject_prefix=prefix, stream_max_bytes=8 * 1024**2)
    subjects = Subjects(prefix)
    runner = WorkerRunner(Idle(), settings)
    labels = {"stream": subjects.stream_generate, "consumer": protocol.CONSUMER_PREFILL}

    def gauges():
        return (REGISTRY.get_sample_value("epd:consumer_num_pending", labels),
                REGISTRY.get_sample_value("epd:consumer_num_ack_pending", labels))

    async def poll_once(js):
        from shared import metrics

        for gauge in (metrics.CONSUMER_PENDING, metrics.CONSUMER_ACK_PENDING):
            gauge.labels(labels["stream"], labels["consumer"]).set(-1)  # "not polled yet"
        task = asyncio.create_task(runner._poll_lag(js, subjects.stream_generate))
        try:  # the first poll is immediate, the next one 5 s later
            for _ in range(100):
                await asyncio.sleep(0.05)
                if -1 not in gauges():
                    break
        finally:
            task.cancel()
        return gauges()

    async def main():
        import nats

        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            await ensure_topology(js, settings, subjects)
            empty = await poll_once(js)
            for i in range(3):
                await js.publish(subjects.generate_jobs, f"job {i}".encode())
            queued = await poll_once(js)
            psub = await js.pull_subscribe_bind(durable=protocol.CONSUMER_PREFILL, stream=subjects.stream_generate)
            (taken,) = await psub.fetch(1, timeout=5)
            held = await poll_once(js)
            await taken.ack()
            return empty, queued, held
        finally:
            await nc.close()

    empty, queued, held = asyncio.run(main())
    assert empty == (0, 0)
    assert queued == (3, 0)
    assert held == (2, 1)
