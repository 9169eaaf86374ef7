"""The EC store: versioned, validated encoder outputs (and the images they came from) in S3.

Every component that moves encoder outputs (the encoder worker, prefill workers, the API, replay
and the vLLM EC connector) goes through :class:`ECStore`, the EC front of
:class:`shared.store.tensor_store.TensorObjectStore`: the key scheme, object format
(:mod:`shared.store.format`) and validation exist once.

Keys (``namespace`` defaults to ``epd``):

* EC object:  ``<namespace>/<encoder fingerprint>/<item content hash>`` (see ``format.ec_key``)
* image:      ``<namespace>/media/<item content hash>``

A load never raises for bad data: a missing, corrupt, foreign-fingerprint or otherwise invalid
object comes back as :class:`ObjectValidationError` with a :class:`MissReason`, is logged with the
reason and counted in ``epd:ec_lookups_total{source="store"}``. Callers fall back to encoding.
"""

from __future__ import annotations

import logging
from typing import Any

from shared import metrics
from shared.store.format import SCHEMA, ECObject, decode_ec_object, encode_ec_object, media_key
from shared.store.objects import ObjectStore
from shared.store.tensor_store import META_FINGERPRINT, META_SCHEMA, TensorCodec, TensorObjectStore

__all__ = ["EC_CODEC", "ECCodec", "ECStore", "META_FINGERPRINT", "META_SCHEMA"]


class ECCodec(TensorCodec[ECObject, str]):
    """EC objects: identified by the item's content hash, right under the namespace."""

    kind = "ec"
    schema = SCHEMA
    folder = None
    not_found_level = logging.INFO  # a miss is the normal first sight of an image

    def name(self, ident: str) -> str:
        return ident

    def decode(self, blob: bytes, *, fingerprint: str, ident: str) -> ECObject:
        return decode_ec_object(blob, fingerprint=fingerprint, item_hash=ident)

    def latency(self, op: str) -> Any:
        return metrics.EC_STORE_LATENCY.labels(op)

    def transferred(self, direction: str) -> Any:
        return metrics.EC_BYTES.labels(direction)

    def lookup(self, outcome: metrics.LookupOutcome, reason: str) -> Any:
        return metrics.EC_LOOKUPS.labels("store", outcome, reason)


EC_CODEC = ECCodec()


class ECStore(TensorObjectStore[ECObject, str]):
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
        super().__init__(
            store,
            EC_CODEC,
            namespace=namespace,
            fingerprint=fingerprint,
            producer=producer,
            max_object_bytes=max_object_bytes,
        )
        self.max_media_bytes = max_media_bytes

    # -- EC objects ------------------------------------------------------------------------
    def key(self, item_hash: str) -> str:
        """``<namespace>/<fingerprint>/<item_hash>`` (``format.ec_key``)."""
        return self.object_key(item_hash)

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
        return key, self.write(key, blob)

    def load(self, item_hash: str, *, request_id: str = "-") -> ECObject:
        """Fetch and validate. Raises ObjectValidationError (a miss, with reason); never bad data."""
        return self.fetch(item_hash, request_id=request_id)

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
