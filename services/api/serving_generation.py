"""The generation routes, ``/v1/chat/completions`` and ``/v1/completions``: a request parsed and
validated, its media loaded, submitted (``ApiService.submit``), and answered with its tokens - one
JSON body, or an SSE stream (``services.api.sse``) - until its result, an error or its deadline.

Served in front of FastAPI's router (``EpdApp.direct_post``: the hot path); a request refused
before its generation job was published is recorded (``epd replay list``, the debug pages).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import nats
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.api.asgi import EpdApp, EventStreamResponse
from services.api.conventions import client_request_id
from services.api.http_errors import error_response, event_error, finish_error
from services.api.interrupts import ClientDisconnected, unless_interrupted
from services.api.params import Endpoint
from services.api.request_io import ApiKeys, RequestLimits, read_body
from services.api.responses import ChoiceResult, response_body
from services.api.schemas import ParsedRequest, parse_chat_request, parse_completion_request, parse_json_body
from services.api.served_model import ServedModel
from services.api.service import ApiService
from services.api.sse import close_all, event_stream, observe_final
from shared import metrics
from shared.client import ChoiceStreams
from shared.errors import Cancelled, DeadlineExceeded, EPDError, ServiceUnavailable
from shared.jetstream import TRACE_HEADERS, nats_unavailable, set_trace
from shared.logs import REQUEST_ID, plain
from shared.protocol import ErrorEvent, FinalResult, TokenChunk

log = logging.getLogger(__name__)


class GenerationRoutes:
    def __init__(self, service: ApiService, served: ServedModel, keys: ApiKeys, limits: RequestLimits):
        self.service = service
        self.served = served
        self.keys = keys
        self.limits = limits
        # epd:* and vllm:* request metrics (shared.metrics.ApiRequestMetrics), one tracker per choice
        # (vLLM counts each of a request's n choices as a request of its own)
        self.request_metrics = metrics.ApiRequestMetrics(service.model_name, max_model_len=served.context_len)

    def register(self, app: EpdApp) -> None:
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        # (served in front of FastAPI: the hot path; the routes above are what the schema shows)
        app.direct_post("/v1/chat/completions", self.chat_completions)
        app.direct_post("/v1/completions", self.completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, Endpoint.COMPLETIONS)

    async def generate(self, request: Request, endpoint: Endpoint) -> Response:
        received_at = time.time()
        self.keys.check(request)
        service = self.service
        request_id = _request_id(request, endpoint)
        token = REQUEST_ID.set(request_id)
        trace = set_trace("api", received_at=received_at)  # headers of everything published below
        metrics.IN_FLIGHT.labels("api").inc()
        parsed: ParsedRequest | None = None
        submitted = False  # a generation job was published: from then on the workers record the end
        try:
            parsed = self._parse(parse_json_body(await read_body(request, self.limits.max_body_bytes)), endpoint)
            if parsed.echo and isinstance(parsed.prompt, tuple):  # (a completion's token-id prompt)
                parsed.echo_text = await self.served.tokenizer.decode(parsed.prompt, param="prompt")
            deadline = received_at + self.limits.request_timeout_s
            await service.wait_connected(deadline)
            images = (
                await asyncio.wait_for(
                    service.load_media(parsed.media, parsed.video_sampling), timeout=max(0.0, deadline - time.time())
                )
                if parsed.media
                else []
            )
            events = await service.submit(request_id, parsed, images, received_at, deadline)
            submitted = True
            tracked = [
                self.request_metrics.submitted(received_at, max_tokens=parsed.sampling.max_tokens)
                for _ in range(parsed.n)
            ]
            log.info("accepted: %d image(s), %d choice(s), stream=%s", len(images), parsed.n, parsed.stream)
            return await self._respond(request, request_id, parsed, received_at, events, tracked)
        except ClientDisconnected:
            log.info("client disconnected: request cancelled")
            metrics.REQUESTS.labels("499").inc()
            return error_response(Cancelled("the client disconnected"))  # nobody reads it
        except (nats.errors.Error, TimeoutError, EPDError) as exc:
            return await self._refused(_refusal(exc), request_id, received_at, parsed, submitted)
        finally:
            metrics.IN_FLIGHT.labels("api").dec()
            TRACE_HEADERS.reset(trace)
            REQUEST_ID.reset(token)

    def _parse(self, body: dict[str, Any], endpoint: Endpoint) -> ParsedRequest:
        served, limits = self.served, self.limits
        if endpoint == Endpoint.CHAT:
            return parse_chat_request(
                body,
                served_model=served.name,
                max_images=limits.max_images,
                max_videos=limits.max_videos,
                max_tokens_limit=served.max_tokens_limit,
                max_tokens_source=served.max_tokens_source,
                default_max_tokens=limits.default_max_tokens,
                tool_parser=served.tool_parser,
                defaults=served.sampling_defaults,
            )
        return parse_completion_request(
            body,
            served_model=served.name,
            max_tokens_limit=served.max_tokens_limit,
            max_tokens_source=served.max_tokens_source,
            default_max_tokens=limits.default_max_tokens,
            defaults=served.sampling_defaults,
        )

    async def _respond(
        self,
        request: Request,
        request_id: str,
        parsed: ParsedRequest,
        received_at: float,
        events: ChoiceStreams,
        tracked: list[metrics.RequestMetrics],
    ) -> Response:
        """A submitted request's response: its JSON body, or its SSE stream once its first event
        arrived (an early failure still gets a real HTTP status). A request whose end is not
        delivered is cancelled (its work would be wasted)."""
        service = self.service
        try:
            if not parsed.stream:
                try:
                    response = await unless_interrupted(
                        _complete(events, request_id, parsed, received_at, tracked), service.stopping, request
                    )
                    response.headers["X-Request-Id"] = request_id
                    return response
                finally:
                    close_all(tracked)
                    await events.aclose()
            # Wait for the first event so an early failure still gets a real HTTP status.
            first = await unless_interrupted(anext(events), service.stopping, request)
            if isinstance(first[1], ErrorEvent):
                raise event_error(first[1])
        except ClientDisconnected:
            close_all(tracked)
            service.cancel_in_background(events, Cancelled("the client disconnected"))
            raise
        except BaseException as exc:  # the request's end was not delivered: its work is wasted
            close_all(tracked)
            service.cancel_in_background(events, Cancelled(f"the API gave up: {type(exc).__name__}"))
            raise
        return EventStreamResponse(
            event_stream(first, events, request_id, parsed, received_at, service, tracked),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
        )

    async def _refused(
        self, exc: EPDError, request_id: str, received_at: float, parsed: ParsedRequest | None, submitted: bool
    ) -> JSONResponse:
        """A request refused before any job was published: a 4xx or 502 is recorded (a
        ``ChatRequestRecord`` and its ``ErrorEvent``, best effort), so ``epd replay list
        --status error`` and the debug pages show it; its id is in ``X-Request-Id``."""
        if not submitted and (400 <= exc.http_status < 500 or exc.http_status == 502):
            await self.service.record_refused(request_id, received_at, parsed, exc)
        response = finish_error(exc)
        response.headers["X-Request-Id"] = request_id
        return response


def _refusal(exc: Exception) -> EPDError:
    """The typed error a request is refused with for ``exc``."""
    if isinstance(exc, nats.errors.Error):  # (its TimeoutError is an asyncio.TimeoutError: not the deadline)
        return nats_unavailable("submitting the request", exc)
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded("the request passed its deadline while loading images")
    assert isinstance(exc, EPDError)
    return exc


def _request_id(request: Request, endpoint: Endpoint) -> str:
    # A client's X-Request-Id (checked by HttpConventions) is part of the id, as in vLLM's
    # chatcmpl-<X-Request-Id>; a random suffix keeps two requests with one id apart (a proxy
    # retrying with the same header): the id names NATS subjects and dedup keys.
    given = client_request_id(request.scope)
    unique = f"{given}-{uuid.uuid4().hex[:8]}" if given else uuid.uuid4().hex
    return f"{'chatcmpl' if endpoint == Endpoint.CHAT else 'cmpl'}-{unique}"


async def _complete(
    events: ChoiceStreams,
    request_id: str,
    parsed: ParsedRequest,
    received_at: float,
    tracked: list[metrics.RequestMetrics],
) -> JSONResponse:
    """A non-streamed request's response: its choices collected into one JSON body."""
    results = [ChoiceResult() for _ in range(len(events))]
    async for index, event in events:
        if isinstance(event, TokenChunk):
            tracked[index].tokens(len(event.token_ids))  # TTFT, inter-token latency
            results[index].chunks.append(event)
        elif isinstance(event, ErrorEvent):
            raise event_error(event)
        elif isinstance(event, FinalResult):
            results[index].final = event
            observe_final(tracked[index], event)
    finals = [r.final for r in results if r.final is not None]
    if len(finals) != len(results):
        raise ServiceUnavailable("token stream ended without a result")
    metrics.REQUESTS.labels("200").inc()
    log.info(
        "completed: %s tokens, finish=%s, sources=%s",
        "+".join(str(f.completion_tokens) for f in finals),
        ",".join(f.finish_reason for f in finals),
        plain(finals[0].ec_sources),
    )
    return JSONResponse(response_body(request_id, parsed, results, int(received_at)))
