"""EC object format: one safetensors file per encoder output, with validating reader.

The object is a standard safetensors file (loadable by the ``safetensors`` library) holding one
tensor named ``features`` and a ``__metadata__`` map:

==================  =============================================================
schema              ``epd-ec-v1``
fingerprint         encoder fingerprint (see shared.fingerprint)
item_hash           content hash of the image
dtype / shape       of ``features`` (shape as JSON)
n_tokens            ``shape[0]``
sha256              of the raw tensor bytes
producer            worker id that wrote it
created_at          unix time
extra               JSON object of model-specific layout (e.g. ``{"grid_thw": [1, 4, 6]}``)
==================  =============================================================

Reading and writing are done here without torch or numpy (raw bytes + dtype + shape), so the
format has exactly one implementation shared by every writer and reader, including the vLLM
connector. :func:`decode_ec_object` checks everything; any problem is an :class:`ECValidationError`
with a :class:`MissReason`, which callers treat as a cache miss, never as data.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "epd-ec-v1"
TENSOR_NAME = "features"
_MAX_HEADER_BYTES = 64 * 1024

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}


class MissReason(str, enum.Enum):
    """Why an EC lookup did not produce usable features. Values appear in logs and metrics."""

    NOT_FOUND = "not_found"
    CORRUPT = "corrupt"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    ITEM_MISMATCH = "item_mismatch"
    SCHEMA_MISMATCH = "schema_mismatch"
    SHAPE_MISMATCH = "shape_mismatch"
    TOO_LARGE = "too_large"
    STORE_ERROR = "store_error"
    TIMEOUT = "timeout"
    ENCODER_FAILED = "encoder_failed"


class ECValidationError(ValueError):
    def __init__(self, reason: MissReason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ECObject:
    """A decoded, validated EC object. ``data`` is the raw little-endian tensor bytes."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]
    fingerprint: str
    item_hash: str
    sha256: str
    producer: str
    created_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.shape[0]


def ec_key(namespace: str, fingerprint: str, item_hash: str) -> str:
    """``<namespace>/<encoder fingerprint>/<item content hash>``."""
    return f"{namespace}/{fingerprint}/{item_hash}"


def media_key(namespace: str, item_hash: str) -> str:
    """Where the original image bytes of an item live (content-addressed)."""
    return f"{namespace}/media/{item_hash}"


def encode_ec_object(
    data: bytes,
    *,
    dtype: str,
    shape: tuple[int, ...],
    fingerprint: str,
    item_hash: str,
    producer: str,
    extra: dict[str, Any] | None = None,
    created_at: float | None = None,
) -> bytes:
    """Serialize raw tensor bytes into an EC object (a safetensors file)."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    if len(shape) != 2 or any(d <= 0 for d in shape):
        raise ValueError(f"features must be 2-D and non-empty, got shape {shape}")
    if len(data) != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise ValueError(f"{len(data)} bytes do not match {dtype}{list(shape)}")
    metadata = {
        "schema": SCHEMA,
        "fingerprint": fingerprint,
        "item_hash": item_hash,
        "dtype": dtype,
        "shape": json.dumps(list(shape)),
        "n_tokens": str(shape[0]),
        "sha256": hashlib.sha256(data).hexdigest(),
        "producer": producer,
        "created_at": f"{time.time() if created_at is None else created_at:.6f}",
        "extra": json.dumps(extra or {}, sort_keys=True),
    }
    header = {
        "__metadata__": metadata,
        TENSOR_NAME: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, len(data)]},
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data section to 8
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


def decode_ec_object(blob: bytes, *, fingerprint: str, item_hash: str) -> ECObject:
    """Parse and validate an EC object against the expected fingerprint and item.

    Raises :class:`ECValidationError`; never returns data that failed a check.
    """
    if len(blob) < 8:
        raise ECValidationError(MissReason.CORRUPT, f"object of {len(blob)} bytes is too short")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(blob):
        raise ECValidationError(MissReason.CORRUPT, f"bad header length {header_len}")
    try:
        header = json.loads(blob[8 : 8 + header_len])
        meta = header["__metadata__"]
        tensor = header[TENSOR_NAME]
        schema = meta["schema"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ECValidationError(MissReason.CORRUPT, f"unreadable header ({exc})") from exc
    if schema != SCHEMA:
        raise ECValidationError(MissReason.SCHEMA_MISMATCH, f"schema {schema!r} != {SCHEMA!r}")
    if meta.get("fingerprint") != fingerprint:
        raise ECValidationError(
            MissReason.FINGERPRINT_MISMATCH,
            f"object fingerprint {meta.get('fingerprint')!r} != expected {fingerprint!r}",
        )
    if meta.get("item_hash") != item_hash:
        raise ECValidationError(
            MissReason.ITEM_MISMATCH, f"object item {meta.get('item_hash')!r} != expected {item_hash!r}"
        )
    try:
        dtype = tensor["dtype"]
        shape = tuple(int(d) for d in tensor["shape"])
        start, end = (int(x) for x in tensor["data_offsets"])
        meta_shape = tuple(json.loads(meta["shape"]))
        n_tokens = int(meta["n_tokens"])
        extra = json.loads(meta.get("extra", "{}"))
        created_at = float(meta["created_at"])
        expected_sha = meta["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ECValidationError(MissReason.CORRUPT, f"bad tensor header ({exc})") from exc
    if dtype not in DTYPE_SIZES or meta.get("dtype") != dtype:
        raise ECValidationError(MissReason.SHAPE_MISMATCH, f"dtype {dtype!r} vs metadata {meta.get('dtype')!r}")
    if len(shape) != 2 or shape != meta_shape or n_tokens != shape[0]:
        raise ECValidationError(
            MissReason.SHAPE_MISMATCH, f"shape {shape} vs metadata {meta_shape} / n_tokens {n_tokens}"
        )
    data_start = 8 + header_len
    expected_len = math.prod(shape) * DTYPE_SIZES[dtype]
    if start != 0 or end - start != expected_len or data_start + end != len(blob):
        raise ECValidationError(
            MissReason.CORRUPT,
            f"data section {end - start} bytes (object {len(blob) - data_start}) != {expected_len} expected",
        )
    data = blob[data_start:]
    actual_sha = hashlib.sha256(data).hexdigest()
    if actual_sha != expected_sha:
        raise ECValidationError(MissReason.CHECKSUM_MISMATCH, f"sha256 {actual_sha[:12]} != {str(expected_sha)[:12]}")
    return ECObject(
        data=data,
        dtype=dtype,
        shape=shape,
        fingerprint=fingerprint,
        item_hash=item_hash,
        sha256=actual_sha,
        producer=str(meta.get("producer", "")),
        created_at=created_at,
        extra=extra if isinstance(extra, dict) else {},
    )
