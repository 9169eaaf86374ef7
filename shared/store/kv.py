"""KV objects: the hand-off from a prefill worker to a decode worker (E|P|D), in the object store.

A KV object is a tensor object (:mod:`shared.store.format`, the same implementation as EC
objects) with schema ``epd-kv-v1``, stored through :class:`KVStore`, the KV front of
:class:`shared.store.tensor_store.TensorObjectStore`:

==================  =============================================================
fingerprint         the MODEL fingerprint (all weights + config + tokenizer + dtype +
                    engine, see ``shared.fingerprint.model_fingerprint``)
request_id          the request it belongs to; ``attempt`` the prefill attempt
tensors             ``kv.<layer>.k`` / ``kv.<layer>.v`` ``[1, kv_heads, past_len, head_dim]``
                    ``prompt_ids`` (I64, the prompt's token ids: repetition penalty)
                    and ``generator_state`` (U8, the sampling RNG; absent for greedy)
decode_state_schema ``DecodeState`` layout version
state               JSON: past_len, last_token, rope_delta (Qwen2-VL M-RoPE offset),
                    prompt_tokens, output_ids (tokens so far), emitted (tokens already
                    streamed), seed, n_layers
sampling            JSON of the request's SamplingSpec (stop strings, max_tokens, ...)
==================  =============================================================

Keys: ``<namespace>/kv/<model fingerprint>/<request_id>-<attempt>``. Sizes are bounded on both
sides (``EPD_MAX_KV_OBJECT_BYTES``): a writer refuses to store a larger object, a reader never
reads one. Objects are deleted by the decode worker when the request ends; leftovers (a worker
died, a request was abandoned) are removed by :meth:`KVStore.sweep`, which every decode worker
runs periodically (objects older than ``EPD_KV_TTL_S``). A sweeper rather than an S3 lifecycle
rule because lifecycle rules count in days and not every S3 server (nor the fs backend) has them.

torch-free: the transformers engine converts its ``DecodeState`` to and from a KV object
(:mod:`shared.engines.transformers_state`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from shared import metrics
from shared.store.format import (
    MAX_HEADER_BYTES,
    MissReason,
    ObjectValidationError,
    RawTensor,
    decode_tensor_object,
    encode_tensor_object,
)
from shared.store.objects import ObjectStore, ObjectTooLarge
from shared.store.tensor_store import META_FINGERPRINT, META_SCHEMA, TensorCodec, TensorObjectStore

__all__ = [
    "KV_CODEC",
    "KV_SCHEMA",
    "KVCodec",
    "KVObject",
    "KVRef",
    "KVStore",
    "META_FINGERPRINT",
    "META_SCHEMA",
    "decode_kv_object",
    "encode_kv_object",
    "kv_key",
    "kv_prefix",
]

KV_SCHEMA = "epd-kv-v1"
_ID_FIELD = "request_id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
_FOLDER = "kv"


class KVRef(NamedTuple):
    """What names a KV object within one model fingerprint."""

    request_id: str
    attempt: int


def kv_prefix(namespace: str) -> str:
    return f"{namespace}/{_FOLDER}/"


def kv_key(namespace: str, fingerprint: str, request_id: str, attempt: int) -> str:
    """``<namespace>/kv/<model fingerprint>/<request_id>-<attempt>``."""
    return f"{kv_prefix(namespace)}{fingerprint}/{KV_CODEC.name(KVRef(request_id, attempt))}"


@dataclass(frozen=True)
class KVObject:
    """A decoded, validated KV object."""

    request_id: str
    attempt: int
    tensors: dict[str, RawTensor]
    #: what ``DecodeState.from_tensors`` takes as metadata (``schema`` + ``state``)
    state_metadata: dict[str, str]
    state: dict[str, Any]
    sampling: dict[str, Any]
    producer: str
    created_at: float
    nbytes: int


def encode_kv_object(
    tensors: Mapping[str, RawTensor],
    *,
    state_metadata: Mapping[str, str],
    sampling: Mapping[str, Any],
    fingerprint: str,
    request_id: str,
    attempt: int,
    producer: str,
    created_at: float | None = None,
) -> bytes:
    """Serialize a decode state (``DecodeState.to_tensors()`` as raw tensors + its metadata)."""
    try:
        schema = state_metadata["schema"]
        state = state_metadata["state"]
    except KeyError as exc:
        raise ValueError(f"decode state metadata lacks {exc}") from exc
    return encode_tensor_object(
        tensors,
        schema=KV_SCHEMA,
        fingerprint=fingerprint,
        id_field=_ID_FIELD,
        object_id=request_id,
        producer=producer,
        created_at=created_at,
        metadata={
            "attempt": str(attempt),
            "decode_state_schema": schema,
            "state": state,
            "sampling": json.dumps(dict(sampling), sort_keys=True),
        },
        max_header_bytes=MAX_HEADER_BYTES,
    )


def decode_kv_object(blob: bytes, *, fingerprint: str, request_id: str, attempt: int) -> KVObject:
    """Parse and validate a KV object (schema, model fingerprint, request, attempt, layout,
    sha256). Raises :class:`ObjectValidationError`."""
    obj = decode_tensor_object(
        blob,
        schema=KV_SCHEMA,
        fingerprint=fingerprint,
        id_field=_ID_FIELD,
        object_id=request_id,
        max_header_bytes=MAX_HEADER_BYTES,
    )
    meta = obj.metadata
    if meta.get("attempt") != str(attempt):
        raise ObjectValidationError(MissReason.ITEM_MISMATCH, f"attempt {meta.get('attempt')!r} != {attempt}")
    try:
        state = json.loads(meta["state"])
        sampling = json.loads(meta["sampling"])
        state_schema = meta["decode_state_schema"]
    except (KeyError, ValueError) as exc:
        raise ObjectValidationError(MissReason.CORRUPT, f"bad KV metadata ({exc})") from exc
    if not isinstance(state, dict) or not isinstance(sampling, dict):
        raise ObjectValidationError(MissReason.CORRUPT, "KV state / sampling metadata is not an object")
    return KVObject(
        request_id=request_id,
        attempt=attempt,
        tensors=obj.tensors,
        state_metadata={"schema": state_schema, "state": meta["state"]},
        state=state,
        sampling=sampling,
        producer=obj.producer,
        created_at=obj.created_at,
        nbytes=len(blob),
    )


class KVCodec(TensorCodec[KVObject, KVRef]):
    """KV objects: identified by (request, attempt), under ``<namespace>/kv/``."""

    kind = "kv"
    schema = KV_SCHEMA
    folder = _FOLDER
    not_found_level = logging.WARNING  # the prefill side said it stored the object

    def name(self, ident: KVRef) -> str:
        request_id, attempt = ident
        if not isinstance(request_id, str) or not _REQUEST_ID.match(request_id):
            raise ValueError(f"request id {str(request_id)[:64]!r} cannot be part of an object key")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise ValueError(f"attempt must be an int >= 0, got {attempt!r}")
        return f"{request_id}-{attempt}"

    def decode(self, blob: bytes, *, fingerprint: str, ident: KVRef) -> KVObject:
        return decode_kv_object(blob, fingerprint=fingerprint, request_id=ident.request_id, attempt=ident.attempt)

    def latency(self, op: str) -> Any:
        return metrics.EC_STORE_LATENCY.labels(f"kv_{op}")

    def transferred(self, direction: str) -> Any:
        return metrics.KV_BYTES.labels(direction)

    def lookup(self, outcome: metrics.LookupOutcome, reason: str) -> Any:
        return metrics.KV_LOOKUPS.labels(outcome, reason)


KV_CODEC = KVCodec()


class KVStore(TensorObjectStore[KVObject, KVRef]):
    """KV objects of one model fingerprint in one object store (bounded, validated)."""

    def __init__(self, store: ObjectStore, *, namespace: str, fingerprint: str, producer: str, max_object_bytes: int):
        super().__init__(
            store,
            KV_CODEC,
            namespace=namespace,
            fingerprint=fingerprint,
            producer=producer,
            max_object_bytes=max_object_bytes,
        )

    def key(self, request_id: str, attempt: int) -> str:
        return self.object_key(KVRef(request_id, attempt))

    def encode(
        self,
        request_id: str,
        attempt: int,
        tensors: Mapping[str, RawTensor],
        state_metadata: Mapping[str, str],
        sampling: Mapping[str, Any],
    ) -> tuple[str, bytes]:
        """``(key, object bytes)``. Raises ObjectTooLarge over ``max_object_bytes`` (checked on
        the tensor sizes before anything is serialized), ValueError for unusable input."""
        size = sum(t.nbytes for t in tensors.values())
        if size > self.max_object_bytes:
            raise ObjectTooLarge(
                f"KV state of {size} bytes exceeds EPD_MAX_KV_OBJECT_BYTES={self.max_object_bytes}",
                size=size,
                max_bytes=self.max_object_bytes,
            )
        key = self.key(request_id, attempt)
        blob = encode_kv_object(
            tensors,
            state_metadata=state_metadata,
            sampling=sampling,
            fingerprint=self.fingerprint,
            request_id=request_id,
            attempt=attempt,
            producer=self.producer,
        )
        if len(blob) > self.max_object_bytes:
            raise ObjectTooLarge(
                f"KV object of {len(blob)} bytes exceeds EPD_MAX_KV_OBJECT_BYTES={self.max_object_bytes}",
                key=key,
                size=len(blob),
                max_bytes=self.max_object_bytes,
            )
        return key, blob

    def put(self, key: str, blob: bytes) -> None:
        """Write an object made by :meth:`encode` (raises ObjectTooLarge, StoreError)."""
        self.write(key, blob)

    def load(self, key: str, *, request_id: str, attempt: int) -> KVObject:
        """Fetch and validate the object of (``request_id``, ``attempt``) at ``key``; a key that
        is not this model's for them is never read (FINGERPRINT_MISMATCH). Raises
        ObjectValidationError (with a MissReason); never bad data."""
        return self.fetch(KVRef(request_id, attempt), request_id=request_id, key=key)
