"""Where a generating worker's images come from: one :class:`FeatureSource` per worker, chosen
in ``setup`` from the role and the engine's capability.

* :class:`LocalFeatures` (role ``agg``, engine :class:`FeaturesThroughWorker`): this worker's
  in-memory cache, else it encodes the image itself. No store, no encoder workers.
* :class:`StoredFeatures` (roles ``pd`` / ``prefill``, :class:`FeaturesThroughWorker`), in order:

  1. this worker's in-memory cache (``local_cache``);
  2. the EC store. The worker subscribes to the item's ``ec.ready`` / ``ec.failed`` events
     *before* looking in the store, so an encoder finishing in between cannot be missed;
  3. if the object is not there yet, the ready event (waiting up to ``ec_wait_s``; the store is
     looked in again meanwhile, in case the event is missed: :class:`EncoderWait`) then the store;
  4. else, and on any failed load (corrupt, other fingerprint, store down, encoder gave up), the
     worker encodes the image itself from the stored image bytes and writes the result back
     (repairing a bad object). The reason is logged and counted
     (``epd:ec_lookups_total{source="recomputed",reason=...}``).

* :class:`ConnectorFeatures` (:class:`FeaturesThroughConnector`, vLLM): features never pass
  through this worker. It waits for the encoder the same way (steps 2-3, existence check only;
  not in ``agg``), then hands the engine the image with its item hash; the engine's EC connector
  (``shared.connectors.s3_ec``) loads the stored output or, on any miss or failed validation, the
  engine encodes the image itself. The engine then reports what it did (``stats.extra
  ["ec_sources"]``: ``store`` / ``recomputed:<reason>``).

Each returns the image item the engine takes and where it came from (``local_cache``, ``local``,
``store``, ``recomputed:<reason>``, ``connector``, ``stolen``).

Encode stealing (``EPD_ENCODE_STEALS``, :class:`Stealer`, ``shared.ec_lifecycle.claims``): while
waiting for the encoder (step 3), a job whose item no encoder has started after
``EPD_ENCODE_STEAL_AFTER_S`` - while the encoders are the bound (:class:`EncoderFleet`: every live
encoder holds as many jobs as it takes, or none is alive) - claims it, and this worker's engine
encodes it: :class:`StoredFeatures` encodes, stores and announces it in ``resolve``;
:class:`ConnectorFeatures` hands the image over and the engine (an EC producer too: it stores what
it encodes) does it in its step; the handler announces the stored object at the request's first
token, or after the generation when none streamed (:meth:`FeatureSource.settle`). At most
``EPD_ENCODE_STEALS`` steals run at once per worker; the other jobs keep waiting, and steal when a
steal ends. A steal renews its claim while it runs; a job waiting on another worker's steal takes
the item over when that claim stops being renewed (the stealer died or stalls: the lease in
``shared.ec_lifecycle.claims``).

EC store lifecycle (``shared.ec_lifecycle.worker``): :class:`StoredFeatures` and
:class:`ConnectorFeatures` note every use of a stored object (cache hit, store hit, write-back,
existence check) in the EC index, batched, so the janitor evicts what is least recently used; an
``ECInvalidated`` (eviction, purge) drops its items from the feature cache.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from shared import metrics, protocol
from shared.ec_lifecycle.claims import STEAL_LEASE_S, STEAL_RENEW_S, EncodeClaims
from shared.ec_lifecycle.worker import WorkerLifecycle
from shared.engines import base
from shared.engines.base import EncodedImage
from shared.errors import EPDError, StoreError
from shared.jetstream import TypedSubscription, subscribe_typed
from shared.protocol import ECFailed, ECReady, ECSource, ImageRef, WorkerHeartbeat, recomputed
from shared.store.ec import ECStore
from shared.store.format import MissReason, ObjectValidationError, join_rows
from shared.topology import Service
from shared.worker import HEARTBEAT_INTERVAL_S

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from PIL import Image

    from shared.worker import WorkerContext

log = logging.getLogger(__name__)

#: A request's media item from the store, checked against its item hash (``ModelHandler.media``):
#: an image, or a video's sampled frames.
MediaLoader = Callable[[ImageRef], Awaitable["Image.Image | base.VideoFrames"]]


class FeatureCache:
    """A byte-bounded LRU of encoder outputs, by item hash."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, EncodedImage] = OrderedDict()

    @staticmethod
    def _size(item: EncodedImage) -> int:
        return item.features.numel() * item.features.element_size()

    def get(self, key: str) -> EncodedImage | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: EncodedImage) -> None:
        size = self._size(item)
        if size > self.max_bytes or key in self._items:
            return
        self._items[key] = item
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= self._size(old)

    def recent(self) -> list[str]:
        """The item hashes held, most recently used first (what a heartbeat advertises)."""
        return list(reversed(self._items))

    def drop(self, keys: Iterable[str]) -> int:
        """Forget ``keys`` (an invalidation: the store no longer has them). Returns how many were held."""
        dropped = 0
        for key in keys:
            item = self._items.pop(key, None)
            if item is not None:
                self.nbytes -= self._size(item)
                dropped += 1
        return dropped


