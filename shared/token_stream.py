"""Streaming a generation's token events to the API: ``TokenChunk`` s numbered by ``seq``.

Used by every worker that generates (prefill in E|PD, decode in E|P|D on a connector engine).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Iterator

from shared.errors import DeadlineExceeded
from shared.protocol import GenerationJob, TokenChunk
from shared.worker import WorkerContext

_DONE = object()


class TokenOutput:
    """Publishes a request's token events as ``TokenChunk`` s (seq = token index) and keeps what
    went out, for the FinalResult or the DecodeJob."""

    def __init__(self, ctx: WorkerContext, job: GenerationJob, attempt: int):
        self.ctx = ctx
        self.job = job
        self.attempt = attempt
        self.subject = ctx.subjects.tokens(job.request_id)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason = "length"
        self.first_token_at: float | None = None

    async def publish(self, event) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        chunk = TokenChunk(
            request_id=self.job.request_id, attempt=self.attempt, seq=len(self.token_ids),
            token_ids=(event.token_id,), text=event.text,
        )
        self.token_ids.append(event.token_id)
        self.text_parts.append(event.text)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        await self.ctx.publisher.publish(self.subject, chunk, request_id=self.job.request_id)


async def stream_events(out: TokenOutput, make_events: Callable[[], Iterator[Any]],
                        run: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
    """Drive ``make_events()`` (an iterator of TokenEvents) with ``run`` (the worker's engine
    thread, or ``asyncio.to_thread`` for an engine that batches concurrent calls itself) and
    publish every event as it comes. Stops the engine once the request's deadline has passed."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def produce() -> None:
        try:
            for event in make_events():
                loop.call_soon_threadsafe(queue.put_nowait, event)
                if time.time() > out.job.deadline:  # nobody is waiting any more: free the engine
                    raise DeadlineExceeded("request deadline passed during generation")
        except BaseException as exc:  # re-raised on the event loop side
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        else:
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    compute = asyncio.ensure_future(run(produce))
    while True:
        event = await queue.get()
        if event is _DONE:
            break
        if isinstance(event, BaseException):
            await compute
            raise event
        await out.publish(event)
    await compute
