"""Build the object store, EC store and KV store from settings (the only place that reads store settings)."""

from __future__ import annotations

from shared.config import CommonSettings
from shared.store.ec import ECStore
from shared.store.kv import KVStore
from shared.store.objects import ObjectStore, make_object_store


def object_store_from_settings(settings: CommonSettings) -> ObjectStore:
    if settings.store_backend == "s3":
        return make_object_store(
            "s3",
            endpoint=settings.s3_endpoint,
            access_key=settings.s3_access_key.get_secret_value(),
            secret_key=settings.s3_secret_key.get_secret_value(),
            bucket=settings.s3_bucket,
            secure=settings.s3_secure,
            region=settings.s3_region,
        )
    if settings.store_backend == "fs":
        return make_object_store("fs", root=settings.store_fs_root)
    return make_object_store(settings.store_backend)  # raises with the list of known kinds


def ec_store_from_settings(settings: CommonSettings, fingerprint: str) -> ECStore:
    store = object_store_from_settings(settings)
    store.ensure_bucket()
    return ECStore(
        store,
        namespace=settings.namespace,
        fingerprint=fingerprint,
        producer=settings.worker_id,
        max_object_bytes=settings.max_ec_object_bytes,
        max_media_bytes=settings.max_image_bytes,
    )


def kv_store_from_settings(settings: CommonSettings, model_fingerprint: str) -> KVStore:
    store = object_store_from_settings(settings)
    store.ensure_bucket()
    return KVStore(
        store,
        namespace=settings.namespace,
        fingerprint=model_fingerprint,
        producer=settings.worker_id,
        max_object_bytes=settings.max_kv_object_bytes,
    )
