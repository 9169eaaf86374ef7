"""EC store lifecycle through a running deployment (issue 15): api (with the janitor) + encoder +
prefill (pd) processes on the tiny model, real NATS and SeaweedFS. A bound of a few objects keeps
the namespace small while distinct images stream in; purges (``epd ec purge``) racing requests
never change their tokens, and no worker serves a purged image from its local feature cache."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid

import nats
import pytest

from shared.ec_lifecycle.index import ECIndex
from shared.ec_lifecycle.janitor import list_objects, purge
from shared.protocol import FinalResult, GenerationJob, ImageRef, SamplingSpec, Subjects
from shared.store.ec import ECStore
from shared.store.format import encode_ec_object
from shared.store.objects import S3ObjectStore
from shared.store.tensors import tensor_to_raw
from tests.stackutil import (
    api_tokens,
    engine_encode,
    engine_messages,
    epd_cli,
    final_result,
    metric_value,
    noise_image,
    run_job,
    scrape,
    start_stack,
    wait_for,
)
from tests.test_e2e_epd import reference_tokens

pytestmark = pytest.mark.slow

SIZE = (56, 56)
BOUND_OBJECTS = 4
GRACE_S = 2


@pytest.fixture(scope="module")
def object_size(reference_engine) -> int:
    """Bytes of one EC object of a SIZE image of the tiny model."""
    (item,) = engine_encode(reference_engine, [noise_image(0, SIZE)])
    raw, dtype, shape = tensor_to_raw(item.features)
    return len(
        encode_ec_object(
            raw,
            dtype=dtype,
            shape=shape,
            fingerprint="f" * 24,
            item_hash="0" * 64,
            producer="x" * 24,
            extra={"grid_thw": [1, 4, 4]},
        )
    )


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory, object_size):
    from shared.tools.infra import free_port

    port = free_port()
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("ec-lifecycle-logs"),
        service_env={"prefill": {"EPD_METRICS_PORT": str(port)}},
        EPD_EC_MAX_BYTES=str(BOUND_OBJECTS * object_size + object_size // 2),
        EPD_EC_EVICT_GRACE_S=str(GRACE_S),
        EPD_EC_JANITOR_INTERVAL_S="1",
        EPD_EC_USE_FLUSH_S="0.5",
    )
    running.prefill_metrics_port = port
    running.bound = BOUND_OBJECTS * object_size + object_size // 2
    try:
        yield running
    finally:
        running.stack.stop()


@pytest.fixture(scope="module")
def store(stack, s3_server) -> S3ObjectStore:
    return S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, stack.bucket)


def ec_items(store, stack) -> dict[str, int]:
    return {o.name: o.info.size for o in list_objects(store, stack.namespace) if o.kind == "ec"}


def sources(stack, body) -> dict[str, str]:
    return final_result(stack, body["id"]).ec_sources


def test_distinct_images_stay_under_the_bound_and_a_hot_image_survives(stack, store, reference_engine):
    text = "Describe the image."
    hot = noise_image(100, SIZE)
    want_hot = reference_tokens(reference_engine, text, [hot])
    assert api_tokens(stack, text, [hot])[0] == want_hot
    seen_over = 0
    for i in range(8):
        image = noise_image(200 + i, SIZE)
        assert api_tokens(stack, text, [image])[0] == reference_tokens(reference_engine, text, [image])
        assert api_tokens(stack, text, [hot])[0] == want_hot  # the hot image is hit after every new one
        seen_over = max(seen_over, sum(ec_items(store, stack).values()))
    # The janitor catches up within a few passes: the namespace is under the bound...
    wait_for(lambda: sum(ec_items(store, stack).values()) <= stack.bound, 120, "the namespace under the bound")
    # ...the hot image is still stored, the cold ones went first (the oldest is gone).
    from shared.media import content_hash_of

    items = ec_items(store, stack)
    assert content_hash_of(hot) in items
    assert content_hash_of(noise_image(200, SIZE)) not in items
    # The evicted image asked again (within the encode stream's duplicate window of its first
    # encode job): the encoder encodes it again at once, the worker loads it from the store.
    evicted = noise_image(200, SIZE)
    got, body = api_tokens(stack, text, [evicted])
    assert got == reference_tokens(reference_engine, text, [evicted])
    assert sources(stack, body)[content_hash_of(evicted)] == "store"
    log = stack.log_of("api")
    assert "EC janitor: evicted" in log
    api_metrics = scrape(f"{stack.url}/metrics")
    assert metric_value(api_metrics, "epd:ec_evictions_total", reason="bytes") >= 9 + 1 - BOUND_OBJECTS - 1
    # Hit ratio: the hot image was found stored every time after the first; the new ones never.
    assert metric_value(api_metrics, "epd:ec_lookups_total", source="api", outcome="hit") >= 8
    assert metric_value(api_metrics, "epd:ec_lookups_total", source="api", outcome="miss") >= 9
    # epd ec ls reports the version, its bytes and that it is current. (The evicted image's new
    # encode put the namespace one object over the bound until the janitor's next pass: wait for it.)

    def ls_row() -> dict:
        out = epd_cli(stack.env, "ec", "ls", "--json")
        assert out.returncode == 0, out.stderr
        (row,) = [r for r in json.loads(out.stdout)["fingerprints"] if r["kind"] == "ec"]
        return row

    row = wait_for(lambda: (r := ls_row())["bytes"] <= stack.bound and r, 60, "epd ec ls within the bound")
    assert row["status"] == "current" and row["model"] == "qwen2-vl-tiny"


def test_purged_image_is_recomputed_not_served_from_a_local_copy(stack, store, reference_engine):
    from shared.media import content_hash_of

    text = "What color dominates?"
    image = noise_image(300, SIZE)
    item = content_hash_of(image)
    want = reference_tokens(reference_engine, text, [image])
    got, body = api_tokens(stack, text, [image])
    assert got == want
    got, body = api_tokens(stack, text, [image])
    assert got == want and sources(stack, body)[item] == "local_cache"  # the worker holds it now
    metrics_url = f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics"
    dropped_before = metric_value(scrape(metrics_url), "epd:ec_invalidations_total", holder="feature_cache")
    fingerprint = reference_engine.encoder_fingerprint
    # A mistyped fingerprint is refused (exit 2), naming the known one; nothing is removed.
    typo = fingerprint[:-1] + ("0" if fingerprint[-1] != "0" else "1")
    out = epd_cli(stack.env, "ec", "purge", "--fingerprint", typo)
    assert out.returncode == 2 and out.stderr.startswith(f"epd ec purge: unknown fingerprint '{typo}'"), out
    assert fingerprint in out.stderr and item in ec_items(store, stack)
    # A normal run exits quietly: no "disconnected from NATS" when the CLI closes its connection.
    out = epd_cli(stack.env, "ec", "purge", "--fingerprint", fingerprint, "--dry-run")
    assert out.returncode == 0 and "would remove" in out.stdout, out
    assert f"note: {fingerprint} is a current fingerprint" in out.stdout, out.stdout
    assert "disconnected" not in out.stderr + out.stdout and item in ec_items(store, stack), out
    out = epd_cli(stack.env, "ec", "purge", "--fingerprint", fingerprint, "--json")
    assert out.returncode == 0, out.stderr
    assert "disconnected" not in out.stderr, out.stderr
    removed = json.loads(out.stdout)["removed"]
    assert [(r["kind"], r["fingerprint"]) for r in removed] == [("ec", fingerprint)]
    assert item not in ec_items(store, stack)
    # The worker dropped its copy when the event came (one delivery; wait for it, bounded).
    wait_for(
        lambda: (
            metric_value(scrape(metrics_url), "epd:ec_invalidations_total", holder="feature_cache") > dropped_before
        ),
        60,
        "the worker to drop purged items",
    )
    got, body = api_tokens(stack, text, [image])
    assert got == want
    # Encoded again by the encoder at once, loaded from the store: its new encode job was not
    # dropped as a copy of the first one (same EC key, inside JetStream's duplicate window), which
    # left the worker waiting EPD_EC_WAIT_S and encoding it itself ("recomputed:timeout").
    assert sources(stack, body)[item] == "store"
    assert f"encode job for {item[:12]} " in stack.log_of("api")
    assert not re.search(rf"encode job for {item[:12]} .*already queued", stack.log_of("api"))


def test_request_in_flight_when_its_object_is_purged_recomputes_it(stack, store, reference_engine):
    """The race made deterministic: the API saw the object stored (no encode job), then a purge
    removed it (and the worker's cached copy) before the worker took the job. The worker
    encodes the image itself: same tokens."""
    from shared.media import content_hash_of

    text = "Where is the brightest spot?"
    image = noise_image(500, SIZE)
    item = content_hash_of(image)
    want = reference_tokens(reference_engine, text, [image])
    assert api_tokens(stack, text, [image])[0] == want  # stored, and cached by the worker
    metrics_url = f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics"
    dropped_before = metric_value(scrape(metrics_url), "epd:ec_invalidations_total", holder="feature_cache")
    out = epd_cli(stack.env, "ec", "purge", "--fingerprint", reference_engine.encoder_fingerprint, "--kind", "ec")
    assert out.returncode == 0, out.stderr
    wait_for(
        lambda: (
            metric_value(scrape(metrics_url), "epd:ec_invalidations_total", holder="feature_cache") > dropped_before
        ),
        60,
        "the worker to drop purged items",
    )
    request_id = f"test-purged-in-flight-{uuid.uuid4().hex[:12]}"
    job = GenerationJob(
        request_id=request_id,
        model="qwen2-vl-tiny",
        messages=engine_messages(text, 1),
        images=(
            ImageRef(
                item_hash=item,
                media_key=ECStore(store, namespace=stack.namespace, fingerprint="-", producer="t").media_key(item),
                width=SIZE[0],
                height=SIZE[1],
                encode_queued=False,
            ),
        ),
        fingerprint=reference_engine.encoder_fingerprint,
        sampling=SamplingSpec(temperature=0, max_tokens=12, ignore_eos=True),
        stream=False,
        deadline=time.time() + 120,
        created_at=time.time(),
    )
    outcome = run_job(stack, stack.subjects.generate_jobs, job, timeout=120)
    assert isinstance(outcome.terminal, FinalResult), outcome.terminal
    assert outcome.tokens == want
    assert outcome.terminal.ec_sources[item] == "recomputed:not_found"


def test_purges_racing_requests_still_yield_the_right_tokens(stack, store, reference_engine, nats_server):
    """Purges of the whole version run back to back while requests for the same images go
    through: whatever a request finds (stored, purged before the load, dropped from the cache),
    its tokens equal the reference."""
    text = "Count the objects."
    images = [noise_image(400 + i, SIZE) for i in range(3)]
    want = [reference_tokens(reference_engine, text, [im]) for im in images]
    fingerprint = reference_engine.encoder_fingerprint
    stop = threading.Event()
    purged: list[int] = []

    def purger():
        async def main():
            nc = await nats.connect(nats_server.url)
            try:
                subjects = Subjects(stack.prefix)
                index = await ECIndex.open(nc.jetstream(), subjects.ec_index_bucket)
                while not stop.is_set():
                    result = await purge(
                        nc=nc,
                        subjects=subjects,
                        index=index,
                        store=store,
                        namespace=stack.namespace,
                        by="test",
                        fingerprint=fingerprint,
                        kinds=("ec",),
                    )
                    purged.append(result.objects)
                    await asyncio.sleep(0.2)
            finally:
                await nc.close()

        asyncio.run(main())

    thread = threading.Thread(target=purger, daemon=True)
    thread.start()
    seen: set[str] = set()
    try:
        for _ in range(2):
            for image, tokens in zip(images, want):
                got, body = api_tokens(stack, text, [image])
                assert got == tokens
                seen.update(final_result(stack, body["id"]).ec_sources.values())
    finally:
        stop.set()
        thread.join(timeout=60)
    assert sum(purged) > 0, "no purge removed anything while the requests ran"
    assert seen, seen
