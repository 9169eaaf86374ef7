"""Cancellation, end to end (real NATS, S3 and worker processes, tiny model): a client that hangs
up, or a request the API gives up on, stops costing worker time (``shared.cancellation``).

* a streaming client that disconnects mid-stream: the generating worker stops (E|PD: prefill;
  E|P|D: decode, whose KV object is deleted), far short of ``max_tokens``;
* a non-streaming client that gives up: the same;
* a queued job of a cancelled request is dropped when a worker takes it: no token is generated;
* an encode job shared with another request is not dropped while that request still needs it;
  one nobody else wants is dropped (``ECFailed`` ``cancelled``);
* the request's record says ``cancelled`` (replay status, timeline stage), and
  ``epd:requests_cancelled_total{stage}`` counts it where it took effect.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
import pytest

from services.api.asgi import EventStreamResponse
from shared.protocol import DecodeJob, ECFailed, ECReady, ErrorEvent, RequestCancelled, TokenChunk
from shared.tools.infra import free_port
from tests.stackutil import (
    GREEDY,
    data_url,
    final_result,
    kv_keys,
    metric_value,
    noise_image,
    scrape,
    start_stack,
    user_message,
    wait_for,
)

pytestmark = pytest.mark.slow

LONG = 4000  # tokens: ~15 s of a worker on the tiny model, unless it is stopped


def _body(seed: int, *, stream: bool, max_tokens: int = LONG) -> dict:
    return {
        "model": "qwen2-vl-tiny",
        "messages": [user_message("describe", [data_url(noise_image(seed, (48, 48)))])],
        **GREEDY,
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _hang_up_mid_stream(stack, body: dict, *, after: int = 3) -> str:
    """Stream ``body``; close the connection after ``after`` SSE events. Returns the request id."""
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= after:
                    break
    return request_id


def _request_ids_before(stack) -> set[str]:
    return {m.request_id for _, _, m in stack.stream_messages("stream_requests")}


def _give_up_without_streaming(stack, body: dict, known: set[str], *, after_s: float = 2.0) -> str:
    """Post ``body`` and give up after ``after_s`` (the client closes the connection). Returns the
    request id (the one new request record)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=after_s))
    new = wait_for(lambda: _request_ids_before(stack) - known, 60, "the request's record")
    assert len(new) == 1, new
    return new.pop()


def _chunks(stack, request_id: str) -> int:
    return sum(len(m.token_ids) for m in stack.messages_of("stream_results", TokenChunk, request_id))


def _stopped(stack, service: str, request_id: str, how: str = "job stopped") -> bool:
    return any(
        request_id in line and f"{how}: its request was cancelled" in line
        for line in stack.log_of(service).splitlines()
    )


def _assert_generation_stopped(stack, service: str, request_id: str) -> int:
    """The worker says it stopped the job; no token is published after that; far short of LONG."""
    wait_for(lambda: _stopped(stack, service, request_id), 120, f"{service} to stop {request_id}")
    wait_for(lambda: stack.messages_of("stream_results", ErrorEvent, request_id), 60, "the cancellation record")
    produced = _chunks(stack, request_id)
    # The job is acked and gone: nothing more comes for it (the workers hold no job).
    wait_for(lambda: not any(v for v in _busy(stack)), 120, "the workers to hold no job")
    assert _chunks(stack, request_id) == produced
    assert produced < LONG // 2, f"{produced} of {LONG} tokens generated after the client left"
    return produced


def _busy(stack):
    from tests.stackutil import busy_work_consumers

    return busy_work_consumers(stack.nats_url, stack.subjects).values()


def _ended_cancelled(stack, request_id: str) -> None:
    (error,) = stack.messages_of("stream_results", ErrorEvent, request_id)
    assert (error.code, error.stage, error.http_status) == ("cancelled", "api", 499)
    (record,) = stack.messages_of("stream_control", RequestCancelled, request_id)
    assert record.reason == "cancelled"
    resp = httpx.get(f"{stack.url}/debug/requests/{request_id}", params={"format": "json"}, timeout=60)
    assert resp.status_code == 200, resp.text
    timeline = resp.json()["timeline"]
    assert timeline["summary"]["status"] == "cancelled"
    assert [s["name"] for s in timeline["stages"]][-1] == "cancelled"


