"""One store for every kind of tensor object (EC objects, KV objects): keys, bounded validated
loads, writes, existence checks and age sweeps, done once for all kinds.

A kind plugs in as a :class:`TensorCodec`: its schema, where its keys live and how an object's
name is spelled, how a blob is decoded and checked, and which metrics count its traffic.
:class:`shared.store.ec.ECStore` and :class:`shared.store.kv.KVStore` are the typed fronts
(what the workers, the API, replay and the vLLM connectors call).

Keys: ``<namespace>/[<codec.folder>/]<fingerprint>/<codec.name(ident)>``. Each object carries
S3 user metadata (:data:`META_SCHEMA`, :data:`META_FINGERPRINT`), so :meth:`TensorObjectStore.exists`
can reject another version with a HEAD only.

A load never returns bad data and never raises anything but :class:`ObjectValidationError`: a
missing, too large, corrupt, foreign-fingerprint or otherwise invalid object (or a store error)
is a miss with a :class:`MissReason`, logged (``<kind> miss key=... reason=...``) and counted.
Objects over ``max_object_bytes`` are neither written nor read.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import Any, Generic, TypeVar

from shared.errors import EPDError, StoreError
from shared.metrics import LookupOutcome
from shared.store.format import MissReason, ObjectValidationError
from shared.store.objects import ObjectInfo, ObjectStore, ObjectTooLarge

log = logging.getLogger(__name__)

# S3 user metadata on tensor objects: lets a HEAD tell an object's kind and version.
META_SCHEMA = "epd-schema"
META_FINGERPRINT = "epd-fingerprint"

T = TypeVar("T")  # the decoded object
Id = TypeVar("Id")  # what identifies an object within one fingerprint (item hash, (request, attempt))


class TensorCodec(abc.ABC, Generic[T, Id]):
    """What one kind of tensor object adds to :class:`TensorObjectStore`."""

    #: short name in logs (``<kind> miss key=...``)
    kind: str
    #: the ``schema`` field its objects carry
    schema: str
    #: key folder under the namespace (None: fingerprints sit directly under the namespace)
    folder: str | None = None
    #: log level of a NOT_FOUND miss (other misses are warnings)
    not_found_level: int = logging.WARNING

    @abc.abstractmethod
    def name(self, ident: Id) -> str:
        """The object's name under its fingerprint folder. Raises ValueError for an ident that
        cannot be part of a key."""

    @abc.abstractmethod
    def decode(self, blob: bytes, *, fingerprint: str, ident: Id) -> T:
        """Parse and check a blob. Raises :class:`ObjectValidationError`."""

    # -- metrics (prometheus children; the codec picks its series) ------------------------------
    @abc.abstractmethod
    def latency(self, op: str) -> Any:
        """Histogram (child) timing store operation ``op`` (``get``, ``put``, ``stat``)."""

    @abc.abstractmethod
    def transferred(self, direction: str) -> Any:
        """Counter (child) of object bytes moved in ``direction`` (``get``, ``put``)."""

    @abc.abstractmethod
    def lookup(self, outcome: LookupOutcome, reason: str) -> Any:
        """Counter (child) of loads by ``outcome`` (hit, miss) and miss reason."""


class TensorObjectStore(Generic[T, Id]):
    """Tensor objects of one kind (``codec``) and one ``fingerprint`` in one object store."""

    def __init__(
        self,
        store: ObjectStore,
        codec: TensorCodec[T, Id],
        *,
        namespace: str,
        fingerprint: str,
        producer: str,
        max_object_bytes: int,
    ):
        self.store = store
        self.codec = codec
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.producer = producer
        self.max_object_bytes = max_object_bytes

    # -- keys -----------------------------------------------------------------------------------
    @property
    def kind_prefix(self) -> str:
        """Where objects of this kind live, every fingerprint."""
        folder = self.codec.folder
        return f"{self.namespace}/{folder}/" if folder else f"{self.namespace}/"

    def object_key(self, ident: Id) -> str:
        return f"{self.kind_prefix}{self.fingerprint}/{self.codec.name(ident)}"

    # -- operations -----------------------------------------------------------------------------
    def stat(self, ident: Id) -> ObjectInfo | None:
        """HEAD of the object (None when missing)."""
        with self.codec.latency("stat").time():
            return self.store.stat(self.object_key(ident))

    def stored(self, ident: Id) -> ObjectInfo | None:
        """HEAD of the object when one of this schema and fingerprint is stored, else None.

        A hit here is a hint, not a promise: :meth:`fetch` still validates the bytes."""
        info = self.stat(ident)
        if (
            info is not None
            and info.metadata.get(META_SCHEMA) == self.codec.schema
            and info.metadata.get(META_FINGERPRINT) == self.fingerprint
        ):
            return info
        return None

    def exists(self, ident: Id) -> bool:
        """Cheap check (one HEAD): :meth:`stored` found the object."""
        return self.stored(ident) is not None

    def write(self, key: str, blob: bytes) -> int:
        """Store an encoded object under ``key`` (with the schema/fingerprint user metadata).
        Returns its size. Raises ObjectTooLarge over ``max_object_bytes``, StoreError."""
        if len(blob) > self.max_object_bytes:
            raise ObjectTooLarge(
                f"{self.codec.kind} object of {len(blob)} bytes exceeds the limit of {self.max_object_bytes}",
                key=key,
                size=len(blob),
                max_bytes=self.max_object_bytes,
            )
        with self.codec.latency("put").time():
            self.store.put(key, blob, metadata={META_SCHEMA: self.codec.schema, META_FINGERPRINT: self.fingerprint})
        self.codec.transferred("put").inc(len(blob))
        return len(blob)

    def fetch(self, ident: Id, *, request_id: str = "-", key: str | None = None) -> T:
        """GET + validate the object of ``ident``. ``key``: the key a caller was handed; one that
        is not this store's key for ``ident`` (another fingerprint's, or forged) is never read.
        Raises ObjectValidationError (a miss, with reason); never returns bad data."""
        expected = self.object_key(ident)
        if key is not None and key != expected:
            raise self._miss(request_id, key, MissReason.FINGERPRINT_MISMATCH, f"key is not this store's ({expected})")
        started = time.perf_counter()
        try:
            with self.codec.latency("get").time():
                blob = self.store.get(expected, max_bytes=self.max_object_bytes)
        except StoreError as exc:
            raise self._miss(request_id, expected, MissReason.STORE_ERROR, str(exc)) from exc
        except EPDError as exc:  # ObjectTooLarge
            raise self._miss(request_id, expected, MissReason.TOO_LARGE, str(exc)) from exc
        if blob is None:
            raise self._miss(request_id, expected, MissReason.NOT_FOUND, "no object")
        try:
            obj = self.codec.decode(blob, fingerprint=self.fingerprint, ident=ident)
        except ObjectValidationError as exc:
            raise self._miss(request_id, expected, exc.reason, exc.detail) from exc
        self.codec.transferred("get").inc(len(blob))
        self.codec.lookup(LookupOutcome.HIT, "").inc()
        log.debug(  # (the record's request_id: the line format shows it once)
            "%s hit key=%s bytes=%d in %.1f ms",
            self.codec.kind,
            expected,
            len(blob),
            (time.perf_counter() - started) * 1e3,
            extra={"request_id": request_id},
        )
        return obj

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def sweep(self, max_age_s: float, *, now: float | None = None) -> int:
        """Delete objects last modified more than ``max_age_s`` ago; returns how many. A kind
        with its own folder sweeps every fingerprint's objects; one without (EC objects share the
        namespace with media and other kinds) only this fingerprint's. Safe to run from several
        workers at once."""
        cutoff = (time.time() if now is None else now) - max_age_s
        prefix = self.kind_prefix if self.codec.folder else f"{self.kind_prefix}{self.fingerprint}/"
        removed = 0
        for info in list(self.store.list(prefix)):
            if info.last_modified is not None and info.last_modified < cutoff:
                self.store.delete(info.key)
                removed += 1
        if removed:
            log.info("%s sweep: removed %d object(s) older than %.0fs", self.codec.kind, removed, max_age_s)
        return removed

    def _miss(self, request_id: str, key: str, reason: MissReason, detail: str) -> ObjectValidationError:
        self.codec.lookup(LookupOutcome.MISS, reason.value).inc()
        level = self.codec.not_found_level if reason is MissReason.NOT_FOUND else logging.WARNING
        log.log(
            level,
            "%s miss key=%s reason=%s detail=%s",
            self.codec.kind,
            key,
            reason.value,
            detail,
            extra={"request_id": request_id},
        )
        return ObjectValidationError(reason, detail)
