"""Request cancellation: the caller gave up, so the workers stop spending time on the request.

The API (``shared.client.RequestClient.abandon``) publishes a :class:`~shared.protocol.RequestCancelled`
on ``<p>.control.cancel.<request_id>`` when its client disconnects, the request passes its deadline,
or the API fails after submitting it. The record is kept in the ``<P>_CONTROL`` stream, so:

* a worker that **takes** a job checks the record (one JetStream read,
  :meth:`CancelRecords.is_cancelled`) and drops the job of a cancelled request (ack, no work);
* a worker **running** a job hears the same message on a core-NATS subscription
  (``Subjects.cancel_all``) and cancels the job's task: the engine's generation is closed, which
  stops it within one engine step on both engines (the transformers decode loop drops the row,
  vLLM aborts the request), and the slot frees.

Encode jobs are shared: one job per image, whoever asked first (``Nats-Msg-Id`` = EC key). A
request whose own encode job was deduplicated publishes :class:`~shared.protocol.ECWanted` for the
item, and the encoder drops a cancelled request's job only when no live request wants it
(:meth:`CancelRecords.wanted_elsewhere`); when it does drop one, it publishes ``ECFailed``
(``cancelled``), so a request that wanted it after all encodes locally instead of waiting.

Every check fails open: when NATS cannot answer, the job runs (a wasted job, never a lost one).
"""

from __future__ import annotations

import logging
import time

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared import protocol
from shared.protocol import ECWanted, RequestCancelled, Subjects

log = logging.getLogger(__name__)


class CancelRecords:
    """Reads the cancellation records of ``<P>_CONTROL`` (see the module docstring)."""

    def __init__(self, js: JetStreamContext, subjects: Subjects):
        self.js = js
        self.subjects = subjects

    async def _last(self, subject: str, expect: type):
        try:
            raw = await self.js.get_last_msg(self.subjects.stream_control, subject)
        except NotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - NATS hiccup: fail open (the job runs)
            log.debug("cancellation check on %s failed: %s: %s", subject, type(exc).__name__, exc)
            return None
        try:
            return protocol.decode(raw.data or b"", expect)
        except protocol.ProtocolError as exc:
            log.warning("ignoring an unreadable record on %s: %s", subject, exc)
            return None

    async def is_cancelled(self, request_id: str) -> bool:
        return await self._last(self.subjects.cancel(request_id), RequestCancelled) is not None

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
