"""Encode stealing (``EPD_ENCODE_STEALS``, ``shared.ec_lifecycle.claims``): a generating worker
encodes an item whose encode job no encoder has started, stores and announces it; the encoder
then skips that job; an item an encoder started is never stolen. Real NATS and S3."""

from __future__ import annotations

import asyncio
import signal
import types
from concurrent.futures import ThreadPoolExecutor

import msgspec
import nats
import pytest

from services.prefill.features import EncoderFleet, Stealer, StealRefused
from shared import metrics
from shared.ec_lifecycle.claims import Claim, EncodeClaims
from shared.media import content_hash_of
from shared.protocol import ECReady, FinalResult, ImageRef, WorkerHeartbeat
from shared.tools.infra import free_port
from shared.worker import Action, settle
from tests.fault_workers import ENCODE_DELAY_ENV
from tests.fault_workers import MODULE as FAULT_WORKERS
from tests.stackutil import (
    api_tokens,
    final_result,
    metric_value,
    noise_image,
    opened_claims,
    scrape,
    start_stack,
    wait_for,
    worker_id_of,
)
from tests.test_e2e_epd import reference_tokens
from tests.test_encoder_failure import _wait_for_log
from tests.test_encoder_handler import _delivery, _handler, _job

TEXT = "Describe the image."


def _beat(worker: str, slots: int, free: int, fingerprint: str = "fp") -> WorkerHeartbeat:
    return WorkerHeartbeat(
        role="encoder",
        worker_id=worker,
        fingerprint=fingerprint,
        model="m",
        engine="transformers",
        in_flight=slots - free,
        sent_at=0.0,
        slots=slots,
        free_slots=free,
    )


def test_the_encoders_are_the_bound_when_every_live_one_is_full_or_none_is_alive() -> None:
    """What gates a steal (``EncoderFleet``): an encoder with a free slot takes the job itself."""
    now = [100.0]
    fleet = EncoderFleet("fp", stale_s=6.0, clock=lambda: now[0])
    fleet.beat(_beat("e1", 16, 0))
    assert not fleet.bound()  # not listening: never
    fleet.listening_since = now[0]
    assert fleet.bound()  # e1 full
    fleet.beat(_beat("e2", 16, 3))
    assert not fleet.bound()  # e2 has room
    fleet.beat(_beat("e2", 16, 0))
    assert fleet.bound()
    fleet.beat(_beat("e3", 0, 0))  # an older encoder, its slots unknown: counts as free
    assert not fleet.bound()
    fleet.beat(_beat("e3", 4, 0, fingerprint="other"))  # another model version's: not counted
    assert not fleet.bound()
    now[0] += 7.0  # every beat stale: no encoder alive
    assert fleet.bound()
    fleet.beat(_beat("e1", 16, 1))  # back, with room
    assert not fleet.bound()
    # just started listening, nothing heard yet: "none alive" only after a stale period
    fresh = EncoderFleet("fp", stale_s=6.0, clock=lambda: now[0])
    fresh.listening_since = now[0]
    assert not fresh.bound()
    now[0] += 6.0
    assert fresh.bound()


