"""OpenAI-compatible HTTP API: the HTTP mapping of chat requests onto the request protocol.

Per request:

1. parse and validate the body (``schemas``), authenticate (``EPD_API_KEYS``);
2. fetch / decode each image once (SSRF-guarded, bounded);
3. submit it (``ApiService.submit`` -> ``shared.client.RequestClient.submit``, the one
   implementation, shared with ``epd replay run``: each distinct image stored content-addressed, one
   ``EncodeJob`` per image whose EC object is not stored yet, the ``ChatRequestRecord``, the
   ``GenerationJob``);
4. forward tokens (SSE or one JSON body) until the final result, an error, or the deadline.

This module is the HTTP side only: routes, request / response shapes, and typed ``shared.errors``
translated to OpenAI-shaped HTTP errors (here and only here). What the process is made of -
connections, stores, the request client, the EC lifecycle, the delivery supervisor, start and
stop - is ``services.api.service``.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import importlib.metadata
import inspect
import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.conventions import HttpConventions, client_request_id, with_cors
from services.api.params import Endpoint
from services.api.responses import ChoiceResult, StreamShaper, response_body
from services.api.sampling_defaults import load_sampling_defaults
from services.api.schemas import (
    ParsedRequest,
    check_model,
    check_sampling_defaults,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_json_body,
    parse_tokenize_request,
)
from services.api.service import ApiService, StopSignal
from services.api.tokenizer import MediaCounter, Tokenizer
from services.api.tool_parsers import parser_for_model
from shared import history, metrics, timeline
from shared.client import ChoiceStreams
from shared.config import ApiSettings
from shared.errors import (
    Cancelled,
    DeadlineExceeded,
    EPDError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    error_from_code,
)
from shared.heap import freeze_startup_heap
from shared.jetstream import TRACE_HEADERS, nats_unavailable, set_trace
from shared.logs import REQUEST_ID, plain
from shared.protocol import (
    ErrorEvent,
    FinalResult,
    TokenChunk,
)

log = logging.getLogger(__name__)


def _error_body(err: EPDError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": err.code}}


def error_response(err: EPDError) -> JSONResponse:
    return JSONResponse(status_code=err.http_status, content=_error_body(err))


T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response."""


async def _until_disconnected(request: Request) -> None:
    # After the body was read, the server's next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_interrupted(awaitable: Awaitable[T], stopping: StopSignal, request: Request | None = None) -> T:
    """Await ``awaitable``, cancelling it if first the API starts stopping
    (:class:`~shared.errors.ServiceUnavailable`) or, given ``request``, its client goes away
    (:class:`ClientDisconnected`). The awaitable runs in the caller's task, which an interruption
    cancels (a cancellation from anywhere else propagates as it is); the stop is a callback and
    the client's disconnect one watcher task, so a request waits here at the cost of one task."""
    task = asyncio.current_task()
    assert task is not None
    if stopping.is_set():  # (not started: an interruption must come while the task waits in it)
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        raise _stopping_error()
    interrupted: list[Exception] = []

    def interrupt(why: Exception) -> None:
        if not interrupted:
            interrupted.append(why)
            task.cancel()

    stop_listening = stopping.listen(lambda: interrupt(_stopping_error()))
    watcher = None
    if request is not None:

        async def watch() -> None:
            await _until_disconnected(request)
            interrupt(ClientDisconnected())

        watcher = asyncio.ensure_future(watch())
    try:
        result = await awaitable
        if interrupted:  # (the awaitable finished anyway: the interruption's cancel is spent)
            task.uncancel()
        return result
    except asyncio.CancelledError:
        if interrupted and task.uncancel() == 0:  # (cancelled by the interruption only)
            raise interrupted[0] from None
        raise
    finally:
        stop_listening()
        if watcher is not None:
            watcher.cancel()


class LastChunk(bytes):
    """What an :class:`EventStreamResponse`'s generator yields last: sent with the end of the
    response (one write; the generator's clean-up runs after it, not before the client has it)."""


