"""Tensor object format: versioned, validated safetensors files (EC objects and KV objects).

One implementation serves every object the system stores: :func:`encode_tensor_object` /
:func:`decode_tensor_object` write and check a standard safetensors file (loadable by the
``safetensors`` library) holding one or more named tensors plus a ``__metadata__`` map:

==================  =============================================================
schema              what the object is, with a version (``epd-ec-v2``, ``epd-kv-v1``)
fingerprint         version of what produced it (encoder or whole-model fingerprint,
                    see shared.fingerprint); a reader only accepts its own
<id field>          whose object it is (``item_hash`` for EC, ``request_id`` for KV)
tensors             JSON ``[[name, dtype, shape], ...]`` in data order; must equal the
                    safetensors header (catches a header corrupted into another shape)
sha256              of all tensor bytes (the whole data section)
producer            worker id that wrote it
created_at          unix time
(more)              schema-specific string fields
==================  =============================================================

Tensors are laid out contiguously in order of decreasing element size, so every tensor is
aligned for zero-copy readers. Reading and writing are done here without torch or numpy (raw
bytes + dtype + shape), so the format has exactly one implementation shared by every writer and
reader, including the vLLM connector. A decode checks everything; any problem is an
:class:`ObjectValidationError` with a :class:`MissReason`, which callers treat as a miss, never
as data.

EC objects (``epd-ec-v2``): one tensor ``features`` ``[n_tokens, hidden]`` and the fields
``dtype``, ``shape``, ``n_tokens`` and ``extra`` (JSON model layout, e.g. ``{"grid_thw": [1, 4, 6]}``).
KV objects: see :mod:`shared.store.kv`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "epd-ec-v2"  # v2: the generic layout (``tensors`` metadata); v1 objects are misses
TENSOR_NAME = "features"
_MAX_HEADER_BYTES = 64 * 1024
#: Upper bounds for any tensor object (KV objects of real models have ~2 tensors per layer).
MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 4096

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_RESERVED_META = frozenset({"schema", "fingerprint", "tensors", "sha256", "producer", "created_at"})


class MissReason(str, enum.Enum):
    """Why a lookup did not produce usable data. Values appear in logs and metrics."""

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
    #: no encoder worker is alive (scaled to zero, or all gone): encoded here, not waited for
    NO_ENCODER = "no_encoder"
    #: the item's identifier cannot be an object key (vLLM connector: never looked up)
    BAD_IDENTIFIER = "bad_identifier"


class ObjectValidationError(ValueError):
    """A stored object that must not be used; ``reason`` says why."""

    def __init__(self, reason: MissReason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RawTensor:
    """A tensor as raw little-endian bytes (C order) + safetensors dtype name + shape."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class TensorObject:
    """A decoded, validated tensor object."""

    schema: str
    fingerprint: str
    object_id: str
    tensors: dict[str, RawTensor]
    sha256: str
    producer: str
    created_at: float
    metadata: dict[str, str]


def _layout(tensors: Mapping[str, RawTensor]) -> list[str]:
    # Larger elements first: every tensor starts at a multiple of its element size.
    return sorted(tensors, key=lambda name: (-DTYPE_SIZES[tensors[name].dtype], name))


