"""What the EC connector's scheduler side sends its worker side each step, and back."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata

from shared.connectors.s3_ec.metrics import S3ECStats


@dataclasses.dataclass(frozen=True)
class ECLoad:
    """A validated encoder output to put into the worker's encoder cache."""

    identifier: str
    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass
class S3ECMetadata(ECConnectorMetadata):
    """Scheduler -> worker, per step."""

    loads: list[ECLoad] = dataclasses.field(default_factory=list)
    #: producer: items of the requests scheduled for the first time in this step
    save_candidates: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class S3ECWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler: the worker side's counters (``S3ECStats.data``)."""

    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> S3ECWorkerMetadata:
        merged = S3ECStats(data={})
        merged.aggregate(S3ECStats(data=self.stats))
        merged.aggregate(S3ECStats(data=getattr(other, "stats", {}) or {}))
        return S3ECWorkerMetadata(stats=merged.data)