def test_a_draining_encoder_counts_as_gone_and_with_none_alive_steals_are_not_limited() -> None:
    """Encoders scaled to zero (issue 44): an encoder's "draining" beat with no job left takes it out
    of the fleet at once (not a stale period later; one still finishing a job counts as full), and
    with no encoder alive every waiting item may be stolen -
    the ``EPD_ENCODE_STEALS`` limit would queue each image request behind the others' encodes."""
    now = [100.0]
    fleet = EncoderFleet("fp", stale_s=6.0, clock=lambda: now[0])
    fleet.listening_since = now[0] - 10
    fleet.beat(_beat("e1", 16, 5))
    assert not fleet.bound() and not fleet.none_alive()
    # draining, still finishing a job it started: alive, and full (takes nothing from the queue)
    fleet.beat(msgspec.structs.replace(_beat("e1", 16, 5), draining=True, in_flight=1))
    assert fleet.bound() and not fleet.none_alive()
    fleet.beat(msgspec.structs.replace(_beat("e1", 16, 5), draining=True, in_flight=0))  # done: gone
    assert fleet.none_alive() and fleet.bound()
    fleet.beat(_beat("e2", 16, 0))  # another one comes back (full): bound, but alive
    assert fleet.bound() and not fleet.none_alive()

    ctx = types.SimpleNamespace(settings=types.SimpleNamespace(worker_id="pd"))
    stealer = Stealer(ctx, store=None, fingerprint="fp", slots=1, after_s=0.0, fleet=fleet)  # type: ignore[arg-type]  # no store: has_room reads none
    stealer.running = 1  # its one steal slot taken
    assert not stealer.has_room()
    assert asyncio.run(stealer.try_steal(ImageRef(item_hash="0" * 64, media_key="m", width=8, height=8), "r")) is (
        StealRefused.BUSY
    )
    now[0] += 7.0  # e2's beat stale: none alive - the limit is lifted
    assert fleet.none_alive() and stealer.has_room()


def test_an_encoders_heartbeat_says_its_slots_and_how_many_are_free(tmp_path, tiny_model_dir, reference_engine):
    async def main():
        h = await _handler(tmp_path, tiny_model_dir, reference_engine, encode_jobs_in_flight=3)
        try:
            hb = h.heartbeat(h.settings)
            assert (hb.role, hb.slots, hb.free_slots) == ("encoder", 3, 3)
            h.in_flight = 3
            assert h.heartbeat(h.settings).free_slots == 0
        finally:
            await h.close()

    asyncio.run(main())


def test_a_steal_needs_an_unclaimed_item_and_an_encoder_yields_only_to_a_steal(claims_env) -> None:
    async def main():
        async with opened_claims(EncodeClaims, claims_env) as claims:
            # an encoder started item a: no steal; another encoder (a redelivery) still encodes it
            assert await claims.for_encoder("fp", "a", "enc-1") is None
            assert await claims.steal("fp", "a", "pd-1") is None
            assert await claims.for_encoder("fp", "a", "enc-2") is None
            # item b stolen first: the encoder yields to the stealer, and only one stealer wins
            assert (first := await claims.steal("fp", "b", "pd-1")) is not None
            assert await claims.steal("fp", "b", "pd-2") is None
            held = await claims.for_encoder("fp", "b", "enc-1")
            assert held is not None and (held.owner, held.stealer) == ("pd-1", True)
            # the lease: a renewal moves the revision, so a waiter that saw the old one cannot take it over
            renewed = await claims.renew("fp", "b", "pd-1", first)
            assert renewed is not None and renewed != first
            assert await claims.steal("fp", "b", "pd-2", lapsed=first) is None
            # not renewed since: of two waiters taking it over, exactly one wins
            taken = await claims.steal("fp", "b", "pd-2", lapsed=renewed)
            assert taken is not None and await claims.steal("fp", "b", "pd-3", lapsed=renewed) is None
            assert (await claims.get("fp", "b")) == Claim("pd-2", True)
            # the old stealer's renewal and release leave the new owner's claim alone
            assert await claims.renew("fp", "b", "pd-1", renewed) is None
            await claims.release("fp", "b", renewed)
            assert (await claims.get("fp", "b")) == Claim("pd-2", True)
            # released by its owner (announced): stealable again, e.g. after an eviction
            await claims.release("fp", "b", taken)
            assert await claims.steal("fp", "b", "pd-2") is not None
            # claims are per model version
            assert await claims.steal("other-fp", "a", "pd-1") is not None

    asyncio.run(main())


