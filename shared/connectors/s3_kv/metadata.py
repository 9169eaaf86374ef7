"""What the KV connector's scheduler side sends its worker side each step, and back."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from shared.store.format import RawTensor


@dataclasses.dataclass(frozen=True)
class KVSave:
    """Write the KV cache of a request whose prompt is complete in this step."""

    req_id: str
    key: str
    request: str
    attempt: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KVLoad:
    """Write validated tensors into a request's blocks."""

    req_id: str
    #: validated tensors (``kv.<layer>``), the request's tokens ``start .. end-1`` are loaded
    tensors: dict[str, RawTensor]
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclasses.dataclass
class S3KVMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step."""

    saves: list[KVSave] = dataclasses.field(default_factory=list)
    loads: list[KVLoad] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class S3KVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler."""

    #: vLLM request id -> why loading its KV into the cache failed (a MissReason value; vLLM
    #: recomputes the blocks)
    load_failures: dict[str, str] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> S3KVWorkerMetadata:
        merged = dict(self.load_failures)
        merged.update(getattr(other, "load_failures", {}) or {})
        return S3KVWorkerMetadata(load_failures=merged)
