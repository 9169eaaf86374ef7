"""Streaming a generation's token events to the API: ``TokenChunk`` s numbered by ``seq``.

Used by every worker that generates (prefill in E|PD / agg / when a hand-off is impossible,
decode in E|P|D). The engine's async iterator is consumed here directly; leaving it (the
request's deadline passed, the job task was cancelled) closes it, which cancels the request
inside the engine.

A chunk is on its way before the previous one's JetStream acknowledgement is awaited, and the
``FinalResult`` before the last chunk's (:meth:`TokenOutput.end`): one round trip to NATS per
chunk less on the token path, and none between a request's last token and its end. The last
token (the engine's event with a ``finish_reason``) goes out with the ``FinalResult``
(``FinalResult.last_chunk``), not as a message of its own - unless a hand-off comes first
(:meth:`TokenOutput.flush` sends it): one message fewer per request for the worker, NATS and
the API to handle, which is most of a one-token request's messages. The order
holds (one connection queues them in order, one stream stores them in order), and nothing is
acknowledged to the job queue before every chunk was stored: :meth:`TokenOutput.end` and
:meth:`TokenOutput.flush` (before a hand-off) wait for the acknowledgements. A chunk JetStream did
not acknowledge (its stream's leader died with it, the connection moved to another NATS server) is
published again, retried through the stream's election: it is stored after the chunks sent
behind it, and the API, which holds what arrives past a gap, reads it from the store or hears it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from shared import protocol
from shared.errors import DeadlineExceeded, ServiceUnavailable
from shared.protocol import FinalResult, TokenChunk

if TYPE_CHECKING:
    from shared.engines.base import TokenEvent
    from shared.jetstream import PendingAck
    from shared.worker import WorkerContext

log = logging.getLogger(__name__)


class TokenOutput:
    """Publishes a request's token events as ``TokenChunk`` s (seq = token index, starting at
    ``first_seq``: the tokens an earlier stage already sent; each with the token's
    ``TokenLogprob`` when the engine gave one) and keeps what went out, for the FinalResult or
    the DecodeJob."""

    def __init__(
        self,
        ctx: WorkerContext,
        request_id: str,
        attempt: int,
        *,
        first_seq: int = 0,
        on_first_token: Callable[[], Awaitable[None]] | None = None,
    ):
        """``on_first_token``: awaited once the first token is out (the prompt was prefilled)."""
        self.ctx = ctx
        self.on_first_token = on_first_token
        self.request_id = request_id
        self.attempt = attempt
        self.first_seq = first_seq
        self.subject = ctx.subjects.tokens(request_id)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason = "length"
        self.first_token_at: float | None = None
        #: the last chunk sent and its acknowledgement, not awaited yet
        self._unconfirmed: tuple[TokenChunk, PendingAck] | None = None
        #: the generation's last chunk (its event had a finish reason), not sent yet: it goes
        #: with the result (:meth:`end`), or on its own before a hand-off (:meth:`flush`)
        self._last: TokenChunk | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    async def publish(self, event: TokenEvent) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        chunk = TokenChunk(
            request_id=self.request_id,
            attempt=self.attempt,
            seq=self.first_seq + len(self.token_ids),
            token_ids=(event.token_id,),
            text=event.text,
            logprobs=(event.logprob,) if event.logprob is not None else (),
        )
        self.token_ids.append(event.token_id)
        self.text_parts.append(event.text)
        await self._send_last()  # (an event after a finished one: the engine's to answer for; kept in order)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            self._last = chunk  # sent with the result
        else:
            await self._send(chunk)
        if self.on_first_token is not None and len(self.token_ids) == 1:
            await self.on_first_token()

    async def _send(self, chunk: TokenChunk) -> None:
        sent = await self.ctx.publisher.send(self.subject, chunk, request_id=self.request_id)
        await self._confirm()  # the previous chunk's acknowledgement (this one is on its way meanwhile)
        self._unconfirmed = (chunk, sent)

    async def _send_last(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            await self._send(last)

    async def flush(self) -> None:
        """Send the last chunk if it is still held for the result, and wait until JetStream
        stored every chunk sent so far: before a hand-off, whose next stage streams the next
        chunks."""
        await self._send_last()
        await self._confirm()

    async def _confirm(self) -> None:
        """Wait for the acknowledgement of the chunk sent last. A chunk JetStream did not
        acknowledge is published again, through an election; ``ServiceUnavailable`` when that
        failed too."""
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        if unconfirmed is None:
            return
        chunk, sent = unconfirmed
        try:
            await sent.confirmed()
        except ServiceUnavailable as exc:
            log.info("token chunk %d not stored (%s): publishing it again", chunk.seq, exc.message)
            msg_id = protocol.token_chunk_msg_id(chunk)
            await self.ctx.publisher.publish(self.subject, chunk, request_id=self.request_id, msg_id=msg_id)

    async def end(self, final: FinalResult) -> None:
        """Publish the request's ``final``, with the last chunk when it is still held (after the
        chunks before it, without waiting for their acknowledgement first), then wait until the
        chunks are stored too: the job may be acked."""
        last, self._last = self._last, None
        if last is not None:
            final = final.with_last_chunk(last)
        await self.ctx.publisher.publish(
            self.subject, final, request_id=self.request_id, msg_id=protocol.final_result_msg_id(self.request_id)
        )
        await self._confirm()

    async def stream(self, events: AsyncIterator[TokenEvent], *, deadline: float, what: str = "generation") -> None:
        """Publish every event of ``events`` as it comes. At ``deadline`` (epoch seconds) stop
        - closing the iterator cancels the request in the engine - and raise DeadlineExceeded
        ("... during <what>")."""
        timeout = asyncio.timeout(max(0.0, deadline - time.time()))
        try:
            async with timeout:
                async for event in events:
                    await self.publish(event)
        except TimeoutError:
            if not timeout.expired():  # another timeout (a publish): not the request's deadline
                raise
            raise DeadlineExceeded(f"request deadline passed during {what}") from None
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
