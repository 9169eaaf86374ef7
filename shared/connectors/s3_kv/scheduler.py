"""The KV connector's scheduler side (vLLM's EngineCore process).

Consumer (decode): answers "not yet" while a background thread fetches and validates a request's
KV object, then offers the validated prompt tokens as external tokens (or 0: vLLM prefills the
request itself) and ships the tensors to the worker once the blocks are allocated.
Producer (prefill): follows a hand-off request's blocks and has the worker write them in the step
that completes the prompt; the finished request's ``kv_transfer_params`` say where.
See :mod:`shared.connectors.s3_kv` for the protocol.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

from shared.connectors.common import ConnectorConfig
from shared.connectors.params import (
    DO_REMOTE_DECODE,
    KV_SOURCE,
    KVHandoff,
    KVHandoffRequest,
    MalformedParams,
    Source,
)
from shared.connectors.s3_kv.layout import check_kv_object
from shared.connectors.s3_kv.metadata import KVLoad, KVSave, S3KVMetadata, S3KVWorkerMetadata
from shared.connectors.s3_kv.state import LoadState, RequestState, SaveState
from shared.store.format import MissReason, ObjectValidationError, RawTensor
from shared.store.kv import KVStore

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVScheduler:
    """Scheduler-side half of :class:`~shared.connectors.s3_kv.S3KVConnector`."""

    def __init__(
        self,
        *,
        config: ConnectorConfig,
        store: KVStore,
        is_producer: bool,
        is_consumer: bool,
        block_size: int,
        layout: dict[str, tuple[int, str]] | None,
    ):
        self.config = config
        self.store = store
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.block_size = block_size
        #: layer name -> (values per block, safetensors dtype) every fetched object is checked against
        self._layout = layout
        self._requests: dict[str, RequestState] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if is_consumer:
            self._pool = concurrent.futures.ThreadPoolExecutor(config.fetch_threads, "epd-kv-fetch")

    def _state(self, rid: str) -> RequestState:
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = RequestState(rid)
        return state

    # -- consumer --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.is_consumer:
            return 0, False
        rid = request.request_id
        state = self._requests.get(rid)
        load = state.load if state is not None else None
        if load is None:
            try:
                handoff = KVHandoff.from_params(request.kv_transfer_params)
            except MalformedParams as exc:
                state = self._state(rid)
                state.load = LoadState(handoff=None)
                self._decide(state, None, 0, MissReason.ITEM_MISMATCH, str(exc))
                return 0, False
            if handoff is None:
                return 0, False
            state = self._state(rid)
            load = state.load = LoadState(handoff)
        assert state is not None
        if not load.decided and not self._poll_fetch(request, state):
            return None, False  # ask again next step; the engine step never waits on the network
        if load.tensors is None:
            return 0, False
        # Leave the last prompt token to be computed: its logits give the first output token.
        load_to = min(load.num_tokens, len(request.prompt_token_ids or ()) - 1)
        if load_to <= num_computed_tokens:
            return 0, False
        load.offered_from = num_computed_tokens
        return load_to - num_computed_tokens, False

    def _poll_fetch(self, request: Request, state: RequestState) -> bool:
        """Start or check the request's fetch; True once it is decided."""
        load = state.load
        assert load is not None and load.handoff is not None
        if load.fetch is None:
            assert self._pool is not None
            prompt = tuple(request.prompt_token_ids or ())
            load.fetch = self._pool.submit(self._fetch_and_check, load.handoff, prompt)
            load.fetch_started = time.monotonic()
            return False
        if not load.fetch.done():
            if time.monotonic() - load.fetch_started < self.config.fetch_timeout_s:
                return False
            load.fetch = None
            self._decide(state, None, 0, MissReason.TIMEOUT, f"fetch of {load.handoff.key} too slow")
            return True
        future, load.fetch = load.fetch, None
        try:
            tensors, n = future.result()
        except ObjectValidationError as exc:
            self._decide(state, None, 0, exc.reason, exc.detail)
        except Exception as exc:  # noqa: BLE001 - any failure: prefill again
            self._decide(state, None, 0, MissReason.STORE_ERROR, f"{type(exc).__name__}: {exc}")
        else:
            self._decide(state, tensors, n, None, load.handoff.key)
        return True

    def _decide(
        self,
        state: RequestState,
        tensors: dict[str, RawTensor] | None,
        num_tokens: int,
        reason: MissReason | None,
        detail: str,
    ) -> None:
        load = state.load
        assert load is not None
        load.decided, load.tensors, load.num_tokens = True, tensors, num_tokens
        if tensors is None:
            state.source, state.reason = Source.RECOMPUTED, reason
            log.warning(
                "KV of %s unusable (%s: %s): vLLM prefills it again",
                state.request_id,
                reason.value if reason else "",
                detail,
            )
        else:
            state.source, state.reason = Source.STORE, None
            log.info("KV of %s loaded from %s (%d tokens)", state.request_id, detail, num_tokens)

    def _fetch_and_check(self, handoff: KVHandoff, prompt: tuple[int, ...]) -> tuple[dict[str, RawTensor], int]:
        """Fetch thread: the validated tensors of the hand-off's object and how many leading prompt
        tokens they hold. Raises ObjectValidationError."""
        obj = self.store.load(handoff.key, request_id=handoff.request, attempt=handoff.attempt)
        return check_kv_object(obj, prompt, self.block_size, self._layout)

    # -- both --------------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        # cached requests' scheduler data lacks the prompt: keep the request objects we save for
        if self.is_producer and (request.kv_transfer_params or {}).get(DO_REMOTE_DECODE):
            self._state(request.request_id).request = request

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        rid = request.request_id
        state = self._requests.get(rid)
        load = state.load if state is not None else None
        if num_external_tokens > 0 and load is not None and load.offered_from is not None:
            start, load.offered_from = load.offered_from, None
            load.span = (start, start + num_external_tokens)
        if not self.is_producer or (state is not None and state.save is not None):
            return
        try:
            target = KVHandoffRequest.from_params(request.kv_transfer_params, default_request=rid)
            if target is None:
                return
            key = self.store.key(target.request, target.attempt)
        except ValueError as exc:
            log.warning("not storing the KV of %s: %s", rid, exc)
            return
        self._state(rid).save = SaveState(target, key)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> S3KVMetadata:
        meta = S3KVMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            block_ids = list(new.block_ids[0])
            load = state.load
            if load is not None and load.span is not None:
                span, load.span = load.span, None
                if load.tensors is not None:
                    meta.loads.append(KVLoad(new.req_id, load.tensors, tuple(block_ids), *span))
                    load.tensors = None  # the tensors now ride the metadata
            if state.save is not None and state.save.done is None:
                state.save.block_ids = block_ids
                self._maybe_save(
                    meta, state, new.prompt_token_ids or [], new.num_computed_tokens + num_scheduled.get(new.req_id, 0)
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            save = state.save if state is not None else None
            if state is None or save is None or save.done is not None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if rid in cached.resumed_req_ids:
                    save.block_ids = list(new_blocks[0])
                else:
                    save.block_ids.extend(new_blocks[0])
            prompt = (state.request.prompt_token_ids if state.request is not None else None) or []
            self._maybe_save(meta, state, prompt, cached.num_computed_tokens[i] + num_scheduled.get(rid, 0))
        return meta

    def _maybe_save(self, meta: S3KVMetadata, state: RequestState, prompt: list[int], computed: int) -> None:
        save = state.save
        assert save is not None
        if not prompt or computed < len(prompt):
            return  # the prompt is not complete yet (chunked prefill): save when it is
        target = save.target
        meta.saves.append(
            KVSave(state.request_id, save.key, target.request, target.attempt, tuple(prompt), tuple(save.block_ids))
        )
        save.done = KVHandoff(save.key, target.request, target.attempt, len(prompt))

    def update_worker_output(self, meta: S3KVWorkerMetadata) -> None:
        for rid, reason in meta.load_failures.items():
            state = self._requests.get(rid)
            if state is not None:
                state.source, state.reason = Source.RECOMPUTED, MissReason(reason)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        if state.load is not None and state.load.fetch is not None:
            state.load.fetch.cancel()
        params: dict[str, Any] = {}
        if state.save is not None and state.save.done is not None:
            params.update(state.save.done.to_params())
        if state.source is not None:
            params[KV_SOURCE] = state.report()
        return False, (params or None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
