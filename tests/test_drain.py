"""Scale-down that loses nothing (issue 44, item 1): a worker told to stop hands back the jobs it
holds but has not started and the jobs routed to it, so other workers take them at once - not
after the ack wait (60 s here) - and finishes the job it runs (a real NATS server, the runner's
own loops)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, ClassVar

import msgspec
import pytest

from services.api.service import WorkerView
from shared import metrics, protocol
from shared.config import EncoderSettings, PrefillSettings, WorkerSettings
from shared.jetstream import JetStreamPublisher, connect
from shared.protocol import EncodeJob, GenerationJob, ImageRef, SamplingSpec, Subjects, WorkerHeartbeat
from shared.routed_jobs import CLAIM_FALLBACK, RoutingClaims
from shared.topology import Role, Service
from shared.worker import Delivery, Handler, WorkerContext, WorkerRunner
from tests.stackutil import until

#: the ack wait of these tests: a job that came back only through it would take this long
ACK_WAIT_S = 60
#: how soon the handed-back jobs must reach the other worker (loose: a loaded machine)
HANDED_BACK_WITHIN_S = 15


class Gated:
    """One job at a time starts (``Delivery.start``) and runs until ``release``; the others wait
    for it, not started - as jobs queued for an engine slot or an encoder's pixels."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.started: list[str] = []
        self.done: list[str] = []
        self.release = asyncio.Event()
        self._slot = asyncio.Semaphore(1)

    async def run(self, request_id: str, delivery: Delivery) -> None:
        self.entered.append(request_id)
        async with self._slot:
            delivery.start()
            self.started.append(request_id)
            await self.release.wait()
            self.done.append(request_id)


class Taker:
    """Records the jobs it took and when."""

    def __init__(self) -> None:
        self.taken: dict[str, float] = {}

    async def run(self, request_id: str, delivery: Delivery) -> None:
        self.taken[request_id] = time.monotonic()


class _Handler(Handler):
    behaviour: Any

    def __init__(self, behaviour: Any) -> None:
        self.behaviour = behaviour

    async def setup(self, ctx: WorkerContext) -> None:
        pass

    async def handle(self, job: Any, delivery: Delivery) -> None:
        await self.behaviour.run(job.request_id, delivery)


class Encodes(_Handler):
    service = Service.ENCODER
    role = Role.ENCODER
    job_type = EncodeJob
    queue = protocol.WorkQueue.ENCODE
    durable = protocol.CONSUMER_ENCODER
    jobs_metric = metrics.ENCODE_JOBS


class Generates(_Handler):
    service = Service.PREFILL
    role = Role.PD
    job_type = GenerationJob
    queue = protocol.WorkQueue.GENERATE
    durable = protocol.CONSUMER_PREFILL
    jobs_metric = metrics.GENERATION_JOBS


class RoutedGenerates(Generates):
    routable: ClassVar[bool] = True


def _encode_job(rid: str) -> EncodeJob:
    ref = ImageRef(item_hash=rid.encode().hex().ljust(64, "0")[:64], media_key="m", width=8, height=8)
    return EncodeJob(request_id=rid, image=ref, fingerprint="fp", ec_key=f"ns/{rid}", created_at=0.0)


def _generation_job(rid: str) -> GenerationJob:
    return GenerationJob(
        request_id=rid,
        model="m",
        messages=[],
        images=(),
        fingerprint="",
        sampling=SamplingSpec(),
        stream=False,
        deadline=time.time() + 300,
        created_at=time.time(),
    )


async def _start(handler: Handler, settings: WorkerSettings, concurrency: int) -> tuple[WorkerRunner, asyncio.Task]:
    runner = WorkerRunner(handler, settings, concurrency=concurrency, pull_timeout_s=0.5)
    return runner, asyncio.create_task(runner.run())


async def _consumer_exists(js: Any, stream: str, durable: str) -> bool:
    try:
        await js.consumer_info(stream, durable, timeout=2)
        return True
    except Exception:  # noqa: BLE001 - not created yet
        return False


