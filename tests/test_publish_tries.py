"""How long a publish waits for an acknowledgement that does not come (``JetStreamPublisher``): a
try lost on the way - sent into a stalled NATS server, or to a stream leader that stepped down - held
a repeatable publish (a job, a final result, a token chunk) for the 5 s of a one-off publish, so a
request recovered ~5 s after the NATS cluster served again (CI's multi-host SIGSTOP case: 6.1 s). A
repeatable one now tries again after ``try_s``.

The server is real; the party that loses the first try is a core NATS responder on the subject,
standing in for a stream leader (it answers like one, with a ``PubAck``)."""

from __future__ import annotations

import json
import time

import nats
import pytest

from shared.errors import ServiceUnavailable
from shared.jetstream import JetStreamPublisher
from shared.protocol import HDR_MSG_ID, ECFailed

TIMEOUT_S = 2.0
TRY_S = 0.4


def _event() -> ECFailed:
    return ECFailed(request_id="r1", item_hash="i" * 64, fingerprint="fp", code="x", message="m", created_at=0.0)


async def test_a_repeatable_publish_tries_again_after_try_s_and_a_one_off_waits_its_timeout(nats_server):
    nc = await nats.connect(nats_server.url)
    try:
        tries: list[str | None] = []

        async def leader_losing_first_tries(msg):  # the first try of each message is lost
            msg_id = (msg.headers or {}).get(HDR_MSG_ID)
            again = msg_id is not None and msg_id in tries
            tries.append(msg_id)
            if again:
                await msg.respond(json.dumps({"stream": "S", "seq": len(tries)}).encode())

        await nc.subscribe("tries.x", cb=leader_losing_first_tries)
        await nc.flush()
        publisher = JetStreamPublisher(nc.jetstream(), timeout=TIMEOUT_S, try_s=TRY_S)

        # control: a one-off publish (no msg id) is tried once and waits its whole timeout
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="publishing ECFailed"):
            await publisher.publish("tries.x", _event(), request_id="r1")
        assert time.monotonic() - started >= TIMEOUT_S - 0.05
        assert tries == [None]

        # a repeatable publish: the lost try costs try_s, the next one is answered
        started = time.monotonic()
        assert await publisher.publish("tries.x", _event(), request_id="r1", msg_id="m-1", deadline=time.time() + 10)
        took = time.monotonic() - started
        assert tries == [None, "m-1", "m-1"]  # (the same id: JetStream would keep one copy)
        assert TRY_S - 0.05 <= took < TIMEOUT_S - 0.5, took

        # a sent message (a token chunk, a record) whose acknowledgement does not come: its sender
        # learns so after try_s, to publish it again
        pending = await publisher.send("tries.x", _event(), request_id="r1", msg_id="m-2")
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            await pending.confirmed()
        took = time.monotonic() - started
        assert tries[-1] == "m-2"
        assert TRY_S - 0.05 <= took < TIMEOUT_S - 0.5, took
    finally:
        await nc.close()


async def test_a_topology_request_that_times_out_is_asked_again_until_its_deadline():
    """ensure_topology's requests (creating a stream or consumer to a config: safe to repeat) are
    asked again while they time out - a loaded server answered a worker's add_consumer after the
    client's 5 s and the worker exited at start-up - and the timeout is raised once past the
    deadline. Other errors are not repeated. Mutation: no retry -> the first case fails."""
    from shared.jetstream import _patiently

    calls: list[float] = []

    async def slow_then_fine():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return "created"

    assert await _patiently(slow_then_fine, "consumer X/y", time.monotonic() + 10) == "created"
    assert len(calls) == 3

    async def always_slow():
        calls.append(time.monotonic())
        raise nats.errors.TimeoutError

    calls.clear()
    started = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await _patiently(always_slow, "consumer X/y", started + 0.5)
    assert 1 < len(calls) and time.monotonic() - started < 2

    async def refused():
        calls.append(time.monotonic())
        raise ValueError("not a timeout")

    calls.clear()
    with pytest.raises(ValueError):
        await _patiently(refused, "consumer X/y", time.monotonic() + 10)
    assert len(calls) == 1
