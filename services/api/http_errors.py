"""Typed ``shared.errors`` to OpenAI-shaped HTTP errors - here and only here: the error body, the
response, an ``ErrorEvent`` read back as its typed error, and the app's exception handlers (every
exception a route raises, FastAPI's and Starlette's own included, answers in OpenAI's shape)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import nats
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared import metrics
from shared.errors import EPDError, InvalidRequest, MethodNotAllowed, NotFound, error_from_code
from shared.jetstream import nats_unavailable
from shared.protocol import ErrorEvent

log = logging.getLogger(__name__)


def error_body(err: EPDError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": err.code}}


def error_response(err: EPDError) -> JSONResponse:
    return JSONResponse(status_code=err.http_status, content=error_body(err))


def finish_error(exc: EPDError) -> JSONResponse:
    """A request's end in an error: logged, counted (``epd_requests_total``) and answered."""
    level = logging.WARNING if exc.http_status < 500 else logging.ERROR
    log.log(level, "request failed: %s %s: %s", exc.http_status, exc.code, exc.message)
    metrics.REQUESTS.labels(str(exc.http_status)).inc()
    return error_response(exc)


def event_error(event: ErrorEvent) -> EPDError:
    """The typed error of a request's ``ErrorEvent`` (its HTTP status and param as the worker set them)."""
    err = error_from_code(event.code, event.message)
    err.http_status = event.http_status
    err.param = event.param or None
    return err


async def _epd_error(request: Request, exc: EPDError):
    return error_response(exc)


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


async def _validation_error(request: Request, exc: RequestValidationError):
    # FastAPI's parameter validation (a query parameter of the wrong type): a 400, not its 422.
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
    param = ".".join(loc) or None
    return error_response(InvalidRequest(f"'{param}': {first.get('msg', 'invalid value')}", param=param))


async def _nats_error(request: Request, exc: nats.errors.Error):
    return finish_error(nats_unavailable(f"{request.method} {request.url.path}", exc))


async def _unexpected(request: Request, exc: Exception):
    # What nobody anticipated still gets an OpenAI-shaped error; the id ties it to the traceback.
    error_id = uuid.uuid4().hex[:12]
    log.error("unexpected error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
    return error_response(EPDError(f"internal error {error_id} ({type(exc).__name__}); see the API log"))


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a route of ``app`` raises answered in OpenAI's error shape."""
    app.exception_handler(EPDError)(_epd_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(nats.errors.Error)(_nats_error)
    app.exception_handler(Exception)(_unexpected)
