"""The EC store: versioned, validated encoder outputs (and the images they came from) in S3.

This is the project's MinIO ECConnector: every component that moves encoder outputs (the
encoder worker, prefill workers, and the vLLM-native connector class) goes through
:class:`ECStore`, so the key scheme, object format and validation exist once.

Keys (``namespace`` defaults to ``epd``):

* EC object:  ``<namespace>/<encoder fingerprint>/<item content hash>`` (see ``format.ec_key``)
* image:      ``<namespace>/media/<item content hash>``

A load never raises for bad data: a missing, corrupt, foreign-fingerprint or otherwise invalid
object comes back as :class:`ECValidationError` with a :class:`MissReason`, is logged with the
reason and counted in ``epd:ec_lookups_total{source="store"}``. Callers fall back to encoding.
"""

from __future__ import annotations

import logging
import time

from shared import metrics
from shared.store.format import (
    SCHEMA,
    ECObject,
    ECValidationError,
    MissReason,
    decode_ec_object,
    ec_key,
    encode_ec_object,
    media_key,
)
from shared.errors import EPDError, StoreError
from shared.store.objects import ObjectStore

log = logging.getLogger(__name__)

# S3 user metadata on EC objects: lets ``exists`` reject other versions with a HEAD only.
META_SCHEMA = "epd-schema"
META_FINGERPRINT = "epd-fingerprint"
META_SHA256 = "epd-sha256"


class ECStore:
    """EC objects and media of one encoder fingerprint in one object store."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        namespace: str,
        fingerprint: str,
        producer: str,
        max_object_bytes: int = 512 * 1024**2,
        max_media_bytes: int = 64 * 1024**2,
    ):
        self.store = store
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.producer = producer
        self.max_object_bytes = max_object_bytes
        self.max_media_bytes = max_media_bytes

    # -- EC objects ------------------------------------------------------------------------
    def key(self, item_hash: str) -> str:
        return ec_key(self.namespace, self.fingerprint, item_hash)

    def exists(self, item_hash: str) -> bool:
        """Cheap check (HEAD): an object of this schema and fingerprint is stored for the item.

        A True here is a hint, not a promise: :meth:`load` still validates the bytes."""
        with metrics.EC_STORE_LATENCY.labels("stat").time():
            info = self.store.stat(self.key(item_hash))
        return (
            info is not None
            and info.metadata.get(META_SCHEMA) == SCHEMA
            and info.metadata.get(META_FINGERPRINT) == self.fingerprint
        )

    def save(
        self, item_hash: str, data: bytes, *, dtype: str, shape: tuple[int, ...], extra: dict | None = None
    ) -> tuple[str, int]:
        """Write (or overwrite) the EC object of an item. Returns (key, object size)."""
        blob = encode_ec_object(
            data,
            dtype=dtype,
            shape=shape,
            fingerprint=self.fingerprint,
            item_hash=item_hash,
            producer=self.producer,
            extra=extra,
        )
        key = self.key(item_hash)
        user_meta = {META_SCHEMA: SCHEMA, META_FINGERPRINT: self.fingerprint}
        with metrics.EC_STORE_LATENCY.labels("put").time():
            self.store.put(key, blob, metadata=user_meta)
        metrics.EC_BYTES.labels("put").inc(len(blob))
        return key, len(blob)

    def load(self, item_hash: str, *, request_id: str = "-") -> ECObject:
        """Fetch and validate. Raises ECValidationError (a miss, with reason); never bad data."""
        key = self.key(item_hash)
        started = time.perf_counter()
        try:
            with metrics.EC_STORE_LATENCY.labels("get").time():
                blob = self.store.get(key, max_bytes=self.max_object_bytes)
        except StoreError as exc:
            raise self._miss(request_id, key, MissReason.STORE_ERROR, str(exc)) from exc
        except EPDError as exc:  # ObjectTooLarge
            raise self._miss(request_id, key, MissReason.TOO_LARGE, str(exc)) from exc
        if blob is None:
            raise self._miss(request_id, key, MissReason.NOT_FOUND, "no object")
        try:
            obj = decode_ec_object(blob, fingerprint=self.fingerprint, item_hash=item_hash)
        except ECValidationError as exc:
            raise self._miss(request_id, key, exc.reason, exc.detail) from exc
        metrics.EC_BYTES.labels("get").inc(len(blob))
        metrics.EC_LOOKUPS.labels("store", "hit", "").inc()
        log.debug(
            "request_id=%s ec hit key=%s bytes=%d in %.1f ms",
            request_id, key, len(blob), (time.perf_counter() - started) * 1e3,
        )
        return obj

    def _miss(self, request_id: str, key: str, reason: MissReason, detail: str) -> ECValidationError:
        metrics.EC_LOOKUPS.labels("store", "miss", reason.value).inc()
        level = logging.INFO if reason is MissReason.NOT_FOUND else logging.WARNING
        log.log(level, "request_id=%s ec miss key=%s reason=%s detail=%s", request_id, key, reason.value, detail)
        return ECValidationError(reason, detail)

    # -- media (original image bytes, content-addressed) -------------------------------------
    def media_key(self, item_hash: str) -> str:
        return media_key(self.namespace, item_hash)

    def put_media(self, item_hash: str, data: bytes) -> str:
        key = self.media_key(item_hash)
        if not self.store.exists(key):
            self.store.put(key, data)
            metrics.MEDIA_BYTES.labels("put").inc(len(data))
        return key

    def get_media(self, key: str) -> bytes | None:
        data = self.store.get(key, max_bytes=self.max_media_bytes)
        if data is not None:
            metrics.MEDIA_BYTES.labels("get").inc(len(data))
        return data
