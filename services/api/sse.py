"""SSE framing of a streamed generation: a request's token events to OpenAI's ``data:`` chunks,
written as few times as the events allow, and its metrics as they arrive."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats

from services.api.asgi import LastChunk
from services.api.http_errors import error_body, event_error
from services.api.interrupts import unless_interrupted
from services.api.responses import StreamShaper
from services.api.schemas import ParsedRequest
from services.api.service import ApiService
from shared import metrics
from shared.client import ChoiceStreams
from shared.errors import Cancelled, EPDError, ServiceUnavailable
from shared.jetstream import nats_unavailable
from shared.logs import REQUEST_ID
from shared.protocol import ErrorEvent, FinalResult, TokenChunk

log = logging.getLogger(__name__)

#: SSE chunks' JSON: compact UTF-8, as vLLM's server writes them (0.3 us a chunk; json.dumps 3 us).
_json = msgspec.json.Encoder().encode


def close_all(tracked: list[metrics.RequestMetrics]) -> None:
    for t in tracked:
        t.close()


def observe_final(tracked: metrics.RequestMetrics, final: FinalResult) -> None:
    """E2E, time per output token, token counts and the finish reason of a completed choice."""
    tracked.finished(final.finish_reason, final.prompt_tokens, final.completion_tokens)


async def event_stream(
    first: tuple[int, Any],
    events: ChoiceStreams,
    request_id: str,
    parsed: ParsedRequest,
    received_at: float,
    service: ApiService,
    tracked: list[metrics.RequestMetrics],
) -> AsyncIterator[bytes]:
    """A streamed request's response body: its events (``first`` already read) as OpenAI's SSE
    chunks, ended by ``data: [DONE]`` (a :class:`~services.api.asgi.LastChunk`). An error after
    the headers went out is reported in-band; the request is cancelled if its stream closes
    before its end (the client went away, the API is stopping)."""
    shaper = StreamShaper(request_id, parsed, int(received_at))
    # What is ready goes out in one write: the chunks are collected here and sent whenever the
    # stream would wait for the next event (and at the end), not one socket write per chunk. A
    # request whose last events arrived together (a short one: its last token and its result)
    # is answered in one write.
    ready: list[bytes] = []

    def data(body: dict[str, Any]) -> None:
        ready.append(b"data: " + _json(body) + b"\n\n")

    def flush() -> bytes:
        out = b"".join(ready)
        ready.clear()
        return out

    token = REQUEST_ID.set(request_id)
    metrics.IN_FLIGHT.labels("api_stream").inc()
    try:
        for body in shaper.opening():
            data(body)
        finals: dict[int, FinalResult] = {}
        try:
            held: tuple[int, Any] | None = first
            while True:
                if held is not None:
                    (index, event), held = held, None
                else:
                    wait = not events.ready  # (an event already queued: no wait, nothing to interrupt)
                    if wait and ready:  # about to wait for NATS: what is ready goes out first
                        yield flush()
                    try:
                        if wait:
                            index, event = await unless_interrupted(anext(events), service.stopping)
                        else:
                            index, event = await anext(events)
                    except StopAsyncIteration:
                        break
                if isinstance(event, TokenChunk):
                    tracked[index].tokens(len(event.token_ids))  # TTFT, inter-token latency
                    out = shaper.tokens(index, event)
                    if out is not None:
                        data(out)
                elif isinstance(event, FinalResult):
                    finals[index] = event
                    observe_final(tracked[index], event)
                    data(shaper.finish(index, event))
                elif isinstance(event, ErrorEvent):
                    raise event_error(event)
            if len(finals) != parsed.n:
                raise ServiceUnavailable("token stream ended without a result")
            ordered = [finals[i] for i in range(parsed.n)]
            if parsed.include_usage:
                data(shaper.usage(ordered))
            metrics.REQUESTS.labels("200").inc()
        except (EPDError, nats.errors.Error) as exc:
            data(error_body(_in_band(exc)))  # headers are gone: in-band, as OpenAI-compatible servers do
        ready.append(b"data: [DONE]\n\n")
        yield LastChunk(flush())
    finally:
        _closed(events, service, tracked)
        metrics.IN_FLIGHT.labels("api_stream").dec()
        REQUEST_ID.reset(token)


def _in_band(exc: EPDError | nats.errors.Error) -> EPDError:
    """The error a stream that failed after its headers went out reports in its body (logged, counted)."""
    if isinstance(exc, EPDError):
        log.error("stream failed: %s: %s", exc.code, exc.message)
        err = exc
    else:
        log.error("stream failed: NATS: %s: %s", type(exc).__name__, exc)
        err = nats_unavailable("streaming tokens", exc)
    metrics.REQUESTS.labels(str(err.http_status)).inc()
    return err


def _closed(events: ChoiceStreams, service: ApiService, tracked: list[metrics.RequestMetrics]) -> None:
    """A stream's generator closed: its choices' trackers closed, the request cancelled unless it ended."""
    close_all(tracked)
    if not events.ended:  # the client went away mid-stream, the API is stopping, or this generator failed
        log.info("stream closed before the request ended: request cancelled")
    why = "the API stopped" if service.stopping.is_set() else "the client disconnected mid-stream"
    # In the background: when the client is gone this task is being cancelled. (A stream that
    # ended has closed itself; cancelling closes one that did not.)
    service.cancel_in_background(events, Cancelled(why))