class EncoderWait:
    """Waiting for an encoder worker's ``ECReady`` / ``ECFailed`` of one item (up to ``wait_s``).

    The events come on a core NATS subscription: one published while this worker's connection
    moves to another NATS server (its server stalled, died or was cut off) never reaches it. So
    the wait also looks in ``store`` every ``LOOK_S`` without an event: an object stored there is
    what a missed ``ECReady`` would have said (a missed ``ECFailed`` costs the wait, then the
    worker encodes the item itself)."""

    #: Seconds without an event between two looks in the store.
    LOOK_S = 2.0

    def __init__(
        self, ctx: WorkerContext, fingerprint: str, wait_s: float, store: ECStore, fleet: EncoderFleet | None = None
    ):
        self.ctx = ctx
        self.fingerprint = fingerprint
        self.wait_s = wait_s
        self.store = store
        #: the encoders' heartbeats: with none alive a job stops waiting (encoders scaled to zero)
        self.fleet = fleet

    @contextlib.asynccontextmanager
    async def watching(self, ref: ImageRef) -> AsyncIterator[TypedSubscription | None]:
        """A subscription to the item's events (None when there is nothing to wait for: no
        encode job was queued, no NATS connection, or ``ec_wait_s`` is 0). Open it before
        looking in the store."""
        if not (ref.encode_queued and self.ctx.nc is not None and self.wait_s > 0):
            yield None
            return
        async with await subscribe_typed(
            self.ctx.nc, self.ctx.subjects.ec_any(self.fingerprint, ref.item_hash), ECReady, ECFailed, confirm=True
        ) as sub:
            yield sub

    async def wait(
        self, sub: TypedSubscription, ref: ImageRef, stealer: Stealer | None = None, request_id: str = ""
    ) -> MissReason | Steal | None:
        """None when the encoder announced the object; a :class:`Steal` (for ``request_id``) when
        ``stealer`` took the item for this worker's engine; else why we stopped waiting."""
        deadline = time.time() + self.wait_s
        next_try = deadline if stealer is None else time.time() + stealer.after_s
        next_look = time.time() + self.LOOK_S
        watched: tuple[int, float] | None = None  # another stealer's claim: (revision, unchanged since)
        if stealer is None and self.fleet is not None:  # (a stealer steals at once when none is alive)
            next_try = time.time()
        while (event := await sub.next(deadline=min(deadline, next_try, next_look))) is None:
            if stealer is None and self.fleet is not None and time.time() < deadline:
                if self.fleet.none_alive():
                    log.info("no encoder alive: encoding %s here", ref.item_hash[:12])
                    return MissReason.NO_ENCODER
                next_try = time.time() + FLEET_RETRY_S
                if time.time() < next_look:
                    continue
            if time.time() >= next_look:
                if await self._stored(ref):
                    log.info(
                        "%s is stored, its ready event not heard (missed in a NATS reconnect, or late)",
                        ref.item_hash[:12],
                    )
                    return None
                next_look = time.time() + self.LOOK_S
                if time.time() < min(deadline, next_try):
                    continue
            if stealer is None or time.time() >= deadline:
                return MissReason.TIMEOUT
            lapsed = watched[0] if watched is not None and time.monotonic() - watched[1] >= STEAL_LEASE_S else None
            taken = await stealer.try_steal(ref, request_id, lapsed=lapsed)
            if isinstance(taken, Steal):
                return taken
            if isinstance(taken, StealerHolds):  # watch its lease
                if watched is None or watched[0] != taken.revision:
                    watched = (taken.revision, time.monotonic())
                next_try = time.time() + STEAL_RENEW_S
                continue
            watched = None
            if taken is StealRefused.STORED:
                return None  # an encoder announced it as we claimed
            # a free steal slot soon (BUSY), the encoders the bound later (ENCODERS_FREE), or
            # never: an encoder started it (CLAIMED)
            retry = {StealRefused.BUSY: STEAL_RETRY_S, StealRefused.ENCODERS_FREE: FLEET_RETRY_S}.get(taken)
            next_try = deadline if retry is None else time.time() + retry
        if isinstance(event, ECFailed):
            log.warning("encoder gave up on %s: %s: %s", ref.item_hash[:12], event.code, event.message)
            return MissReason.ENCODER_FAILED
        return None

    async def _stored(self, ref: ImageRef) -> bool:
        try:
            return await asyncio.to_thread(self.store.exists, ref.item_hash)
        except StoreError as exc:  # (the event may still come; the next look may get through)
            log.debug("looking for %s in the store: %s", ref.item_hash[:12], exc)
            return False