class EventStreamResponse(StreamingResponse):
    """Starlette's ``StreamingResponse`` without a task group per response. Under uvicorn's ASGI
    spec 2.3 Starlette runs the stream and a disconnect listener as two tasks of an anyio task
    group (~0.1 ms of a one-token request here); here the stream runs in the request's own task,
    and one watcher task cancels it when the client disconnects. The stream's generator sees that
    cancellation at the await it is in, as it does under Starlette's. A :class:`LastChunk` ends
    the response; the generator is still run to its end (its clean-up) after it."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        disconnected = False
        self._complete = False

        async def cancel_on_disconnect() -> None:
            nonlocal disconnected
            await self.listen_for_disconnect(receive)
            if self._complete:  # (the server says "disconnect" once the response is complete)
                return
            disconnected = True
            streaming.cancel()  # (it is suspended in stream_response: this task only runs then)

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            streaming.uncancel()  # the client is gone: nothing more to send, and not an error
        finally:
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if self._complete:
                raise RuntimeError("an event stream yielded a chunk after its LastChunk")
            last = isinstance(chunk, LastChunk)
            self._complete = last  # (before the send: the end wakes the disconnect listener)
            body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            await send({"type": "http.response.body", "body": body, "more_body": not last})
        if not self._complete:
            self._complete = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})


Handler = Callable[[Request], Awaitable[Response]]


class EpdApp(FastAPI):
    """FastAPI, with the generation routes served in front of it: a ``POST`` to a path given to
    :meth:`direct_post` goes straight to its handler, without FastAPI's router, dependency
    solving and the three middlewares Starlette wraps around every request (each wraps ``send``
    and ``receive``: ~0.15 ms of a one-token request here, measured with ``bench/p5_fabric_overhead.py``).
    The handler's exceptions go to the app's exception handlers, as Starlette's would. Everything
    else (other methods on those paths, a ``root_path``, the OpenAPI schema, lifespan) is the
    FastAPI app's; register the route there too, for the schema and the 405s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direct: dict[str, Handler] = {}
        #: wraps the whole app, direct routes included (``services.api.conventions``)
        self.outermost: Callable[[Any], Any] | None = None

    def direct_post(self, path: str, handler: Handler) -> None:
        if self.middleware_stack is not None:
            raise RuntimeError("direct routes are set before the app serves its first request")
        self._direct[path] = handler

    def route_of(self, scope: Any) -> str:
        """The route template that served ``scope`` (after it was served), "none" for no route:
        the ``handler`` label of the HTTP metrics."""
        if scope["path"] in self._direct and scope["method"] == "POST":
            return scope["path"]
        route = scope.get("route")
        return getattr(route, "path", None) or "none"

    def build_middleware_stack(self) -> Any:
        app = self._build_middleware_stack()
        return self.outermost(app) if self.outermost is not None else app

    def _build_middleware_stack(self) -> Any:
        stack = super().build_middleware_stack()
        direct = dict(self._direct)
        if not direct:
            return stack

        async def serve(scope: Any, receive: Any, send: Any) -> None:
            handler = None
            if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
                handler = direct.get(scope["path"])
            if handler is None:
                await stack(scope, receive, send)
                return
            request = Request(scope, receive, send)
            try:
                response = await handler(request)
            except Exception as exc:  # noqa: BLE001 - each goes to its registered handler, as under Starlette
                response = await self._handled(request, exc)
            await response(scope, receive, send)

        return serve

    async def _handled(self, request: Request, exc: Exception) -> Response:
        """The response of the exception handler registered for ``exc`` 's class or its nearest base."""
        for cls in type(exc).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                response = handler(request, exc)
                return await response if inspect.isawaitable(response) else response
        raise exc


def _stopping_error() -> ServiceUnavailable:
    return ServiceUnavailable("the API is shutting down before the request finished; retry it")


