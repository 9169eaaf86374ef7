"""A job whose workers keep dying is failed through JetStream's MAX_DELIVERIES advisory, so the
request ends with a clear error instead of waiting for its deadline. Real NATS and two real API
processes (replicas on one NATS, each running the delivery supervisor); the test itself plays a
worker that takes the job and dies (never acks), twice.

The replicas' supervisors share a queue group, so each advisory is handled once: exactly one
terminal event per exhausted job. Negative control: plain subscribers (no queue group) on the same
advisory subject each get their own copy - what every replica used to publish an event for."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from shared import protocol
from shared.protocol import ECFailed, EncodeJob, ErrorEvent, GenerationJob, ImageRef
from shared.tools.infra import free_port
from shared.tools.launcher import Stack
from tests.stackutil import start_stack

pytestmark = pytest.mark.slow

# The request deadline is far off: ending at it (504) instead of through the advisory (502)
# would be the failure, and a loaded machine must not reach it by being slow.
ACK_WAIT_S, MAX_DELIVER, REQUEST_TIMEOUT_S = 1, 2, 120
#: After the request ended: how long a second (duplicate) event is given to show up.
SETTLE_S = 3.0


@pytest.fixture(scope="module")
def crashing_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """Two API replicas on one NATS and no worker; the test is the (crashing) worker."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("max-deliver-logs"),
        services=["api"],
        roles={},
        EPD_ACK_WAIT_S=str(ACK_WAIT_S),
        EPD_MAX_DELIVER=str(MAX_DELIVER),
        EPD_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
    )
    replica = Stack(env=running.env, log_dir=tmp_path_factory.mktemp("max-deliver-replica-logs"), api_port=free_port())
    try:
        replica.add("api", index=1)
        replica.wait_ready(timeout=120, roles={})
        running.replica = replica
        yield running
    finally:
        replica.stop()
        running.stack.stop()


class Watch:
    """Core subscriptions the test holds while a job fails: every event of ``cls`` on
    ``subject``, and the advisories on ``advisory`` as two plain subscribers and as two members
    of a queue group of the test's own (not the supervisors', which it would join)."""

    def __init__(self, nc, subject: str, cls, advisory: str):
        self.nc, self.subject, self.cls, self.advisory = nc, subject, cls, advisory
        self.events: list = []
        self.plain: list[int] = [0, 0]
        self.grouped: list[int] = [0, 0]

    async def start(self) -> Watch:
        async def on_event(msg):
            try:
                event = protocol.decode(msg.data)
            except protocol.ProtocolError:
                return
            if isinstance(event, self.cls):
                self.events.append((event, msg.headers or {}))

        def counter(counts, i):
            async def cb(msg):
                json.loads(msg.data)  # an advisory is JSON
                counts[i] += 1

            return cb

        await self.nc.subscribe(self.subject, cb=on_event)
        for i in range(2):
            await self.nc.subscribe(self.advisory, cb=counter(self.plain, i))
            await self.nc.subscribe(self.advisory, queue="test-control-group", cb=counter(self.grouped, i))
        return self


def _api_logs(stack) -> str:
    return stack.log_of("api") + "\n" + "\n".join(p.log_path.read_text() for p in stack.replica.processes)


async def _take_and_die(stack, stream: str, durable: str, cls, *, deliveries: int, timeout: float = 120):
    """Fetch the stack's next job of type ``cls`` ``deliveries`` times without acking (a worker that
    dies each time). Returns the job and the delivery counts seen."""
    import nats

    nc = await nats.connect(stack.nats_url)
    try:
        psub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
        seen: list[int] = []
        job = None
        deadline = time.monotonic() + timeout
        while len(seen) < deliveries and time.monotonic() < deadline:
            try:
                msgs = await psub.fetch(1, timeout=2)
            except TimeoutError:
                continue
            for msg in msgs:
                decoded = protocol.decode(msg.data)
                if isinstance(decoded, cls):
                    job = decoded
                    seen.append(msg.metadata.num_delivered)
                else:
                    await msg.ack()
        # The server gives up on a message (and sends the advisory) when a worker next asks for
        # work after the last ack wait: a live worker pool keeps asking.
        try:
            extra = await psub.fetch(1, timeout=2 * ACK_WAIT_S + 1)
        except TimeoutError:
            extra = []
        assert not any(isinstance(protocol.decode(m.data), cls) for m in extra), "delivered past max_deliver"
        return job, seen
    finally:
        await nc.close()


def test_generation_job_that_keeps_failing_ends_the_request_with_502(crashing_stack):
    import nats

    subjects = crashing_stack.subjects
    result = {}
    started = time.monotonic()

    def client():
        result["resp"] = crashing_stack.chat(
            [{"role": "user", "content": "Hello"}], max_tokens=4, timeout=REQUEST_TIMEOUT_S + 60
        )
        result["seconds"] = time.monotonic() - started

    async def main():
        nc = await nats.connect(crashing_stack.nats_url)
        try:
            watch = await Watch(
                nc,
                subjects.tokens_all,
                ErrorEvent,
                subjects.max_deliveries_advisory(subjects.stream_generate, protocol.CONSUMER_PREFILL),
            ).start()
            thread.start()
            job, seen = await _take_and_die(
                crashing_stack,
                subjects.stream_generate,
                protocol.CONSUMER_PREFILL,
                GenerationJob,
                deliveries=MAX_DELIVER,
            )
            await asyncio.to_thread(thread.join, REQUEST_TIMEOUT_S + 60)
            await asyncio.sleep(SETTLE_S)
            return job, seen, watch
        finally:
            await nc.close()

    thread = threading.Thread(target=client)
    job, seen, watch = asyncio.run(main())
    assert not thread.is_alive(), "the request did not end"
    assert job is not None and seen == [1, 2]
    # Two API replicas, one advisory: exactly one ErrorEvent, with its msg id; one on record.
    events = [(e, h) for e, h in watch.events if e.request_id == job.request_id]
    assert len(events) == 1, events
    event, headers = events[0]
    assert (event.code, event.stage) == ("worker_failed", "prefill")
    assert headers.get(protocol.HDR_MSG_ID, "").startswith(f"max-deliveries-{subjects.stream_generate}-")
    stored = crashing_stack.messages_of("stream_results", ErrorEvent, job.request_id)
    assert [e.code for e in stored] == ["worker_failed"]
    assert _api_logs(crashing_stack).count(f"generation job of {job.request_id} failed") == 1
    # Negative control: without a queue group, each subscriber (each replica) gets the advisory.
    assert watch.plain == [1, 1] and sum(watch.grouped) == 1, (watch.plain, watch.grouped)
    resp = result["resp"]
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "worker_failed" and f"failed {MAX_DELIVER} times" in error["message"]
    # Ended by the advisory (a couple of ack waits), before the request deadline (which gives 504).
    assert result["seconds"] < REQUEST_TIMEOUT_S


