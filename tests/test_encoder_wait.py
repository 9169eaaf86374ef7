"""A generating worker waiting for its encoder (``services.prefill.features.EncoderWait``) when the
encoder's ``ECReady`` never reaches it: the event is core NATS, lost when it is published while the
worker's connection moves to another NATS server (the multi-host SIGSTOP case lost one that way and
the request waited out ``ec_wait_s``, 30 s). The wait looks in the store meanwhile. Real NATS and S3."""

from __future__ import annotations

import asyncio
import time

import nats
import numpy as np

from services.prefill.features import EncoderWait
from shared.config import WorkerSettings
from shared.jetstream import JetStreamPublisher
from shared.protocol import ImageRef, Subjects
from shared.store.ec import ECStore
from shared.store.format import MissReason
from shared.worker import WorkerContext

FP = "c" * 24
ITEM = "d" * 64
WAIT_S = 5.0
LOOK_S = 0.5


async def test_a_waiter_that_missed_the_ready_event_finds_the_object_in_the_store(nats_server, s3_store):
    nc = await nats.connect(nats_server.url)
    try:
        ctx = WorkerContext(WorkerSettings(), Subjects("encwait"), JetStreamPublisher(nc.jetstream()), nc)
        store = ECStore(s3_store, namespace="ns", fingerprint=FP, producer="test")
        encoder = EncoderWait(ctx, FP, WAIT_S, store)
        encoder.LOOK_S = LOOK_S  # (the class's 2 s: a shorter test)
        ref = ImageRef(item_hash=ITEM, media_key="media/x", width=8, height=8)

        # control: nothing stored and no event - the wait runs out
        async with encoder.watching(ref) as sub:
            assert sub is not None
            started = time.monotonic()
            assert await encoder.wait(sub, ref) is MissReason.TIMEOUT
            assert time.monotonic() - started >= WAIT_S - 0.1

        # the encoder stored the object; its ECReady was never heard
        async with encoder.watching(ref) as sub:
            assert sub is not None
            features = np.ones((4, 8), np.float32)
            await asyncio.to_thread(store.save, ITEM, features.tobytes(), dtype="F32", shape=features.shape)
            started = time.monotonic()
            assert await encoder.wait(sub, ref) is None  # (None: stored, load it)
            took = time.monotonic() - started
        assert took < WAIT_S / 2, took
        print(f"found in the store {took:.2f}s into the wait (looks every {LOOK_S}s)")
    finally:
        await nc.close()