#: How often a job waiting for its encoder looks for a free steal slot, or for the encoders to
#: become the bound (``Stealer``).
STEAL_RETRY_S = 0.1
#: How often a job waiting for its encoder looks again while the encoders are not the bound
#: (``StealRefused.ENCODERS_FREE``; each look reads the item's claim, for a stealer to watch).
FLEET_RETRY_S = 0.5
#: An encoder is gone after this long without a heartbeat (three missed): :class:`EncoderFleet`.
ENCODER_STALE_S = 3 * HEARTBEAT_INTERVAL_S


class EncoderFleet:
    """The encoder workers of this worker's model version, as their heartbeats (core NATS, every
    ``HEARTBEAT_INTERVAL_S``) say: whether they are the bound. A steal only pays then: an encoder
    with a free slot starts a queued job within moments, and taking it would move the encode onto
    this worker's engine, which E|PD keeps for prefill and decode.

    Bound: every live encoder (a beat within ``stale_s``) holds as many jobs as it takes
    (``free_slots`` 0), or none is alive (:meth:`none_alive`). An encoder that says nothing of its
    slots (an older version) counts as free.

    None alive: the last encoder left deliberately (its "draining" beat with no job left: a
    scale-down), or no encoder has beaten for ``absent_s`` (``EPD_NO_ENCODER_AFTER_S``; crashed,
    stalled, or scaled to zero before this worker started - counted from when it began listening:
    until then it cannot tell "none" from "not heard yet")."""

    def __init__(
        self,
        fingerprint: str,
        stale_s: float,
        clock: Callable[[], float] = time.monotonic,
        absent_s: float | None = None,
    ):
        self.fingerprint = fingerprint
        self.stale_s = stale_s
        #: how long without any encoder's beat before none is alive (default: ``stale_s``)
        self.absent_s = stale_s if absent_s is None else absent_s
        self.clock = clock
        #: when :meth:`listen` subscribed to the heartbeats (None: not listening, never bound)
        self.listening_since: float | None = None
        #: worker id -> (full, when its beat came)
        self._beats: dict[str, tuple[bool, float]] = {}
        #: when an encoder last left by draining (its last beat: no job left)
        self._drained_at: float | None = None

    async def listen(self, ctx: WorkerContext) -> None:
        if ctx.nc is None:
            return
        await ctx.nc.subscribe(ctx.subjects.heartbeat(Service.ENCODER.value), cb=self._on_beat)
        self.listening_since = self.clock()

    async def _on_beat(self, msg: Msg) -> None:
        try:
            self.beat(protocol.decode(msg.data, WorkerHeartbeat))
        except protocol.ProtocolError:
            return

    def beat(self, hb: WorkerHeartbeat) -> None:
        if hb.fingerprint != self.fingerprint:
            return
        if hb.draining and hb.in_flight <= 0:  # stopping, and done: it takes no job of the queue any more
            self._beats.pop(hb.worker_id, None)
            self._drained_at = self.clock()
            return
        # (a draining one still finishing the jobs it started counts, as full: a waiter's item may be one)
        self._beats[hb.worker_id] = (hb.draining or (hb.slots > 0 and hb.free_slots <= 0), self.clock())

    def none_alive(self) -> bool:
        """No encoder is alive (the class docstring): every queued encode waits for a generating
        worker then, so it stops waiting (``EncoderWait``) and steals are not limited
        (``Stealer.has_room``)."""
        if self.listening_since is None:
            return False
        now = self.clock()
        if any(now - at < self.stale_s for _, at in self._beats.values()):
            return False
        last = max((at for _, at in self._beats.values()), default=self.listening_since)
        if self._drained_at is not None and self._drained_at >= last:
            return True  # the last one left deliberately
        return now - max(last, self.listening_since) >= self.absent_s

    def bound(self) -> bool:
        """Whether the encoders are the bound now (the class docstring)."""
        if self.listening_since is None:
            return False
        if self.none_alive():
            return True
        now = self.clock()
        live = [full for full, at in self._beats.values() if now - at < self.stale_s]
        return bool(live) and all(live)


