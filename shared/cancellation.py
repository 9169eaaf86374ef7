"""Request cancellation: the caller gave up, so the workers stop spending time on the request.

The API (``shared.client.RequestClient.abandon``) publishes a :class:`~shared.protocol.RequestCancelled`
on ``<p>.control.cancel.<request_id>`` when its client disconnects, the request passes its deadline,
or the API fails after submitting it. The record is kept in the ``<P>_CONTROL`` stream, so:

* a worker that **takes** a job checks the record (one JetStream read,
  :meth:`RequestRecords.is_cancelled`) and drops the job of a cancelled request (ack, no work).
  A first delivery published while the worker was listening to every cancellation (the core
  subscription below, connected since before the job was published) is checked against the
  cancellations it heard instead (:meth:`RequestRecords.heard_cancelled`): no round trip on the
  hot path. Only a redelivery can have completed already, so only it needs the results read;
* a worker **running** a job hears the same message on a core-NATS subscription
  (``Subjects.cancel_all``) and cancels the job's task: the engine's generation is closed, which
  stops it within one engine step on both engines (the transformers decode loop drops the row,
  vLLM aborts the request), and the slot frees.

Encode jobs are shared: one job per image, whoever asked first (``Nats-Msg-Id`` = EC key). A
request whose own encode job was deduplicated publishes :class:`~shared.protocol.ECWanted` for the
item, and the encoder drops a cancelled request's job only when no live request wants it
(:meth:`RequestRecords.wanted_elsewhere`); when it does drop one, it publishes ``ECFailed``
(``cancelled``), so a request that wanted it after all encodes locally instead of waiting.

**Ended requests** (:meth:`RequestRecords.ended`): a job is also redelivered after its request
completed when the worker's ack was lost (a NATS node failed over between the final result and
the ack, or the worker died right after publishing it). The request's ``<p>.tokens.<request_id>``
subject in ``<P>_RESULTS`` ends with the :class:`~shared.protocol.FinalResult` or
:class:`~shared.protocol.ErrorEvent` once the request is over, so its last message is the
completion record: a worker taking a job reads it (one JetStream read, no extra write on the
hot path, done alongside the cancellation read) and acks the job of an ended request without
running it (``JobOutcome.ALREADY_DONE``).

Every check fails open: when NATS cannot answer, the job runs (a wasted job, never a lost one).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared import protocol
from shared.protocol import ECWanted, ErrorEvent, FinalResult, RequestCancelled, Subjects

log = logging.getLogger(__name__)


class Ended(enum.StrEnum):
    """Why a request needs no more work (:meth:`RequestRecords.ended`)."""

    #: the caller gave up (a ``RequestCancelled`` record)
    CANCELLED = "cancelled"
    #: its ``FinalResult`` was published
    COMPLETED = "completed"
    #: its ``ErrorEvent`` was published
    FAILED = "failed"


#: Seconds of clock difference allowed between the NATS server (a message's stream timestamp)
#: and a worker (when it started listening) before a first delivery is trusted to the heard set.
CLOCK_SKEW_S = 2.0
#: Cancellations a worker remembers (~100 bytes each); older ones are read from the stream.
HEARD_MAX = 50_000


class RequestRecords:
    """Reads what says a request is over: the cancellation records of ``<P>_CONTROL`` and the
    last message of the request's tokens subject in ``<P>_RESULTS`` (see the module docstring);
    and, for a worker's first deliveries, the cancellations the worker heard itself."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, nc: NATS | None = None):
        self.js = js
        self.subjects = subjects
        self._nc = nc
        #: request ids heard cancelled, oldest first (bounded by ``HEARD_MAX``)
        self._heard: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: since when (``time.time()``) every cancellation was heard; None: not listening
        self._complete_since: float | None = None
        self._reconnects = 0

    def listening(self) -> None:
        """The worker's subscription to every cancellation is in place (flushed to the server)."""
        assert self._nc is not None, "listening needs the connection"
        self._complete_since = time.time()
        self._reconnects = self._nc.stats["reconnects"]

    def heard(self, request_id: str) -> None:
        """A cancellation arrived on the subscription."""
        self._heard[request_id] = None
        while len(self._heard) > HEARD_MAX:
            self._heard.popitem(last=False)
            self._complete_since = time.time()  # what is forgotten now must be read again

    def heard_cancelled(self, request_id: str, published_at: float | None) -> bool | None:
        """Whether ``request_id`` was heard cancelled, for a job published at ``published_at``
        (its stream timestamp); None when the heard set may miss its cancellation (not listening
        then, a reconnect since - core NATS drops what is published meanwhile - or forgotten):
        read the record instead."""
        nc = self._nc
        if nc is None or self._complete_since is None or published_at is None:
            return None
        if nc.stats["reconnects"] != self._reconnects:  # the subscription had a gap: count from now
            self._reconnects = nc.stats["reconnects"]
            self._complete_since = time.time()
        if not nc.is_connected or published_at < self._complete_since + CLOCK_SKEW_S:
            return None
        return request_id in self._heard

    async def _last(self, subject: str, expect: type | None, stream: str | None = None):
        """The last message on ``subject`` (in ``stream``, default ``<P>_CONTROL``) decoded as
        ``expect`` (None: any protocol message); None when there is none or NATS cannot say."""
        try:
            raw = await self.js.get_last_msg(stream or self.subjects.stream_control, subject)
        except NotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - NATS hiccup: fail open (the job runs)
            log.debug("request record check on %s failed: %s: %s", subject, type(exc).__name__, exc)
            return None
        try:
            return protocol.decode(raw.data or b"", expect)
        except protocol.ProtocolError as exc:
            log.warning("ignoring an unreadable record on %s: %s", subject, exc)
            return None

    async def is_cancelled(self, request_id: str) -> bool:
        return await self._last(self.subjects.cancel(request_id), RequestCancelled) is not None

    async def result(self, request_id: str) -> FinalResult | ErrorEvent | None:
        """The request's final result or error event, when its tokens subject ends with one."""
        last = await self._last(self.subjects.tokens(request_id), None, self.subjects.stream_results)
        return last if isinstance(last, (FinalResult, ErrorEvent)) else None  # a TokenChunk: still running

    async def ended(self, request_id: str) -> Ended | None:
        """Whether the request is over (cancelled, or its result published); None while it is
        not, or when NATS cannot say (fail open). Both records are read at once: one round trip."""
        cancelled, result = await asyncio.gather(self.is_cancelled(request_id), self.result(request_id))
        if cancelled:
            return Ended.CANCELLED
        if isinstance(result, FinalResult):
            return Ended.COMPLETED
        if isinstance(result, ErrorEvent):
            return Ended.FAILED
        return None

    async def wanted_elsewhere(self, fingerprint: str, item_hash: str, request_id: str) -> bool:
        """Whether a request other than ``request_id`` waits on the encode job of this item and
        is not cancelled (the latest :class:`ECWanted` of the item names it)."""
        wanted = await self._last(self.subjects.ec_wanted(fingerprint, item_hash), ECWanted)
        if wanted is None or wanted.request_id == request_id:
            return False
        return not await self.is_cancelled(wanted.request_id)


def cancelled_request_id(subject: str) -> str:
    """The request id of a ``<p>.control.cancel.<request_id>`` subject."""
    return subject.rsplit(".", 1)[-1]


def cancel_record(request_id: str, reason: str) -> RequestCancelled:
    return RequestCancelled(request_id=request_id, reason=reason, created_at=time.time())
