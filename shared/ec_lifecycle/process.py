"""A process's part in the EC store lifecycle (:class:`ECLifecycle`: use records, and in the API
the index of announced objects and the fingerprint registry), and the API's, with its janitor
(:func:`start_api_lifecycle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from shared import protocol
from shared.ec_lifecycle.index import ECIndex
from shared.ec_lifecycle.janitor import Janitor, Policy, expiration_days, set_expiration_rule
from shared.ec_lifecycle.uses import UseRecorder
from shared.protocol import Subjects

if TYPE_CHECKING:
    from shared.config import JanitorSettings, NatsSettings, StoreSettings

log = logging.getLogger(__name__)


class ECLifecycle:
    """A process's part in the EC lifecycle: its :class:`UseRecorder`, and in the API the index
    of announced objects (``ECReady``), the fingerprint registry (heartbeats) and, when a bound
    or TTL is set, the :class:`Janitor`."""

    def __init__(self, *, nc: Any, subjects: Subjects, index: ECIndex, recorder: UseRecorder):
        self.nc = nc
        self.subjects = subjects
        self.index = index
        self.recorder = recorder
        self.janitor: Janitor | None = None
        self._subs: list = []
        self._fp_written: dict[str, float] = {}

    @classmethod
    async def open(cls, nc: Any, subjects: Subjects, *, flush_s: float, replicas: int = 1) -> ECLifecycle:
        index = await ECIndex.open(nc.jetstream(), subjects.ec_index_bucket, replicas=replicas)
        recorder = UseRecorder(index, flush_s=flush_s)
        recorder.start()
        return cls(nc=nc, subjects=subjects, index=index, recorder=recorder)

    async def index_announcements(self) -> None:
        """Index every object an encoder announces (``ECReady``); in a queue group, so N API
        replicas write each entry once."""
        from shared.protocol import ECReady

        async def on_ready(msg: Any) -> None:
            try:
                ev = protocol.decode(msg.data, ECReady)
            except protocol.ProtocolError:
                return
            if ev.encode_started_at:  # 0: nothing was written (already stored)
                self.recorder.note(ev.ec_key, ev.fingerprint, ev.item_hash, size=ev.nbytes, created=True)
            else:
                self.recorder.note(ev.ec_key, ev.fingerprint, ev.item_hash, size=ev.nbytes)

        self._subs.append(
            await self.nc.subscribe(self.subjects.ec_ready_all, queue=protocol.QUEUE_EC_INDEX, cb=on_ready)
        )

    async def fingerprint_seen(self, fingerprint: str, *, model: str = "", model_path: str = "") -> None:
        """Record that a fingerprint is served (at most once a minute per fingerprint)."""
        now = time.time()
        if not fingerprint or now - self._fp_written.get(fingerprint, 0.0) < 60:
            return
        self._fp_written[fingerprint] = now
        try:
            await self.index.seen(fingerprint, model=model, model_path=model_path, at=now)
        except Exception as exc:  # noqa: BLE001 - recorded again on the next write
            self._fp_written.pop(fingerprint, None)
            log.debug("could not record fingerprint %s: %s", fingerprint, exc)

    async def close(self) -> None:
        if self.janitor is not None:
            await self.janitor.stop()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        await self.recorder.close()


def policy_from_settings(janitor: JanitorSettings) -> Policy:
    return Policy(
        max_bytes=janitor.ec_max_bytes,
        max_objects=janitor.ec_max_objects,
        ttl_s=janitor.ec_ttl_s,
        purge_retired_after_s=janitor.ec_purge_retired_after_s,
        retired_after_s=janitor.ec_retired_after_s,
        grace_s=janitor.ec_evict_grace_s,
    )


async def start_api_lifecycle(
    nc: Any,
    subjects: Subjects,
    store: Any,
    *,
    nats: NatsSettings,
    store_settings: StoreSettings,
    janitor: JanitorSettings,
    flush_s: float,
    holder: str,
    fingerprint: str,
    model: str,
    model_path: str,
) -> ECLifecycle:
    """The API process's lifecycle: recorder, announcement index, fingerprint registry, and the
    janitor when ``EPD_EC_MAX_BYTES`` / ``EPD_EC_MAX_OBJECTS`` / ``EPD_EC_TTL_S`` /
    ``EPD_EC_PURGE_RETIRED_AFTER_S`` is set (plus the S3 lifecycle backstop with a TTL).
    ``nats``, ``store_settings``, ``janitor``: the API's settings groups; ``flush_s``:
    ``EPD_EC_USE_FLUSH_S``; ``holder``: who the janitor's lease names."""
    lifecycle = await ECLifecycle.open(nc, subjects, flush_s=flush_s, replicas=nats.stream_replicas)
    await lifecycle.index_announcements()
    await lifecycle.fingerprint_seen(fingerprint, model=model, model_path=model_path)
    policy = policy_from_settings(janitor)
    if policy.active:
        lifecycle.janitor = Janitor(
            nc=nc,
            subjects=subjects,
            index=lifecycle.index,
            store=store.store,
            namespace=store_settings.namespace,
            holder=holder,
            policy=policy,
            interval_s=janitor.ec_janitor_interval_s,
            reconcile_interval_s=janitor.ec_reconcile_interval_s,
            flush_s=flush_s,
            tombstone_keep_s=max(600.0, 2 * nats.dup_window_s),
        )
        if policy.ttl_s is not None and janitor.ec_lifecycle_rule:
            await asyncio.to_thread(
                set_expiration_rule, store.store, f"{store_settings.namespace}/", expiration_days(policy.ttl_s)
            )
        lifecycle.janitor.start()
        log.info(
            "EC janitor on: max %s bytes, max %s objects, ttl %s s, purge retired after %s s",
            policy.max_bytes,
            policy.max_objects,
            policy.ttl_s,
            policy.purge_retired_after_s,
        )
    return lifecycle