class StealRefused(enum.Enum):
    """Why :meth:`Stealer.try_steal` did not take an item."""

    #: every steal slot of this worker is in use: try again soon
    BUSY = "busy"
    #: an encoder has a free slot (:class:`EncoderFleet`): it takes the job; look again later
    ENCODERS_FREE = "encoders_free"
    #: someone claimed the item (an encoder started it), or the claims cannot be reached: wait
    CLAIMED = "claimed"
    #: the store has it (an encoder announced it as the steal was claimed): load it
    STORED = "stored"


@dataclasses.dataclass(frozen=True)
class StealerHolds:
    """Another generating worker steals the item: its claim's ``revision``, for the waiter to watch
    (unchanged for ``STEAL_LEASE_S``: the waiter takes it over)."""

    revision: int


class Steal:
    """An item this worker took from the encoders: it announces the stored object (or that it
    failed) exactly once, which also frees the steal slot."""

    def __init__(self, stealer: Stealer, ref: ImageRef, request_id: str, revision: int):
        self.stealer = stealer
        self.ref = ref
        self.request_id = request_id
        #: the claim's revision, renewed while the steal runs (``Stealer._renew``)
        self.revision = revision
        self.started_at = time.time()
        self._done = False
        self.renewing: asyncio.Task[None] | None = None

    async def announce(self, n_tokens: int, nbytes: int, encode_s: float) -> None:
        """The object is stored: tell the waiters (the API indexes it too)."""
        s = self.stealer
        ready = ECReady(
            request_id=self.request_id,
            item_hash=self.ref.item_hash,
            fingerprint=s.fingerprint,
            ec_key=s.store.key(self.ref.item_hash),
            n_tokens=n_tokens,
            nbytes=nbytes,
            producer=s.worker_id,
            encode_s=encode_s,
            created_at=time.time(),
            encode_started_at=self.started_at,
        )
        await self._end(s.ctx.subjects.ec_ready(s.fingerprint, self.ref.item_hash), ready, "announced")

    async def fail(self, message: str) -> None:
        """Nothing stored: the waiters stop waiting and encode themselves."""
        s = self.stealer
        failed = ECFailed(
            request_id=self.request_id,
            item_hash=self.ref.item_hash,
            fingerprint=s.fingerprint,
            code="steal_failed",
            message=message,
            created_at=time.time(),
        )
        await self._end(s.ctx.subjects.ec_failed(s.fingerprint, self.ref.item_hash), failed, "failed")

    async def _end(self, subject: str, event: ECReady | ECFailed, outcome: str) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self.stealer.ctx.publisher.publish(subject, event, request_id=self.request_id)
            metrics.EC_STEALS.labels(outcome).inc()
        finally:
            await self.stealer.ended(self)


