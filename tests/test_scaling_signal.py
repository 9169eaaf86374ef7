"""The scaling signal per worker role (issue 44 item 3; ``services.api.scaling``): against a real NATS
server, the lag counts every consumer of a role's queue (routed ones too), the cost per job comes
from recent jobs' stage timings, and the pending work rises and falls with the backlog; the API
exports it on ``/metrics``."""

from __future__ import annotations

import asyncio
import time
import uuid

import nats
from prometheus_client import REGISTRY

from services.api.scaling import DEFAULT_JOB_COST_S, JobCosts, ScalingSignal
from shared import protocol
from shared.config import PrefillSettings
from shared.jetstream import ensure_topology
from shared.protocol import ECReady, FinalResult, Subjects, Timing
from shared.routed_jobs import ensure_routed_consumer
from shared.topology import Service
from tests.stackutil import until


def _gauge(name: str, role: Service) -> float | None:
    return REGISTRY.get_sample_value(name, {"role": role.value})


def _ready(item: str, encode_s: float, *, encoded: bool = True) -> ECReady:
    return ECReady(
        request_id="r",
        item_hash=item,
        fingerprint="fp",
        ec_key=f"ns/{item}",
        n_tokens=4,
        nbytes=10,
        producer="e1",
        encode_s=encode_s,
        created_at=time.time(),
        encode_started_at=time.time() if encoded else 0.0,
    )


def _final(**timings: float) -> FinalResult:
    return FinalResult(
        request_id="r",
        attempt=1,
        token_ids=[1],
        text="x",
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=1,
        timings=timings,
    )


def test_job_costs_are_the_median_of_recent_jobs_per_role() -> None:
    costs = JobCosts(window=3)
    assert costs.cost(Service.ENCODER) == DEFAULT_JOB_COST_S  # nothing seen yet
    costs.encoded(_ready("a", 0.1))
    costs.encoded(_ready("b", 9.0, encoded=False))  # found stored, not encoded: no cost
    costs.encoded(_ready("c", 0.3))
    costs.encoded(_ready("d", 0.2))
    assert costs.cost(Service.ENCODER) == 0.2
    for s in (0.5, 0.6, 0.7, 0.8):  # the window keeps the last 3
        costs.encoded(_ready("e", s))
    assert costs.cost(Service.ENCODER) == 0.7
    # E|PD: the PD worker prefills and decodes; E|P|D: the decode worker decodes
    costs.finished(_final(**{Timing.PREFILL: 0.2, Timing.DECODE: 0.5}))
    assert costs.cost(Service.PREFILL) == 0.7 and costs.cost(Service.DECODE) == DEFAULT_JOB_COST_S
    costs = JobCosts()
    costs.finished(_final(**{Timing.PREFILL: 0.2, Timing.DECODE: 0.5, Timing.DECODE_FIRST_TOKEN: 0.01}))
    assert costs.cost(Service.PREFILL) == 0.2 and costs.cost(Service.DECODE) == 0.5


def test_the_pending_work_rises_and_falls_with_the_backlog(nats_server) -> None:
    """5 generation jobs queued (3 shared, 2 routed to a worker) and 4 encode jobs, encodes costing
    0.5 s (announced on NATS) and generations 0.25 s: lag 5 and 4, pending work 1.25 s and 2 s;
    consumed and acked: 0."""
    prefix = f"scale{uuid.uuid4().hex[:8]}"
    settings = PrefillSettings(nats_url=nats_server.url, subject_prefix=prefix, stream_max_bytes=8 * 1024**2)
    subjects = Subjects(prefix)

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        signal = ScalingSignal(subjects, poll_s=3600)  # polled by hand
        try:
            js = nc.jetstream()
            await ensure_topology(js, settings.nats, subjects)
            routed = await ensure_routed_consumer(js, settings.nats, subjects, "w1")
            await signal.start(nc)
            for i in range(3):
                await js.publish(subjects.generate_jobs, f"job {i}".encode())
            for i in range(2):
                await js.publish(subjects.generate_routed("w1"), f"routed {i}".encode())
            for i in range(4):
                await js.publish(subjects.encode_jobs, f"encode {i}".encode())
            for item in ("a", "b"):
                await nc.publish(subjects.ec_ready("fp", item), protocol.encode(_ready(item, 0.5)))
            signal.costs.finished(_final(**{Timing.PREFILL: 0.1, Timing.DECODE: 0.15}))
            await until(lambda: _costs_heard(signal), 30, "the encodes' costs")

            await signal.poll()
            assert _gauge("epd:queue_lag_jobs", Service.PREFILL) == 5
            assert _gauge("epd:queue_lag_jobs", Service.ENCODER) == 4
            assert _gauge("epd:job_cost_seconds", Service.ENCODER) == 0.5
            assert _gauge("epd:pending_work_seconds", Service.PREFILL) == 5 * 0.25
            assert _gauge("epd:pending_work_seconds", Service.ENCODER) == 4 * 0.5
            assert _gauge("epd:queue_lag_jobs", Service.DECODE) == 0

            # taken but not acked: still pending work (being done); acked: gone
            for role, stream, durable, n, lag in (
                (Service.PREFILL, subjects.stream_generate, protocol.CONSUMER_PREFILL, 3, 5),
                (Service.PREFILL, subjects.stream_generate, routed, 2, 2),
                (Service.ENCODER, subjects.stream_encode, protocol.CONSUMER_ENCODER, 4, 4),
            ):
                psub = await js.pull_subscribe_bind(durable=durable, stream=stream)
                taken = []
                while len(taken) < n:
                    taken += await psub.fetch(n - len(taken), timeout=30)
                await signal.poll()
                assert _gauge("epd:queue_lag_jobs", role) == lag
                for msg in taken:
                    await msg.ack_sync()
                await signal.poll()
                assert _gauge("epd:queue_lag_jobs", role) == lag - n
            await signal.poll()
            for role in (Service.PREFILL, Service.ENCODER):
                assert _gauge("epd:queue_lag_jobs", role) == 0
                assert _gauge("epd:pending_work_seconds", role) == 0
        finally:
            await signal.stop()
            await nc.close()

    asyncio.run(main())


async def _costs_heard(signal: ScalingSignal) -> bool:
    return signal.costs.cost(Service.ENCODER) == 0.5
