"""Invalidations: every removal of EC objects (janitor evictions, ``epd ec purge``, objects gone
behind the index) is announced with :class:`~shared.protocol.ECInvalidated` on
``<p>.ec.invalidated.<fp>`` (core NATS); whoever holds copies drops them.

* The asyncio face - :func:`publish_invalidated`, :func:`subscribe_invalidations`: the API (janitor),
  ``epd ec purge`` and PD workers (:mod:`shared.ec_lifecycle.worker`), on their own connection.
* The thread face - :class:`ConnectorLifecycle`: the vLLM EC connector's part, in vLLM's scheduler
  process, whose engine step never waits on NATS: a daemon thread runs its own event loop and
  connection, collects the item hashes of every ``ECInvalidated`` for the connector's fingerprint,
  and owns a :class:`~shared.ec_lifecycle.uses.UseRecorder`. The scheduler drains the hashes once
  per step (``take``) and notes uses (``used``), both thread-safe.

NATS settings are the caller's: the services' settings, or the connector's extra config
(``nats_url``, ``subject_prefix``, ``nats_user_env`` / ``nats_password_env``; epd-serve's vLLM
engine fills them in from its own settings). Without a ``nats_url`` the connector holds objects
until its own LRU drops them; their content is still right (keys are versioned), only a purge is
not seen. No vLLM or torch import.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from shared import protocol
from shared.jetstream import confirm_subscriptions
from shared.nats_auth import inbox_prefix
from shared.protocol import ECInvalidated, Subjects
from shared.store.ec import ECStore

log = logging.getLogger(__name__)

#: item hashes per ECInvalidated message (~70 bytes each: well under NATS's 1 MB payload)
INVALIDATION_CHUNK = 2000


# -- the asyncio face --------------------------------------------------------------------------------
async def publish_invalidated(
    nc: Any, subjects: Subjects, fingerprint: str, item_hashes: Iterable[str], *, reason: str, by: str
) -> int:
    """Announce removed EC objects; returns how many messages were sent."""
    items = list(dict.fromkeys(item_hashes))
    sent = 0
    for i in range(0, len(items), INVALIDATION_CHUNK):
        msg = ECInvalidated(
            fingerprint=fingerprint,
            item_hashes=tuple(items[i : i + INVALIDATION_CHUNK]),
            reason=reason,
            by=by,
            created_at=time.time(),
        )
        await nc.publish(
            subjects.ec_invalidated(fingerprint),
            protocol.encode(msg),
            headers=protocol.headers_for(msg, f"ec-{reason}"),
        )
        sent += 1
    if sent:
        await nc.flush(timeout=10)
    return sent


async def subscribe_invalidations(nc: Any, subjects: Subjects, on_event: Callable[[ECInvalidated], Any]) -> Any:
    """Call ``on_event`` for every :class:`ECInvalidated` (junk is skipped). Returns the
    subscription (``await sub.unsubscribe()``). Confirmed with the server before returning."""

    async def handle(msg: Any) -> None:
        try:
            event = protocol.decode(msg.data, ECInvalidated)
        except protocol.ProtocolError as exc:
            log.warning("skipping a message on %s: %s", msg.subject, exc)
            return
        try:
            result = on_event(event)
            if asyncio.iscoroutine(result):
                await result
        except Exception:  # a holder's bug must not kill the subscription
            log.exception("invalidation handler failed")

    sub = await nc.subscribe(subjects.ec_invalidated_all, cb=handle)
    # the server handles a connection's commands in order: a round trip it answers itself confirms
    # the SUB (fails open, like subscribe_typed(confirm=True))
    await confirm_subscriptions(nc, what=subjects.ec_invalidated_all)
    return sub


# -- the thread face ------------------------------------------------------------------------------
class ConnectorLifecycle:
    """The vLLM EC connector's part in the lifecycle, on a thread of its own (module docstring)."""

    def __init__(
        self,
        nats_url: str,
        prefix: str,
        store: ECStore,
        *,
        flush_s: float = 2.0,
        user: str | None = None,
        password: str | None = None,
        replicas: int = 1,
        ping_interval_s: float = 2.0,
        max_outstanding_pings: int = 2,
        tls_options: dict[str, Any] | None = None,
    ):
        self.nats_url = nats_url
        #: nats-py's TLS options (``NatsSettings.tls_options``; empty: plaintext)
        self.tls_options = dict(tls_options or {})
        self.user = user
        self.password = password
        self.replicas = replicas
        self.ping_interval_s = ping_interval_s
        self.max_outstanding_pings = max_outstanding_pings
        self.subjects = Subjects(prefix)
        self.store = store
        self.flush_s = flush_s
        self._dropped: set[str] = set()
        self._lock = threading.Lock()
        self._recorder: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        #: set once subscribed (tests wait on it)
        self.ready = threading.Event()

    @classmethod
    def launch(
        cls,
        store: ECStore,
        *,
        nats_url: str,
        prefix: str,
        user: str | None = None,
        password: str | None = None,
        replicas: int = 1,
        ping_interval_s: float = 2.0,
        max_outstanding_pings: int = 2,
        tls_options: dict[str, Any] | None = None,
    ) -> ConnectorLifecycle | None:
        """Started, or None (with a log line) when no ``nats_url`` is configured. ``replicas``:
        of the EC index bucket, should this connector be the one creating it."""
        if not nats_url:
            log.info("EC connector: no nats_url in its extra config: no invalidation events, uses not recorded")
            return None
        lifecycle = cls(
            nats_url,
            prefix or "epd",
            store,
            user=user,
            password=password,
            replicas=replicas,
            ping_interval_s=ping_interval_s,
            max_outstanding_pings=max_outstanding_pings,
            tls_options=tls_options,
        )
        lifecycle.start()
        return lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name="ec-lifecycle", daemon=True)
        self._thread.start()

    # -- called from the scheduler (any thread) -------------------------------------------------
    def take(self) -> set[str]:
        """Item hashes invalidated since the last call."""
        with self._lock:
            dropped, self._dropped = self._dropped, set()
        return dropped

    def used(self, identifier: str, *, size: int = 0) -> None:
        if self._recorder is not None:
            self._recorder.note(self.store.key(identifier), self.store.fingerprint, identifier, size=size)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the thread ----------------------------------------------------------------------------
    def _on_event(self, event: ECInvalidated) -> None:
        if event.fingerprint == self.store.fingerprint:
            with self._lock:
                self._dropped.update(event.item_hashes)

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # noqa: BLE001 - never take the engine down
            log.warning("EC connector lifecycle thread ended: %s: %s", type(exc).__name__, exc)

    async def _main(self) -> None:
        from shared import natsclient
        from shared.ec_lifecycle.index import ECIndex
        from shared.ec_lifecycle.uses import UseRecorder

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await natsclient.connect(
            [u.strip() for u in self.nats_url.split(",") if u.strip()],
            name="epd-ec-connector",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            ping_interval=self.ping_interval_s,
            max_outstanding_pings=self.max_outstanding_pings,
            **self.tls_options,
            **(
                {"user": self.user, "password": self.password or "", "inbox_prefix": inbox_prefix(self.user)}
                if self.user
                else {}
            ),
        )
        try:
            sub = await subscribe_invalidations(nc, self.subjects, self._on_event)
            try:
                index = await ECIndex.open(nc.jetstream(), self.subjects.ec_index_bucket, replicas=self.replicas)
                self._recorder = UseRecorder(index, flush_s=self.flush_s)
                self._recorder.start()
            except Exception as exc:  # noqa: BLE001 - invalidations still work
                log.warning("EC connector: index unavailable (%s): uses not recorded", exc)
            self.ready.set()
            await self._stop.wait()
            await sub.unsubscribe()
            if self._recorder is not None:
                await self._recorder.close()
        finally:
            await nc.close()
