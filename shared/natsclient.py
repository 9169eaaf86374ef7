"""The NATS client every connection of ours uses: nats-py's, leaving a server it gave up on at once.

nats-py reconnects by closing its transport to the old server and waiting until it is closed. Over
TLS that close is the TLS shutdown - a close_notify sent, the peer's awaited - and a server that
stopped answering (stalled, or cut off by a partition) never answers: asyncio waits out its
``ssl_shutdown_timeout`` (30 s) before nats-py tries the next server. In the multi-host test's
minority partition an API replica was off NATS for 27 s, answering 503 (plaintext: under 8 s).
:class:`Client` aborts that transport instead: the client has given up on the server (unanswered
pings, a broken connection), whatever is unsent to it is lost either way, and the subscriptions
and unacknowledged work move with the client to the next server as before.
"""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as _NatsPyClient
from nats.aio.transport import TcpTransport


class Client(_NatsPyClient):
    """nats-py's client whose reconnect drops the old connection instead of shutting it down."""

    async def _attempt_reconnect(self) -> None:
        # (nats-py's own reconnect, run next, closes this transport and awaits it: aborted, that
        # returns at once instead of after the TLS shutdown's timeout)
        transport = self._transport
        if isinstance(transport, TcpTransport) and transport._io_writer is not None:
            transport._io_writer.transport.abort()
        await super()._attempt_reconnect()


async def connect(servers: list[str], **options: Any) -> Client:
    """``nats.connect`` with :class:`Client` (the same options)."""
    nc = Client()
    await nc.connect(servers, **options)
    return nc
