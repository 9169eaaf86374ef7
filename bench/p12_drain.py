"""P12: how soon a stopping worker's jobs reach another worker (issue 44, scale-down).

Worker A holds four jobs - one started (it runs until released), three waiting for it, as jobs
queued for an engine slot - and worker B pulls the same queue. A is stopped (SIGTERM's
``request_stop``); measured: the time from the stop until B took all three. The same for jobs
routed to A (``EPD_ROUTING=affinity``): one A runs, two left in its own routed consumer.

Side by side in one run: the runner as it is, and with the hand-back switched off (the runner of
before issue 44: it held the three until its drain ended - ``EPD_DRAIN_S``, the default 60 s - then
they came back one ack wait later, ``EPD_ACK_WAIT_S`` = 4 s, after the last ``in_progress``; routed
ones when the API's watchdog found the worker gone). A real NATS server (``EmbeddedNats``),
the runner's own loops; median and spread of ``--reps``.

Run: ``.venv/bin/python bench/p12_drain.py [--reps 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from typing import Any

from shared import metrics, protocol
from shared.config import EncoderSettings, PrefillSettings, WorkerSettings
from shared.jetstream import JetStreamPublisher, connect
from shared.protocol import EncodeJob, GenerationJob, ImageRef, SamplingSpec, Subjects
from shared.tools.infra import EmbeddedNats
from shared.topology import Role, Service
from shared.worker import Delivery, Handler, WorkerContext, WorkerRunner

ACK_WAIT_S = 4.0  # the default EPD_ACK_WAIT_S


class _Gated(Handler):
    """One job runs (started) until ``release``; the others wait for it, not started. Or, with
    ``take``, records the jobs taken (worker B)."""

    def __init__(self, take: bool = False) -> None:
        self.take = take
        self.taken: dict[str, float] = {}
        self.entered = 0
        self.started = 0
        self.release = asyncio.Event()
        self._slot = asyncio.Semaphore(1)

    async def setup(self, ctx: WorkerContext) -> None:
        pass

    async def handle(self, job: Any, delivery: Delivery) -> None:
        if self.take:
            self.taken[job.request_id] = time.monotonic()
            return
        self.entered += 1
        async with self._slot:
            delivery.start()
            self.started += 1
            await self.release.wait()


class _Encodes(_Gated):
    service = Service.ENCODER
    role = Role.ENCODER
    job_type = EncodeJob
    queue = protocol.WorkQueue.ENCODE
    durable = protocol.CONSUMER_ENCODER
    jobs_metric = metrics.ENCODE_JOBS


class _Generates(_Gated):
    service = Service.PREFILL
    role = Role.PD
    job_type = GenerationJob
    queue = protocol.WorkQueue.GENERATE
    durable = protocol.CONSUMER_PREFILL
    jobs_metric = metrics.GENERATION_JOBS


class _RoutedGenerates(_Generates):
    routable = True


async def _until(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.005)


def _job(kind: str, rid: str) -> EncodeJob | GenerationJob:
    if kind == "shared":
        ref = ImageRef(item_hash=uuid.uuid4().hex * 2, media_key="m", width=8, height=8)
        return EncodeJob(request_id=rid, image=ref, fingerprint="fp", ec_key=f"ns/{rid}", created_at=0.0)
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


async def _once(url: str, kind: str, hand_back: bool) -> float:
    """Seconds from A's stop until B took A's other jobs."""
    prefix = "d" + uuid.uuid4().hex[:8]
    subjects = Subjects(prefix)
    cls: type[WorkerSettings] = EncoderSettings if kind == "shared" else PrefillSettings

    def settings(worker_id: str) -> WorkerSettings:
        return cls(
            nats_url=url,
            subject_prefix=prefix,
            worker_id=worker_id,
            ack_wait_s=ACK_WAIT_S,
            stream_max_bytes=8 * 1024**2,
        )

    a_handler = _Encodes() if kind == "shared" else _RoutedGenerates()
    b_handler = _Encodes(take=True) if kind == "shared" else _Generates(take=True)
    a = WorkerRunner(a_handler, settings("a"), concurrency=4 if kind == "shared" else 1, pull_timeout_s=0.5)
    if not hand_back:  # the runner of before: nothing handed back, nothing moved
        a._hand_back_unstarted = lambda: None  # type: ignore[method-assign]  # the control

        async def _nothing(*_: Any) -> None:
            return None

        a.routing.hand_over = _nothing  # type: ignore[method-assign]  # the control
    a_run = asyncio.create_task(a.run())
    nc = await connect(settings("t").nats, name="bench-drain")
    b_run = None
    try:
        js = nc.jetstream(timeout=10)
        publisher = JetStreamPublisher(js)
        subject = subjects.encode_jobs if kind == "shared" else subjects.generate_routed("a")
        n = 4 if kind == "shared" else 3
        await asyncio.sleep(0.5)  # (A's consumers created)
        await _until(lambda: a_handler.started == 0)
        for i in range(n):
            rid = f"{prefix}-{i}"
            await publisher.publish(subject, _job(kind, rid), request_id=rid, msg_id=rid)
        await _until(lambda: a_handler.started == 1 and a_handler.entered == (4 if kind == "shared" else 1))
        b = WorkerRunner(b_handler, settings("b"), concurrency=4, pull_timeout_s=0.5)
        b_run = asyncio.create_task(b.run())
        await asyncio.sleep(1.0)  # B pulling
        asked = time.monotonic()
        a.request_stop()
        await _until(lambda: len(b_handler.taken) >= n - 1, timeout=120)
        await asyncio.sleep(0.05)
        took = sorted(b_handler.taken.values())[n - 2] - asked  # the last of A's n - 1 other jobs
        a_handler.release.set()
        await asyncio.wait_for(a_run, 60)
        b.request_stop()
        await asyncio.wait_for(b_run, 60)
        return took
    finally:
        a_handler.release.set()
        for task in (a_run, b_run):
            if task is not None and not task.done():
                task.cancel()
        await nc.close()


async def _main(reps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp, max_file_store=2**50) as nats_server:
        for kind in ("shared", "routed"):
            for hand_back in (True, False):
                if kind == "routed" and not hand_back:
                    # nobody moves them without the API's watchdog (it falls back once the worker's
                    # heartbeat is EPD_ROUTING_TAKEOVER_S old): no B run to time here
                    continue
                runs = [await _once(nats_server.url, kind, hand_back) for _ in range(reps)]
                label = "hand-back" if hand_back else "before (ack wait)"
                print(
                    f"{kind:7s} {label:18s} median {statistics.median(runs):.3f} s "
                    f"[{min(runs):.3f}-{max(runs):.3f}] over {reps}"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(_main(args.reps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
