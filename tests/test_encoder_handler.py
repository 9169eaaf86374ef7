"""The encoder handler without a broker (``shared.worker.settle``, what the runner does with a message):
idempotency, poison jobs, retries (fs-backed store, real engine)."""

from __future__ import annotations

import time

import pytest

from services.encoder.handler import EncoderHandler
from shared import protocol
from shared.config import EncoderSettings
from shared.errors import StoreError
from shared.jetstream import PendingAck
from shared.media import content_hash_of
from shared.protocol import ECFailed, ECReady, EncodeJob, ImageRef, Subjects
from shared.store.ec import ECStore
from shared.store.objects import LocalDirObjectStore
from shared.worker import Action, Delivery, WorkerContext, settle
from tests.stackutil import noise_image, png_bytes


class RecordingPublisher:
    def __init__(self):
        self.sent: list[tuple[str, protocol.Message]] = []

    async def publish(self, subject, msg, *, request_id, msg_id=None, deadline=None):
        self.sent.append((subject, msg))
        return True

    async def send(self, subject, msg, *, request_id):
        self.sent.append((subject, msg))
        return PendingAck(None, timeout_s=1.0, doing="recording")


async def _handler(tmp_path, tiny_model_dir, engine, **settings) -> EncoderHandler:
    """An encoder handler on an fs store in ``tmp_path``, set up, with a recording publisher."""
    settings = EncoderSettings(
        model_path=tiny_model_dir, store_backend="fs", store_fs_root=tmp_path, max_deliver=3, **settings
    )
    store = ECStore(LocalDirObjectStore(tmp_path), namespace="t", fingerprint=engine.encoder_fingerprint, producer="w1")
    h = EncoderHandler(settings, engine=engine, store=store)
    publisher = RecordingPublisher()
    await h.setup(WorkerContext(settings, Subjects("t"), publisher))
    h.publisher = publisher
    return h


@pytest.fixture
async def handler(tmp_path, tiny_model_dir, reference_engine):
    h = await _handler(tmp_path, tiny_model_dir, reference_engine)
    yield h
    await h.close()


def _job(handler, image, *, fingerprint=None, media=True):
    item = content_hash_of(image)
    key = handler.store.put_media(item, png_bytes(image)) if media else f"t/media/{item}"
    ref = ImageRef(item_hash=item, media_key=key, width=image.width, height=image.height)
    return EncodeJob(
        request_id="r1",
        image=ref,
        fingerprint=fingerprint or handler.fingerprint,
        ec_key=handler.store.key(item),
        created_at=time.time(),
    )


def _delivery(job, n=1, max_deliver=3):
    return Delivery(
        data=protocol.encode(job), subject="t.encode.jobs", headers={}, num_delivered=n, max_deliver=max_deliver
    )


async def test_encodes_then_is_idempotent(handler):
    job = _job(handler, noise_image(1, (56, 56)))
    verdict = await settle(handler, _delivery(job))
    assert verdict.action is Action.ACK
    ((subject, ready),) = handler.publisher.sent
    assert isinstance(ready, ECReady) and ready.encode_s > 0
    assert subject == f"t.ec.ready.{handler.fingerprint}.{job.image.item_hash}"
    assert handler.store.load(job.image.item_hash).n_tokens == ready.n_tokens

    # Redelivered (or duplicated) job: announced again, not recomputed.
    verdict = await settle(handler, _delivery(job, n=2))
    assert verdict.action is Action.ACK
    again = handler.publisher.sent[-1][1]
    assert isinstance(again, ECReady) and again.encode_s == 0.0


async def test_poison_jobs_are_terminated_with_an_event(handler):
    missing = _job(handler, noise_image(2, (56, 56)), media=False)
    verdict = await settle(handler, _delivery(missing))
    assert verdict.action is Action.TERM
    failed = handler.publisher.sent[-1][1]
    assert isinstance(failed, ECFailed) and failed.code == "media_missing"

    foreign = _job(handler, noise_image(3, (56, 56)), fingerprint="0" * 24)
    verdict = await settle(handler, _delivery(foreign))
    assert verdict.action is Action.TERM
    assert handler.publisher.sent[-1][1].code == "fingerprint_mismatch"

    garbage = Delivery(data=b"\x00garbage", subject="t.encode.jobs", headers={}, num_delivered=1, max_deliver=3)
    sent = len(handler.publisher.sent)
    assert (await settle(handler, garbage)).action is Action.TERM
    assert len(handler.publisher.sent) == sent  # no event: there is no job to tell


