"""The index of EC objects: what is stored, how big, when it was last used - in a JetStream
key-value bucket every process can update cheaply (never a rewrite of the S3 object on a hit).

Bucket ``<P>_EC_INDEX`` (``Subjects.ec_index_bucket``), history 1. Keys:

==============================  ==========================================================
``ec.<fingerprint>.<name>``     :class:`IndexEntry` of one EC object (``<name>``: the item
                                hash, or ``x<sha256>`` of an identifier a KV key cannot hold)
``fp.<fingerprint>``            :class:`FingerprintEntry`: which model a fingerprint belongs
                                to and when a worker last served it (current or retired)
``lease.janitor``               :class:`Lease`: the one janitor allowed to delete
==============================  ==========================================================

Values are JSON (msgspec). Updates are compare-and-set on the entry's revision, so a janitor
deleting an entry whose use was just recorded loses the race and keeps the object.

Uses are recorded through :class:`~shared.ec_lifecycle.uses.UseRecorder`: ``note()`` on the hot
path is a dict assignment; a background task writes one index update per distinct object every
``EPD_EC_USE_FLUSH_S``.
Entries are created by writes (an encoder's announcement, a worker's write-back, the janitor's
listing), never by reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)

from shared.jetstream import kv_latest, open_bucket

log = logging.getLogger(__name__)

LEASE_KEY = "lease.janitor"
_NAME = re.compile(r"^[A-Za-z0-9_=-]{1,200}$")


class IndexEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One EC object in the index."""

    v: int = 1
    key: str
    fingerprint: str
    item_hash: str
    size: int = 0
    created: float
    last_use: float


class FingerprintEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A fingerprint seen serving: the model (served name, folder when known) and when last seen."""

    v: int = 1
    fingerprint: str
    model: str = ""
    model_path: str = ""
    first_seen: float
    last_seen: float


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    expires: float


_enc = msgspec.json.Encoder()


def _wrong_sequence(exc: BaseException) -> bool:
    """A compare-and-set lost: the key changed since the revision we gave."""
    return isinstance(exc, KeyWrongLastSequenceError) or getattr(exc, "err_code", None) in (10071, 10164)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped, whatever it raised."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping it is all that matters
        pass


def entry_key(fingerprint: str, item_hash: str) -> str:
    """The index key of an EC object (item hashes are hex; other identifiers are hashed)."""
    name = item_hash if _NAME.match(item_hash) else "x" + hashlib.sha256(item_hash.encode()).hexdigest()[:40]
    return f"ec.{fingerprint}.{name}"


def fingerprint_key(fingerprint: str) -> str:
    return f"fp.{fingerprint}"


@dataclass(frozen=True)
class Use:
    """A use (or a write) of one EC object, as recorded by :class:`~shared.ec_lifecycle.uses.UseRecorder`."""

    key: str
    fingerprint: str
    item_hash: str
    at: float
    size: int = 0
    #: the object was just written (``created`` = ``at``) rather than read
    created: bool = False


class ECIndex:
    """The EC index bucket (see the module docstring). Every method is one or a few KV round trips."""

    def __init__(self, kv: Any, *, js: Any, bucket: str):
        self.kv = kv
        self._js = js
        self._bucket = bucket

    @classmethod
    async def open(cls, js: Any, bucket: str, *, replicas: int = 1) -> ECIndex:
        """Open the bucket, creating it when missing (safe from several processes at once)."""
        kv = await open_bucket(js, bucket, replicas=replicas, what="the EC index", description="epd EC store index")
        return cls(kv, js=js, bucket=bucket)

    # -- entries -------------------------------------------------------------------------------
    async def get(self, key: str) -> tuple[IndexEntry, int] | None:
        try:
            e = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        if e.value is None:
            return None
        try:
            return msgspec.json.decode(e.value, type=IndexEntry), e.revision
        except msgspec.DecodeError:
            log.warning("unreadable EC index entry %s: replaced on next use", key)
            return None

    async def generation(self, key: str) -> int:
        """The revision of the key's last change - written, updated, deleted or purged - or 0 when
        it never had one (or its delete marker was purged, ``Janitor._purge_tombstones``: 10 min,
        longer than any duplicate window). Names the lifetime of an EC object fleet-wide:
        :func:`shared.protocol.encode_job_msg_id`."""
        try:
            return int((await self.kv.get(key)).revision)
        except KeyNotFoundError as exc:  # nats-py raises it for a deleted key too, with its marker
            marker = getattr(exc, "entry", None)
            return int(marker.revision) if marker is not None and marker.revision else 0

    async def record(self, use: Use) -> None:
        """Create the object's entry (a write) or move its last use forward (compare-and-set; a
        few tries). A read of an object without an entry creates none: it may be a use noted just
        before the janitor evicted the object, which must not come back as a ghost entry (an
        object that nobody announced is indexed by the janitor's next listing)."""
        ikey = entry_key(use.fingerprint, use.item_hash)
        for _ in range(5):
            found = await self.get(ikey)
            if found is None:
                if not use.created:
                    return
                entry = IndexEntry(
                    key=use.key,
                    fingerprint=use.fingerprint,
                    item_hash=use.item_hash,
                    size=use.size,
                    created=use.at,
                    last_use=use.at,
                )
                try:
                    await self.kv.create(ikey, _enc.encode(entry))
                    return
                except KeyWrongLastSequenceError:
                    continue  # created meanwhile: update it
            else:
                old, revision = found
                entry = msgspec.structs.replace(
                    # a write knows the object's size; a read's size is a hint for an entry without one
                    old,
                    last_use=max(old.last_use, use.at),
                    size=(use.size or old.size) if use.created else (old.size or use.size),
                    created=use.at if use.created else old.created,
                )
                if entry == old:
                    return
                try:
                    await self.kv.update(ikey, _enc.encode(entry), last=revision)
                    return
                except KeyWrongLastSequenceError:
                    continue
        log.debug("EC index entry %s kept changing; use of %s not recorded", ikey, use.key)

    async def remove(self, ikey: str, revision: int | None) -> bool:
        """Delete an entry if it is still at ``revision`` (None: whatever it is). False when it
        changed (a use was recorded meanwhile) or is gone: the caller must not delete the object."""
        try:
            await self.kv.delete(ikey, last=revision)
            return True
        except KeyNotFoundError:
            return False
        except BadRequestError as exc:  # (kv.delete does not map "wrong last sequence" itself)
            if _wrong_sequence(exc):
                return False
            raise

    async def snapshot(self, prefix: str = "ec.>") -> dict[str, tuple[Any, int]]:
        """Every live entry under ``prefix`` (a KV key pattern) as of the call: key -> (decoded
        value, revision)."""
        out: dict[str, tuple[Any, int]] = {}
        for key, value, revision in await kv_latest(self._js, self._bucket, prefix):
            kind = IndexEntry if key.startswith("ec.") else FingerprintEntry if key.startswith("fp.") else None
            if kind is None:
                continue
            try:
                out[key] = (msgspec.json.decode(value, type=kind), revision)
            except msgspec.DecodeError:
                log.warning("unreadable EC index entry %s: ignored", key)
        return out

    # -- fingerprints --------------------------------------------------------------------------
    async def seen(self, fingerprint: str, *, model: str = "", model_path: str = "", at: float | None = None) -> None:
        """Record that ``fingerprint`` is served now (by a worker's heartbeat or the API itself)."""
        at = time.time() if at is None else at
        old = await self.fingerprint(fingerprint)
        entry = FingerprintEntry(
            fingerprint=fingerprint,
            model=model or (old.model if old else ""),
            model_path=model_path or (old.model_path if old else ""),
            first_seen=old.first_seen if old else at,
            last_seen=max(at, old.last_seen if old else 0.0),
        )
        if entry != old:
            await self.kv.put(fingerprint_key(fingerprint), _enc.encode(entry))

    async def fingerprints(self) -> dict[str, FingerprintEntry]:
        """Every registered fingerprint (one read of the bucket, :meth:`snapshot`)."""
        return {v.fingerprint: v for v, _ in (await self.snapshot("fp.>")).values()}

    async def fingerprint(self, fingerprint: str) -> FingerprintEntry | None:
        """The registry entry of one fingerprint (one KV get), None when it has none."""
        try:
            e = await self.kv.get(fingerprint_key(fingerprint))
        except KeyNotFoundError:
            return None
        try:
            return msgspec.json.decode(e.value, type=FingerprintEntry) if e.value else None
        except msgspec.DecodeError:
            return None

    # -- the janitor lease ---------------------------------------------------------------------
    async def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        """Take or renew the janitor lease for ``ttl_s``. True iff ``holder`` holds it now. Two
        contenders never both get True: every change is compare-and-set on the lease's revision."""
        now = time.time()
        lease = _enc.encode(Lease(holder=holder, expires=now + ttl_s))
        try:
            e = await self.kv.get(LEASE_KEY)
        except KeyNotFoundError:
            e = None
        try:
            if e is None or e.value is None:
                await self.kv.create(LEASE_KEY, lease)
                return True
            current = msgspec.json.decode(e.value, type=Lease)
            if current.holder != holder and current.expires > now:
                return False
            await self.kv.update(LEASE_KEY, lease, last=e.revision)
            return True
        except (KeyWrongLastSequenceError, msgspec.DecodeError):
            return False

    async def release_lease(self, holder: str) -> None:
        try:
            e = await self.kv.get(LEASE_KEY)
            if e.value and msgspec.json.decode(e.value, type=Lease).holder == holder:
                await self.kv.delete(LEASE_KEY, last=e.revision)
        except (KeyNotFoundError, msgspec.DecodeError):
            pass
        except BadRequestError as exc:
            if not _wrong_sequence(exc):
                raise
