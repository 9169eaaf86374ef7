"""The API's ASGI fast path: :class:`EpdApp` serves the generation routes in front of FastAPI's
router and middlewares (:meth:`EpdApp.direct_post`), and :class:`EventStreamResponse` streams a
response in the request's own task (no task group per response).

Nothing here knows a route: ``services.api.app`` registers them (``serving_*`` modules).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse


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
