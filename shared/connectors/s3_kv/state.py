"""Scheduler-side state of the KV connector: one record per request. No vLLM or torch import."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from shared.connectors.params import KVHandoff, KVHandoffRequest, Source
from shared.store.format import MissReason, RawTensor


@dataclasses.dataclass
class LoadState:
    """Consumer (decode): the stored KV cache a request loads."""

    #: where the object is (None: the request's params were malformed)
    handoff: KVHandoff | None
    #: background fetch (GET, validation, checks against the prompt and this engine) in flight
    fetch: concurrent.futures.Future | None = None
    fetch_started: float = 0.0
    #: the fetch is over and its outcome is the request's ``source``
    decided: bool = False
    #: validated layer tensors, held until they ride to the worker (then None)
    tensors: dict[str, RawTensor] | None = None
    #: leading prompt tokens the object holds
    num_tokens: int = 0
    #: tokens already computed when the load was offered to vLLM
    offered_from: int | None = None
    #: tokens [start, end) to write once vLLM allocated the blocks
    span: tuple[int, int] | None = None


@dataclasses.dataclass
class SaveState:
    """Producer (prefill): where a request's KV cache is written once its prompt is computed."""

    target: KVHandoffRequest
    key: str
    #: the request's blocks so far
    block_ids: list[int] = dataclasses.field(default_factory=list)
    #: what the finished request reports, once the save is scheduled
    done: KVHandoff | None = None


@dataclasses.dataclass
class RequestState:
    """The KV connector scheduler's state of one request."""

    request_id: str
    #: the vLLM request (producer: cached requests' scheduler data lacks the prompt)
    request: Any = None
    load: LoadState | None = None
    save: SaveState | None = None
    #: consumer: where the request's KV cache came from (STORE or RECOMPUTED with ``reason``)
    source: Source | None = None
    reason: MissReason | None = None

    def report(self) -> str:
        """The finished request's ``epd_kv_source`` value."""
        assert self.source is not None
        return self.source.report(self.reason.value if self.reason is not None else "")
