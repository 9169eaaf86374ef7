"""The runner's outcome rules (``shared.worker.settle``), without a broker: what a handler's
return or exception becomes (ack / nak / term) and when the request's terminal event is sent."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import protocol
from shared.errors import EngineError, EPDError, InvalidRequest, ServiceUnavailable, StoreError, WorkerFailed
from shared.protocol import EncodeJob, ImageRef
from shared.topology import Role, Service
from shared.worker import Action, Delivery, Handler, Reject, Retry, settle

JOB = EncodeJob(
    request_id="r1",
    image=ImageRef(item_hash="a" * 64, media_key="k", width=1, height=1),
    fingerprint="f",
    ec_key="e",
    created_at=time.time(),
)


class Scripted(Handler):
    """Raises what it is given; records every terminal call."""

    service = Service.ENCODER
    role = Role.ENCODER
    job_type = EncodeJob
    queue = protocol.WorkQueue.ENCODE

    def __init__(
        self, outcome: BaseException | None = None, *, terminal_fails: bool = False, block: asyncio.Event | None = None
    ):
        self.outcome = outcome
        self.terminal_fails = terminal_fails
        self.block = block
        self.started = asyncio.Event()
        self.handled = 0
        self.terminal: list[tuple[str, EPDError, str]] = []
        self.cancelled: list[str] = []

    async def setup(self, ctx) -> None:
        pass

    async def handle(self, job: EncodeJob, delivery: Delivery) -> None:
        assert job == JOB
        self.handled += 1
        self.started.set()
        if self.block is not None:
            await self.block.wait()
        if self.outcome is not None:
            raise self.outcome

    async def on_cancelled(self, job: EncodeJob) -> None:
        self.cancelled.append(job.request_id)

    async def on_terminal(self, job: EncodeJob, error: EPDError, message: str) -> None:
        self.terminal.append((job.request_id, error, message))
        if self.terminal_fails:
            raise ConnectionError("NATS is gone")


def delivery(n: int = 1, max_deliver: int = 3, data: bytes | None = None) -> Delivery:
    return Delivery(
        data=protocol.encode(JOB) if data is None else data,
        subject="t.encode.jobs",
        headers={},
        num_delivered=n,
        max_deliver=max_deliver,
    )


async def test_return_acks_and_sends_nothing():
    h = Scripted()
    assert (await settle(h, delivery())).action is Action.ACK
    assert h.terminal == []


async def test_retry_naks_with_its_delay_or_the_backoff_then_ends_the_request_at_the_last_delivery():
    h = Scripted(Retry(5.0, "busy"))
    s = await settle(h, delivery(n=1))
    assert (s.action, s.delay_s) == (Action.NAK, 5.0) and h.terminal == []
    h = Scripted(Retry(None, "busy"))
    assert (await settle(h, delivery(n=2))).delay_s == 2.0  # 1 s per delivery so far
    s = await settle(h, delivery(n=3))
    assert s.action is Action.TERM
    ((rid, error, message),) = h.terminal
    assert rid == "r1" and isinstance(error, WorkerFailed) and message == "gave up after 3 attempts: busy"
    h = Scripted(Retry(None, "engine down", error=EngineError("engine down")))
    await settle(h, delivery(n=3))
    assert h.terminal[0][1].code == "engine_error"


async def test_reject_ends_the_request_once_with_its_error():
    h = Scripted(Reject(InvalidRequest("bad"), message="bad request"))
    assert (await settle(h, delivery(n=1))).action is Action.TERM
    assert [(e.code, m) for _, e, m in h.terminal] == [("invalid_request", "bad request")]


@pytest.mark.parametrize(
    "exc, n, action, terminal",
    [
        (EngineError("broken"), 1, Action.TERM, ("engine_error", "EngineError: broken")),  # final at once
        (StoreError("store down"), 1, Action.NAK, None),  # transient
        (ServiceUnavailable("NATS unavailable"), 1, Action.NAK, None),  # transient too: NATS stalled
        (StoreError("store down"), 3, Action.TERM, ("store_error", "gave up after 3 attempts: StoreError: store down")),
        (RuntimeError("bug"), 2, Action.NAK, None),  # unexpected: retried
        (RuntimeError("bug"), 3, Action.TERM, ("worker_failed", "gave up after 3 attempts: RuntimeError: bug")),
    ],
)
async def test_other_exceptions(exc, n, action, terminal):
    h = Scripted(exc)
    assert (await settle(h, delivery(n=n))).action is action
    assert [(e.code, m) for _, e, m in h.terminal] == ([terminal] if terminal else [])


async def test_undecodable_message_is_terminated_without_an_event():
    h = Scripted()
    assert (await settle(h, delivery(data=b"\x00garbage"))).action is Action.TERM
    assert h.terminal == []


async def test_a_terminal_event_that_cannot_be_sent_leaves_the_job_to_a_redelivery():
    h = Scripted(Reject(InvalidRequest("bad")), terminal_fails=True)
    assert (await settle(h, delivery(n=1))).action is Action.NAK
    assert len(h.terminal) == 1


class Cancels:
    """The cancellation records of some request ids (``shared.cancellation.CancelRecords``' reads)."""

    def __init__(self, *cancelled: str):
        self.cancelled = set(cancelled)

    async def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled


async def test_a_cancelled_request_s_job_is_dropped_when_taken_and_others_run():
    h = Scripted()
    s = await settle(h, delivery(), Cancels(JOB.request_id))
    assert (s.action, s.reason, h.handled, h.cancelled, h.terminal) == (Action.ACK, "cancelled", 0, ["r1"], [])
    # negative control: another request's cancellation drops nothing
    h = Scripted()
    s = await settle(h, delivery(), Cancels("another"))
    assert (s.action, s.reason, h.handled, h.cancelled) == (Action.ACK, "", 1, [])


async def test_a_running_job_whose_request_is_cancelled_stops_and_is_acked_once_cleaned_up():
    h = Scripted(block=asyncio.Event())  # runs until stopped
    d = delivery()
    task = asyncio.ensure_future(settle(h, d, Cancels()))
    d.cancel.bind(task)
    await asyncio.wait_for(h.started.wait(), 60)
    d.cancel.request()
    s = await asyncio.wait_for(task, 60)
    assert (s.action, s.reason, h.cancelled, h.terminal) == (Action.ACK, "cancelled", ["r1"], [])
    assert d.cancel.seen and not task.cancelled()


async def test_a_job_cancelled_by_shutdown_is_left_for_redelivery():
    h = Scripted(block=asyncio.Event())
    d = delivery()
    task = asyncio.ensure_future(settle(h, d, Cancels()))
    d.cancel.bind(task)
    await asyncio.wait_for(h.started.wait(), 60)
    task.cancel()  # the runner's drain timeout, not the request's cancellation: not acked
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.cancelled == [] and h.terminal == []
