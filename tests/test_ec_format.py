"""EC object format: standard safetensors, and every corruption is a typed miss (pure logic)."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from shared.store.format import ECValidationError, MissReason, decode_ec_object, ec_key, encode_ec_object

FP, ITEM = "f" * 24, "1" * 64


def make(features: np.ndarray, **kw) -> bytes:
    args = dict(dtype="F32", shape=features.shape, fingerprint=FP, item_hash=ITEM, producer="w1",
                extra={"grid_thw": [1, 2, 3]})
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
    with pytest.raises(ECValidationError) as exc:
        decode_ec_object(mutate(blob), fingerprint=FP, item_hash=ITEM)
    assert exc.value.reason is reason


def test_other_fingerprint_item_and_schema_are_misses(features):
    blob = make(features)
    with pytest.raises(ECValidationError) as exc:
        decode_ec_object(blob, fingerprint="0" * 24, item_hash=ITEM)
    assert exc.value.reason is MissReason.FINGERPRINT_MISMATCH
    with pytest.raises(ECValidationError) as exc:
        decode_ec_object(blob, fingerprint=FP, item_hash="2" * 64)
    assert exc.value.reason is MissReason.ITEM_MISMATCH

    # Rewrite the header with another schema (same length JSON would be fiddly: rebuild it).
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["schema"] = "epd-ec-v0"
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with pytest.raises(ECValidationError) as exc:
        decode_ec_object(struct.pack("<Q", len(hb)) + hb + blob[8 + n :], fingerprint=FP, item_hash=ITEM)
    assert exc.value.reason is MissReason.SCHEMA_MISMATCH


def test_metadata_shape_lie_is_detected(features):
    blob = make(features)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["n_tokens"] = "5"
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with pytest.raises(ECValidationError) as exc:
        decode_ec_object(struct.pack("<Q", len(hb)) + hb + blob[8 + n :], fingerprint=FP, item_hash=ITEM)
    assert exc.value.reason is MissReason.SHAPE_MISMATCH


def test_writer_rejects_inconsistent_input(features):
    with pytest.raises(ValueError):
        encode_ec_object(b"123", dtype="F32", shape=(6, 8), fingerprint=FP, item_hash=ITEM, producer="w")
    with pytest.raises(ValueError):
        encode_ec_object(b"", dtype="F32", shape=(0, 8), fingerprint=FP, item_hash=ITEM, producer="w")
