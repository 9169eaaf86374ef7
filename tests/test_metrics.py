"""Prometheus metrics against the running E|PD stack: the EC outcome counters move exactly as
expected for a hit, a miss and a fallback; latency, token, byte, in-flight and consumer-lag
metrics are exposed in vLLM's ``prefix:name`` style on the API and on the workers, and the
in-flight and lag gauges follow a request the workers hold."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.engines.ec_objects import encoded_to_extra
from shared.media import content_hash_of
from shared.store.ec import ECStore
from shared.store.objects import S3ObjectStore
from shared.store.tensors import tensor_to_raw
from tests.stackutil import GREEDY as _GREEDY
from tests.stackutil import (
    data_url,
    engine_encode,
    metric_value,
    noise_image,
    parse_metrics,
    scrape,
    user_message,
    wait_for,
)
from tests.test_replay import find_case

pytestmark = pytest.mark.slow

GREEDY = {**_GREEDY, "max_tokens": 6}
EC = "epd:ec_lookups_total"


def worker_metrics_url(stack) -> str:
    return f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics"


def ec_counts(stack) -> dict[tuple[str, str, str], float]:
    return {
        (labels["source"], labels["outcome"], labels["reason"]): v
        for name, labels, v in parse_metrics(scrape(worker_metrics_url(stack)))
        if name == EC
    }


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
    store = ECStore(
        S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, epd_stack.bucket),
        namespace=epd_stack.namespace,
        fingerprint=reference_engine.encoder_fingerprint,
        producer="test",
    )
    encoded = engine_encode(reference_engine, [image2])[0]
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


def test_latency_token_byte_in_flight_and_lag_metrics(epd_stack):
    """One request, held: the encoder is paused (SIGSTOP) so the prefill worker takes the job and
    waits for its features. While it waits, the in-flight gauges (API and worker) and the
    worker's ack-pending lag gauge read 1; once the encoder resumes and the request completes,
    they return to 0. Then every latency, token and byte metric moved by this one request."""
    api_url, worker_url = f"{epd_stack.url}/metrics", worker_metrics_url(epd_stack)
    api0, worker0 = scrape(api_url), scrape(worker_url)
    encoder = next(p for p in epd_stack.stack.processes if p.name == "encoder" and p.alive())
    lag = dict(stream=epd_stack.subjects.stream_generate, consumer="prefill")

    def gauges():
        api, worker = scrape(api_url), scrape(worker_url)
        return (
            metric_value(api, "epd:requests_in_flight", service="api"),
            metric_value(worker, "epd:requests_in_flight", service="prefill"),
            metric_value(worker, "epd:consumer_num_ack_pending", **lag),
            metric_value(worker, "epd:consumer_num_pending", **lag),
        )

    with ThreadPoolExecutor(1) as pool:
        os.killpg(encoder.popen.pid, signal.SIGSTOP)
        try:
            future = pool.submit(ask, epd_stack, noise_image(403, (56, 56)))
            # The worker updates its lag every 2 s and waits up to EPD_EC_WAIT_S (30 s) for the
            # encoder before encoding locally: 25 s leave several polls and no fallback.
            wait_for(lambda: gauges()[:3] == (1, 1, 1), 25, "in-flight and ack-pending gauges to read 1")
        finally:
            os.killpg(encoder.popen.pid, signal.SIGCONT)
        body = future.result(timeout=300)
    wait_for(lambda: gauges() == (0, 0, 0, 0), 60, "the gauges to return to 0 after the request")
    api1, worker1 = scrape(api_url), scrape(worker_url)

    def moved(before, after, name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    # API: one more request in every latency histogram, its tokens counted, TPOT in range.
    for name in (
        "epd:time_to_first_token_seconds_count",
        "epd:e2e_request_latency_seconds_count",
        "epd:time_per_output_token_seconds_count",
    ):
        assert moved(api0, api1, name) == 1, name
    tpot = moved(api0, api1, "epd:time_per_output_token_seconds_sum")
    e2e = moved(api0, api1, "epd:e2e_request_latency_seconds_sum")
    assert 0 < tpot < e2e
    assert moved(api0, api1, "epd:generation_tokens_total") == 6
    assert moved(api0, api1, "epd:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert moved(api0, api1, "epd:media_bytes_total", direction="put") > 0  # the new image was stored
    assert moved(api0, api1, "epd:message_bytes_total", kind="generation_job") > 0

    # Worker: queue time, bytes it read and published; the lag gauges are labelled with the
    # worker's stream and durable consumer.
    assert moved(worker0, worker1, "epd:queue_time_seconds_count", stream="generate") == 1
    assert moved(worker0, worker1, "epd:ec_bytes_total", direction="get") > 0
    assert moved(worker0, worker1, "epd:message_bytes_total", kind="token_chunk") > 0
    assert moved(worker0, worker1, "epd:message_bytes_total", kind="final_result") > 0
    series = [labels for name, labels, _ in parse_metrics(worker1) if name == "epd:consumer_num_pending"]
    assert series == [lag], series


def test_consumer_lag_gauges_follow_a_backlog(nats_server):
    """The lag gauges a worker exports count what waits in its stream and what it holds unacked:
    3 jobs queued with nobody consuming -> pending 3; one taken and not acked -> 2 and 1; all
    taken and acked -> back to 0. Each poll starts from -1 ("not polled"), so a gauge that is
    never set fails here instead of reading 0."""
    import asyncio
    import uuid

    from prometheus_client import REGISTRY

    from shared import protocol
    from shared.config import PrefillSettings
    from shared.jetstream import ensure_topology
    from shared.protocol import Subjects
    from shared.topology import Role, Service
    from shared.worker import Handler, WorkerRunner

    class Idle(Handler):
        service = Service.PREFILL
        role = Role.PD
        queue = protocol.WorkQueue.GENERATE
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
        return (
            REGISTRY.get_sample_value("epd:consumer_num_pending", labels),
            REGISTRY.get_sample_value("epd:consumer_num_ack_pending", labels),
        )

    async def poll_once(nc, js):
        from shared import metrics

        for gauge in (metrics.CONSUMER_PENDING, metrics.CONSUMER_ACK_PENDING):
            gauge.labels(labels["stream"], labels["consumer"]).set(-1)  # "not polled yet"
        task = asyncio.create_task(runner._liveness(nc, js, subjects.stream_generate))
        try:  # the first round trip is immediate (the next one 2 s later); 60 s only catch a hang
            async with asyncio.timeout(60):
                while -1 in gauges():
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()
        return gauges()

    async def main():
        import nats

        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            await ensure_topology(js, settings.nats, subjects)
            empty = await poll_once(nc, js)
            for i in range(3):
                await js.publish(subjects.generate_jobs, f"job {i}".encode())
            queued = await poll_once(nc, js)
            psub = await js.pull_subscribe_bind(durable=protocol.CONSUMER_PREFILL, stream=subjects.stream_generate)
            (taken,) = await psub.fetch(1, timeout=30)
            held = await poll_once(nc, js)
            await taken.ack_sync()
            rest = await psub.fetch(2, timeout=30)
            while len(rest) < 2:
                rest += await psub.fetch(2 - len(rest), timeout=30)
            for msg in rest:
                await msg.ack_sync()
            drained = await poll_once(nc, js)
            return empty, queued, held, drained
        finally:
            await nc.close()

    empty, queued, held, drained = asyncio.run(main())
    assert empty == (0, 0)
    assert queued == (3, 0)
    assert held == (2, 1)
    assert drained == (0, 0)
