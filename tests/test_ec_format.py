"""EC object format: standard safetensors, and every corruption is a typed miss (pure logic)."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from shared.store.format import MissReason, ObjectValidationError, decode_ec_object, ec_key, encode_ec_object

FP, ITEM = "f" * 24, "1" * 64


def make(features: np.ndarray, **kw) -> bytes:
    args = dict(
        dtype="F32", shape=features.shape, fingerprint=FP, item_hash=ITEM, producer="w1", extra={"grid_thw": [1, 2, 3]}
    )
    args.update(kw)
    return encode_ec_object(features.astype(np.float32).tobytes(), **args)


@pytest.fixture
def features():
    return np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)


def test_round_trip_and_standard_safetensors(features):
    blob = make(features)
    obj = decode_ec_object(blob, fingerprint=FP, item_hash=ITEM)
    assert obj.shape == (6, 8) and obj.n_tokens == 6 and obj.dtype == "F32"
    assert obj.extra == {"grid_thw": [1, 2, 3]} and obj.producer == "w1"
    np.testing.assert_array_equal(np.frombuffer(obj.data, np.float32).reshape(6, 8), features)
    # Any safetensors reader can open it.
    np.testing.assert_array_equal(st_load(blob)["features"], features)


def test_key_scheme():
    assert ec_key("epd", FP, ITEM) == f"epd/{FP}/{ITEM}"


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), MissReason.CHECKSUM_MISMATCH),
        (lambda b: b[:-4], MissReason.CORRUPT),
        (lambda b: b[:5], MissReason.CORRUPT),
        (lambda b: b"", MissReason.CORRUPT),
        (lambda b: struct.pack("<Q", 10**9) + b[8:], MissReason.CORRUPT),
        (lambda b: b[:8] + b"X" + b[9:], MissReason.CORRUPT),
    ],
    ids=["flipped-data-byte", "truncated", "header-cut", "empty", "huge-header-len", "broken-json"],
)
def test_corruption_is_a_typed_miss(features, mutate, reason):
    blob = make(features)
    decode_ec_object(blob, fingerprint=FP, item_hash=ITEM)  # control: intact object is valid
    with pytest.raises(ObjectValidationError) as exc:
        decode_ec_object(mutate(blob), fingerprint=FP, item_hash=ITEM)
    assert exc.value.reason is reason


def test_other_fingerprint_item_and_schema_are_misses(features):
    blob = make(features)
    with pytest.raises(ObjectValidationError) as exc:
        decode_ec_object(blob, fingerprint="0" * 24, item_hash=ITEM)
    assert exc.value.reason is MissReason.FINGERPRINT_MISMATCH
    with pytest.raises(ObjectValidationError) as exc:
        decode_ec_object(blob, fingerprint=FP, item_hash="2" * 64)
    assert exc.value.reason is MissReason.ITEM_MISMATCH

    # Rewrite the header with another schema (same length JSON would be fiddly: rebuild it).
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["schema"] = "epd-ec-v0"
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with pytest.raises(ObjectValidationError) as exc:
        decode_ec_object(struct.pack("<Q", len(hb)) + hb + blob[8 + n :], fingerprint=FP, item_hash=ITEM)
    assert exc.value.reason is MissReason.SCHEMA_MISMATCH


def test_metadata_shape_lie_is_detected(features):
    blob = make(features)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["n_tokens"] = "5"
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with pytest.raises(ObjectValidationError) as exc:
        decode_ec_object(struct.pack("<Q", len(hb)) + hb + blob[8 + n :], fingerprint=FP, item_hash=ITEM)
    assert exc.value.reason is MissReason.SHAPE_MISMATCH


def test_writer_rejects_inconsistent_input(features):
    with pytest.raises(ValueError):
        encode_ec_object(b"123", dtype="F32", shape=(6, 8), fingerprint=FP, item_hash=ITEM, producer="w")
    with pytest.raises(ValueError):
        encode_ec_object(b"", dtype="F32", shape=(0, 8), fingerprint=FP, item_hash=ITEM, producer="w")


# -- the EC front of the one tensor-object store (fs backend: same contract as S3) ---------------
def test_ec_store_round_trip_exists_and_misses(features, tmp_path):
    from shared.store.ec import ECStore
    from shared.store.objects import LocalDirObjectStore, ObjectTooLarge

    raw = LocalDirObjectStore(tmp_path)
    raw.ensure_bucket()
    store = ECStore(raw, namespace="ns", fingerprint=FP, producer="w1", max_object_bytes=1 << 20)
    assert store.key(ITEM) == ec_key("ns", FP, ITEM)  # one key scheme
    assert not store.exists(ITEM) and store.stat(ITEM) is None
    with pytest.raises(ObjectValidationError) as exc:
        store.load(ITEM)
    assert exc.value.reason is MissReason.NOT_FOUND

    key, size = store.save(ITEM, features.tobytes(), dtype="F32", shape=features.shape, extra={"grid_thw": [1, 2, 3]})
    assert key == store.key(ITEM) and store.stat(ITEM).size == size
    assert store.exists(ITEM)
    obj = store.load(ITEM)
    np.testing.assert_array_equal(np.frombuffer(obj.data, np.float32).reshape(features.shape), features)
    # Another fingerprint's store neither sees nor reads it.
    other = ECStore(raw, namespace="ns", fingerprint="e" * 24, producer="w2")
    assert not other.exists(ITEM)
    raw.put(other.key(ITEM), raw.get(key, max_bytes=1 << 20), metadata=raw.stat(key).metadata)
    assert not other.exists(ITEM)  # the S3 metadata names the writer's fingerprint
    with pytest.raises(ObjectValidationError) as exc:
        other.load(ITEM)
    assert exc.value.reason is MissReason.FINGERPRINT_MISMATCH
    # Objects over the bound are neither read nor written.
    small = ECStore(raw, namespace="ns", fingerprint=FP, producer="w1", max_object_bytes=size - 1)
    with pytest.raises(ObjectValidationError) as exc:
        small.load(ITEM)
    assert exc.value.reason is MissReason.TOO_LARGE
    with pytest.raises(ObjectTooLarge):
        small.save(ITEM, features.tobytes(), dtype="F32", shape=features.shape, extra={"grid_thw": [1, 2, 3]})


def test_ec_sweep_removes_only_this_fingerprints_old_objects(features, tmp_path):
    import time

    from shared.store.ec import ECStore
    from shared.store.objects import LocalDirObjectStore

    raw = LocalDirObjectStore(tmp_path)
    raw.ensure_bucket()
    store = ECStore(raw, namespace="ns", fingerprint=FP, producer="w1")
    other = ECStore(raw, namespace="ns", fingerprint="e" * 24, producer="w2")
    key, _ = store.save(ITEM, features.tobytes(), dtype="F32", shape=features.shape)
    other_key, _ = other.save(ITEM, features.tobytes(), dtype="F32", shape=features.shape)
    media = store.put_media(ITEM, b"image bytes")
    assert store.sweep(3600) == 0  # fresh objects stay
    # EC objects share the namespace with media and other kinds: only this fingerprint's go
    assert store.sweep(3600, now=time.time() + 7200) == 1
    assert raw.stat(key) is None and raw.stat(other_key) is not None and raw.stat(media) is not None