async def test_an_encoder_acks_a_stolen_item_s_job_without_encoding(
    claims_env, tmp_path, tiny_model_dir, reference_engine
):
    url, subjects, settings = claims_env
    nc = await nats.connect(url)
    h = await _handler(tmp_path, tiny_model_dir, reference_engine)
    try:
        h.claims = await EncodeClaims.open(nc.jetstream(), subjects, settings)
        stolen, started = noise_image(11, (56, 56)), noise_image(12, (56, 56))
        job = _job(h, stolen)
        assert await h.claims.steal(job.fingerprint, job.image.item_hash, "pd-9") is not None
        before = metrics.ENCODE_JOBS.labels("stolen")._value.get()
        verdict = await settle(h, _delivery(job))
        assert verdict.action is Action.ACK
        assert h.publisher.sent == []  # the stealer announces it, not this encoder
        assert not h.store.exists(job.image.item_hash)
        assert metrics.ENCODE_JOBS.labels("stolen")._value.get() == before + 1
        # negative control: an item no one stole is encoded, announced, and its claim released
        other = _job(h, started)
        verdict = await settle(h, _delivery(other))
        assert verdict.action is Action.ACK
        ((_, ready),) = h.publisher.sent
        assert isinstance(ready, ECReady) and h.store.exists(other.image.item_hash)
        assert await h.claims.get(other.fingerprint, other.image.item_hash) is None
    finally:
        await h.close()
        await nc.close()