def test_encode_job_that_keeps_failing_is_reported_failed(crashing_stack):
    """The advisory turns an exhausted encode job into ECFailed for its item, which a prefill
    worker waiting for it takes as "encode locally" instead of waiting out EPD_EC_WAIT_S."""
    import nats

    subjects = crashing_stack.subjects
    item = "ab" * 32
    job = EncodeJob(
        request_id=f"test-maxdeliver-{int(time.time() * 1000)}",
        fingerprint="f" * 24,
        ec_key=f"x/{item}",
        image=ImageRef(item_hash=item, media_key=f"x/media/{item}", width=8, height=8),
        created_at=time.time(),
    )

    async def main():
        nc = await nats.connect(crashing_stack.nats_url)
        try:
            watch = await Watch(
                nc,
                subjects.ec_failed(job.fingerprint, item),
                ECFailed,
                subjects.max_deliveries_advisory(subjects.stream_encode, protocol.CONSUMER_ENCODER),
            ).start()
            await nc.jetstream().publish(
                subjects.encode_jobs, protocol.encode(job), headers=protocol.headers_for(job, job.request_id)
            )
            taken, seen = await _take_and_die(
                crashing_stack, subjects.stream_encode, protocol.CONSUMER_ENCODER, EncodeJob, deliveries=MAX_DELIVER
            )
            deadline = time.monotonic() + 60
            while not watch.events and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(SETTLE_S)
            return taken, seen, watch
        finally:
            await nc.close()

    taken, seen, watch = asyncio.run(main())
    assert taken == job and seen == [1, 2]
    assert len(watch.events) == 1, watch.events  # two API replicas, one event
    event, headers = watch.events[0]
    assert isinstance(event, ECFailed) and event.code == "max_deliveries"
    assert event.item_hash == item and event.request_id == job.request_id
    assert headers.get(protocol.HDR_MSG_ID, "").startswith(f"max-deliveries-{subjects.stream_encode}-")
    assert watch.plain == [1, 1] and sum(watch.grouped) == 1, (watch.plain, watch.grouped)  # negative control


def test_a_job_that_runs_out_of_deliveries_after_its_request_completed_is_not_reported(crashing_stack):
    """Acks lost in a NATS failover: the redeliveries of an answered request's job fail until
    JetStream gives up. The request is over (its FinalResult is on record): no ErrorEvent, no
    "failed N times" log. Control: the same without the FinalResult gets its ErrorEvent (the
    test above)."""
    import nats

    subjects = crashing_stack.subjects
    rid = f"test-maxdeliver-done-{int(time.time() * 1000)}"
    job = GenerationJob(
        request_id=rid,
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        images=(),
        fingerprint="fp",
        sampling=protocol.SamplingSpec(temperature=0, max_tokens=4),
        stream=False,
        deadline=time.time() + REQUEST_TIMEOUT_S,
        created_at=time.time(),
    )
    final = protocol.FinalResult(
        request_id=rid,
        attempt=1,
        token_ids=(1,),
        text="x",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=1,
    )

    async def main():
        nc = await nats.connect(crashing_stack.nats_url)
        try:
            watch = await Watch(
                nc,
                subjects.tokens(rid),
                ErrorEvent,
                subjects.max_deliveries_advisory(subjects.stream_generate, protocol.CONSUMER_PREFILL),
            ).start()
            js = nc.jetstream()
            await js.publish(subjects.generate_jobs, protocol.encode(job), headers=protocol.headers_for(job, rid))
            await js.publish(subjects.tokens(rid), protocol.encode(final), headers=protocol.headers_for(final, rid))
            taken, seen = await _take_and_die(
                crashing_stack,
                subjects.stream_generate,
                protocol.CONSUMER_PREFILL,
                GenerationJob,
                deliveries=MAX_DELIVER,
            )
            deadline = time.monotonic() + 60  # the advisory reached a supervisor (which logs it)
            while "ran out of deliveries after its request ended" not in _api_logs(crashing_stack) and not watch.events:
                assert time.monotonic() < deadline, "no supervisor handled the advisory"
                await asyncio.sleep(0.1)
            await asyncio.sleep(SETTLE_S)
            return taken, seen, watch
        finally:
            await nc.close()

    taken, seen, watch = asyncio.run(main())
    assert taken == job and seen == [1, 2] and sum(watch.grouped) == 1
    assert watch.events == []
    assert crashing_stack.messages_of("stream_results", ErrorEvent, rid) == []
    assert f"generation job of {rid} failed" not in _api_logs(crashing_stack)
