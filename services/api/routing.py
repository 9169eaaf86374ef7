"""The API side of cache-aware routing (``EPD_ROUTING=affinity``; the policy is in
``shared.routing``, the claims in ``shared.routed_jobs``): the table of live generating workers,
the choice, and one watchdog per routed job.

The table comes from the workers' heartbeats (every 2 s; ``WorkerHeartbeat.items / slots /
free_slots``), kept with the time this process received each (a monotonic clock: no trust in the
workers' clocks). Between heartbeats the router adds what it learned itself: the jobs it routed
to a worker since its last heartbeat count as load (``pending``), the requests that ended there
since (their ``FinalResult``) free a slot (``ended``), and the images of a request count as held by
the worker that ran it as soon as its ``FinalResult`` arrives or the job is routed there
(``learned``, for ``LEARNED_S``) - the next turn of a conversation often comes before the next
heartbeat, and a heartbeat sent while the previous turn ran says the worker is busy.

The watchdog of a routed job (:meth:`Router._watch`) waits for its claim, event-driven: a core-NATS
subscription to the claims bucket's writes (new ones only, nothing replayed at start) wakes it.

* not claimed within ``EPD_ROUTING_AFFINITY_TIMEOUT_S``, or the target's heartbeat is older than
  ``EPD_ROUTING_TAKEOVER_S`` first: claim ``@fallback``; won -> a copy on the shared queue;
* claimed by the target: while the claim is the target's, check its heartbeat; once it is older
  than ``EPD_ROUTING_TAKEOVER_S``, compare-and-set the claim to ``@takeover:<worker>`` and, having
  won, put a copy on the shared queue;
* ends when the claim is done / taken / fell back, or at the job's deadline.

The subscription only makes it prompt: every decision is an atomic claim operation, so a missed
write costs time (one check interval), never a second run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from shared import metrics
from shared.config import NatsSettings
from shared.jetstream import Publisher
from shared.protocol import FinalResult, GenerationJob, RouteReason, Subjects, WorkerHeartbeat
from shared.routed_jobs import (
    CLAIM_FALLBACK,
    RoutingClaims,
    claim_key,
    fallback_copy,
    fallback_msg_id,
    takeover_value,
)
from shared.routing import Candidate, Decision, choose, short_hash
from shared.topology import Service

log = logging.getLogger(__name__)

#: How long an image counts as held by a worker on the router's own knowledge (a FinalResult, a
#: routing decision) without its heartbeat saying so: a few heartbeats.
LEARNED_S = 10.0
#: Most learned items kept per worker.
LEARNED_MAX = 1024
#: A worker without a heartbeat for this long leaves the table.
FORGET_S = 3600.0
#: The longest a watchdog waits between checks of its target's heartbeat (and of the claim, when a
#: write was missed).
CHECK_S = 0.25


@dataclass
class _Worker:
    hb: WorkerHeartbeat
    seen_at: float
    #: jobs routed to it since its last heartbeat, and jobs of it that ended since (FinalResults)
    pending: int = 0
    ended: int = 0
    learned: OrderedDict[str, float] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class RouterTuning:
    """The router's settings (the API's ``EPD_ROUTING_*`` and ``EPD_WORKER_STALE_S``)."""

    #: score of a worker per fraction of the request's images it holds
    affinity_weight: float
    #: score taken off a worker per fraction of its engine slots in use
    load_weight: float
    #: a routed job no worker claimed within this long goes to the shared queue
    affinity_timeout_s: float
    #: a routed worker whose heartbeat is this old is gone: its job goes to the shared queue
    takeover_s: float
    #: a worker is gone after this long without a heartbeat
    worker_stale_s: float


class Router:
    """Routes generation jobs (``RequestClient(router=...)``): see the module docstring."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        publisher: Publisher,
        nats: NatsSettings,
        tuning: RouterTuning,
        *,
        fingerprint: str = "",
    ):
        self.nc = nc
        self.subjects = subjects
        self.publisher = publisher
        self.nats = nats
        self.tuning = tuning
        self.fingerprint = fingerprint
        self.claims: RoutingClaims | None = None
        self.workers: dict[str, _Worker] = {}
        #: latest claim value seen per tracked key, and the event that wakes its watchdog
        self._values: dict[str, str] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._watchdogs: set[asyncio.Task] = set()
        self._sub: Any = None

    async def start(self) -> None:
        self.claims = await RoutingClaims.open(self.nc.jetstream(), self.subjects, self.nats)
        self._sub = await self.nc.subscribe(self.subjects.routing_claims_all, cb=self._on_claim)

    async def stop(self) -> None:
        for task in list(self._watchdogs):
            task.cancel()
        if self._watchdogs:
            await asyncio.wait(self._watchdogs, timeout=2.0)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection is closing anyway
                log.debug("unsubscribe: %s", exc)

    # -- the table ---------------------------------------------------------------------------
    def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        if hb.role != Service.PREFILL:
            return
        w = self.workers.get(hb.worker_id)
        if w is None:
            self.workers[hb.worker_id] = _Worker(hb, time.monotonic())
        else:
            w.hb, w.seen_at, w.pending, w.ended = hb, time.monotonic(), 0, 0

    def alive(self, worker_id: str, within_s: float | None = None) -> bool:
        """Whether ``worker_id`` beat within ``within_s`` (default ``EPD_ROUTING_TAKEOVER_S``)."""
        w = self.workers.get(worker_id)
        limit = self.tuning.takeover_s if within_s is None else within_s
        return w is not None and time.monotonic() - w.seen_at <= limit

    def _learn(self, worker_id: str, item_hashes: list[str]) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        now = time.monotonic()
        for item in item_hashes:
            w.learned[short_hash(item)] = now
            w.learned.move_to_end(short_hash(item))
        while len(w.learned) > LEARNED_MAX:
            w.learned.popitem(last=False)

    def observe(self, final: FinalResult) -> None:
        """A request ended on ``final.worker``: it holds the request's images now, and has a slot
        more than its last heartbeat said."""
        w = self.workers.get(final.worker)
        if w is None:
            return
        w.ended += 1
        if final.ec_sources:
            self._learn(final.worker, list(final.ec_sources))

    def candidates(self) -> list[Candidate]:
        """The live generating workers that take routed jobs, as the scorer sees them."""
        now = time.monotonic()
        # a worker the watchdog would take jobs from is no candidate (nor one the API calls gone)
        stale = self.tuning.takeover_s
        out = []
        for worker_id, w in list(self.workers.items()):
            hb = w.hb
            if now - w.seen_at > FORGET_S:  # gone for good (a restarted worker has a new id)
                del self.workers[worker_id]
                continue
            if not hb.routable or hb.draining or not self.alive(worker_id, min(self.tuning.worker_stale_s, stale)):
                continue
            if self.fingerprint and hb.fingerprint and hb.fingerprint != self.fingerprint:
                continue
            learned = {item for item, at in w.learned.items() if now - at <= LEARNED_S}
            out.append(
                Candidate(
                    worker_id=worker_id,
                    slots=hb.slots,
                    free_slots=hb.free_slots,
                    items=frozenset(hb.items) | learned,
                    pending=w.pending,
                    ended=w.ended,
                )
            )
        return out

    def decide(self, job: GenerationJob) -> Decision:
        if job.reprefill or not job.images:
            return Decision("", RouteReason.NO_AFFINITY, "no images" if not job.images else "re-prefill")
        return choose(
            self.candidates(),
            [ref.item_hash for ref in job.stored_items],
            affinity_weight=self.tuning.affinity_weight,
            load_weight=self.tuning.load_weight,
        )

    # -- publishing --------------------------------------------------------------------------
    async def publish(self, job: GenerationJob) -> None:
        """Publish ``job`` where :meth:`decide` says; a routed one gets a watchdog."""
        decision = self.decide(job)
        metrics.ROUTING_DECISIONS.labels(decision.reason).inc()
        rid = job.request_id
        log.info("routing: %s -> %s (%s)", decision.reason, decision.worker_id or "shared queue", decision.detail)
        if not decision.worker_id:
            shared = msgspec.structs.replace(job, route_reason=decision.reason, route_detail=decision.detail)
            await self.publisher.publish(
                self.subjects.generate_jobs, shared, request_id=rid, msg_id=rid, deadline=job.deadline
            )
            return
        target = decision.worker_id
        routed = msgspec.structs.replace(
            job, routed_to=target, route_reason=decision.reason, route_detail=decision.detail
        )
        key = claim_key(rid)
        self._wake[key] = asyncio.Event()  # before publishing: the claim may come at once
        try:
            await self.publisher.publish(
                self.subjects.generate_routed(target), routed, request_id=rid, msg_id=rid, deadline=job.deadline
            )
        except BaseException:
            self._forget(key)
            raise
        w = self.workers.get(target)
        if w is not None:
            w.pending += 1
        self._learn(target, [ref.item_hash for ref in job.stored_items])
        task = asyncio.ensure_future(self._watch(routed, key))
        self._watchdogs.add(task)
        task.add_done_callback(self._watchdogs.discard)

    async def _on_claim(self, msg) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        event = self._wake.get(key)
        if event is not None:
            self._values[key] = (msg.data or b"").decode(errors="replace")
            event.set()

    def _forget(self, key: str) -> None:
        self._wake.pop(key, None)
        self._values.pop(key, None)

    async def _wait(self, key: str, timeout: float) -> None:
        event = self._wake[key]
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        except TimeoutError:
            pass
        event.clear()

    async def _watch(self, job: GenerationJob, key: str) -> None:
        """The watchdog of one routed job (module docstring)."""
        assert self.claims is not None
        rid, target = job.request_id, job.routed_to
        until = time.time() + self.tuning.affinity_timeout_s
        try:
            # 1. until the target claims it, it times out, or the target is gone
            while key not in self._values:
                left = until - time.time()
                if left <= 0 or not self.alive(target):
                    won, state = await self._retrying(job, functools.partial(self.claims.claim, rid, CLAIM_FALLBACK))
                    if won:
                        timeout = self.tuning.affinity_timeout_s
                        await self._fallback(
                            job,
                            f"not claimed by {target} within {timeout:g}s"
                            if left <= 0
                            else f"{target} gone before claiming it",
                        )
                        return
                    if state is None or state.value != target:
                        return
                    break
                await self._wait(key, min(left, CHECK_S))
            # 2. claimed: while it is the target's, watch the target's heartbeat
            while time.time() < job.deadline:
                value = self._values.get(key, target)
                if value != target:
                    return  # done, or already taken over
                if not self.alive(target):
                    state = await self._retrying(job, functools.partial(self.claims.get, rid))
                    if state is None or state.value != target:
                        return
                    replace = functools.partial(self.claims.replace, rid, takeover_value(target), state.revision)
                    if await self._retrying(job, replace):
                        takeover = self.tuning.takeover_s
                        await self._fallback(job, f"{target} gone after claiming it (no heartbeat for {takeover:g}s)")
                        return
                    continue
                await self._wait(key, CHECK_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("routing watchdog of %s failed", rid)
        finally:
            self._forget(key)

    async def _retrying(self, job: GenerationJob, op):
        """``op()`` until it answers or the job's deadline passes (NATS hiccups)."""
        delay = 0.1
        while True:
            try:
                return await op()
            except Exception as exc:  # nats raises several unrelated types: retried until the deadline
                if time.time() + delay >= job.deadline:
                    raise
                log.warning("routing claim operation failed (%s: %s): retrying", type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _fallback(self, job: GenerationJob, detail: str) -> None:
        """Having won the claim: the job's copy on the shared queue."""
        rid = job.request_id
        metrics.ROUTING_DECISIONS.labels(RouteReason.FALLBACK).inc()
        copy = fallback_copy(job, detail)
        log.warning("routed job of %s to the shared queue: %s", rid, detail)
        w = self.workers.get(job.routed_to)
        if w is not None:
            w.pending = max(0, w.pending - 1)
            for ref in job.stored_items:
                w.learned.pop(short_hash(ref.item_hash), None)
        await self._retrying(
            job,
            functools.partial(
                self.publisher.publish, self.subjects.generate_jobs, copy, request_id=rid, msg_id=fallback_msg_id(rid)
            ),
        )