class Stealer:
    """This worker's encode steals (the module docstring): ``slots`` at once, after ``after_s``,
    while ``fleet`` says the encoders are the bound."""

    def __init__(
        self, ctx: WorkerContext, store: ECStore, fingerprint: str, slots: int, after_s: float, fleet: EncoderFleet
    ):
        self.ctx = ctx
        self.store = store
        self.fingerprint = fingerprint
        self.worker_id = ctx.settings.worker_id
        self.slots = slots
        self.after_s = after_s
        self.fleet = fleet
        self.running = 0
        self._claims: EncodeClaims | None = None

    async def _open(self) -> EncodeClaims:
        if self._claims is None:
            assert self.ctx.nc is not None  # (an EncoderWait subscription exists: so does NATS)
            self._claims = await EncodeClaims.open(self.ctx.nc.jetstream(), self.ctx.subjects, self.ctx.settings.nats)
        return self._claims

    def has_room(self) -> bool:
        """A steal slot is free - or no encoder is alive: then every waiting item is stolen at
        once (encoders scaled to zero: the limit would queue each request behind the others' encodes)."""
        return self.running < self.slots or self.fleet.none_alive()

    async def try_steal(
        self, ref: ImageRef, request_id: str, *, lapsed: int | None = None
    ) -> Steal | StealRefused | StealerHolds:
        """Claim the item for this worker's engine. ``lapsed``: the revision of another stealer's
        claim the caller saw unchanged for ``STEAL_LEASE_S``: take it over."""
        if not self.has_room():
            return StealRefused.BUSY
        if lapsed is None and not self.fleet.bound():
            return await self._stealer_of(ref)
        self.running += 1  # held across the awaits below: two jobs never take one slot
        revision = None
        try:
            claims = await self._open()
            revision = await claims.steal(self.fingerprint, ref.item_hash, self.worker_id, lapsed=lapsed)
            if revision is None:
                held = await claims.held(self.fingerprint, ref.item_hash)
                if held is None:  # released as we looked: the next try creates it
                    return StealRefused.BUSY
                claim, other = held
                return StealerHolds(other) if claim.stealer else StealRefused.CLAIMED
            if await asyncio.to_thread(self.store.exists, ref.item_hash):
                await claims.release(self.fingerprint, ref.item_hash, revision)
                revision = None
                return StealRefused.STORED
        except Exception as exc:  # noqa: BLE001 - nats and the store raise several unrelated types: wait as before
            log.warning(
                "could not steal %s (%s: %s): waiting for the encoder", ref.item_hash[:12], type(exc).__name__, exc
            )
            revision = None
            return StealRefused.CLAIMED
        finally:
            if revision is None:
                self.running -= 1
        if lapsed is not None:
            log.warning("took over the encode of %s: its stealer stopped renewing its claim", ref.item_hash[:12])
        log.info("stealing the encode of %s", ref.item_hash[:12])
        metrics.EC_STEALS.labels("stolen").inc()
        steal = Steal(self, ref, request_id, revision)
        steal.renewing = asyncio.create_task(self._renew(steal, claims), name=f"renew-claim-{ref.item_hash[:12]}")
        return steal

    async def _stealer_of(self, ref: ImageRef) -> StealerHolds | StealRefused:
        """The encoders take their jobs (not the bound): no steal. Another worker's steal of the
        item is still watched - one whose stealer dies is taken over whatever the encoders do:
        they skip a stolen item's job."""
        try:
            held = await (await self._open()).held(self.fingerprint, ref.item_hash)
        except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types: wait as before
            log.debug("looking at the claim of %s: %s: %s", ref.item_hash[:12], type(exc).__name__, exc)
            held = None
        if held is not None and held[0].stealer:
            return StealerHolds(held[1])
        return StealRefused.ENCODERS_FREE

    async def _renew(self, steal: Steal, claims: EncodeClaims) -> None:
        """Renew the steal's claim until it ends (cancelled by :meth:`ended`)."""
        while True:
            await asyncio.sleep(STEAL_RENEW_S)
            try:
                revision = await claims.renew(self.fingerprint, steal.ref.item_hash, self.worker_id, steal.revision)
            except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types: try again next time
                log.warning(
                    "could not renew the claim of %s: %s: %s", steal.ref.item_hash[:12], type(exc).__name__, exc
                )
                continue
            if revision is None:
                log.warning(
                    "the claim of %s was taken over (this worker looked dead): encoding anyway",
                    steal.ref.item_hash[:12],
                )
                return
            steal.revision = revision

    async def ended(self, steal: Steal) -> None:
        self.running -= 1
        if steal.renewing is not None:  # stopped before the release, so the revision is final
            steal.renewing.cancel()
            await asyncio.gather(steal.renewing, return_exceptions=True)
        if self._claims is not None:
            await self._claims.release(self.fingerprint, steal.ref.item_hash, steal.revision)


