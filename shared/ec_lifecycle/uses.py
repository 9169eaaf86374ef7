"""Uses of EC objects recorded in the index (:mod:`shared.ec_lifecycle.index`): ``note()`` on the
hot path is a dict assignment; a background task writes one index update per distinct object every
``EPD_EC_USE_FLUSH_S``, so the janitor evicts what is least recently used.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from shared import metrics
from shared.ec_lifecycle.index import ECIndex, Use, cancel_and_wait

log = logging.getLogger(__name__)


class UseRecorder:
    """Batches uses of EC objects: ``note()`` from any thread costs a dict assignment; every
    ``flush_s`` one index update per distinct object (``epd:ec_uses_recorded_total``)."""

    def __init__(self, index: ECIndex, *, flush_s: float):
        self.index = index
        self.flush_s = flush_s
        self._pending: dict[str, Use] = {}
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None

    def note(self, key: str, fingerprint: str, item_hash: str, *, size: int = 0, created: bool = False) -> None:
        use = Use(key=key, fingerprint=fingerprint, item_hash=item_hash, at=time.time(), size=size, created=created)
        with self._lock:
            old = self._pending.get(key)
            if old is not None:
                use = Use(
                    key=key,
                    fingerprint=fingerprint,
                    item_hash=item_hash,
                    at=use.at,
                    size=size or old.size,
                    created=created or old.created,
                )
            self._pending[key] = use

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def flush(self) -> int:
        with self._lock:
            batch, self._pending = self._pending, {}
        for use in batch.values():
            try:
                await self.index.record(use)
            except Exception as exc:  # noqa: BLE001 - NATS down: the use is lost, the object only looks colder
                log.warning("could not record the use of %s: %s: %s", use.key, type(exc).__name__, exc)
                return 0
        if batch:
            metrics.EC_USES_RECORDED.inc(len(batch))
        return len(batch)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        try:
            await self.flush()
        except Exception:  # noqa: BLE001 - closing: best effort
            pass
