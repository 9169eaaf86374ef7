"""The worker runner hands a job over as soon as JetStream delivers it, idle or not (a real NATS
server; the runner's own pull loop)."""

from __future__ import annotations

import asyncio
import os
import time

from shared import metrics, protocol
from shared.config import EncoderSettings
from shared.jetstream import JetStreamPublisher, connect
from shared.protocol import EncodeJob, ImageRef, Subjects
from shared.topology import Role, Service
from shared.worker import Delivery, Handler, WorkerContext, WorkerRunner
from tests.stackutil import until

REF = ImageRef(item_hash="0" * 64, media_key="m", width=8, height=8)


class Taker(Handler):
    """Records when each job was taken; does nothing else."""

    service = Service.ENCODER
    role = Role.ENCODER
    job_type = EncodeJob
    queue = protocol.WorkQueue.ENCODE
    durable = protocol.CONSUMER_ENCODER
    jobs_metric = metrics.ENCODE_JOBS

    def __init__(self) -> None:
        self.taken: dict[str, float] = {}

    async def setup(self, ctx: WorkerContext) -> None:
        pass

    async def handle(self, job: EncodeJob, delivery: Delivery) -> None:
        self.taken[job.request_id] = time.monotonic()


def test_jobs_sent_one_after_another_after_idle_pulls_are_taken_at_once(nats_server):
    """Rounds of: the runner's pull requests expire with no job (idle), then three jobs, each
    sent once the one before was taken - the pattern in which nats-py's pulls of several jobs
    held ~6% of the jobs for ~430 ms (an orphaned pull request's expiry). Every job must be
    taken well under that (the pull's round trip is ~1 ms)."""
    prefix = f"pull{os.getpid()}"
    settings = EncoderSettings(nats_url=nats_server.url, subject_prefix=prefix, worker_id="pull-worker")
    subjects = Subjects(prefix)
    handler = Taker()

    async def scenario() -> dict[str, float]:
        # Pulls of 0.5 s: an idle pull expires in each round's pause.
        runner = WorkerRunner(handler, settings, concurrency=8, pull_timeout_s=0.5)
        running = asyncio.create_task(runner.run())
        nc = await connect(settings.nats, name="pull-test")
        waits: dict[str, float] = {}
        try:
            js = nc.jetstream(timeout=10)

            async def consuming() -> bool:
                try:
                    await js.consumer_info(subjects.stream_encode, protocol.CONSUMER_ENCODER, timeout=2)
                    return True
                except Exception:  # noqa: BLE001 - not created yet
                    return False

            await until(consuming, 60, "the runner's consumer")
            publisher = JetStreamPublisher(js)
            for rnd in range(12):
                await asyncio.sleep(0.55)  # the scenario itself: longer than a pull, nothing sent
                for k in range(3):
                    rid = f"{prefix}-{rnd}-{k}"
                    sent = time.monotonic()
                    job = EncodeJob(request_id=rid, image=REF, fingerprint="fp", ec_key=f"ns/{rid}", created_at=0.0)
                    await publisher.publish(subjects.encode_jobs, job, request_id=rid, msg_id=rid)
                    await until(lambda rid=rid: rid in handler.taken, 30, f"job {rid} taken")
                    waits[rid] = handler.taken[rid] - sent
        finally:
            runner.request_stop()
            await asyncio.wait_for(running, 60)
            await nc.close()
        return waits

    waits = asyncio.run(scenario())
    assert len(waits) == 36
    slow = {rid: round(w, 3) for rid, w in waits.items() if w > 0.25}
    assert not slow, f"jobs taken late (s after their publish): {slow}"


def test_a_stop_gives_up_the_outstanding_pull_and_hands_back_what_it_received(nats_server):
    """Ctrl-C of an idle worker: its pull (30 s here) is given up at once, not waited out; and a
    job the server delivered to a pull no fetch waits on any more is handed back (``nak``) when
    the worker stops pulling, so another worker takes it now, not after the ack wait (60 s here)."""
    import json

    prefix = f"stop{os.getpid()}"
    settings = EncoderSettings(nats_url=nats_server.url, subject_prefix=prefix, worker_id="stop-worker", ack_wait_s=60)
    subjects = Subjects(prefix)
    stream, durable = subjects.stream_encode, protocol.CONSUMER_ENCODER

    async def scenario() -> tuple[float, int | None, float]:
        runner = WorkerRunner(Taker(), settings, pull_timeout_s=30.0)
        running = asyncio.create_task(runner.run())
        nc = await connect(settings.nats, name="stop-test")
        try:
            js = nc.jetstream(timeout=10)

            async def pulling() -> bool:  # the runner's 30-s pull is outstanding at the server
                try:
                    return (await js.consumer_info(stream, durable, timeout=2)).num_waiting >= 1
                except Exception:  # noqa: BLE001 - not created yet
                    return False

            await until(pulling, 60, "the runner's pull")
            asked = time.monotonic()
            runner.request_stop()
            await asyncio.wait_for(running, 60)
            stopped_in = time.monotonic() - asked

            # A job sits in a pull subscription's queue, received for a pull no fetch waits on
            # (sent by hand: what a pull the stop gave up receives).
            psub = await js.pull_subscribe_bind(durable=durable, stream=stream)
            rid = f"{prefix}-handed-back"
            job = EncodeJob(request_id=rid, image=REF, fingerprint="fp", ec_key=f"ns/{rid}", created_at=0.0)
            await JetStreamPublisher(js).publish(subjects.encode_jobs, job, request_id=rid, msg_id=rid)
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
                json.dumps({"batch": 1, "expires": 5_000_000_000}).encode(),
                reply=psub._deliver,  # the subscription's inbox (nats-py has no public name for it)
            )
            await until(lambda: psub.pending_msgs >= 1, 30, "the job in the subscription's queue")
            handed = time.monotonic()
            await WorkerRunner(Taker(), settings)._stop_pulling(psub)
            again = await js.pull_subscribe_bind(durable=durable, stream=stream)
            try:
                msgs = await again.fetch(1, timeout=20)
            except TimeoutError:
                return stopped_in, None, 0.0
            await msgs[0].ack()
            return stopped_in, msgs[0].metadata.num_delivered, time.monotonic() - handed
        finally:
            if not running.done():
                runner.request_stop()
            await nc.close()

    stopped_in, delivered, after = asyncio.run(scenario())
    assert stopped_in < 10, f"the worker took {stopped_in:.1f}s to stop: it waited out its 30-s pull"
    assert delivered == 2, "the job in the queue was not handed back (it would come back after the 60-s ack wait)"
    assert after < 20, after
