"""The runner's outcome rules (``shared.worker.settle``), without a broker: what a handler's
return or exception becomes (ack / nak / term) and when the request's terminal event is sent."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from shared import cancellation, metrics, protocol
from shared.cancellation import CLOCK_SKEW_S, Ended, RequestRecords
from shared.errors import EngineError, EPDError, InvalidRequest, ServiceUnavailable, StoreError, WorkerFailed
from shared.protocol import EncodeJob, ImageRef, Subjects
from shared.topology import Role, Service
from shared.worker import Action, Delivery, Handler, Reject, Retry, settle

JOB = EncodeJob(
    request_id="r1",
    image=ImageRef(item_hash="a" * 64, media_key="k", width=1, height=1),
    fingerprint="f",
    ec_key="e",
    created_at=time.time(),
)


def metric_value(counter, outcome: str) -> float:
    return counter.labels(outcome)._value.get()


class Scripted(Handler):
    """Raises what it is given; records every terminal call."""

    service = Service.ENCODER
    role = Role.ENCODER
    job_type = EncodeJob
    queue = protocol.WorkQueue.ENCODE
    jobs_metric = metrics.ENCODE_JOBS

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
    """The records of some request ids (``shared.cancellation.RequestRecords``' reads): cancelled
    ones, and ``ended`` ones (request id -> ``Ended``: their result is published)."""

    def __init__(self, *cancelled: str, ended: dict[str, Ended] | None = None):
        self.cancelled = set(cancelled)
        self.results = ended or {}

    async def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled

    async def ended(self, request_id: str) -> Ended | None:
        return Ended.CANCELLED if request_id in self.cancelled else self.results.get(request_id)

    def heard_cancelled(self, request_id: str, published_at: float | None) -> bool | None:
        return None  # not listening: every check reads the records


async def test_a_job_taken_after_its_request_ended_is_acked_without_running():
    """The ack of the delivery that finished the request was lost: the redelivery must not run."""
    before = metric_value(metrics.ENCODE_JOBS, "already_done")
    for ended in (Ended.COMPLETED, Ended.FAILED):
        h = Scripted(InvalidRequest("must not run"))
        s = await settle(h, delivery(n=2), Cancels(ended={JOB.request_id: ended}))
        assert (s.action, s.reason, h.handled, h.cancelled, h.terminal) == (
            Action.ACK,
            f"already {ended}",
            0,
            ["r1"],
            [],
        )
    assert metric_value(metrics.ENCODE_JOBS, "already_done") == before + 2
    # negative control: another request's result does not stop this one
    h = Scripted()
    s = await settle(h, delivery(n=2), Cancels(ended={"another": Ended.COMPLETED}))
    assert (s.action, h.handled) == (Action.ACK, 1)


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


class FakeConnection:
    """What ``RequestRecords`` asks of the NATS connection: connected, and reconnects so far."""

    def __init__(self) -> None:
        self.is_connected = True
        self.stats = {"reconnects": 0}


class CountsReads(Scripted):
    """Counts the JetStream reads of ``Handler.ended`` (the records say: not ended)."""

    reads = 0

    async def ended(self, job, records) -> Ended | None:
        self.reads += 1
        return None


class Clock:
    """``shared.cancellation``'s ``time`` (its ``time()`` only), set by the test."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


LISTENING_AT = 1000.0
PUBLISHED_AT = LISTENING_AT + CLOCK_SKEW_S + 1  # after the worker started listening, past the skew


def listening_records(monkeypatch, *heard: str) -> tuple[RequestRecords, FakeConnection, Clock]:
    clock = Clock(LISTENING_AT)
    monkeypatch.setattr(cancellation, "time", clock)
    nc = FakeConnection()
    records = RequestRecords(None, Subjects("t"), nc)  # type: ignore[arg-type]  # no JetStream: ended() is faked
    records.listening()
    for request_id in heard:
        records.heard(request_id)
    clock.now = PUBLISHED_AT + 0.5  # the job is taken
    return records, nc, clock


def published(at: float, n: int = 1) -> Delivery:
    return dataclasses.replace(delivery(n=n), published_at=at)


async def test_a_first_delivery_is_checked_against_the_cancellations_heard_without_a_read(monkeypatch):
    """Listening since before the job was published: the heard set answers, no round trip."""
    records, _, _ = listening_records(monkeypatch, JOB.request_id)
    h = CountsReads()
    s = await settle(h, published(PUBLISHED_AT), records)
    assert (s.reason, h.handled, h.cancelled, h.reads) == ("cancelled", 0, ["r1"], 0)
    # negative control: not heard -> runs, still without a read
    records, _, _ = listening_records(monkeypatch, "another")
    h = CountsReads()
    s = await settle(h, published(PUBLISHED_AT), records)
    assert (s.reason, h.handled, h.reads) == ("", 1, 0)


@pytest.mark.parametrize("gap", ["redelivery", "published before listening", "reconnected", "disconnected", "forgot"])
async def test_the_records_are_read_when_the_heard_set_may_miss_the_cancellation(gap, monkeypatch):
    records, nc, clock = listening_records(monkeypatch)
    d = published(PUBLISHED_AT, n=2 if gap == "redelivery" else 1)
    if gap == "published before listening":
        d = published(LISTENING_AT + CLOCK_SKEW_S / 2)  # (within the skew counts as before)
    elif gap == "reconnected":  # the subscription had a gap: complete only from when that is seen
        nc.stats["reconnects"] += 1
    elif gap == "disconnected":
        nc.is_connected = False
    elif gap == "forgot":
        monkeypatch.setattr(cancellation, "HEARD_MAX", 2)
        for rid in ("a", "b", "c"):  # "a" is forgotten: complete only from now
            records.heard(rid)
    h = CountsReads()
    s = await settle(h, d, records)
    assert (s.reason, h.handled, h.reads) == ("", 1, 1)
