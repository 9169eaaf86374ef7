"""EC store lifecycle: the janitor that keeps the EC namespace bounded, and purges of model versions.

* :class:`Janitor` - one pass every ``EPD_EC_JANITOR_INTERVAL_S``, only while it holds the lease
  in the index bucket (``ECIndex.acquire_lease``: compare-and-set, so two replicas never both
  evict). A pass reads the index (:mod:`shared.ec_lifecycle.index`), then deletes

  1. objects unused for ``EPD_EC_TTL_S`` (reason ``ttl``);
  2. objects of fingerprints retired for ``EPD_EC_PURGE_RETIRED_AFTER_S`` (reason ``retired``);
  3. the least recently used objects until the namespace is under ``EPD_EC_MAX_BYTES`` /
     ``EPD_EC_MAX_OBJECTS`` minus what was written during the last two periods (so it stays under
     the bound between passes; reasons ``bytes`` / ``objects``), never one created or used in the
     last ``EPD_EC_EVICT_GRACE_S`` (a request in flight is about to read it; if the bound still
     cannot be met, it says so in the log).

  Each deletion first removes the index entry *at the revision the pass read* (a use recorded
  meanwhile makes it fail, and the object stays), then the object. Every ``EPD_EC_RECONCILE_
  INTERVAL_S`` the pass lists the store: objects nobody announced are indexed (created = last
  use = their modification time), entries whose object is gone are dropped.
* :func:`purge` - what ``epd ec purge`` does (by fingerprint, retired fingerprints, age), also for
  KV objects (E|P|D hand-offs, not indexed: selected from the listing).
* Every removal of EC objects is announced with :class:`~shared.protocol.ECInvalidated` on
  ``<p>.ec.invalidated.<fp>`` (core NATS, :mod:`shared.ec_lifecycle.invalidation`): PD workers drop
  them from their feature cache, vLLM EC connectors from their held bytes.
* :func:`set_expiration_rule` - the S3 lifecycle backstop when ``EPD_EC_TTL_S`` is set.

torch-free (the API and the CLI run it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared import metrics
from shared.ec_lifecycle.index import (
    ECIndex,
    FingerprintEntry,
    IndexEntry,
    Use,
    cancel_and_wait,
    entry_key,
)
from shared.ec_lifecycle.invalidation import publish_invalidated
from shared.errors import StoreError
from shared.protocol import EvictionReason, Subjects
from shared.store.objects import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

_NOT_EC_FOLDERS = frozenset({"media", "kv"})
#: deletions a janitor pass runs at once (each: one KV compare-and-set, one S3 DELETE)
EVICT_CONCURRENCY = 8


# -- listing the store ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredObject:
    kind: str  # "ec" | "kv"
    fingerprint: str
    name: str
    info: ObjectInfo


def list_objects(store: ObjectStore, namespace: str) -> list[StoredObject]:
    """Every EC object (``<ns>/<fp>/<item>``) and KV object (``<ns>/kv/<fp>/<name>``) in the store."""
    out: list[StoredObject] = []
    for info in store.list(f"{namespace}/"):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[1] not in _NOT_EC_FOLDERS:
            out.append(StoredObject("ec", parts[1], parts[2], info))
        elif len(parts) == 4 and parts[1] == "kv":
            out.append(StoredObject("kv", parts[2], parts[3], info))
    return out


# -- S3 lifecycle backstop --------------------------------------------------------------------------
def expiration_days(ttl_s: float) -> int:
    """Days of the backstop rule: twice the TTL, at least one day. An S3 rule counts from an
    object's creation, not its last use: a hot object older than that is deleted and recomputed
    once - the price of a bound that holds while no janitor runs."""
    return max(1, math.ceil(2 * ttl_s / 86400))


def set_expiration_rule(store: ObjectStore, prefix: str, days: int) -> bool:
    """Put an S3 lifecycle rule expiring ``prefix`` after ``days``. False (with a warning) when
    the backend or server does not support it; never raises."""
    client = getattr(store, "_client", None)
    bucket = getattr(store, "bucket", None)
    if client is None or bucket is None:
        log.warning(
            "EC TTL backstop: the %s backend has no lifecycle rules; only the janitor bounds the store",
            type(store).__name__,
        )
        return False
    try:
        from minio.commonconfig import ENABLED, Filter
        from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule

        rule = Rule(
            ENABLED, rule_filter=Filter(prefix=prefix), rule_id="epd-ec-ttl-backstop", expiration=Expiration(days=days)
        )
        client.set_bucket_lifecycle(bucket, LifecycleConfig([rule]))
        log.info(
            "EC TTL backstop: S3 lifecycle rule on s3://%s/%s expires objects after %d day(s)", bucket, prefix, days
        )
        return True
    except Exception as exc:  # noqa: BLE001 - NotImplemented, MalformedXML, AccessDenied...: a backstop only
        log.warning(
            "EC TTL backstop: the S3 server refused a lifecycle rule (%s: %s); only the janitor bounds the store",
            type(exc).__name__,
            exc,
        )
        return False


def get_expiration_days(store: ObjectStore, prefix: str) -> int | None:
    """The days of our backstop rule on ``prefix`` as the server reports it (None: none)."""
    client = getattr(store, "_client", None)
    config = client.get_bucket_lifecycle(store.bucket) if client is not None else None  # type: ignore[attr-defined]  # minio client of S3ObjectStore (None for other stores)
    for rule in config.rules if config else []:
        if rule.rule_id == "epd-ec-ttl-backstop" and rule.expiration is not None:
            return rule.expiration.days
    return None


# -- the janitor ------------------------------------------------------------------------------------
@dataclass
class Policy:
    max_bytes: int | None = None
    max_objects: int | None = None
    ttl_s: float | None = None
    purge_retired_after_s: float | None = None
    retired_after_s: float = 600
    grace_s: float = 60
    #: evict below the bound by what arrives before the next pass (off: exactly down to the bound)
    headroom: bool = True

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.max_bytes, self.max_objects, self.ttl_s, self.purge_retired_after_s))


@dataclass
class PassReport:
    objects: int = 0
    bytes: int = 0
    evicted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    evicted_bytes: int = 0
    #: CAS lost (used meanwhile) or already gone
    skipped: int = 0
    indexed: int = 0
    over_bound: bool = False
    #: how far below the byte bound this pass evicted (what arrives before the next pass)
    headroom_bytes: int = 0


def is_current(fp: FingerprintEntry | None, now: float, retired_after_s: float) -> bool:
    return fp is not None and now - fp.last_seen <= retired_after_s


class Janitor:
    """Keeps the EC namespace under its bounds (module docstring). Runs in the API process."""

    def __init__(
        self,
        *,
        nc: Any,
        subjects: Subjects,
        index: ECIndex,
        store: ObjectStore,
        namespace: str,
        holder: str,
        policy: Policy,
        interval_s: float,
        reconcile_interval_s: float,
        flush_s: float = 0.0,
        tombstone_keep_s: float = 600.0,
    ):
        self.nc = nc
        self.subjects = subjects
        self.index = index
        self.store = store
        self.namespace = namespace
        self.holder = holder
        self.policy = policy
        self.interval_s = interval_s
        self.reconcile_interval_s = reconcile_interval_s
        #: the processes' use flush period (EPD_EC_USE_FLUSH_S): how late new objects reach the index
        self.flush_s = flush_s
        #: how long an index entry's delete marker is kept: its revision is the generation that
        #: makes a re-encode a new encode job (``ECIndex.generation``), so longer than the
        #: encode stream's duplicate window
        self.tombstone_keep_s = tombstone_keep_s
        self.leading = False
        self._last_reconcile = 0.0
        self._last_tombstone_purge = 0.0
        self._tombstones: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._fps_shown: set[str] = set()
        #: seconds between the starts of the last two passes (the real period, not the configured one)
        self._period = 0.0
        self._last_pass = 0.0

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._tombstones is not None:
            self._tombstones.cancel()
        await cancel_and_wait(self._task)
        if self.leading:
            try:
                await self.index.release_lease(self.holder)
            except Exception:  # noqa: BLE001 - NATS gone: the lease expires by itself
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS / S3 down: try again next pass
                log.warning("EC janitor pass failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.interval_s)  # a period, not a synchronisation

    async def run_once(self) -> PassReport | None:
        """One pass; None when another janitor holds the lease."""
        leading = await self.index.acquire_lease(self.holder, ttl_s=max(3 * self.interval_s, 30.0))
        if leading != self.leading:
            log.info("EC janitor %s: %s the lease", self.holder, "took" if leading else "lost")
            self.leading = leading
            self._last_reconcile = 0.0  # a new leader lists the store first
        if not leading:
            return None
        now = time.time()
        if self._last_pass:
            self._period = now - self._last_pass
        self._last_pass = now
        report = PassReport()
        if now - self._last_reconcile >= self.reconcile_interval_s:
            report.indexed = await self.reconcile()
            self._last_reconcile = time.time()
        if now - self._last_tombstone_purge > 600 and (self._tombstones is None or self._tombstones.done()):
            # (one request per delete marker: thousands after a busy period; never inside a pass)
            self._tombstones = asyncio.ensure_future(self._purge_tombstones())
            self._last_tombstone_purge = now
        snap = await self.index.snapshot("ec.>")
        await self._fill_sizes(snap)
        fps = await self.index.fingerprints()
        entries = sorted(((k, e, r) for k, (e, r) in snap.items()), key=lambda t: t[1].last_use)
        victims = self._select(entries, fps, now, report)
        await self._evict(victims, report)
        self._update_gauges(entries, victims)
        left_bytes = report.bytes - report.evicted_bytes
        if victims or report.over_bound:
            log.info(
                "EC janitor: evicted %d object(s) (%s, %d bytes); %d object(s), %d bytes left (bound %s, "
                "headroom %d)%s",
                sum(report.evicted.values()),
                dict(report.evicted),
                report.evicted_bytes,
                report.objects - sum(report.evicted.values()),
                left_bytes,
                self.policy.max_bytes,
                report.headroom_bytes,
                "; OVER THE BOUND: everything left was used within the grace period" if report.over_bound else "",
            )
        else:
            log.debug("EC janitor: %d object(s), %d bytes, nothing to evict", report.objects, report.bytes)
        return report

    async def _fill_sizes(self, snap: dict[str, tuple[IndexEntry, int]]) -> None:
        """Entries whose writer did not say the object's size (an announcement without it): one
        HEAD each, then the entry carries it."""
        for ikey, (entry, _) in list(snap.items()):
            if entry.size:
                continue
            info = await asyncio.to_thread(self.store.stat, entry.key)
            if info is None:
                continue  # gone: the next reconcile drops the entry
            await self.index.record(
                Use(
                    key=entry.key,
                    fingerprint=entry.fingerprint,
                    item_hash=entry.item_hash,
                    at=entry.last_use,
                    size=info.size,
                )
            )
            found = await self.index.get(ikey)
            if found is not None:
                snap[ikey] = found

    async def _purge_tombstones(self) -> None:
        try:
            await self.index.kv.purge_deletes(olderthan=int(self.tombstone_keep_s))
        except Exception as exc:  # noqa: BLE001 - tombstones are purged again next pass
            log.debug("purging index tombstones: %s", exc)

    def _select(
        self,
        entries: list[tuple[str, IndexEntry, int]],
        fps: dict[str, FingerprintEntry],
        now: float,
        report: PassReport,
    ) -> list[tuple[str, IndexEntry, int, str]]:
        p = self.policy
        victims: list[tuple[str, IndexEntry, int, str]] = []
        chosen: set[str] = set()
        report.objects = len(entries)
        report.bytes = sum(e.size for _, e, _ in entries)
        if p.ttl_s is not None:
            for k, e, r in entries:
                if now - e.last_use > p.ttl_s:
                    victims.append((k, e, r, EvictionReason.TTL))
                    chosen.add(k)
        if p.purge_retired_after_s is not None:
            newest: dict[str, float] = defaultdict(float)
            for _, e, _ in entries:
                newest[e.fingerprint] = max(newest[e.fingerprint], e.last_use)
            for k, e, r in entries:
                fp = fps.get(e.fingerprint)
                if k in chosen or is_current(fp, now, p.retired_after_s):
                    continue
                retired_since = (fp.last_seen if fp else newest[e.fingerprint]) + p.retired_after_s
                if now - retired_since > p.purge_retired_after_s:
                    victims.append((k, e, r, EvictionReason.RETIRED))
                    chosen.add(k)
        nbytes = report.bytes - sum(v[1].size for v in victims)
        count = len(entries) - len(victims)
        # Headroom: what was written lately is about what arrives before the next pass, so a pass
        # evicts down to that far below the bound (the namespace then stays under it between
        # passes at a steady write rate; at most half the bound).
        # The window: two real periods (a pass under load takes longer than the interval; capped at
        # 4 intervals) plus twice the use flush (objects written but not yet in the index).
        window = 2 * max(self.interval_s, min(self._period, 4 * self.interval_s)) + 2 * self.flush_s
        recent = [e for _, e, _ in entries if p.headroom and now - e.created < window]
        room_bytes = min(sum(e.size for e in recent), (p.max_bytes or 0) // 2)
        room_objects = min(len(recent), (p.max_objects or 0) // 2)
        report.headroom_bytes = room_bytes

        def over(room: bool) -> str | None:
            if p.max_bytes is not None and nbytes > p.max_bytes - (room_bytes if room else 0):
                return EvictionReason.BYTES
            if p.max_objects is not None and count > p.max_objects - (room_objects if room else 0):
                return EvictionReason.OBJECTS
            return None

        if over(room=True) is not None:  # over, or within what the next period brings of it
            for k, e, r in entries:  # least recently used first
                reason = over(room=True)
                if reason is None:
                    break
                if k in chosen or now - max(e.last_use, e.created) < p.grace_s:
                    continue
                victims.append((k, e, r, reason))
                chosen.add(k)
                nbytes -= e.size
                count -= 1
        report.over_bound = over(room=False) is not None
        return victims

    async def _evict(self, victims: list[tuple[str, IndexEntry, int, str]], report: PassReport) -> None:
        gone: dict[tuple[str, str], list[str]] = defaultdict(list)
        slots = asyncio.Semaphore(EVICT_CONCURRENCY)

        async def evict(ikey: str, entry: IndexEntry, revision: int, reason: str) -> None:
            async with slots:
                if not await self.index.remove(ikey, revision):
                    report.skipped += 1  # used (or removed) since this pass read it: keep the object
                    return
                try:
                    await asyncio.to_thread(self.store.delete, entry.key)
                except StoreError as exc:  # the next reconcile indexes it again
                    log.warning("EC janitor: could not delete %s: %s", entry.key, exc)
                    return
            report.evicted[reason] += 1
            report.evicted_bytes += entry.size
            metrics.EC_EVICTIONS.labels(reason).inc()
            gone[(entry.fingerprint, reason)].append(entry.item_hash)

        await asyncio.gather(*(evict(*victim) for victim in victims))
        for (fp, reason), items in gone.items():
            await publish_invalidated(self.nc, self.subjects, fp, items, reason=reason, by=self.holder)

    def _update_gauges(self, entries: list[tuple[str, IndexEntry, int]], victims: list) -> None:
        removed = {v[0] for v in victims}
        per_fp_bytes: dict[str, int] = defaultdict(int)
        per_fp_count: dict[str, int] = defaultdict(int)
        for k, e, _ in entries:
            if k not in removed:
                per_fp_bytes[e.fingerprint] += e.size
                per_fp_count[e.fingerprint] += 1
        for fp in self._fps_shown | set(per_fp_bytes):
            metrics.EC_STORE_BYTES.labels(fp).set(per_fp_bytes.get(fp, 0))
            metrics.EC_STORE_OBJECTS.labels(fp).set(per_fp_count.get(fp, 0))
        self._fps_shown |= set(per_fp_bytes)

    async def reconcile(self) -> int:
        """List the store: index objects nobody announced, drop entries whose object is gone.
        Returns how many objects were newly indexed."""
        started = time.time()
        listed = await asyncio.to_thread(list_objects, self.store, self.namespace)
        snap = await self.index.snapshot("ec.>")
        seen: set[str] = set()
        added = 0
        for obj in listed:
            if obj.kind != "ec":
                continue
            ikey = entry_key(obj.fingerprint, obj.name)
            seen.add(ikey)
            have = snap.get(ikey)
            if have is None or have[0].size == 0:
                at = obj.info.last_modified or started
                await self.index.record(
                    Use(
                        key=obj.info.key,
                        fingerprint=obj.fingerprint,
                        item_hash=obj.name,
                        at=at,
                        size=obj.info.size,
                        created=have is None,
                    )
                )
                added += have is None
        gone: dict[str, list[str]] = defaultdict(list)
        for ikey, (entry, revision) in snap.items():
            # (an entry made after the listing started may name an object written after it)
            if ikey not in seen and entry.created < started - 60 and await self.index.remove(ikey, revision):
                gone[entry.fingerprint].append(entry.item_hash)
                metrics.EC_EVICTIONS.labels(EvictionReason.GONE).inc()
        for fp, items in gone.items():
            log.info(
                "EC janitor: %d indexed object(s) of %s are no longer stored (removed behind the index)", len(items), fp
            )
            await publish_invalidated(self.nc, self.subjects, fp, items, reason=EvictionReason.GONE, by=self.holder)
        if added:
            log.info("EC janitor: indexed %d stored object(s) nobody announced", added)
        return added


# -- purge (epd ec purge) ---------------------------------------------------------------------------
@dataclass
class PurgeResult:
    """What a purge removed (or would remove): per (kind, fingerprint), objects and bytes."""

    removed: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    dry_run: bool = False

    @property
    def objects(self) -> int:
        return sum(v[0] for v in self.removed.values())

    @property
    def nbytes(self) -> int:
        return sum(v[1] for v in self.removed.values())


class UnknownFingerprint(LookupError):
    """A purge named a fingerprint that neither the store nor the fingerprint registry knows (a
    typo, most likely): nothing was removed."""

    def __init__(self, fingerprint: str, known: dict[str, FingerprintEntry | None]):
        super().__init__(f"unknown fingerprint {fingerprint!r}")
        self.fingerprint = fingerprint
        #: every fingerprint with objects in the namespace or in the registry -> its registry entry
        self.known = known


async def purge(
    *,
    nc: Any,
    subjects: Subjects,
    index: ECIndex,
    store: ObjectStore,
    namespace: str,
    by: str,
    fingerprint: str | None = None,
    retired: bool = False,
    older_than_s: float | None = None,
    retired_after_s: float = 600,
    kinds: tuple[str, ...] = ("ec", "kv"),
    dry_run: bool = False,
    keep: Iterable[str] = (),
    allow_unknown: bool = False,
) -> PurgeResult:
    """Remove the objects that match every given selector: of ``fingerprint``; of retired
    fingerprints (not served for ``retired_after_s``, and never one in ``keep``); last used (EC:
    per the index, else modified) more than ``older_than_s`` ago. EC removals are announced.

    A ``fingerprint`` that no stored object and no registry entry has raises
    :class:`UnknownFingerprint` before anything is removed, unless ``allow_unknown``."""
    if fingerprint is None and not retired and older_than_s is None:
        raise ValueError("purge needs --fingerprint, --retired or --older-than")
    now = time.time()
    keep = set(keep)
    listed = await asyncio.to_thread(list_objects, store, namespace)
    snap = await index.snapshot("ec.>")
    fps = await index.fingerprints()
    if fingerprint is not None and not allow_unknown:
        known: dict[str, FingerprintEntry | None] = {obj.fingerprint: None for obj in listed}
        known.update(fps)
        if fingerprint not in known:
            raise UnknownFingerprint(fingerprint, known)
    result = PurgeResult(dry_run=dry_run)
    gone: dict[str, list[str]] = defaultdict(list)

    def last_use_of(obj: StoredObject) -> float:
        indexed = snap.get(entry_key(obj.fingerprint, obj.name)) if obj.kind == "ec" else None
        return indexed[0].last_use if indexed else (obj.info.last_modified or now)

    # A fingerprint no heartbeat ever named (KV objects' model fingerprints, a version served by
    # plain vLLM servers) counts as retired only once none of its objects was used for retired_after_s.
    newest: dict[tuple[str, str], float] = defaultdict(float)
    for obj in listed:
        newest[(obj.kind, obj.fingerprint)] = max(newest[(obj.kind, obj.fingerprint)], last_use_of(obj))

    def retired_version(obj: StoredObject) -> bool:
        if obj.fingerprint in keep:
            return False
        reg = fps.get(obj.fingerprint)
        if reg is not None:
            return not is_current(reg, now, retired_after_s)
        return now - newest[(obj.kind, obj.fingerprint)] > retired_after_s

    for obj in listed:
        if obj.kind not in kinds or (fingerprint is not None and obj.fingerprint != fingerprint):
            continue
        if retired and not retired_version(obj):
            continue
        ikey = entry_key(obj.fingerprint, obj.name) if obj.kind == "ec" else None
        last_use = last_use_of(obj)
        if older_than_s is not None and now - last_use <= older_than_s:
            continue
        slot = result.removed[(obj.kind, obj.fingerprint)]
        slot[0] += 1
        slot[1] += obj.info.size
        if dry_run:
            continue
        if ikey is not None:
            await index.remove(ikey, None)
        await asyncio.to_thread(store.delete, obj.info.key)
        if obj.kind == "ec":
            metrics.EC_EVICTIONS.labels(EvictionReason.PURGE).inc()
            gone[obj.fingerprint].append(obj.name)
    for fp, items in gone.items():
        await publish_invalidated(nc, subjects, fp, items, reason=EvictionReason.PURGE, by=by)
    if not dry_run and result.objects:
        log.info(
            "EC purge by %s: removed %d object(s), %d bytes (%s)",
            by,
            result.objects,
            result.nbytes,
            {f"{k}/{fp}": v[0] for (k, fp), v in result.removed.items()},
        )
    return result
