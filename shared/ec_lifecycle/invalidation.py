"""The EC connector's part in the EC store lifecycle (:mod:`shared.ec_lifecycle.janitor`), in vLLM's
scheduler process: drop held bytes of evicted / purged objects, record uses in the EC index.

vLLM's engine step never waits on NATS: a daemon thread runs its own event loop and connection,
collects the item hashes of every ``ECInvalidated`` for this connector's fingerprint, and owns a
:class:`~shared.ec_lifecycle.index.UseRecorder`. The scheduler drains the hashes once per step
(``take``) and notes uses (``used``), both thread-safe.

Enabled when ``EPD_NATS_URL`` is set in the vLLM process's environment (epd-serve's workers pass
their environment to the engines they start; a standalone vLLM server sets it, with
``EPD_SUBJECT_PREFIX`` when not ``epd``). Without it the connector holds objects until its own
LRU drops them; their content is still right (keys are versioned), only a purge is not seen.
No vLLM or torch import.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from shared.protocol import ECInvalidated, Subjects
from shared.store.ec import ECStore

log = logging.getLogger(__name__)


class ConnectorLifecycle:
    def __init__(self, nats_url: str, prefix: str, store: ECStore, *, flush_s: float = 2.0):
        self.nats_url = nats_url
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
    def from_env(cls, store: ECStore) -> ConnectorLifecycle | None:
        url = os.environ.get("EPD_NATS_URL", "")
        if not url:
            log.info("EC connector: EPD_NATS_URL not set: no invalidation events, uses not recorded")
            return None
        lifecycle = cls(url, os.environ.get("EPD_SUBJECT_PREFIX", "epd") or "epd", store)
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
        import nats

        from shared.ec_lifecycle.index import ECIndex, UseRecorder
        from shared.ec_lifecycle.janitor import subscribe_invalidations

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await nats.connect(
            [u.strip() for u in self.nats_url.split(",") if u.strip()],
            name="epd-ec-connector",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        try:
            sub = await subscribe_invalidations(nc, self.subjects, self._on_event)
            try:
                index = await ECIndex.open(nc.jetstream(), self.subjects.ec_index_bucket)
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