def test_a_stopping_worker_hands_back_what_it_has_not_started_and_finishes_what_it_runs(nats_server):
    """Worker A holds four encode jobs: one started, three waiting for it. Stopped, A gives the
    three back at once (worker B takes them long before the 60-s ack wait), finishes the started
    one within its drain, and B never gets that one."""
    prefix = f"drain{os.getpid()}"
    subjects = Subjects(prefix)

    def settings(worker_id: str) -> EncoderSettings:
        return EncoderSettings(
            nats_url=nats_server.url, subject_prefix=prefix, worker_id=worker_id, ack_wait_s=ACK_WAIT_S, drain_s=120
        )

    async def scenario() -> None:
        gated, taker = Gated(), Taker()
        a, a_run = await _start(Encodes(gated), settings("a"), concurrency=4)
        nc = await connect(settings("t").nats, name="drain-test")
        b_run: asyncio.Task | None = None
        try:
            js = nc.jetstream(timeout=10)
            await until(lambda: _consumer_exists(js, subjects.stream_encode, protocol.CONSUMER_ENCODER), 60, "consumer")
            publisher = JetStreamPublisher(js)
            rids = [f"{prefix}-{i}" for i in range(4)]
            for rid in rids:
                await publisher.publish(subjects.encode_jobs, _encode_job(rid), request_id=rid, msg_id=rid)
            await until(lambda: len(gated.entered) == 4 and len(gated.started) == 1, 30, "A holding all four jobs")
            assert a.drain_timeout_s == 120  # EPD_DRAIN_S
            b, b_run = await _start(Encodes(taker), settings("b"), concurrency=4)
            (running,) = gated.started
            unstarted = set(rids) - {running}

            asked = time.monotonic()
            a.request_stop()
            await until(lambda: set(taker.taken) == unstarted, HANDED_BACK_WITHIN_S, "B taking the unstarted jobs")
            handed_back_s = max(taker.taken.values()) - asked
            assert not a_run.done()  # still finishing its job
            gated.release.set()
            await asyncio.wait_for(a_run, 30)
            assert gated.done == [running]
            info = await js.consumer_info(subjects.stream_encode, protocol.CONSUMER_ENCODER)
            assert info.num_pending == 0 and info.num_ack_pending == 0  # all acked, nothing to redeliver
            assert running not in taker.taken
            print(f"unstarted jobs taken elsewhere {handed_back_s:.2f} s after the stop (ack wait {ACK_WAIT_S} s)")
            b.request_stop()
            await asyncio.wait_for(b_run, 30)
        finally:
            gated.release.set()
            for task in (a_run, b_run):
                if task is not None and not task.done():
                    task.cancel()
            await nc.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("phase", ["held", "queued"])
def test_a_stopping_worker_sends_its_routed_jobs_to_the_shared_queue(nats_server, phase):
    """Jobs the API routed to worker A: one it runs, one it holds unstarted (``held``: A takes two
    at once) or leaves in its own routed consumer (``queued``: A takes one at a time), one more in
    its consumer. Stopped, A moves the ones it will not run to the shared queue (each once: it wins
    their routing claims as ``@fallback``), where worker B takes them at once."""
    prefix = f"droute{os.getpid()}{phase}"
    subjects = Subjects(prefix)

    def settings(worker_id: str) -> PrefillSettings:
        return PrefillSettings(
            nats_url=nats_server.url, subject_prefix=prefix, worker_id=worker_id, ack_wait_s=ACK_WAIT_S, drain_s=120
        )

    async def scenario() -> None:
        gated, taker = Gated(), Taker()
        a, a_run = await _start(RoutedGenerates(gated), settings("a"), concurrency=2 if phase == "held" else 1)
        nc = await connect(settings("t").nats, name="drain-routed-test")
        b_run: asyncio.Task | None = None
        try:
            js = nc.jetstream(timeout=10)
            routed = subjects.routed_consumer("a")
            await until(lambda: _consumer_exists(js, subjects.stream_generate, routed), 60, "A's routed consumer")
            publisher = JetStreamPublisher(js)
            rids = [f"{prefix}-{i}" for i in range(3)]
            for rid in rids:
                job = _generation_job(rid)
                await publisher.publish(subjects.generate_routed("a"), job, request_id=rid, msg_id=rid)
            held = 2 if phase == "held" else 1
            await until(lambda: len(gated.entered) == held and len(gated.started) == 1, 30, "A holding its jobs")
            b, b_run = await _start(Generates(taker), settings("b"), concurrency=4)
            (running,) = gated.started
            others = set(rids) - {running}

            asked = time.monotonic()
            a.request_stop()
            await until(lambda: set(taker.taken) == others, HANDED_BACK_WITHIN_S, "B taking A's other routed jobs")
            handed_s = max(taker.taken.values()) - asked
            claims = await RoutingClaims.open(js, subjects, settings("t").nats)
            for rid in others:
                assert (await claims.get(rid)).value == CLAIM_FALLBACK
            gated.release.set()
            await asyncio.wait_for(a_run, 30)
            assert gated.done == [running] and running not in taker.taken
            info = await js.consumer_info(subjects.stream_generate, routed)
            assert info.num_pending == 0 and info.num_ack_pending == 0
            print(f"routed jobs ({phase}) taken from the shared queue {handed_s:.2f} s after the stop")
            b.request_stop()
            await asyncio.wait_for(b_run, 30)
        finally:
            gated.release.set()
            for task in (a_run, b_run):
                if task is not None and not task.done():
                    task.cancel()
            await nc.close()

    asyncio.run(scenario())


def test_a_draining_worker_leaves_the_health_count_at_once() -> None:
    """``/health`` counts the workers that take work: a stopping worker's "draining" beat takes it
    out (not ``EPD_WORKER_STALE_S`` after its last beat); its earlier beat counted."""
    view = WorkerView(stale_s=10.0)
    beat = WorkerHeartbeat(
        role="encoder",
        worker_id="e1",
        fingerprint="fp",
        model="m",
        engine="transformers",
        in_flight=0,
        sent_at=time.time(),
    )
    view.update(beat)
    assert [hb.worker_id for hb in view.live()["encoder"]] == ["e1"]
    view.update(msgspec.structs.replace(beat, draining=True, sent_at=time.time()))
    assert view.live() == {}
