"""How a request's wait for its events ends early: the API starting to stop (a 503) or its HTTP
client going away (:class:`ClientDisconnected`). The generation routes and the SSE stream wait
through :func:`unless_interrupted`."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from services.api.service import StopSignal
from shared.errors import ServiceUnavailable

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response."""


def stopping_error() -> ServiceUnavailable:
    return ServiceUnavailable("the API is shutting down before the request finished; retry it")


async def _until_disconnected(request: Request) -> None:
    # After the body was read, the server's next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_interrupted(awaitable: Awaitable[T], stopping: StopSignal, request: Request | None = None) -> T:
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
        raise stopping_error()
    interrupted: list[Exception] = []

    def interrupt(why: Exception) -> None:
        if not interrupted:
            interrupted.append(why)
            task.cancel()

    stop_listening = stopping.listen(lambda: interrupt(stopping_error()))
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
