"""Open the object store, the EC store and the KV store of a store settings group: the only place
that turns :class:`~shared.config.StoreSettings` into stores (services, tools and the vLLM
connectors alike)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import StoreBackend, StoreSettings
from shared.store.ec import ECStore
from shared.store.kv import KVStore
from shared.store.objects import ObjectStore, make_object_store


@dataclass(frozen=True)
class Stores:
    """What :func:`open_stores` opened: the object store, and the EC / KV store asked for."""

    objects: ObjectStore
    ec: ECStore | None = None
    kv: KVStore | None = None

    def ec_store(self) -> ECStore:
        assert self.ec is not None, "open_stores(ec_fingerprint=...) opens the EC store"
        return self.ec

    def kv_store(self) -> KVStore:
        assert self.kv is not None, "open_stores(kv_fingerprint=...) opens the KV store"
        return self.kv


def _object_store(store: StoreSettings) -> ObjectStore:
    if store.store_backend is StoreBackend.S3:
        return make_object_store(
            StoreBackend.S3,
            endpoint=store.s3_endpoint,
            access_key=store.s3_access_key.get_secret_value(),
            secret_key=store.s3_secret_key.get_secret_value(),
            bucket=store.s3_bucket,
            secure=store.s3_secure,
            region=store.s3_region,
            ca_file=store.s3_tls_ca,
        )
    return make_object_store(StoreBackend.FS, root=store.store_fs_root)


def open_stores(
    store: StoreSettings,
    *,
    producer: str = "",
    ec_fingerprint: str | None = None,
    kv_fingerprint: str | None = None,
    max_media_bytes: int | None = None,
    ensure_bucket: bool = False,
) -> Stores:
    """The object store ``store`` points at, plus the EC store of ``ec_fingerprint`` (bounded by
    ``max_ec_object_bytes``; stored images by ``max_media_bytes``) and the KV store of
    ``kv_fingerprint`` (bounded by ``max_kv_object_bytes``) when given; their objects name
    ``producer``. ``ensure_bucket``: create the bucket when missing (blocking: call it off the
    event loop)."""
    objects = _object_store(store)
    if ensure_bucket:
        objects.ensure_bucket()
    ec = kv = None
    if ec_fingerprint is not None:
        media = {} if max_media_bytes is None else {"max_media_bytes": max_media_bytes}
        ec = ECStore(
            objects,
            namespace=store.namespace,
            fingerprint=ec_fingerprint,
            producer=producer,
            max_object_bytes=store.max_ec_object_bytes,
            **media,
        )
    if kv_fingerprint is not None:
        kv = KVStore(
            objects,
            namespace=store.namespace,
            fingerprint=kv_fingerprint,
            producer=producer,
            max_object_bytes=store.max_kv_object_bytes,
        )
    return Stores(objects, ec, kv)