@pytest.mark.slow
def test_a_pd_worker_steals_a_queued_encode_but_not_a_started_one(
    nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path
):
    """The one encoder (one job at a time) sleeps inside the encode of image A, so image B's
    encode job stays queued: the PD worker steals B, and B's request completes with B's right
    tokens while A's still waits (A was started: never stolen). The encoder, killed and replaced,
    then encodes A; B's job is not encoded again."""
    metrics_port = free_port()
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path / "logs",
        service_env={"encoder": {ENCODE_DELAY_ENV: "600"}, "prefill": {"EPD_METRICS_PORT": str(metrics_port)}},
        service_modules={"encoder": FAULT_WORKERS},
        EPD_ENCODE_JOBS_IN_FLIGHT="1",
        EPD_ENCODE_STEALS="1",
        EPD_ENCODE_STEAL_AFTER_S="0.2",
        EPD_ACK_WAIT_S="3",
        EPD_MAX_DELIVER="10",
        EPD_EC_WAIT_S="300",
    )
    stack = running.stack
    prefill_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        slow = next(p for p in stack.processes if p.name == "encoder")
        pd = next(p for p in stack.processes if p.name == "prefill")
        a, b = noise_image(81, (64, 48)), noise_image(82, (64, 48))
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(api_tokens, running, TEXT, [a], timeout=600)
            _wait_for_log(slow, "fault injection", timeout=120)  # the encoder started A, and holds it
            tokens_b, body_b = pool.submit(api_tokens, running, TEXT, [b], timeout=120).result(timeout=180)
            assert tokens_b == reference_tokens(reference_engine, TEXT, [b])
            assert not first.done()  # A waits for its encoder: it was not stolen
            ready_b = [m for m in running.messages_of("stream_events", ECReady, body_b["id"])]
            assert [m.producer for m in ready_b] == [worker_id_of(pd, "prefill")], ready_b

            slow.stop(sig=signal.SIGKILL)
            fast = stack.add("encoder", index=1, extra_env={ENCODE_DELAY_ENV: "0"})
            tokens_a, body_a = first.result(timeout=600)
        assert tokens_a == reference_tokens(reference_engine, TEXT, [a])
        assert final_result(running, body_a["id"]).ec_sources[content_hash_of(a)] == "store"
        assert final_result(running, body_b["id"]).ec_sources[content_hash_of(b)] == "stolen"
        # B's queued job reaches the new encoder: found stored, announced, not encoded again
        _wait_for_log(fast, f"item {content_hash_of(b)[:12]} already stored", timeout=120)
        steals = wait_for(
            lambda: metric_value(scrape(prefill_metrics), "epd:ec_steals_total", outcome="announced"),
            30,
            "the steal to be counted",
        )
        assert steals == 1
        assert metric_value(scrape(prefill_metrics), "epd:ec_steals_total", outcome="stolen") == 1
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_killed_stealer_s_item_is_taken_over_once_its_claim_lapses(
    nats_server, s3_server, tiny_model_dir, reference_engine, tmp_path
):
    """No encoder at all: the one PD worker steals the image's encode and hangs inside its engine's
    encode (fault injection), and is SIGKILLed there, mid-steal. A second PD worker gets the
    request's generation job redelivered, finds the dead stealer's claim no longer renewed and takes
    the item over after ``STEAL_LEASE_S``: the request completes with its right tokens, the item
    stolen by the second worker - where without the lease it waited ``EPD_EC_WAIT_S`` (300 s here,
    past this test's bound)."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path / "logs",
        services=["api", "prefill"],
        roles={"prefill": 1},
        service_env={"prefill": {ENCODE_DELAY_ENV: "600"}},
        service_modules={"prefill": FAULT_WORKERS},
        EPD_ENCODE_STEALS="1",
        EPD_ENCODE_STEAL_AFTER_S="0.2",
        EPD_ACK_WAIT_S="3",
        EPD_MAX_DELIVER="100",  # claims live ack_wait x max_deliver x 2: the dead stealer's claim outlives the test
        EPD_EC_WAIT_S="300",
    )
    stack = running.stack
    try:
        stealer = next(p for p in stack.processes if p.name == "prefill")
        image = noise_image(84, (64, 48))
        item = content_hash_of(image)
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(api_tokens, running, TEXT, [image], timeout=200)
            _wait_for_log(stealer, f"stealing the encode of {item[:12]}", timeout=120)
            _wait_for_log(stealer, "fault injection", timeout=60)  # inside the stolen encode, for 600 s
            assert not request.done()
            stealer.stop(sig=signal.SIGKILL)
            taker = stack.add("prefill", index=1, extra_env={ENCODE_DELAY_ENV: "0"})
            tokens, body = request.result(timeout=150)
        assert tokens == reference_tokens(reference_engine, TEXT, [image])
        _wait_for_log(taker, f"took over the encode of {item[:12]}", timeout=10)
        # (not final_result(): it waits for every job to be acked, and no encoder takes the encode job)
        (final,) = running.messages_of("stream_results", FinalResult, body["id"])
        assert final.ec_sources == {item: "stolen"}
        ready = [m for m in running.messages_of("stream_events", ECReady, body["id"]) if m.item_hash == item]
        assert [m.producer for m in ready] == [worker_id_of(taker, "prefill")]
    finally:
        stack.stop()


def test_a_silent_encoder_is_gone_after_no_encoder_after_s_a_drained_one_at_once() -> None:
    """``EPD_NO_ENCODER_AFTER_S`` (``absent_s``): an encoder that stops beating (crashed, paused)
    counts as gone only once no encoder has beaten for that long; one that drained (its last beat
    says so) at once; a worker that just started waits that long before it calls none alive."""
    now = [100.0]
    fleet = EncoderFleet("fp", stale_s=6.0, clock=lambda: now[0], absent_s=30.0)
    fleet.listening_since = now[0]
    assert not fleet.none_alive()
    now[0] += 29.0
    assert not fleet.none_alive()  # not heard from any yet: 29 s < 30 s
    now[0] += 1.0
    assert fleet.none_alive()
    fleet.beat(_beat("e1", 16, 5))
    now[0] += 10.0  # e1 silent 10 s: stale, but not absent long enough
    assert not fleet.none_alive()
    now[0] += 20.0
    assert fleet.none_alive()
    fleet.beat(_beat("e1", 16, 5))  # back
    assert not fleet.none_alive()
    fleet.beat(msgspec.structs.replace(_beat("e1", 16, 5), draining=True, in_flight=0))  # drained: gone at once
    assert fleet.none_alive()
    fleet.beat(_beat("e2", 16, 5))  # a new one
    assert not fleet.none_alive()