def create_app(settings: ApiSettings, *, freeze_heap: bool = False) -> EpdApp:
    """The API app. ``freeze_heap``: freeze the process's heap once the service has started
    (``shared.heap``; the API process's own entry point, never an app built in a test's process)."""
    service = ApiService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        if freeze_heap:
            freeze_startup_heap()
        try:
            yield
        finally:
            await service.stop()

    app = EpdApp(title="epd-serve", lifespan=lifespan)
    app.state.service = service
    app.outermost = lambda inner: HttpConventions(
        with_cors(inner, settings), access_log_on=settings.access_log, route_of=app.route_of
    )
    #: /tokenize, /detokenize, echo of a token-id prompt (loaded on first use)
    tokenizer = Tokenizer(service.identity.model_path)
    #: /tokenize of a chat with images or videos: their placeholder tokens (loaded on first use)
    media_counter = MediaCounter(service.identity.model_path)
    # The context served (EPD_MAX_MODEL_LEN, which both engines honour, or the model's): max_tokens
    # is refused above it here; prompt + max_tokens over it is refused by the worker that
    # tokenized the prompt (a 400 naming the same limit).
    context_len, context_source = context_length(service.identity.model_path, settings.model.max_model_len)
    if settings.max_tokens_limit is not None and settings.max_tokens_limit < context_len:
        max_tokens_limit, max_tokens_source = settings.max_tokens_limit, "EPD_MAX_TOKENS_LIMIT"
    else:
        max_tokens_limit, max_tokens_source = context_len, context_source
    #: ``created`` of the model card: when the model folder's config.json was written (the same on
    #: every API replica and across restarts, unlike the API's start time)
    model_created = _mtime(service.identity.model_path / "config.json")
    # epd:* and vllm:* request metrics (shared.metrics.ApiRequestMetrics), one tracker per choice
    # (vLLM counts each of a request's n choices as a request of its own)
    request_metrics = metrics.ApiRequestMetrics(service.model_name, max_model_len=context_len)
    # tool_choice "auto" and tool conversations: decided once, from the chat template the workers
    # render (a template that renders tools and asks for a call format parsed here)
    tool_parser = parser_for_model(service.identity.model_path)
    log.info(
        "tool calling (tool_choice auto): %s",
        f"the {tool_parser.name} parser" if tool_parser else "off (the chat template renders no tool calls)",
    )
    # what a request that leaves a sampling field out gets: the model's generation config, as on
    # vLLM's server (EPD_GENERATION_CONFIG), checked here once (a bad default stops the start-up)
    sampling_defaults = load_sampling_defaults(service.identity.model_path, settings.generation_config)
    check_sampling_defaults(sampling_defaults)
    log.info("sampling defaults: %s from %s", sampling_defaults.given() or "OpenAI's", sampling_defaults.source)

    @app.exception_handler(EPDError)
    async def _epd_error(request: Request, exc: EPDError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Starlette's own answers (no such route, wrong method) in OpenAI's shape too.
        err: EPDError
        if exc.status_code == 404:
            err = NotFound(f"Invalid URL ({request.method} {request.url.path})")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed for {request.url.path}")
        else:
            err = EPDError(str(exc.detail))
            err.http_status, err.code = exc.status_code, f"http_{exc.status_code}"
            err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = error_response(err)
        for name, value in (exc.headers or {}).items():  # (405: Allow)
            response.headers[name] = value
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # FastAPI's parameter validation (a query parameter of the wrong type): a 400, not its 422.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
        param = ".".join(loc) or None
        return error_response(InvalidRequest(f"'{param}': {first.get('msg', 'invalid value')}", param=param))

    @app.exception_handler(nats.errors.Error)
    async def _nats_error(request: Request, exc: nats.errors.Error):
        return _finish_error(nats_unavailable(f"{request.method} {request.url.path}", exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # What nobody anticipated still gets an OpenAI-shaped error; the id ties it to the traceback.
        error_id = uuid.uuid4().hex[:12]
        log.error("unexpected error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return error_response(EPDError(f"internal error {error_id} ({type(exc).__name__}); see the API log"))

    def check_auth(request: Request) -> None:
        if not settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.encode(), key.encode()) for key in settings.api_keys
        ):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer <key>)")

    @app.get("/health")
    async def health():
        live = service.workers.live()
        connected = await service.nats_answers()
        body = {
            "status": "ok" if connected else "unavailable",
            "nats": connected,
            "model": service.model_name,
            "encoder_fingerprint": service.fingerprint,
            "workers": {role: len(hbs) for role, hbs in live.items()},
        }
        return JSONResponse(body, status_code=200 if connected else 503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        """vLLM's (and SageMaker's) liveness probe: an empty 200 while NATS answers, else 503."""
        if not await service.nats_answers():
            raise ServiceUnavailable("NATS does not answer")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        if not settings.metrics_public:
            check_auth(request)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/requests")
    async def debug_requests(
        request: Request, format: str = "html", status: str | None = None, since_s: float = 3600.0, limit: int = 50
    ):
        """Recent requests, newest first, with their status, each linking its waterfall page
        (``?format=json``: the list; ``status``: ok, error, cancelled or incomplete)."""
        check_auth(request)
        if status and status not in history.STATUSES:
            raise InvalidRequest(f"unknown status {status!r}: use {', '.join(history.STATUSES)}", param="status")
        if service.nc is None or not service.nc.is_connected:
            raise ServiceUnavailable("not connected to NATS")
        summaries = await history.list_requests(
            service.nc, service.subjects, since_s=since_s, status=status or None, limit=limit
        )
        if format == "json":
            return JSONResponse({"requests": [s.to_json() for s in summaries]})
        return HTMLResponse(_requests_index_html(summaries, status=status, since_s=since_s))

    @app.get("/debug/requests/{request_id}")
    async def debug_request(request: Request, request_id: str, format: str = "html"):
        """The request's waterfall page (``?format=json``: its messages and timeline as JSON)."""
        check_auth(request)
        if service.nc is None or not service.nc.is_connected:
            raise ServiceUnavailable("not connected to NATS")
        case = await history.find_case(service.nc, service.subjects, request_id)
        tl = timeline.build_timeline(case)
        if format == "json":
            return JSONResponse({"case": case.to_json(), "timeline": tl.to_json()})
        # (relative: right behind a proxy's path prefix too)
        return HTMLResponse(timeline.render_html(case, tl, index_href="../requests"))

    def model_card() -> dict[str, Any]:
        # root / parent as vLLM answers them: its `bench serve` reads root when --model is left out.
        return {
            "id": service.model_name,
            "object": "model",
            "created": model_created,
            "owned_by": "epd-serve",
            "root": service.model_name,
            "parent": None,
            "max_model_len": context_len,
        }

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str):
        check_auth(request)
        check_model(model_id, service.model_name)
        return model_card()

    @app.get("/version")
    async def version():
        try:
            return {"version": importlib.metadata.version("epd-serve")}
        except importlib.metadata.PackageNotFoundError:
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` -> token ids. A chat's image and
        video parts are loaded as a chat request's (``media_io_kwargs`` included) and stand as the
        placeholder tokens the engine expands them to (``MediaCounter``): ``count`` is the chat's
        ``usage.prompt_tokens``."""
        check_auth(request)
        req = parse_tokenize_request(
            parse_json_body(await _read_body(request, settings.max_body_bytes)),
            served_model=service.model_name,
            tool_parser=tool_parser,
            max_images=settings.max_images_per_request,
            max_videos=settings.max_videos_per_request,
        )
        if req.messages is not None:
            text = await tokenizer.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
            )
        else:
            assert req.prompt is not None
            text = req.prompt
        tokens = await tokenizer.encode_prompt(text, add_special_tokens=req.add_special_tokens)
        if req.media:
            try:
                media = await asyncio.wait_for(
                    service.load_media(req.media, req.video_sampling), timeout=settings.request_timeout_s
                )
            except TimeoutError:
                raise DeadlineExceeded("the request passed its deadline while loading its media") from None
            tokens = await media_counter.expand(text, tokens, media, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(tokens), "max_model_len": context_len, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = await tokenizer.token_strs(tokens)
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's ``/detokenize``: token ids -> ``{"prompt": text}``."""
        check_auth(request)
        tokens = parse_detokenize_request(
            parse_json_body(await _read_body(request, settings.max_body_bytes)), served_model=service.model_name
        )
        return {"prompt": await tokenizer.decode(tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, Endpoint.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, Endpoint.COMPLETIONS)

    # (served in front of FastAPI: the hot path; the routes above are what the schema shows)
    app.direct_post("/v1/chat/completions", chat_completions)
    app.direct_post("/v1/completions", completions)

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        received_at = time.time()
        check_auth(request)
        # A client's X-Request-Id (checked by HttpConventions) is part of the id, as in vLLM's
        # chatcmpl-<X-Request-Id>; a random suffix keeps two requests with one id apart (a proxy
        # retrying with the same header): the id names NATS subjects and dedup keys.
        given = client_request_id(request.scope)
        unique = f"{given}-{uuid.uuid4().hex[:8]}" if given else uuid.uuid4().hex
        request_id = f"{'chatcmpl' if endpoint == Endpoint.CHAT else 'cmpl'}-{unique}"
        token = REQUEST_ID.set(request_id)
        trace = set_trace("api", received_at=received_at)  # headers of everything published below
        metrics.IN_FLIGHT.labels("api").inc()
        parsed: ParsedRequest | None = None
        submitted = False  # a generation job was published: from then on the workers record the end

        async def refused(exc: EPDError) -> JSONResponse:
            """A request refused before any job was published: a 4xx or 502 is recorded (a
            ``ChatRequestRecord`` and its ``ErrorEvent``, best effort), so ``epd replay list
            --status error`` and the debug pages show it; its id is in ``X-Request-Id``."""
            if not submitted and (400 <= exc.http_status < 500 or exc.http_status == 502):
                await service.record_refused(request_id, received_at, parsed, exc)
            response = _finish_error(exc)
            response.headers["X-Request-Id"] = request_id
            return response

        try:
            body = parse_json_body(await _read_body(request, settings.max_body_bytes))
            if endpoint == Endpoint.CHAT:
                parsed = parse_chat_request(
                    body,
                    served_model=service.model_name,
                    max_images=settings.max_images_per_request,
                    max_videos=settings.max_videos_per_request,
                    max_tokens_limit=max_tokens_limit,
                    max_tokens_source=max_tokens_source,
                    default_max_tokens=settings.default_max_tokens,
                    tool_parser=tool_parser,
                    defaults=sampling_defaults,
                )
            else:
                parsed = parse_completion_request(
                    body,
                    served_model=service.model_name,
                    max_tokens_limit=max_tokens_limit,
                    max_tokens_source=max_tokens_source,
                    default_max_tokens=settings.default_max_tokens,
                    defaults=sampling_defaults,
                )
                if parsed.echo and isinstance(parsed.prompt, tuple):
                    parsed.echo_text = await tokenizer.decode(parsed.prompt, param="prompt")
            deadline = received_at + settings.request_timeout_s
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
                request_metrics.submitted(received_at, max_tokens=parsed.sampling.max_tokens) for _ in range(parsed.n)
            ]
            log.info("accepted: %d image(s), %d choice(s), stream=%s", len(images), parsed.n, parsed.stream)
            try:
                if not parsed.stream:
                    try:
                        response = await _unless_interrupted(
                            _complete(events, request_id, parsed, received_at, tracked), service.stopping, request
                        )
                        response.headers["X-Request-Id"] = request_id
                        return response
                    finally:
                        _close_all(tracked)
                        await events.aclose()
                # Wait for the first event so an early failure still gets a real HTTP status.
                first = await _unless_interrupted(anext(events), service.stopping, request)
                if isinstance(first[1], ErrorEvent):
                    raise _event_error(first[1])
            except ClientDisconnected:
                _close_all(tracked)
                service.cancel_in_background(events, Cancelled("the client disconnected"))
                raise
            except BaseException as exc:  # the request's end was not delivered: its work is wasted
                _close_all(tracked)
                service.cancel_in_background(events, Cancelled(f"the API gave up: {type(exc).__name__}"))
                raise
            return EventStreamResponse(
                _sse(first, events, request_id, parsed, received_at, service, tracked),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        except ClientDisconnected:
            log.info("client disconnected: request cancelled")
            metrics.REQUESTS.labels("499").inc()
            return error_response(Cancelled("the client disconnected"))  # nobody reads it
        except nats.errors.Error as exc:  # (its TimeoutError is an asyncio.TimeoutError: not the deadline)
            return await refused(nats_unavailable("submitting the request", exc))
        except TimeoutError:
            return await refused(DeadlineExceeded("the request passed its deadline while loading images"))
        except EPDError as exc:
            return await refused(exc)
        finally:
            metrics.IN_FLIGHT.labels("api").dec()
            TRACE_HEADERS.reset(trace)
            REQUEST_ID.reset(token)

    return app


def _requests_index_html(summaries: list[history.Summary], *, status: str | None, since_s: float) -> str:
    """The ``/debug/requests`` page: a self-contained table (no script, no external asset) that
    fits a 1280 px wide window: fixed column widths, ids cut with an ellipsis (whole in their
    tooltip), errors wrapped."""
    e = html.escape

    def ms(seconds: float | None) -> str:
        return "" if seconds is None else f"{seconds * 1e3:.0f}"

    rows = []
    for s in summaries:
        tokens = "" if s.completion_tokens is None else f"{s.prompt_tokens or 0} / {s.completion_tokens}"
        link = f"/debug/requests/{urllib.parse.quote(s.request_id, safe='')}"
        received = history.iso_time(s.received_at)  # (the time of day shown; the date in its tooltip)
        rows.append(
            f'<tr class="{e(s.status)}"><td class="id" title="{e(s.request_id)}"><a href="{e(link)}">'
            f'{e(s.request_id)}</a></td><td title="{e(received)}">{e(received[11:])}</td><td>{e(s.status)}</td>'
            f'<td class="n">{s.images}</td><td class="n">{tokens}</td><td class="n">{ms(s.ttft_s)}</td>'
            f'<td class="n">{ms(s.e2e_s)}</td><td class="err">{e(s.error)}</td>'
            f'<td class="id" title="{e(s.replay_of)}">{e(s.replay_of)}</td></tr>'
        )
    shown = f"status {e(status)}, " if status else ""
    widths = (28, 10, 7, 6, 9, 5, 5, 21, 9)  # percent: request, received, ..., error, replay of
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>epd-serve: recent requests</title><style>"
        "body{font:14px system-ui,sans-serif;margin:1.5em}"
        "table{border-collapse:collapse;width:100%;table-layout:fixed}"
        "td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top;"
        "overflow:hidden;text-overflow:ellipsis;white-space:nowrap}"
        "th{white-space:normal}td.id{font:12px ui-monospace,monospace}td.n{text-align:right}"
        "td.err{white-space:normal;overflow-wrap:anywhere}"
        "tr.error td,tr.cancelled td{color:#b3261e}tr.incomplete td{color:#8a6d00}</style></head><body>"
        f"<h1>Recent requests</h1><p>{len(summaries)} request(s), newest first ({shown}received within "
        f'{since_s:g} s). Filter: <a href="?status=error">errors</a>, <a href="?">all</a>; '
        "<code>?format=json</code> for the list.</p>"
        "<table><colgroup>"
        + "".join(f'<col style="width:{w}%">' for w in widths)
        + "</colgroup><tr><th>request</th><th>received (UTC)</th><th>status</th><th>images</th>"
        "<th>tokens (prompt / completion)</th><th>TTFT ms</th><th>E2E ms</th><th>error</th><th>replay of</th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )


def context_length(model_dir: Path, max_model_len: int | None) -> tuple[int, str]:
    """The context length served and what sets it: ``EPD_MAX_MODEL_LEN`` when it is below the
    model's ``max_position_embeddings`` (it can only lower it, as the engines apply it), else the
    model's."""
    model_len = metrics.model_max_len(model_dir)
    if max_model_len and max_model_len < model_len:
        return max_model_len, "the context length set by EPD_MAX_MODEL_LEN (epd up --max-model-len)"
    return model_len, (
        "the model's context length (max_position_embeddings in its config.json; EPD_MAX_MODEL_LEN lowers it)"
    )


def _mtime(path: Path) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return int(time.time())


def _finish_error(exc: EPDError) -> JSONResponse:
    level = logging.WARNING if exc.http_status < 500 else logging.ERROR
    log.log(level, "request failed: %s %s: %s", exc.http_status, exc.code, exc.message)
    metrics.REQUESTS.labels(str(exc.http_status)).inc()
    return error_response(exc)


def _event_error(event: ErrorEvent) -> EPDError:
    err = error_from_code(event.code, event.message)
    err.http_status = event.http_status
    err.param = event.param or None
    return err


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _close_all(tracked: list[metrics.RequestMetrics]) -> None:
    for t in tracked:
        t.close()


def _observe_final(tracked: metrics.RequestMetrics, final: FinalResult) -> None:
    """E2E, time per output token, token counts and the finish reason of a completed choice."""
    tracked.finished(final.finish_reason, final.prompt_tokens, final.completion_tokens)


async def _complete(
    events: ChoiceStreams,
    request_id: str,
    parsed: ParsedRequest,
    received_at: float,
    tracked: list[metrics.RequestMetrics],
) -> JSONResponse:
    results = [ChoiceResult() for _ in range(len(events))]
    async for index, event in events:
        if isinstance(event, TokenChunk):
            tracked[index].tokens(len(event.token_ids))  # TTFT, inter-token latency
            results[index].chunks.append(event)
        elif isinstance(event, ErrorEvent):
            raise _event_error(event)
        elif isinstance(event, FinalResult):
            results[index].final = event
            _observe_final(tracked[index], event)
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


#: SSE chunks' JSON: compact UTF-8, as vLLM's server writes them (0.3 us a chunk; json.dumps 3 us).
_json = msgspec.json.Encoder().encode


async def _sse(
    first: tuple[int, Any],
    events: ChoiceStreams,
    request_id: str,
    parsed: ParsedRequest,
    received_at: float,
    service: ApiService,
    tracked: list[metrics.RequestMetrics],
) -> AsyncIterator[bytes]:
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
                            index, event = await _unless_interrupted(anext(events), service.stopping)
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
                    _observe_final(tracked[index], event)
                    data(shaper.finish(index, event))
                elif isinstance(event, ErrorEvent):
                    raise _event_error(event)
            if len(finals) != parsed.n:
                raise ServiceUnavailable("token stream ended without a result")
            ordered = [finals[i] for i in range(parsed.n)]
            if parsed.include_usage:
                data(shaper.usage(ordered))
            metrics.REQUESTS.labels("200").inc()
        except EPDError as exc:
            # Headers are gone: report in-band, the way OpenAI-compatible servers do.
            log.error("stream failed: %s: %s", exc.code, exc.message)
            metrics.REQUESTS.labels(str(exc.http_status)).inc()
            data(_error_body(exc))
        except nats.errors.Error as exc:
            log.error("stream failed: NATS: %s: %s", type(exc).__name__, exc)
            err = nats_unavailable("streaming tokens", exc)
            metrics.REQUESTS.labels(str(err.http_status)).inc()
            data(_error_body(err))
        ready.append(b"data: [DONE]\n\n")
        yield LastChunk(flush())
    finally:
        _close_all(tracked)
        if not events.ended:  # the client went away mid-stream, the API is stopping, or this generator failed
            log.info("stream closed before the request ended: request cancelled")
        why = "the API stopped" if service.stopping.is_set() else "the client disconnected mid-stream"
        # In the background: when the client is gone this task is being cancelled. (A stream that
        # ended has closed itself; cancelling closes one that did not.)
        service.cancel_in_background(events, Cancelled(why))
        metrics.IN_FLIGHT.labels("api_stream").dec()
        REQUEST_ID.reset(token)
