"""What every HTTP response of the API gets, as vLLM's OpenAI server gives it: an ``X-Request-Id``
header, one access-log line, the ``http_requests_total`` / ``http_request_duration_seconds``
metrics and, when configured, CORS.

One pure ASGI wrapper around the whole app, the generation routes served in front of FastAPI
included (``services.api.asgi.EpdApp``): Starlette's middlewares would each wrap ``send`` and
``receive`` again and never see those routes.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import msgspec
from starlette.middleware.cors import CORSMiddleware

from shared import metrics

ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]

#: the access log: one line per request (``EPD_ACCESS_LOG``), as uvicorn's ``uvicorn.access``
access_log = logging.getLogger("epd.access")

#: a client's ``X-Request-Id`` the API takes: it becomes part of NATS subjects and message ids,
#: so letters, digits, ``-`` and ``_`` only (a UUID, a W3C trace id, nginx's ``$request_id``)
MAX_CLIENT_REQUEST_ID = 128
_CLIENT_REQUEST_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_CLIENT_REQUEST_ID}}}")
#: where the wrapper leaves a client's valid ``X-Request-Id`` for the handlers (the scope's key)
CLIENT_REQUEST_ID = "epd.client_request_id"
_HEADER = b"x-request-id"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def client_request_id(scope: MutableMapping[str, Any]) -> str | None:
    """The valid ``X-Request-Id`` the client sent with this request, if any."""
    return scope.get(CLIENT_REQUEST_ID)


def with_cors(
    app: ASGIApp,
    *,
    origins: Sequence[str],
    methods: Sequence[str],
    headers: Sequence[str],
    credentials: bool,
) -> ASGIApp:
    """``app`` behind Starlette's CORS middleware when ``origins`` (``EPD_ALLOWED_ORIGINS``) are
    given (preflight ``OPTIONS`` answered, ``Access-Control-*`` headers on the responses to allowed
    origins, and ``X-Request-Id`` readable by the page); else ``app`` as it is (a browser's
    cross-origin call is refused by the browser; a preflight gets a 405). ``methods``, ``headers``,
    ``credentials``: ``EPD_ALLOWED_METHODS``, ``EPD_ALLOWED_HEADERS``, ``EPD_ALLOW_CREDENTIALS``."""
    if not origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=list(methods),
        allow_headers=list(headers),
        allow_credentials=credentials,
        expose_headers=["X-Request-Id"],
    )


class HttpConventions:
    """The outermost ASGI layer of the API (see the module's docstring).

    ``X-Request-Id``: a client's valid one is echoed on the response (and the generation routes
    make it part of their request id, ``services.api.serving_generation``); one of another shape is refused
    with a 400; without one the response carries the request's own id (a generation request's
    ``chatcmpl-...``) or a fresh one."""

    def __init__(self, app: ASGIApp, *, access_log_on: bool, route_of: Callable[[MutableMapping[str, Any]], str]):
        self.app = app
        self.access_log_on = access_log_on
        self.route_of = route_of
        #: (method, status class, handler) -> its counter and histogram children (``labels()`` each
        #: time costs ~10 us a request)
        self._series: dict[tuple[str, int, str], tuple[Any, Any]] = {}

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = None
        for name, value in scope["headers"]:
            if name == _HEADER:
                given = value.decode("latin-1")
                break
        status = 500  # (an exception before the response started: the server answers 500)
        shown_id = given

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            nonlocal status, shown_id
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _HEADER or shown_id is None]
                if shown_id is None:
                    own = next((v for k, v in headers if k.lower() == _HEADER), None)
                    if own is None:
                        shown_id = uuid.uuid4().hex
                        headers.append((_HEADER, shown_id.encode()))
                    else:
                        shown_id = own.decode("latin-1")
                else:
                    headers.append((_HEADER, shown_id.encode("latin-1")))
                message["headers"] = headers
            await send(message)

        try:
            if given is not None and not _CLIENT_REQUEST_ID.fullmatch(given):
                shown_id = None  # (not echoed: the API's own id)
                await _bad_request_id(send_with_id)
            else:
                scope[CLIENT_REQUEST_ID] = given
                await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            handler = self.route_of(scope)
            method = scope["method"]
            # (a client picks the method: the metrics' label takes the standard ones only)
            label = method if method in _METHODS else "other"
            if handler not in metrics.HTTP_EXCLUDED_HANDLERS:
                key = (label, status // 100, handler)
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = (
                        metrics.HTTP_REQUESTS.labels(label, f"{status // 100}xx", handler),
                        metrics.HTTP_REQUEST_DURATION.labels(label, handler),
                    )
                series[0].inc()
                series[1].observe(elapsed)
            if self.access_log_on:
                client = scope.get("client")
                query = scope.get("query_string", b"")
                access_log.info(
                    '%s - "%s %s%s HTTP/%s" %d %.1f ms',
                    f"{client[0]}:{client[1]}" if client else "-",
                    method,
                    scope.get("root_path", "") + scope["path"],
                    "?" + query.decode("latin-1") if query else "",
                    scope.get("http_version", "1.1"),
                    status,
                    elapsed * 1e3,
                    extra={"request_id": shown_id or "-"},
                )


async def _bad_request_id(send: Any) -> None:
    body = msgspec.json.encode(
        {
            "error": {
                "message": f"'X-Request-Id' must be 1-{MAX_CLIENT_REQUEST_ID} letters, digits, '-' or '_'",
                "type": "invalid_request_error",
                "param": "X-Request-Id",
                "code": "invalid_request_id",
            }
        }
    )
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