async def test_transient_failures_retry_then_give_up(handler, monkeypatch):
    job = _job(handler, noise_image(4, (56, 56)))

    def broken_put(*args, **kwargs):
        raise StoreError("store down")

    monkeypatch.setattr(handler.store.store, "put", broken_put)
    verdict = await settle(handler, _delivery(job, n=1))
    assert verdict.action is Action.NAK and verdict.delay_s > 0
    assert not any(isinstance(m, ECFailed) for _, m in handler.publisher.sent)
    verdict = await settle(handler, _delivery(job, n=3))  # last attempt
    assert verdict.action is Action.TERM
    failed = handler.publisher.sent[-1][1]
    assert isinstance(failed, ECFailed) and "3 attempts" in failed.message


async def test_jobs_in_flight_hold_decoded_images_within_the_pixel_budget(tmp_path, tiny_model_dir, reference_engine):
    """Many encode jobs at once (EPD_ENCODE_JOBS_IN_FLIGHT): the images held decoded never exceed
    EPD_ENCODE_PIXEL_BUDGET, and every job still completes (their encodes share forwards)."""
    import asyncio

    budget = 3 * 56 * 56  # three 56x56 images at a time
    h = await _handler(tmp_path, tiny_model_dir, reference_engine, encode_pixel_budget=budget)
    held, most = 0, 0
    load_image = h.image

    async def counting_image(ref):
        nonlocal held, most
        image = await load_image(ref)
        held += ref.width * ref.height
        most = max(most, held)
        await asyncio.sleep(0.05)  # hold it while the others arrive
        return image

    original_produce = h.producer.produce

    async def produce_then_release(item, image):
        nonlocal held
        try:
            return await original_produce(item, image)
        finally:
            held -= image.width * image.height

    h.image = counting_image
    h.producer.produce = produce_then_release
    try:
        jobs = [_job(h, noise_image(40 + i, (56, 56))) for i in range(8)]
        verdicts = await asyncio.gather(*(settle(h, _delivery(job)) for job in jobs))
    finally:
        await h.close()
    assert [v.action for v in verdicts] == [Action.ACK] * 8
    assert 0 < most <= budget, most
    assert most > 56 * 56  # negative control: more than one at a time when the budget allows


async def test_a_job_stored_by_another_worker_while_it_waited_is_not_encoded_again(
    tmp_path, tiny_model_dir, reference_engine
):
    """A job waiting for the pixel budget (a burst) whose item another worker stored meanwhile (a PD
    worker that stole the encode, then released its claim) announces the stored object and encodes
    nothing (seen in P11: the encoder encoded 18 stolen videos again)."""
    import asyncio

    h = await _handler(tmp_path, tiny_model_dir, reference_engine, encode_pixel_budget=56 * 56)
    produced: list[str] = []
    original_produce = h.producer.produce

    async def counting_produce(item, image):
        produced.append(item)
        return await original_produce(item, image)

    h.producer.produce = counting_produce
    image = noise_image(77, (56, 56))
    job = _job(h, image)
    try:
        held = await h.pixel_budget.acquire(56 * 56)  # the budget is taken: the job waits
        waiting = asyncio.create_task(settle(h, _delivery(job)))
        deadline = time.monotonic() + 30
        while not h.pixel_budget._waiters:  # the job looked in the store (nothing) and waits for the budget
            assert time.monotonic() < deadline, "the job never waited for the pixel budget"
            await asyncio.sleep(0.01)
        # another worker stores the item meanwhile (its own encode, written to the same store)
        other = await _handler(tmp_path / "other", tiny_model_dir, reference_engine)
        other.store = h.store
        other.producer.store = h.store
        await other.producer.produce(job.image.item_hash, image)
        await other.close()
        h.pixel_budget.release(held)
        verdict = await asyncio.wait_for(waiting, 60)
    finally:
        await h.close()
    assert verdict.action == Action.ACK
    assert produced == []  # not encoded again
    (ready,) = [m for _, m in h.publisher.sent if isinstance(m, ECReady)]
    assert ready.item_hash == job.image.item_hash