def join_in_store(store: ECStore, ref: ImageRef, request_id: str) -> int | None:
    """(Blocking.) The EC object of a segmented video (``ref.segments``) under its own item,
    its segments' objects' rows joined in order, for an engine whose connector loads one object
    per item. Returns the object's size when written here, 0 when it was stored already, None when
    not joined: a segment's object missing or unreadable (logged; the engine then encodes the
    video whole - a miss, never a wrong feature)."""
    item = ref.item_hash[:12]
    try:
        if store.exists(ref.item_hash):
            return 0
        objects = [store.load(seg.item_hash, request_id=request_id) for seg in ref.segments]
        data, dtype, shape = join_rows(objects)
        extra = {**objects[0].extra, "segments": len(objects)}
        _key, nbytes = store.save(ref.item_hash, data, dtype=dtype, shape=shape, extra=extra)
    except (EPDError, ValueError) as exc:  # (ObjectValidationError: a segment's object missing or bad)
        log.warning("video %s: its segments' features not joined (%s): the engine encodes it whole", item, exc)
        return None
    log.info("video %s: %d segments joined in the store (%d bytes)", item, len(objects), nbytes)
    return nbytes


class FeatureSource(abc.ABC):
    #: The worker's part in the EC store lifecycle (sources that use the store).
    lifecycle: WorkerLifecycle | None = None

    @abc.abstractmethod
    async def resolve(self, ref: ImageRef, request_id: str) -> tuple[EncodedImage | base.ConnectorItem, str]:
        """The engine's item for one image and where it came from."""

    async def join(
        self, ref: ImageRef, parts: list[EncodedImage | base.ConnectorItem], request_id: str
    ) -> EncodedImage | base.ConnectorItem:
        """A segmented video (``ref.segments``) as the engine takes it, from its segments' resolved
        items (in order): here their features joined."""
        encoded = [p for p in parts if isinstance(p, EncodedImage)]
        if len(encoded) != len(parts):
            raise TypeError("a video in segments: every segment's features must be resolved here")
        return base.join_segments(encoded, ref.fps)

    async def settle(self, request_id: str, stats: base.GenerationStats | None) -> None:
        """After a request's generation (``stats``; None when it failed): announce the items its
        engine encoded in place of the encoders (:class:`ConnectorFeatures`; the others announce in
        ``resolve``)."""

    async def close(self) -> None:
        """At shutdown: write the uses not written yet, stop listening for invalidations."""
        if self.lifecycle is not None:
            await self.lifecycle.close()


class LocalFeatures(FeatureSource):
    """Cache, else encode here (agg: no store, no encoder workers). Subclassed by
    :class:`StoredFeatures`, which looks in the store in between and writes back."""

    def __init__(self, engine: base.FeaturesThroughWorker, cache: FeatureCache, image: MediaLoader):
        self.engine = engine
        self.cache = cache
        self.image = image

    async def resolve(self, ref: ImageRef, request_id: str) -> tuple[EncodedImage, str]:
        if (cached := self.cached(ref)) is not None:
            return cached, ECSource.LOCAL_CACHE
        item = await self.encode(ref)
        metrics.EC_LOOKUPS.labels(ECSource.LOCAL, metrics.LookupOutcome.HIT, "").inc()
        return item, ECSource.LOCAL

    def cached(self, ref: ImageRef) -> EncodedImage | None:
        """The item's features from this worker's local cache (counted as a hit), or None."""
        cached = self.cache.get(ref.item_hash)
        if cached is not None:
            metrics.EC_LOOKUPS.labels(ECSource.LOCAL_CACHE, metrics.LookupOutcome.HIT, "").inc()
        return cached

    async def encode(self, ref: ImageRef) -> EncodedImage:
        item = await base.encode_item(self.engine, await self.image(ref))
        self.cache.put(ref.item_hash, item)
        return item

    async def join(
        self, ref: ImageRef, parts: list[EncodedImage | base.ConnectorItem], request_id: str
    ) -> EncodedImage:
        """The segments' features joined (:meth:`FeatureSource.join`), with what the engine's prompt
        says of the whole video's time (Qwen3-VL's ``<t seconds>`` per temporal patch) from the
        video's own metadata in its ref - not the segments' EC objects' times: keyed by their pixels
        alone, a segment's object may have been encoded for another video, or another segment of
        this one (a still clip)."""
        joined = await super().join(ref, parts, request_id)
        assert isinstance(joined, EncodedImage)
        timestamps = self.engine.video_timestamps(base.video_metadata_of(ref))
        return dataclasses.replace(joined, timestamps=timestamps)


