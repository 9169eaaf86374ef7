"""Cache-aware routing of generation jobs, the policy: what workers advertise and how the API scores
them (pure; the claims and consumers that carry it out: ``shared.routed_jobs``).

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

**Wiring** (``shared.routed_jobs``): the claim that makes exactly one worker run a routed job, a
worker's own consumer of its routed jobs, and the worker runner's routing strategy. This module is the
policy alone: it imports neither NATS nor the claims.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.protocol import ADVERTISED_HASH_CHARS, FinalResult, GenerationJob, RouteReason


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


class JobRouter(Protocol):
    """What the request client needs to route (``services.api.routing.Router``)."""

    async def publish(self, job: GenerationJob) -> None:
        """Publish a request's generation job where the routing decides."""

    def observe(self, final: FinalResult) -> None:
        """A request ended: its worker now holds its images."""