@pytest.fixture(scope="module")
def e_pd(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    port = free_port()
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("cancel-epd"),
        service_env={"prefill": {"EPD_METRICS_PORT": str(port)}},
        EPD_MAX_TOKENS_LIMIT=str(LONG),
        EPD_REQUEST_TIMEOUT_S="240",
        # the shared encode job's test pauses the encoder to keep jobs queued: nobody steals them
        EPD_ENCODE_STEALS="0",
        EPD_NO_ENCODER_AFTER_S="300",  # ... nor encodes them itself while the paused encoder is silent
    )
    running.prefill_metrics_port = port
    try:
        yield running
    finally:
        running.stack.stop()


def _worker_cancelled(stack) -> float:
    return metric_value(
        scrape(f"http://127.0.0.1:{stack.prefill_metrics_port}/metrics"),
        "epd:requests_cancelled_total",
        stage="prefill",
    )


def _api_cancelled(stack) -> float:
    return metric_value(scrape(f"{stack.url}/metrics"), "epd:requests_cancelled_total", stage="api")


def _safe(fn) -> float:
    try:
        return fn()
    except (KeyError, AssertionError, ValueError):  # the labelled series appears at its first count
        return 0.0


def test_a_streaming_client_that_hangs_up_stops_the_generation(e_pd):
    # Control: the same request, not abandoned, generates what it was asked for.
    done = httpx.post(f"{e_pd.url}/v1/chat/completions", json=_body(1, stream=False, max_tokens=64), timeout=300)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 64
    worker0, api0 = _safe(lambda: _worker_cancelled(e_pd)), _safe(lambda: _api_cancelled(e_pd))

    request_id = _hang_up_mid_stream(e_pd, _body(2, stream=True))
    _assert_generation_stopped(e_pd, "prefill", request_id)
    _ended_cancelled(e_pd, request_id)
    assert _worker_cancelled(e_pd) == worker0 + 1
    assert _api_cancelled(e_pd) == api0 + 1


def test_a_client_that_gives_up_on_a_plain_request_stops_the_generation(e_pd):
    known = _request_ids_before(e_pd)
    request_id = _give_up_without_streaming(e_pd, _body(3, stream=False), known)
    _assert_generation_stopped(e_pd, "prefill", request_id)
    _ended_cancelled(e_pd, request_id)


def _pids(stack, service: str) -> list:
    return [p for p in stack.stack.processes if p.name == service and p.alive()]


def test_a_queued_job_of_a_cancelled_request_is_dropped_when_taken(e_pd):
    (prefill,) = _pids(e_pd, "prefill")
    known = _request_ids_before(e_pd)
    prefill.popen.send_signal(signal.SIGSTOP)  # the job waits in the queue
    try:
        request_id = _give_up_without_streaming(e_pd, _body(4, stream=False), known)
        wait_for(lambda: e_pd.messages_of("stream_control", RequestCancelled, request_id), 60, "the cancel record")
    finally:
        prefill.popen.send_signal(signal.SIGCONT)
    wait_for(lambda: _stopped(e_pd, "prefill", request_id, "job dropped"), 120, "the prefill worker to drop the job")
    assert _chunks(e_pd, request_id) == 0
    # The worker goes on with the next request.
    resp = httpx.post(f"{e_pd.url}/v1/chat/completions", json=_body(5, stream=False, max_tokens=4), timeout=300)
    assert resp.status_code == 200, resp.text


def test_a_shared_encode_job_runs_while_another_request_needs_it_and_is_dropped_when_nobody_does(e_pd):
    (encoder,) = _pids(e_pd, "encoder")
    shared_body, alone_body = _body(6, stream=False, max_tokens=4), _body(7, stream=False, max_tokens=4)
    known = _request_ids_before(e_pd)
    results: dict[str, httpx.Response] = {}
    encoder.popen.send_signal(signal.SIGSTOP)  # encode jobs wait in the queue
    try:
        first = _give_up_without_streaming(e_pd, shared_body, known)  # queued the encode job, then cancelled
        # A second request for the same image: its encode job is deduplicated into the first one's.
        waiter = threading.Thread(
            target=lambda: results.setdefault(
                "second", httpx.post(f"{e_pd.url}/v1/chat/completions", json=shared_body, timeout=300)
            )
        )
        waiter.start()
        wait_for(lambda: len(_request_ids_before(e_pd) - known) == 2, 60, "the second request's record")
        alone = _give_up_without_streaming(e_pd, alone_body, _request_ids_before(e_pd))  # nobody else wants it
        for rid in (first, alone):
            wait_for(lambda rid=rid: e_pd.messages_of("stream_control", RequestCancelled, rid), 60, "the cancel record")
    finally:
        encoder.popen.send_signal(signal.SIGCONT)
    waiter.join(300)
    second = results["second"]
    assert second.status_code == 200, second.text
    final = final_result(e_pd, second.json()["id"])
    # The shared job ran for the second request: its features came from the encoder, not a local encode.
    assert set(final.ec_sources.values()) <= {"store", "local_cache"}, final.ec_sources
    item_shared = _item(e_pd, first)
    assert any(m.item_hash == item_shared for m in e_pd.messages_of("stream_events", ECReady, first))
    assert not _stopped(e_pd, "encoder", first, "job dropped")
    # The other one was dropped, and the drop said so to anyone waiting for it.
    wait_for(lambda: _stopped(e_pd, "encoder", alone, "job dropped"), 120, "the encoder to drop the lone job")
    failed = e_pd.messages_of("stream_events", ECFailed, alone)
    assert [f.code for f in failed] == ["cancelled"]