class StoredFeatures(LocalFeatures):
    """Cache -> store -> wait for the encoder -> encode here with write-back (module docstring)."""

    def __init__(
        self,
        engine: base.FeaturesThroughWorker,
        cache: FeatureCache,
        image: MediaLoader,
        store: ECStore,
        encoder: EncoderWait,
        stealer: Stealer | None = None,
    ):
        super().__init__(engine, cache, image)
        self.store = store
        self.encoder = encoder
        self.stealer = stealer
        #: records uses in the EC index, drops invalidated items from ``cache``
        self.lifecycle: WorkerLifecycle = WorkerLifecycle(encoder.ctx, store, cache)

    async def resolve(self, ref: ImageRef, request_id: str) -> tuple[EncodedImage, str]:
        await self.lifecycle.ensure_started()
        if (cached := self.cached(ref)) is not None:
            self.lifecycle.used(ref.item_hash)
            return cached, ECSource.LOCAL_CACHE
        reason = MissReason.NOT_FOUND
        async with self.encoder.watching(ref) as sub:
            try:
                return await self._from_store(ref, request_id), ECSource.STORE
            except ObjectValidationError as exc:
                reason = exc.reason
            if reason is MissReason.NOT_FOUND and sub is not None:
                waited = await self.encoder.wait(sub, ref, self.stealer, request_id)
                if isinstance(waited, Steal):
                    return await self._steal(ref, waited), ECSource.STOLEN
                if waited is not None:
                    reason = waited
                else:
                    try:
                        return await self._from_store(ref, request_id), ECSource.STORE
                    except ObjectValidationError as exc:
                        reason = exc.reason

        log.warning("encoding %s locally: %s", ref.item_hash[:12], reason.value)
        item = await self.encode(ref)
        await self._write_back(ref, item)
        metrics.EC_LOOKUPS.labels(ECSource.RECOMPUTED, metrics.LookupOutcome.HIT, reason.value).inc()
        return item, recomputed(reason.value)

    async def _steal(self, ref: ImageRef, steal: Steal) -> EncodedImage:
        """Encode a stolen item here, store it, announce it."""
        try:
            started = time.perf_counter()
            item = await self.encode(ref)
            encode_s = time.perf_counter() - started
            nbytes = await self._write_back(ref, item)
        except BaseException as exc:
            await steal.fail(f"the stealing worker failed: {type(exc).__name__}: {exc}")
            raise
        if nbytes is None:
            await steal.fail("the stealing worker could not store it")
        else:
            await steal.announce(item.n_tokens, nbytes, encode_s)
        metrics.EC_LOOKUPS.labels(ECSource.STOLEN, metrics.LookupOutcome.HIT, "").inc()
        return item

    async def _from_store(self, ref: ImageRef, request_id: str) -> EncodedImage:
        from shared.engines.ec_objects import ec_object_to_encoded

        obj = await asyncio.to_thread(self.store.load, ref.item_hash, request_id=request_id)
        self.lifecycle.used(ref.item_hash, size=len(obj.data))
        item = ec_object_to_encoded(obj)
        self.cache.put(ref.item_hash, item)
        return item

    async def _write_back(self, ref: ImageRef, item: EncodedImage) -> int | None:
        """Repairs a corrupt / missing object for the next request. Returns its size (None: not
        stored)."""
        from shared.engines.ec_objects import encoded_to_extra
        from shared.store.tensors import tensor_to_raw

        raw, dtype, shape = tensor_to_raw(item.features)
        try:
            _key, nbytes = await asyncio.to_thread(
                self.store.save, ref.item_hash, raw, dtype=dtype, shape=shape, extra=encoded_to_extra(item)
            )
            self.lifecycle.used(ref.item_hash, size=nbytes, created=True)
        except StoreError as exc:
            log.warning("could not write back %s: %s", ref.item_hash[:12], exc)
            return None
        return nbytes


