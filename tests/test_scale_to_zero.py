"""Encoders scaled to zero (issue 44, item 2): with no encoder alive a generating worker encodes an
image itself at once instead of waiting ``EPD_EC_WAIT_S`` for an encoder that is not there; the
scaling signal says encoders are wanted meanwhile, and an encoder that comes back takes the queue."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import nats

from services.prefill.features import EncoderFleet, EncoderWait
from shared.jetstream import subscribe_typed
from shared.media import content_hash_of
from shared.protocol import ECFailed, ECReady, FinalResult, ImageRef, Subjects, WorkerHeartbeat
from shared.store.format import MissReason
from shared.worker import WorkerContext
from tests.stackutil import api_tokens, metric_value, noise_image, scrape, start_stack, wait_for
from tests.test_e2e_epd import reference_tokens

TEXT = "Describe the image."
#: the stack's wait for an encoder: a request that waited it out fails this test's bound
EC_WAIT_S = 120


def _beat(worker: str, *, draining: bool = False, in_flight: int = 0) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        role="encoder",
        worker_id=worker,
        fingerprint="fp",
        model="m",
        engine="transformers",
        in_flight=in_flight,
        sent_at=time.time(),
        slots=4,
        free_slots=4,
        draining=draining,
    )


def test_a_job_stops_waiting_once_no_encoder_is_alive(nats_server) -> None:
    """Without steals (``EPD_ENCODE_STEALS=0``): a job waiting for an encoder gives up at once
    when the encoders' heartbeats say none is alive (a draining encoder done with its jobs
    included), and waits as before while one is - also a draining one still finishing what it
    started (negative controls: it waits out ``wait_s``)."""
    subjects = Subjects(f"zero{uuid.uuid4().hex[:8]}")
    ref = ImageRef(item_hash="1" * 64, media_key="m", width=8, height=8, encode_queued=True)

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            ctx = WorkerContext(settings=None, subjects=subjects, publisher=None, nc=nc)  # type: ignore[arg-type]  # wait() reads neither
            fleet = EncoderFleet("fp", stale_s=6.0)
            fleet.listening_since = time.monotonic() - 10
            fleet.beat(_beat("e1"))
            wait = EncoderWait(ctx, "fp", 1.5, store=None, fleet=fleet)  # type: ignore[arg-type]  # no look in the store within 1.5 s
            async with await subscribe_typed(nc, subjects.ec_any("fp", ref.item_hash), ECReady, ECFailed) as sub:
                started = time.monotonic()
                assert await wait.wait(sub, ref) is MissReason.TIMEOUT  # e1 alive: waited for it
                assert time.monotonic() - started >= 1.4
                # draining but still finishing a job it started (the waited-for item may be it): alive
                fleet.beat(_beat("e1", draining=True, in_flight=1))
                assert await wait.wait(sub, ref) is MissReason.TIMEOUT
                fleet.beat(_beat("e1", draining=True))  # done: gone
                started = time.monotonic()
                assert await wait.wait(sub, ref) is MissReason.NO_ENCODER
                assert time.monotonic() - started < 1.0
        finally:
            await nc.close()

    asyncio.run(main())


def test_image_requests_with_no_encoder_are_served_without_the_encoder_wait(
    nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path
):
    """E|PD scaled to zero encoders (the one encoder SIGTERMed): three image requests at once are
    each answered well inside ``EPD_EC_WAIT_S`` (120 s) with their right tokens, the images encoded
    by the PD worker; the API's encoder signal shows the queued encode jobs; an encoder started
    again takes that queue (its lag falls to 0)."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path / "logs",
        EPD_EC_WAIT_S=str(EC_WAIT_S),
        EPD_ENCODE_STEALS="0",  # the wait itself ends (with steals, they take the images: tests/test_encode_steal.py)
    )
    stack = running.stack
    metrics_url = f"{running.url}/metrics"
    try:
        encoder = next(p for p in stack.processes if p.name == "encoder")
        encoder.stop(sig=signal.SIGTERM)
        images = [noise_image(90 + i, (64, 48)) for i in range(3)]
        started = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda im: api_tokens(running, TEXT, [im], timeout=EC_WAIT_S * 2), images))
        took = time.monotonic() - started
        assert took < EC_WAIT_S / 2, f"{took:.1f}s: the requests waited for an encoder"
        for image, (tokens, body) in zip(images, answers):
            assert tokens == reference_tokens(reference_engine, TEXT, [image])
            (final,) = running.messages_of("stream_results", FinalResult, body["id"])
            assert final.ec_sources == {content_hash_of(image): f"recomputed:{MissReason.NO_ENCODER.value}"}
        lag = wait_for(
            lambda: metric_value(scrape(metrics_url), "epd:queue_lag_jobs", role="encoder") >= 3 or None,
            30,
            "the encode jobs in the encoder signal",
        )
        assert lag
        assert metric_value(scrape(metrics_url), "epd:pending_work_seconds", role="encoder") > 0
        print(f"3 image requests with no encoder: {took:.1f}s (EPD_EC_WAIT_S {EC_WAIT_S})")

        stack.add("encoder", index=1)
        wait_for(
            lambda: metric_value(scrape(metrics_url), "epd:queue_lag_jobs", role="encoder") == 0,
            120,
            "the new encoder to take the queue",
        )
    finally:
        stack.stop()
