"""A generating worker's part in the EC store lifecycle (:mod:`shared.ec_lifecycle`): it records
its uses of EC objects in the index (batched), and drops the items of every ``ECInvalidated`` from
its local feature cache, so an evicted or purged object is not served from a local copy after
the event.

Started on the first request (the handler's set-up belongs to the worker; nothing is cached
before a first request, so nothing can be missed). Without NATS, or while the index cannot be
opened, uses are not recorded (the janitor then sees the objects as colder than they are) and
the worker retries later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from shared import metrics
from shared.ec_lifecycle.invalidation import subscribe_invalidations
from shared.ec_lifecycle.process import ECLifecycle
from shared.logs import REQUEST_ID
from shared.protocol import ECInvalidated
from shared.store.ec import ECStore

if TYPE_CHECKING:
    from shared.worker import WorkerContext

log = logging.getLogger(__name__)

_RETRY_S = 30.0


class ItemCache(Protocol):
    """A local cache of EC items (``services.prefill.features.FeatureCache``, which uses this module)."""

    def drop(self, keys: Iterable[str]) -> int: ...


class WorkerLifecycle:
    def __init__(self, ctx: WorkerContext, store: ECStore, cache: ItemCache | None):
        self.ctx = ctx
        self.store = store
        self.cache = cache
        self.lifecycle: ECLifecycle | None = None
        self._sub: Any = None
        self._lock = asyncio.Lock()
        self._retry_at = 0.0

    async def ensure_started(self) -> None:
        if self.lifecycle is not None or self.ctx.nc is None or time.monotonic() < self._retry_at:
            return
        async with self._lock:
            if self.lifecycle is not None:
                return
            # (started from a request's task: the flusher and the subscription must not log under its id)
            token = REQUEST_ID.set("-")
            try:
                lifecycle = await ECLifecycle.open(
                    self.ctx.nc,
                    self.ctx.subjects,
                    flush_s=self.ctx.settings.ec_use_flush_s,
                    replicas=self.ctx.settings.nats.stream_replicas,
                )
                self._sub = await subscribe_invalidations(self.ctx.nc, self.ctx.subjects, self.invalidated)
            except Exception as exc:  # noqa: BLE001 - lifecycle is best effort; requests go on
                self._retry_at = time.monotonic() + _RETRY_S
                log.warning(
                    "EC index unavailable (%s: %s): uses not recorded, retrying in %.0fs",
                    type(exc).__name__,
                    exc,
                    _RETRY_S,
                )
                return
            finally:
                REQUEST_ID.reset(token)
            self.lifecycle = lifecycle

    def used(self, item_hash: str, *, size: int = 0, created: bool = False) -> None:
        if self.lifecycle is not None:
            self.lifecycle.recorder.note(
                self.store.key(item_hash), self.store.fingerprint, item_hash, size=size, created=created
            )

    def invalidated(self, event: ECInvalidated) -> None:
        if event.fingerprint != self.store.fingerprint or self.cache is None:
            return
        dropped = self.cache.drop(event.item_hashes)
        if dropped:
            metrics.EC_INVALIDATIONS.labels("feature_cache").inc(dropped)
            log.info("dropped %d cached item(s) of %s: %s by %s", dropped, event.fingerprint, event.reason, event.by)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        if self.lifecycle is not None:
            await self.lifecycle.close()