class ConnectorFeatures(FeatureSource):
    """Wait until the encoder has stored the item (or gave up, or ``ec_wait_s`` passed), then hand
    over the image; the engine's EC connector loads the stored output itself and the engine
    encodes the image when it cannot. The source is provisional: the engine reports the real one
    after generating. ``encoder`` None (agg): no waiting."""

    def __init__(self, image: MediaLoader, store: ECStore, encoder: EncoderWait | None, stealer: Stealer | None = None):
        self.image = image
        self.store = store
        self.encoder = encoder
        #: steals: only with an engine that stores what it encodes (``FeaturesThroughConnector.stores_encodes``)
        self.stealer = stealer
        #: request id -> the items it stole, announced in ``settle``
        self.steals: dict[str, list[Steal]] = {}
        #: records uses in the EC index (the engine's connector drops invalidated bytes itself)
        self.lifecycle = WorkerLifecycle(encoder.ctx, store, None) if encoder is not None else None

    async def _item(self, ref: ImageRef) -> base.ConnectorItem:
        """The item as the engine takes it: the image, or the video's frames, with its hash."""
        return base.connector_item(await self.image(ref), ref.item_hash)

    async def resolve(self, ref: ImageRef, request_id: str) -> tuple[base.ConnectorItem, str]:
        if self.encoder is None or self.lifecycle is None:
            return await self._item(ref), ECSource.LOCAL
        await self.lifecycle.ensure_started()
        if not ref.encode_queued:  # the API found it stored: a use
            self.lifecycle.used(ref.item_hash)
        async with self.encoder.watching(ref) as sub:
            if sub is not None:
                try:
                    stored = await asyncio.to_thread(self.store.exists, ref.item_hash)
                except StoreError as exc:
                    log.warning("existence check of %s failed (%s): not waiting", ref.item_hash[:12], exc)
                    stored = True
                if stored:
                    self.lifecycle.used(ref.item_hash)
                else:
                    reason = await self.encoder.wait(sub, ref, self.stealer, request_id)
                    if isinstance(reason, Steal):  # (settled by the handler, whatever happens next)
                        self.steals.setdefault(request_id, []).append(reason)
                        return await self._item(ref), ECSource.STOLEN
                    if reason is not None:
                        log.warning("item %s not stored (%s): the engine encodes it", ref.item_hash[:12], reason.value)
        return await self._item(ref), ECSource.CONNECTOR

    async def join(
        self, ref: ImageRef, parts: list[EncodedImage | base.ConnectorItem], request_id: str
    ) -> base.ConnectorItem:
        """The segments' frames as one video under the video's item hash; with encoders, its
        features joined from the segments' EC objects into the video's own object first (the
        engine's connector loads one object per item). Where a segment's object is missing or
        unreadable nothing is joined: the engine encodes the video whole (a miss, never a wrong
        feature)."""
        media = [p for p in parts if not isinstance(p, EncodedImage)]
        if len(media) != len(parts):
            raise TypeError("a video in segments: the segments must be media items")
        video = base.join_video_media(media, ref)
        if self.encoder is not None and self.lifecycle is not None:
            nbytes = await asyncio.to_thread(join_in_store, self.store, ref, request_id)
            if nbytes == 0:
                self.lifecycle.used(ref.item_hash)
            elif nbytes is not None:
                self.lifecycle.used(ref.item_hash, size=nbytes, created=True)
        return video

    async def settle(self, request_id: str, stats: base.GenerationStats | None) -> None:
        """The engine stored what it encoded in its step (an EC producer as well): announce each
        stolen item that is in the store now; the rest failed (their waiters encode themselves)."""
        for steal in self.steals.pop(request_id, ()):
            item = steal.ref.item_hash
            try:
                info = await asyncio.to_thread(self.store.stored, item)
            except StoreError as exc:
                info = None
                log.warning("could not check the stolen item %s: %s", item[:12], exc)
            if info is None:
                await steal.fail("the stealing worker's engine did not store it")
                continue
            n_tokens = (stats.extra.get("ec_items") or {}).get(item, 0) if stats is not None else 0
            await steal.announce(n_tokens, info.size, 0.0)
            metrics.EC_LOOKUPS.labels(ECSource.STOLEN, metrics.LookupOutcome.HIT, "").inc()