def _item(stack, request_id: str) -> str:
    (record,) = [m for _, _, m in stack.stream_messages("stream_requests") if m.request_id == request_id]
    return record.images[0].item_hash


@pytest.fixture(scope="module")
def e_p_d(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("cancel-epd3"),
        topology="e-p-d",
        EPD_MAX_TOKENS_LIMIT=str(LONG),
        EPD_REQUEST_TIMEOUT_S="240",
    )
    try:
        yield running
    finally:
        running.stack.stop()


def test_e_p_d_a_client_that_hangs_up_stops_the_decode_worker_and_its_kv_object_goes(e_p_d, s3_server):
    from shared.store.objects import S3ObjectStore

    store = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, e_p_d.bucket)
    request_id = _hang_up_mid_stream(e_p_d, _body(8, stream=True))
    _assert_generation_stopped(e_p_d, "decode", request_id)
    _ended_cancelled(e_p_d, request_id)
    (decode_job,) = e_p_d.messages_of("stream_decode", DecodeJob, request_id)
    wait_for(lambda: decode_job.kv_key not in kv_keys(store, e_p_d), 120, "the KV object to be deleted")


def test_an_event_stream_ends_quietly_when_its_client_disconnects_and_cancels_nothing_else():
    """``EventStreamResponse`` (the API's SSE responses), at the ASGI level: the client's
    disconnect cancels the stream where it waits - its generator cleans up (where the API
    cancels the request's work) - and the response returns without an error; a cancellation
    that is not a disconnect (the server stopping) is not swallowed."""

    async def main(disconnect: bool) -> tuple[list[bytes], list[str], BaseException | None]:
        sent: list[bytes] = []
        log: list[str] = []
        first_sent = asyncio.Event()

        async def events():
            try:
                yield b"data: 1\n\n"
                await asyncio.Event().wait()  # the next event never comes
                yield b"data: 2\n\n"
            finally:
                log.append("generator closed")

        async def receive():
            await first_sent.wait()
            if disconnect:
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                sent.append(message["body"])
                first_sent.set()

        response = EventStreamResponse(events(), media_type="text/event-stream")
        task = asyncio.ensure_future(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
        if not disconnect:
            await first_sent.wait()
            task.cancel()
        try:
            await asyncio.wait_for(task, 10)
            return sent, log, None
        except asyncio.CancelledError as exc:
            return sent, log, exc

    sent, log, error = asyncio.run(main(disconnect=True))
    assert sent == [b"data: 1\n\n"] and log == ["generator closed"] and error is None
    sent, log, error = asyncio.run(main(disconnect=False))
    assert sent == [b"data: 1\n\n"] and isinstance(error, asyncio.CancelledError)


def test_a_wait_for_a_request_ends_with_its_interruption_and_lets_other_cancellations_through():
    """``unless_interrupted`` (the API's waits for a request's events): the API starting to stop
    ends the wait with a 503 error and the client's disconnect with ``ClientDisconnected``, the
    awaited work cancelled where it waits either way; a cancellation from elsewhere is not
    converted, even when it comes with an interruption; a result comes back with nothing left
    listening; a wait that starts after the stop does not start its work."""
    from starlette.requests import Request

    from services.api.interrupts import ClientDisconnected, unless_interrupted
    from services.api.service import StopSignal
    from shared.errors import ServiceUnavailable

    async def main(how: str) -> tuple[str, list[str], StopSignal]:
        stopping, log, asked = StopSignal(), [], asyncio.Event()
        gone = asyncio.Event()

        async def work() -> str:
            log.append("started")
            asked.set()
            try:
                if how == "result":
                    return "result"
                await asyncio.Event().wait()
                return "never"
            except asyncio.CancelledError:
                log.append("work cancelled")
                raise

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        if how == "stopped before":
            stopping.set()
        waiting = asyncio.ensure_future(unless_interrupted(work(), stopping, request))
        if how != "stopped before" and how != "result":
            await asked.wait()
            if how in ("stop", "stop and cancel"):
                stopping.set()
            if how in ("cancel", "stop and cancel"):
                waiting.cancel()
            if how == "disconnect":
                gone.set()
        await asyncio.wait({waiting}, timeout=10)
        if not waiting.done():
            waiting.cancel()
            return "still waiting", log, stopping
        try:
            outcome = repr(waiting.result())
        except (ServiceUnavailable, ClientDisconnected, asyncio.CancelledError) as exc:
            outcome = type(exc).__name__
        return outcome, log, stopping

    assert asyncio.run(main("stop"))[:2] == ("ServiceUnavailable", ["started", "work cancelled"])
    assert asyncio.run(main("disconnect"))[:2] == ("ClientDisconnected", ["started", "work cancelled"])
    assert asyncio.run(main("cancel"))[:2] == ("CancelledError", ["started", "work cancelled"])
    assert asyncio.run(main("stop and cancel"))[:2] == ("CancelledError", ["started", "work cancelled"])
    assert asyncio.run(main("stopped before"))[:2] == ("ServiceUnavailable", [])
    outcome, log, stopping = asyncio.run(main("result"))
    assert (outcome, log) == ("'result'", ["started"])
    assert stopping._listeners == []  # (the wait stopped listening)

    async def finished_anyway() -> tuple[str, int]:
        stopping, asked = StopSignal(), asyncio.Event()

        async def work() -> str:
            asked.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                pass
            return "finished anyway"

        async def waiting() -> tuple[str, int]:
            result = await unless_interrupted(work(), stopping)
            task = asyncio.current_task()
            assert task is not None
            return result, task.cancelling()

        wait = asyncio.ensure_future(waiting())
        await asked.wait()
        stopping.set()
        return await asyncio.wait_for(wait, 10)

    # work that finishes in spite of the interruption: its result, and no cancel request left behind
    assert asyncio.run(finished_anyway()) == ("finished anyway", 0)


def test_a_stop_signal_calls_each_listener_once_and_at_once_when_already_set():
    from services.api.service import StopSignal

    stopping, called = StopSignal(), []
    stop_listening = stopping.listen(lambda: called.append("a"))
    stopping.listen(lambda: called.append("b"))
    stop_listening()
    assert not stopping.is_set() and called == []
    stopping.set()
    stopping.set()
    assert stopping.is_set() and called == ["b"]
    stopping.listen(lambda: called.append("c"))
    assert called == ["b", "c"]


def test_an_event_streams_last_chunk_ends_the_response_in_one_message_and_its_clean_up_still_runs():
    """``LastChunk``: the chunk and the end of the response go out in one ASGI message (one socket
    write); the generator's clean-up runs after it - to its end, awaits included, though the server
    now answers ``receive`` with a disconnect (uvicorn does once a response is complete). Control:
    a generator without a ``LastChunk`` gets the end as a message of its own."""
    from services.api.asgi import LastChunk

    async def main(last: bool) -> tuple[list[tuple[bytes, bool]], list[str]]:
        sent: list[tuple[bytes, bool]] = []
        log: list[str] = []
        complete = asyncio.Event()

        async def events():
            try:
                yield b"data: 1\n\n"
                yield LastChunk(b"data: [DONE]\n\n") if last else b"data: [DONE]\n\n"
            finally:
                await asyncio.sleep(0)  # the listener hears "disconnect" meanwhile
                await asyncio.sleep(0.01)
                log.append("cleaned up")

        async def receive():
            await complete.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append((message["body"], message["more_body"]))
                if not message["more_body"]:
                    complete.set()

        response = EventStreamResponse(events(), media_type="text/event-stream")
        await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 10)
        return sent, log

    sent, log = asyncio.run(main(last=True))
    assert sent == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)] and log == ["cleaned up"]
    sent, log = asyncio.run(main(last=False))
    assert sent == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", True), (b"", False)] and log == ["cleaned up"]
