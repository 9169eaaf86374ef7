"""A job whose workers keep dying is failed through JetStream's MAX_DELIVERIES advisory, so the
request ends with a clear error instead of waiting for its deadline. Real NATS and the real API
process; the test itself plays a worker that takes the job and dies (never acks), twice."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared import protocol
from shared.protocol import ECFailed, EncodeJob, GenerationJob, ImageRef
from tests.stackutil import start_stack

pytestmark = pytest.mark.slow

# The request deadline is far off: ending at it (504) instead of through the advisory (502)
# would be the failure, and a loaded machine must not reach it by being slow.
ACK_WAIT_S, MAX_DELIVER, REQUEST_TIMEOUT_S = 1, 2, 120


@pytest.fixture(scope="module")
def crashing_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """The API only; the test is the (crashing) worker."""
    running = start_stack(
        nats_server, s3_server, tiny_model_dir, tmp_path_factory.mktemp("max-deliver-logs"),
        services=["api"], roles={}, EPD_ACK_WAIT_S=str(ACK_WAIT_S), EPD_MAX_DELIVER=str(MAX_DELIVER),
        EPD_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
    )
    try:
        yield running
    finally:
        running.stack.stop()


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
            except asyncio.TimeoutError:
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
        except asyncio.TimeoutError:
            extra = []
        assert not any(isinstance(protocol.decode(m.data), cls) for m in extra), "delivered past max_deliver"
        return job, seen
    finally:
        await nc.close()


def test_generation_job_that_keeps_failing_ends_the_request_with_502(crashing_stack):
    result = {}
    started = time.monotonic()

    def client():
        result["resp"] = crashing_stack.chat([{"role": "user", "content": "Hello"}], max_tokens=4,
                                             timeout=REQUEST_TIMEOUT_S + 60)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=client)
    thread.start()
    job, seen = asyncio.run(_take_and_die(crashing_stack, crashing_stack.subjects.stream_generate,
                                          protocol.CONSUMER_PREFILL, GenerationJob, deliveries=MAX_DELIVER))
    thread.join(timeout=REQUEST_TIMEOUT_S + 60)
    assert not thread.is_alive(), "the request did not end"
    assert job is not None and seen == [1, 2]
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
        request_id=f"test-maxdeliver-{int(time.time() * 1000)}", fingerprint="f" * 24, ec_key=f"x/{item}",
        image=ImageRef(item_hash=item, media_key=f"x/media/{item}", width=8, height=8), created_at=time.time(),
    )

    async def main():
        nc = await nats.connect(crashing_stack.nats_url)
        try:
            sub = await nc.subscribe(subjects.ec_failed(job.fingerprint, item))
            await nc.jetstream().publish(subjects.encode_jobs, protocol.encode(job),
                                         headers=protocol.headers_for(job, job.request_id))
            taken, seen = await _take_and_die(crashing_stack, subjects.stream_encode, protocol.CONSUMER_ENCODER,
                                              EncodeJob, deliveries=MAX_DELIVER)
            return taken, seen, protocol.decode((await sub.next_msg(timeout=60)).data)
        finally:
            await nc.close()

    taken, seen, event = asyncio.run(main())
    assert taken == job and seen == [1, 2]
    assert isinstance(event, ECFailed) and event.code == "max_deliveries"
    assert event.item_hash == item and event.request_id == job.request_id