def encode_tensor_object(
    tensors: Mapping[str, RawTensor],
    *,
    schema: str,
    fingerprint: str,
    id_field: str,
    object_id: str,
    producer: str,
    metadata: Mapping[str, str] | None = None,
    created_at: float | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> bytes:
    """Serialize named raw tensors into a tensor object (a safetensors file). Raises ValueError
    for inconsistent input (sizes, dtypes, reserved metadata names, a header over the bound)."""
    if not tensors:
        raise ValueError("a tensor object needs at least one tensor")
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"{len(tensors)} tensors exceed the limit of {MAX_TENSORS}")
    for name, t in tensors.items():
        if not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        if t.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {t.dtype!r} for {name}")
        if any((not isinstance(d, int)) or d < 0 for d in t.shape):
            raise ValueError(f"invalid shape {t.shape} for {name}")
        if len(t.data) != t.nbytes:
            raise ValueError(f"{name}: {len(t.data)} bytes do not match {t.dtype}{list(t.shape)}")
    extra = dict(metadata or {})
    clash = (_RESERVED_META | {id_field}) & set(extra)
    if clash:
        raise ValueError(f"metadata may not set reserved fields {sorted(clash)}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise ValueError("metadata keys and values must be strings")
    order = _layout(tensors)
    digest = hashlib.sha256()
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
        digest.update(t.data)
    meta = {
        "schema": schema,
        "fingerprint": fingerprint,
        id_field: object_id,
        "tensors": json.dumps([[n, tensors[n].dtype, list(tensors[n].shape)] for n in order], separators=(",", ":")),
        "sha256": digest.hexdigest(),
        "producer": producer,
        "created_at": f"{time.time() if created_at is None else created_at:.6f}",
        **extra,
    }
    header = {"__metadata__": meta, **header}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data section to 8
    if len(header_bytes) > max_header_bytes:
        raise ValueError(f"header of {len(header_bytes)} bytes exceeds the limit of {max_header_bytes}")
    return b"".join([struct.pack("<Q", len(header_bytes)), header_bytes, *(tensors[n].data for n in order)])


def decode_tensor_object(
    blob: bytes,
    *,
    schema: str,
    fingerprint: str,
    id_field: str,
    object_id: str,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> TensorObject:
    """Parse and validate a tensor object against the expected schema, fingerprint and id.

    Checks, in order: header framing and JSON (CORRUPT), schema (SCHEMA_MISMATCH), fingerprint
    (FINGERPRINT_MISMATCH), id (ITEM_MISMATCH), the tensor table against the ``tensors``
    metadata and the data layout (SHAPE_MISMATCH / CORRUPT), the sha256 of the data
    (CHECKSUM_MISMATCH). Raises :class:`ObjectValidationError`; never returns unchecked data.
    """
    if len(blob) < 8:
        raise ObjectValidationError(MissReason.CORRUPT, f"object of {len(blob)} bytes is too short")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > max_header_bytes or 8 + header_len > len(blob):
        raise ObjectValidationError(MissReason.CORRUPT, f"bad header length {header_len}")
    try:
        header = json.loads(blob[8 : 8 + header_len])
        meta = header.pop("__metadata__")
        got_schema = meta["schema"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ObjectValidationError(MissReason.CORRUPT, f"unreadable header ({exc})") from exc
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ObjectValidationError(MissReason.CORRUPT, "metadata is not a map of strings")
    if got_schema != schema:
        raise ObjectValidationError(MissReason.SCHEMA_MISMATCH, f"schema {got_schema!r} != {schema!r}")
    if meta.get("fingerprint") != fingerprint:
        raise ObjectValidationError(
            MissReason.FINGERPRINT_MISMATCH,
            f"object fingerprint {meta.get('fingerprint')!r} != expected {fingerprint!r}",
        )
    if meta.get(id_field) != object_id:
        raise ObjectValidationError(
            MissReason.ITEM_MISMATCH, f"object {id_field} {meta.get(id_field)!r} != expected {object_id!r}"
        )
    try:
        table = json.loads(meta["tensors"])
        declared = [(str(n), str(d), tuple(int(x) for x in shp)) for n, d, shp in table]
        entries = {
            name: (
                str(info["dtype"]),
                tuple(int(x) for x in info["shape"]),
                tuple(int(x) for x in info["data_offsets"]),
            )
            for name, info in header.items()
        }
        created_at = float(meta["created_at"])
        expected_sha = meta["sha256"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ObjectValidationError(MissReason.CORRUPT, f"bad tensor header ({exc})") from exc
    if not declared or len(declared) > MAX_TENSORS:
        raise ObjectValidationError(MissReason.CORRUPT, f"{len(declared)} tensors (1..{MAX_TENSORS} allowed)")
    if len(entries) != len(declared) or any(n not in entries or entries[n][:2] != (d, shp) for n, d, shp in declared):
        raise ObjectValidationError(MissReason.SHAPE_MISMATCH, "tensor table does not match the metadata")
    data_start = 8 + header_len
    offset = 0
    tensors: dict[str, RawTensor] = {}
    for name, dtype, shape in declared:
        if dtype not in DTYPE_SIZES or any(d < 0 for d in shape):
            raise ObjectValidationError(MissReason.SHAPE_MISMATCH, f"{name}: bad dtype/shape {dtype}{list(shape)}")
        start, end = entries[name][2]
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        if start != offset or end - start != size:
            raise ObjectValidationError(
                MissReason.CORRUPT, f"{name}: data offsets [{start}, {end}) != [{offset}, {offset + size})"
            )
        offset = end
    if data_start + offset != len(blob):
        raise ObjectValidationError(
            MissReason.CORRUPT, f"data section {len(blob) - data_start} bytes != {offset} expected"
        )
    data = memoryview(blob)[data_start:]
    actual_sha = hashlib.sha256(data).hexdigest()
    if actual_sha != expected_sha:
        raise ObjectValidationError(
            MissReason.CHECKSUM_MISMATCH, f"sha256 {actual_sha[:12]} != {str(expected_sha)[:12]}"
        )
    for name, dtype, shape in declared:
        start, end = entries[name][2]
        tensors[name] = RawTensor(bytes(data[start:end]), dtype, shape)
    return TensorObject(
        schema=schema,
        fingerprint=fingerprint,
        object_id=object_id,
        tensors=tensors,
        sha256=actual_sha,
        producer=str(meta.get("producer", "")),
        created_at=created_at,
        metadata=meta,
    )


# -- EC objects ---------------------------------------------------------------------------------
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


def join_rows(objects: Sequence[ECObject]) -> tuple[bytes, str, tuple[int, ...]]:
    """The tensors of ``objects`` concatenated along their first axis, in order, as (raw bytes,
    dtype, shape): a segmented video's features from its segments' (row-major raw bytes, so the
    data one after another). Raises ValueError when there is none or their dtypes or row shapes
    differ."""
    if not objects:
        raise ValueError("join_rows: no object")
    kinds = {(o.dtype, tuple(o.shape[1:])) for o in objects}
    if len(kinds) != 1:
        raise ValueError(f"join_rows: the objects' dtypes or row shapes differ: {sorted(kinds)}")
    ((dtype, row),) = kinds
    return b"".join(o.data for o in objects), dtype, (sum(o.shape[0] for o in objects), *row)


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
    return encode_tensor_object(
        {TENSOR_NAME: RawTensor(data, dtype, tuple(shape))},
        schema=SCHEMA,
        fingerprint=fingerprint,
        id_field="item_hash",
        object_id=item_hash,
        producer=producer,
        created_at=created_at,
        metadata={
            "dtype": dtype,
            "shape": json.dumps(list(shape)),
            "n_tokens": str(shape[0]),
            "extra": json.dumps(extra or {}, sort_keys=True),
        },
        max_header_bytes=_MAX_HEADER_BYTES,
    )


def decode_ec_object(blob: bytes, *, fingerprint: str, item_hash: str) -> ECObject:
    """Parse and validate an EC object against the expected fingerprint and item.

    Raises :class:`ObjectValidationError`; never returns data that failed a check.
    """
    obj = decode_tensor_object(
        blob,
        schema=SCHEMA,
        fingerprint=fingerprint,
        id_field="item_hash",
        object_id=item_hash,
        max_header_bytes=_MAX_HEADER_BYTES,
    )
    meta = obj.metadata
    tensor = obj.tensors.get(TENSOR_NAME)
    if tensor is None or len(obj.tensors) != 1:
        raise ObjectValidationError(MissReason.SHAPE_MISMATCH, f"EC object tensors {sorted(obj.tensors)}")
    try:
        meta_shape = tuple(json.loads(meta["shape"]))
        n_tokens = int(meta["n_tokens"])
        extra = json.loads(meta.get("extra", "{}"))
    except (ValueError, KeyError, TypeError) as exc:
        raise ObjectValidationError(MissReason.CORRUPT, f"bad EC metadata ({exc})") from exc
    if meta.get("dtype") != tensor.dtype:
        raise ObjectValidationError(
            MissReason.SHAPE_MISMATCH, f"dtype {tensor.dtype!r} vs metadata {meta.get('dtype')!r}"
        )
    shape = tensor.shape
    if len(shape) != 2 or 0 in shape or shape != meta_shape or n_tokens != shape[0]:
        raise ObjectValidationError(
            MissReason.SHAPE_MISMATCH, f"shape {shape} vs metadata {meta_shape} / n_tokens {n_tokens}"
        )
    return ECObject(
        data=tensor.data,
        dtype=tensor.dtype,
        shape=shape,
        fingerprint=fingerprint,
        item_hash=item_hash,
        sha256=obj.sha256,
        producer=obj.producer,
        created_at=obj.created_at,
        extra=extra if isinstance(extra, dict) else {},
    )


#: A video's sampled frames, stored content-addressed under its media key (the workers read these,
#: never the container file): one ``U8`` tensor ``[n, height, width, 3]`` (RGB), the rate the
#: frames stand for and, where given, which frames of the source they are (:class:`VideoSource`).
VIDEO_FRAMES_SCHEMA = "epd-video-frames-v1"
_FRAMES_TENSOR = "frames"


@dataclass(frozen=True)
class VideoSource:
    """Which frames of the source video the sampled ones are (``indices``, one per frame), the
    source's rate and frame count: the metadata vLLM's loader returns beside the frames (Qwen3-VL
    writes each temporal patch's time in the source into its prompt)."""

    indices: tuple[int, ...]
    fps: float
    total_frames: int

    def check(self, n_frames: int) -> None:
        """ValueError unless this describes ``n_frames`` sampled frames."""
        idx = self.indices
        if len(idx) != n_frames or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in idx):
            raise ValueError(f"frame indices must be {n_frames} non-negative ints, got {list(idx)[:8]}")
        if any(b < a for a, b in zip(idx, idx[1:])) or not (
            isinstance(self.total_frames, int) and idx[-1] < self.total_frames
        ):
            raise ValueError(f"frame indices must be ascending and below the source's {self.total_frames} frames")
        if not (isinstance(self.fps, float) and math.isfinite(self.fps) and self.fps >= 0):
            raise ValueError(f"the source's fps must be a finite float >= 0, got {self.fps!r}")


def encode_video_frames(
    frames: RawTensor, *, item_hash: str, sampled_fps: float, producer: str, source: VideoSource | None = None
) -> bytes:
    """Serialize a video's sampled frames (``U8 [n, h, w, 3]``) into a tensor object."""
    if frames.dtype != "U8" or len(frames.shape) != 4 or frames.shape[3] != 3 or min(frames.shape) < 1:
        raise ValueError(f"video frames must be U8 [n, height, width, 3], got {frames.dtype}{list(frames.shape)}")
    if not (math.isfinite(sampled_fps) and sampled_fps >= 0):
        raise ValueError(f"sampled_fps must be a finite number >= 0, got {sampled_fps!r}")
    metadata = {"sampled_fps": repr(float(sampled_fps))}
    if source is not None:
        source.check(frames.shape[0])
        metadata["source_frames_indices"] = json.dumps(list(source.indices))
        metadata["source_fps"] = repr(float(source.fps))
        metadata["source_total_frames"] = str(source.total_frames)
    return encode_tensor_object(
        {_FRAMES_TENSOR: frames},
        schema=VIDEO_FRAMES_SCHEMA,
        fingerprint="",  # the frames are the model's input, not its output: any model reads them
        id_field="item_hash",
        object_id=item_hash,
        producer=producer,
        metadata=metadata,
    )


def decode_video_frames(blob: bytes, *, item_hash: str) -> tuple[RawTensor, float]:
    """A video's sampled frames and their rate, validated (schema, item, layout, checksum).
    Raises :class:`ObjectValidationError`."""
    frames, fps, _ = decode_video_frames_with_source(blob, item_hash=item_hash)
    return frames, fps


def decode_video_frames_with_source(blob: bytes, *, item_hash: str) -> tuple[RawTensor, float, VideoSource | None]:
    """:func:`decode_video_frames` and the frames' :class:`VideoSource` (None: stored without it)."""
    obj = decode_tensor_object(
        blob, schema=VIDEO_FRAMES_SCHEMA, fingerprint="", id_field="item_hash", object_id=item_hash
    )
    frames = obj.tensors.get(_FRAMES_TENSOR)
    if frames is None or frames.dtype != "U8" or len(frames.shape) != 4 or frames.shape[3] != 3:
        raise ObjectValidationError(MissReason.SHAPE_MISMATCH, "not a video's frames (U8 [n, h, w, 3])")
    try:
        fps = float(obj.metadata["sampled_fps"])
    except (KeyError, ValueError):
        raise ObjectValidationError(MissReason.CORRUPT, "video frames without a sampled_fps") from None
    source = None
    if "source_frames_indices" in obj.metadata:
        try:
            source = VideoSource(
                indices=tuple(json.loads(obj.metadata["source_frames_indices"])),
                fps=float(obj.metadata["source_fps"]),
                total_frames=int(obj.metadata["source_total_frames"]),
            )
            source.check(frames.shape[0])
        except (KeyError, ValueError, TypeError) as exc:
            raise ObjectValidationError(MissReason.CORRUPT, f"video frames with a bad source ({exc})") from None
    return frames, fps, source
