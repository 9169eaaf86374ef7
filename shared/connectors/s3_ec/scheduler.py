"""The EC connector's scheduler side (vLLM's EngineCore process).

Consumer: prefetches each stored encoder output in the background, admits a request only when
every item it needs is decided (validated bytes held here, or encode locally), and ships held
bytes to the worker in the step vLLM commits the item. Producer: names the items of newly
scheduled requests (the worker re-saves those the store lost) and reports what it stored.
See :mod:`shared.connectors.s3_ec` for how vLLM drives these calls.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from shared.connectors.common import ConnectorConfig
from shared.connectors.params import EC_ITEMS, EC_SOURCES, Source
from shared.connectors.s3_ec.metadata import ECLoad, S3ECMetadata
from shared.connectors.s3_ec.metrics import S3ECStats, StatsRecorder, Timing, Transfer
from shared.connectors.s3_ec.state import (
    FetchResult,
    LookupOutcome,
    RequestState,
    StoredItem,
    valid_identifier,
)
from shared.ec_lifecycle.invalidation import ConnectorLifecycle
from shared.store.ec import ECStore
from shared.store.format import ECObject, MissReason, ObjectValidationError

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: stored-item records kept before idle ones with stale existence answers are forgotten
_MAX_STORED_ITEMS = 65536


class ECScheduler:
    """Scheduler-side half of :class:`~shared.connectors.s3_ec.S3ECConnector`."""

    def __init__(
        self,
        *,
        config: ConnectorConfig,
        store: ECStore,
        is_producer: bool,
        is_consumer: bool,
        embed_width: int,
        stats: StatsRecorder,
    ):
        self.config = config
        self.store = store
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self._embed_width = embed_width
        self._stats = stats
        #: per identifier, in order of use (the held objects' LRU order)
        self._objects: OrderedDict[str, StoredItem] = OrderedDict()
        self._held_bytes = 0
        #: identifiers whose fetch is in flight (an index into _objects)
        self._fetching: set[str] = set()
        self._requests: dict[str, RequestState] = {}
        #: loads for the worker, sent with the next connector metadata
        self._outbox: dict[str, ECLoad] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if is_consumer:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=config.fetch_threads, thread_name_prefix="ec-prefetch"
            )
        if is_producer:
            store.store.ensure_bucket()
        #: invalidation events and use recording (EPD_NATS_URL), consumers only: they hold bytes
        self._lifecycle = self._start_lifecycle(config, store) if is_consumer else None

    # -- seams and observability -----------------------------------------------------------------
    @staticmethod
    def _start_lifecycle(config: ConnectorConfig, store: ECStore) -> ConnectorLifecycle | None:
        """Invalidations and use records over the deployment's NATS named in the extra config."""
        user, password = config.nats_credentials()
        return ConnectorLifecycle.launch(
            store,
            nats_url=config.nats_url,
            prefix=config.subject_prefix,
            user=user,
            password=password,
            replicas=config.stream_replicas,
            ping_interval_s=config.nats_ping_interval_s,
            max_outstanding_pings=config.nats_max_outstanding_pings,
            tls_options=config.nats_tls_options(),
        )

    def load_item(self, identifier: str) -> ECObject:
        """GET + validate one object (runs in a fetch thread). A seam for tests that inject store
        faults."""
        return self.store.load(identifier)

    def request_state(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    # -- consumer: admission -----------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """True iff validated bytes for ``identifier`` are held here (no network: vLLM commits
        the item as an external load in the same step)."""
        entry = self._objects.get(identifier)
        return self.is_consumer and entry is not None and entry.obj is not None

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return True
        self._collect_finished_fetches()
        now = time.monotonic()
        pending = False
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = RequestState(rid)
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already in the KV cache
            ident = feature.identifier
            item = state.item(ident)
            if item.decided:
                continue
            entry = self._objects.get(ident)
            if item.verdict is not None:
                self._decide(request, feature, *item.verdict)
            elif not valid_identifier(ident):
                self._decide(request, feature, LookupOutcome.MISS, MissReason.BAD_IDENTIFIER)
            elif entry is not None and entry.obj is not None:
                self._admit_held(request, feature, entry)
            elif entry is not None and entry.fetch is not None:
                if now - entry.fetch_started > self.config.fetch_timeout_s:
                    self._decide(request, feature, LookupOutcome.FALLBACK, MissReason.TIMEOUT)
                else:
                    entry.waiters.add(rid)
                    pending = True
            else:
                fresh = (
                    entry is not None and entry.exists is not None and now - entry.checked_at < self.config.exists_ttl_s
                )
                if fresh and entry is not None and not entry.exists:
                    self._decide(request, feature, LookupOutcome.MISS, MissReason.NOT_FOUND)
                else:
                    if entry is None:
                        entry = self._objects[ident] = StoredItem(ident)
                    assert self._pool is not None
                    entry.fetch = self._pool.submit(self._fetch, ident, bool(fresh and entry.exists))
                    entry.fetch_started = now
                    entry.waiters.add(rid)
                    self._fetching.add(ident)
                    pending = True
            if state.unavailable:
                return False
        # (also when every item was decided in an earlier call: until vLLM takes the request
        # through take_unavailable_requests it must not be admitted without its input)
        return not pending and not state.unavailable

    def _admit_held(self, request: Request, feature: Any, entry: StoredItem) -> None:
        assert entry.obj is not None
        want = feature.mm_position.get_num_embeds()
        if entry.obj.shape[0] != want:
            # Another item under the same identifier (a reused uuid): never load it for this request.
            log.warning(
                "request %s: EC object %s has %d rows, the prompt has %d placeholders: encoding locally",
                request.request_id,
                entry.identifier,
                entry.obj.shape[0],
                want,
            )
            if not entry.pinned_by:
                self._release(entry)
            self._decide(request, feature, LookupOutcome.FALLBACK, MissReason.SHAPE_MISMATCH)
            return
        entry.pinned_by.add(request.request_id)
        if self._lifecycle is not None:
            self._lifecycle.used(entry.identifier)
        self._objects.move_to_end(entry.identifier)
        self._requests[request.request_id].item(entry.identifier).outcome = LookupOutcome.HIT

    def _decide(self, request: Request, feature: Any, outcome: LookupOutcome, reason: MissReason) -> None:
        """The item will not come from the store: vLLM encodes it locally (its pixels are in the
        request); without local input the request is reported unavailable."""
        rid = request.request_id
        state = self._requests[rid]
        item = state.item(feature.identifier)
        data = feature.data
        if data is None or all(getattr(elem, "data", None) is None for elem in data.values()):
            state.unavailable = True
            item.outcome, item.reason = LookupOutcome.UNAVAILABLE, reason
            self._count(LookupOutcome.UNAVAILABLE, reason)
            log.error(
                "request %s: no EC object for %s (%s) and no local input: failing it",
                rid,
                feature.identifier,
                reason.value,
            )
            return
        item.outcome, item.reason = outcome, reason
        self._count(outcome, reason)
        if outcome is LookupOutcome.FALLBACK:
            log.warning(
                "request %s: EC object %s unusable (%s): encoding locally", rid, feature.identifier, reason.value
            )

    def _fetch(self, identifier: str, known_to_exist: bool) -> FetchResult:
        """Background thread: existence check (unless a fresh answer said yes), GET, validation."""
        started = time.perf_counter()
        existed = known_to_exist
        try:
            if not existed:
                existed = self.store.exists(identifier)
                if not existed:
                    return FetchResult(None, MissReason.NOT_FOUND, False, time.perf_counter() - started)
            obj = self.load_item(identifier)
            if obj.shape[1] != self._embed_width:
                raise ObjectValidationError(
                    MissReason.SHAPE_MISMATCH, f"feature width {obj.shape[1]} vs the model's {self._embed_width}"
                )
            return FetchResult(obj, None, True, time.perf_counter() - started)
        except ObjectValidationError as exc:
            return FetchResult(None, exc.reason, existed, time.perf_counter() - started, exc.detail)
        except Exception as exc:  # noqa: BLE001 - a store outage is a fallback, never an engine crash
            return FetchResult(
                None, MissReason.STORE_ERROR, existed, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
            )

    def _collect_finished_fetches(self) -> None:
        now = time.monotonic()
        for ident in [i for i in self._fetching if self._objects[i].fetch.done()]:  # type: ignore[union-attr]  # _fetching holds only items with a fetch in flight
            self._fetching.discard(ident)
            entry = self._objects[ident]
            assert entry.fetch is not None
            result: FetchResult = entry.fetch.result()
            entry.fetch = None
            waiters, entry.waiters = entry.waiters, set()
            with self._stats.record() as stats:
                stats.observe(Timing.FETCH, result.seconds)
            entry.exists, entry.checked_at = result.existed, now
            if result.obj is not None:
                self._hold(entry, result.obj)
                with self._stats.record() as stats:
                    stats.add_bytes(Transfer.GET, len(result.obj.data))
                continue  # each waiter is admitted (shape-checked, pinned) on its next call
            assert result.reason is not None
            if result.existed:
                log.warning(
                    "EC object %s failed after the existence check said yes: %s %s",
                    ident,
                    result.reason.value,
                    result.detail,
                )
            outcome = LookupOutcome.FALLBACK if result.existed else LookupOutcome.MISS
            for rid in waiters:  # decided on each waiter's next call, where its item is at hand
                state = self._requests.get(rid)
                if state is not None:
                    state.item(ident).verdict = (outcome, result.reason)
        if len(self._objects) > _MAX_STORED_ITEMS:  # bounded: forget stale answers
            cutoff = now - self.config.exists_ttl_s
            for ident in [i for i, e in self._objects.items() if e.idle() and e.checked_at < cutoff]:
                del self._objects[ident]

    def take_unavailable_requests(self) -> set[str]:
        failed = {rid for rid, state in self._requests.items() if state.unavailable}
        for rid in failed:
            self._requests[rid].unavailable = False
        return failed

    # -- allocation and metadata -------------------------------------------------------------------
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if not self.is_consumer:
            return
        ident = request.mm_features[index].identifier
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = RequestState(rid)
        item = state.item(ident)
        entry = self._objects.get(ident)
        if entry is not None and entry.obj is not None:
            obj = entry.obj
            self._outbox[ident] = ECLoad(ident, obj.data, obj.dtype, obj.shape)
            entry.pinned_by.discard(rid)
            item.source = Source.STORE
            self._count(LookupOutcome.HIT)  # counted when vLLM really takes it from the store
        else:
            item.source = Source.RECOMPUTED
            if item.reason is None:
                item.reason = MissReason.NOT_FOUND

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> S3ECMetadata:
        meta = S3ECMetadata(loads=list(self._outbox.values()))
        self._outbox.clear()
        self.apply_invalidations()
        if self.is_producer:
            for new_req in scheduler_output.scheduled_new_reqs:
                for feature in new_req.mm_features or ():
                    meta.save_candidates.append(feature.identifier)
        self._evict()
        return meta

    def update_worker_stats(self, data: dict[str, Any]) -> None:
        """Merge the worker side's counters (sent back in its worker metadata)."""
        with self._stats.record() as stats:
            stats.aggregate(S3ECStats(data=data))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        state = self._requests.pop(rid, None)
        for feature in request.mm_features:
            entry = self._objects.get(feature.identifier)
            if entry is not None:
                entry.pinned_by.discard(rid)
                entry.waiters.discard(rid)
        params: dict[str, Any] = {}
        if self.is_consumer:
            sources: dict[str, str] = {}
            for feature in request.mm_features:
                ident = feature.identifier
                if ident in sources:
                    continue
                item = state.items.get(ident) if state is not None else None
                if item is None or item.source is None:  # vLLM had it (encoder or prefix cache)
                    self._count(LookupOutcome.ENGINE_CACHE)
                sources[ident] = item.report() if item is not None else Source.ENGINE_CACHE.report()
            if sources:
                params[EC_SOURCES] = sources
        if self.is_producer and request.mm_features:
            params[EC_ITEMS] = {
                f.identifier: {"key": self.store.key(f.identifier), "n_tokens": f.mm_position.get_num_embeds()}
                for f in request.mm_features
                if valid_identifier(f.identifier)
            }
        return False, (params or None)

    def shutdown(self) -> None:
        if self._lifecycle is not None:
            self._lifecycle.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- held objects ----------------------------------------------------------------------------
    def _hold(self, entry: StoredItem, obj: ECObject) -> None:
        self._release(entry)
        entry.obj = obj
        self._held_bytes += entry.nbytes
        self._objects.move_to_end(entry.identifier)

    def _release(self, entry: StoredItem) -> None:
        self._held_bytes -= entry.nbytes
        entry.obj = None

    def apply_invalidations(self) -> int:
        """Drop held objects the store removed (``ECInvalidated``) and forget their existence
        answers. Runs at the end of a scheduling step, after this step's loads were shipped: a
        request admitted with one of them finds it gone at its allocation and vLLM encodes the
        item itself (its pixels are in the request)."""
        if self._lifecycle is None:
            return 0
        dropped = 0
        for ident in self._lifecycle.take():
            entry = self._objects.get(ident)
            if entry is None:
                continue
            if entry.obj is not None:
                self._release(entry)
                dropped += 1
            entry.exists, entry.checked_at = None, 0.0
        if dropped:
            log.info("EC connector: dropped %d held object(s) the store no longer has", dropped)
        return dropped

    def _evict(self) -> None:
        """Drop unpinned held objects, least recently used first, down to ``local_cache_bytes``."""
        if self._held_bytes <= self.config.local_cache_bytes:
            return
        for entry in list(self._objects.values()):
            if self._held_bytes <= self.config.local_cache_bytes:
                break
            if entry.obj is not None and not entry.pinned_by:
                self._release(entry)

    def _count(self, outcome: LookupOutcome, reason: MissReason | None = None) -> None:
        with self._stats.record() as stats:
            stats.count_lookup(outcome, reason)
