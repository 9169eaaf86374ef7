"""Cache-aware routing of generation jobs: what workers advertise, how the API scores them, and
the claim that makes exactly one worker run a routed job.

**Why.** A generating worker's local caches (its feature cache, a vLLM engine's encoder and prefix
caches) only help when the repeat of an image reaches the worker that saw it; on one shared queue
that happens 1/N of the time with N workers. With ``EPD_ROUTING=affinity`` the API sends a request
with images to the worker that holds them, weighed against load.

**Advertising** (:func:`advertised`). Every heartbeat of a generating worker carries the
``EPD_ROUTING_ADVERTISED_ITEMS`` (K, default 64) most recently used item hashes of its caches,
truncated to ``protocol.ADVERTISED_HASH_CHARS`` characters, plus its engine slots and free slots.
Top-K exact rather than a sketch (Bloom filter, count-min): no false positives (a false positive
sends the job to a worker that then loads from S3 *and* may be the busier one), the list is ordered
by recency, which is what the next turn of a conversation repeats, and the bound is explicit -
K x 17 bytes, 1.1 KB for K=64 every 2 s. A sketch is smaller per item only when the cache holds
far more items than K and old ones come back; raise K then (linear in bytes).

**Scoring** (:func:`choose`): a worker's score is ``affinity_weight x (fraction of the request's
distinct images it holds) - load_weight x (fraction of its engine slots in use)``; a worker without
a free slot is skipped. The best one wins: ``affinity`` when it holds an image, ``load`` when a
holder exists but was full or scored lower (the least loaded worker gets it - and holds it for the
next turn); no images, or no live worker holding any: ``no_affinity``, the shared queue.

**Claims** (:class:`RoutingClaims`): a routed job is published once on the target's own subject
(``Subjects.generate_routed``, consumer ``Subjects.routed_consumer``); whoever runs it first wins
the create-only key ``<request id>`` of the ``<P>_ROUTING_CLAIMS`` key-value bucket:

* the target worker claims with its worker id when it takes the job (a redelivery to it finds
  its own id: still its job); it writes ``@done:<worker>`` when the job is settled;
* the API's watchdog (``services.api.routing``), when the target did not claim within
  ``EPD_ROUTING_AFFINITY_TIMEOUT_S`` or its heartbeat stopped, claims ``@fallback`` and, having won,
  publishes a copy on the shared queue; a target that takes its copy later loses and drops it;
* when the target claimed but its heartbeat is older than ``EPD_ROUTING_TAKEOVER_S``, the watchdog
  replaces the claim by ``@takeover:<worker>`` (compare-and-set on the revision it read: a worker
  finishing at that moment wins instead) and publishes the copy; the target, if it comes back,
  checks the claim before it sends its final result (:meth:`RouteClaim.held`) and drops its run.

Only the claim winner runs the job, and the shared queue's copy exists only once the API won the
claim, so no job runs twice to completion; redelivery (ack wait, a worker restarted under the
same id) works on both consumers as before. Keys live as long as the streams keep messages.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)

from shared.config import NatsSettings
from shared.jetstream import open_bucket
from shared.protocol import ADVERTISED_HASH_CHARS, FinalResult, GenerationJob, RouteReason, Subjects

log = logging.getLogger(__name__)

#: A worker's routed consumer that has not pulled for this long is removed by the server (its
#: worker is gone; its jobs went to the shared queue through the watchdog).
ROUTED_CONSUMER_INACTIVE_S = 3600.0

#: Claim values other than a worker id (which never starts with ``@``).
CLAIM_FALLBACK = "@fallback"
_TAKEOVER = "@takeover:"
_DONE = "@done:"

_ERR_CONSUMER_EXISTS_DIFFERENT = 10148
_KEY_OK = re.compile(r"^[-_=a-zA-Z0-9]+$")


def fallback_copy(job: GenerationJob, detail: str) -> GenerationJob:
    """The shared queue's copy of a routed job, published once by whoever won its claim as
    :data:`CLAIM_FALLBACK` (the API's watchdog, or its target as it stops), with message id
    :func:`fallback_msg_id`."""
    return msgspec.structs.replace(job, routed_to="", route_reason=RouteReason.FALLBACK, route_detail=detail)


def fallback_msg_id(request_id: str) -> str:
    return f"{request_id}-fallback"


def takeover_value(worker_id: str) -> str:
    return _TAKEOVER + worker_id


def done_value(worker_id: str) -> str:
    return _DONE + worker_id


def short_hash(item_hash: str) -> str:
    """An item hash as heartbeats advertise it (its first ``ADVERTISED_HASH_CHARS`` characters)."""
    return item_hash[:ADVERTISED_HASH_CHARS]


def advertised(recent_first: Iterable[str], k: int) -> tuple[str, ...]:
    """The heartbeat's ``items``: the first ``k`` distinct item hashes of ``recent_first`` (most
    recently used first), shortened (:func:`short_hash`)."""
    out: dict[str, None] = {}
    if k <= 0:
        return ()
    for item in recent_first:
        out.setdefault(short_hash(item), None)
        if len(out) >= k:
            break
    return tuple(out)


class RecentItems:
    """The item hashes a worker used most recently (bounded LRU): what a worker whose engine keeps
    its own caches (vLLM: encoder cache, prefix cache) advertises."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def used(self, item_hash: str) -> None:
        if self.capacity <= 0:
            return
        self._items[item_hash] = None
        self._items.move_to_end(item_hash)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def drop(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._items.pop(key, None)

    def recent(self) -> list[str]:
        """Most recently used first."""
        return list(reversed(self._items))


# -- scoring ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A live generating worker as the API sees it: its last heartbeat, plus the jobs this API
    routed to it since (``pending``), those of its jobs that ended since (``ended``) and the items it
    is known to hold since."""

    worker_id: str
    #: engine slots, and those its heartbeat said were free
    slots: int
    free_slots: int
    #: short item hashes it holds (advertised and learned)
    items: frozenset[str]
    pending: int = 0
    #: its jobs that ended since its last heartbeat (a slot each)
    ended: int = 0

    @property
    def free(self) -> int:
        """Jobs it would take now: its heartbeat's free slots, plus the ended, minus the routed since."""
        return min(self.slots, self.free_slots + self.ended - self.pending)

    @property
    def load(self) -> float:
        """The fraction of its engine slots in use (0..1)."""
        busy = self.slots - self.free_slots + self.pending - self.ended
        return max(0.0, min(1.0, busy / max(1, self.slots)))


@dataclass(frozen=True)
class Decision:
    """Where a job goes: ``worker_id`` ("" = the shared queue) and why."""

    worker_id: str
    reason: RouteReason
    detail: str = ""
    #: distinct images of the request the chosen worker holds
    held: int = 0
    score: float = 0.0


def choose(
    candidates: Sequence[Candidate], item_hashes: Iterable[str], *, affinity_weight: float, load_weight: float
) -> Decision:
    """The routing decision for a request with ``item_hashes`` (full or short; see the module
    docstring). Deterministic: ties go to the less loaded worker, then the smaller worker id."""
    items = {short_hash(h) for h in item_hashes}
    if not items:
        return Decision("", RouteReason.NO_AFFINITY, "no images")
    holders = [c for c in candidates if items & c.items]
    if not holders:
        return Decision("", RouteReason.NO_AFFINITY, "no live worker holds its images")
    best: tuple[tuple[float, float, int], Candidate, int, float] | None = None
    full: list[str] = []
    for c in sorted(candidates, key=lambda c: c.worker_id):  # ties: the first (smaller id) stays
        held = len(items & c.items)
        if c.free <= 0:
            if held:
                full.append(c.worker_id)
            continue
        score = affinity_weight * held / len(items) - load_weight * c.load
        key = (score, -c.load, held)  # max score, then the less loaded, then more images held
        if best is None or key > best[0]:
            best = (key, c, held, score)
    if best is None:
        return Decision("", RouteReason.LOAD, "every live worker is at capacity: the shared queue")
    _, chosen, held, score = best
    if held:
        return Decision(
            chosen.worker_id,
            RouteReason.AFFINITY,
            f"holds {held}/{len(items)} image(s), load {chosen.load:.2f}",
            held=held,
            score=score,
        )
    why = f"holder(s) {', '.join(full)} at capacity" if full else "holder(s) more loaded"
    return Decision(chosen.worker_id, RouteReason.LOAD, f"{why}; least loaded (load {chosen.load:.2f})", score=score)


# -- claims -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClaimState:
    value: str
    revision: int


def claim_key(request_id: str) -> str:
    """The bucket key of a request's claim: its id when it is a valid key, else a digest of it."""
    if _KEY_OK.match(request_id) and len(request_id) <= 200:
        return request_id
    return "h-" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


class RoutingClaims:
    """The ``<P>_ROUTING_CLAIMS`` key-value bucket (see the module docstring). Raises what nats-py
    raises when NATS does not answer: callers decide (a worker naks, the API retries)."""

    def __init__(self, kv: Any):
        self.kv = kv

    @classmethod
    async def open(cls, js: Any, subjects: Subjects, settings: NatsSettings) -> RoutingClaims:
        """Open the bucket, creating it when missing."""
        description = "epd routing claims: which worker runs a routed generation job"
        return cls(
            await open_bucket(
                js,
                subjects.routing_bucket,
                replicas=settings.stream_replicas,
                what="the routing claims",
                ttl=settings.stream_max_age_s,
                description=description,
            )
        )

    async def get(self, request_id: str) -> ClaimState | None:
        try:
            entry = await self.kv.get(claim_key(request_id))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return ClaimState(entry.value.decode(), int(entry.revision or 0))

    async def claim(self, request_id: str, owner: str) -> tuple[bool, ClaimState | None]:
        """Claim the job for ``owner``: (True, state) when this call created the claim or it was
        ``owner``'s already (a redelivery); (False, state) when someone else holds it."""
        try:
            revision = await self.kv.create(claim_key(request_id), owner.encode())
            return True, ClaimState(owner, int(revision))
        except KeyWrongLastSequenceError:
            pass
        state = await self.get(request_id)
        return (state is not None and state.value == owner), state

    async def replace(self, request_id: str, value: str, revision: int) -> bool:
        """Compare-and-set: write ``value`` if the claim is still at ``revision``."""
        try:
            await self.kv.update(claim_key(request_id), value.encode(), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True


@dataclass
class RouteClaim:
    """A worker's won claim of the routed job it runs (``shared.worker.Delivery.claim``)."""

    claims: RoutingClaims
    request_id: str
    owner: str
    revision: int

    async def held(self) -> bool:
        """Whether the job is still this worker's (not taken over). Fails open: when NATS does
        not answer, the worker goes on (a duplicate run, never a lost one)."""
        try:
            state = await self.claims.get(self.request_id)
        except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types
            log.warning("could not check the routing claim: %s: %s", type(exc).__name__, exc)
            return True
        return state is not None and state.value == self.owner

    async def finish(self) -> None:
        """The job is settled: mark the claim done, so the API's watchdog stops watching it (a
        takeover that won meanwhile stays; best effort)."""
        try:
            if not await self.claims.replace(self.request_id, done_value(self.owner), self.revision):
                log.info("routing claim of %s changed while the job ran", self.request_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the watchdog ends at the deadline anyway
            log.debug("could not mark the routing claim done: %s: %s", type(exc).__name__, exc)


# -- a worker's routed consumer -----------------------------------------------------------------
def routed_consumer_config(settings: NatsSettings, subjects: Subjects, worker_id: str) -> ConsumerConfig:
    """The durable pull consumer of the jobs routed to ``worker_id``: like the shared one
    (``shared.jetstream.consumer_configs``), filtered on the worker's subject, removed by the
    server after :data:`ROUTED_CONSUMER_INACTIVE_S` without a pull."""
    return ConsumerConfig(
        durable_name=subjects.routed_consumer(worker_id),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        filter_subject=subjects.generate_routed(worker_id),
        deliver_policy=DeliverPolicy.NEW,
        max_ack_pending=1024,
        inactive_threshold=ROUTED_CONSUMER_INACTIVE_S,
    )


async def ensure_routed_consumer(js: Any, settings: NatsSettings, subjects: Subjects, worker_id: str) -> str:
    """Create (or update) ``worker_id``'s routed consumer; returns its durable name."""
    cfg = routed_consumer_config(settings, subjects, worker_id)
    try:
        await js.add_consumer(subjects.stream_generate, cfg)
    except BadRequestError as exc:
        if exc.err_code != _ERR_CONSUMER_EXISTS_DIFFERENT:
            raise
        assert cfg.durable_name is not None
        info = await js.consumer_info(subjects.stream_generate, cfg.durable_name)
        await js.add_consumer(subjects.stream_generate, cfg.evolve(deliver_policy=info.config.deliver_policy))
    assert cfg.durable_name is not None
    return cfg.durable_name


class JobRouter(Protocol):
    """What the request client needs to route (``services.api.routing.Router``)."""

    async def publish(self, job: GenerationJob) -> None:
        """Publish a request's generation job where the routing decides."""

    def observe(self, final: FinalResult) -> None:
        """A request ended: its worker now holds its images."""
