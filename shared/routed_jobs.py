"""Routed generation jobs: the claim that makes exactly one worker run a job the API routed
(``EPD_ROUTING=affinity``; the policy, what workers advertise and how the API scores them, is
``shared.routing``), a worker's own consumer of them, and the worker runner's routing strategy.

**Claims** (:class:`RoutingClaims`, over ``shared.claims``): a routed job is published once on the
target's own subject (``Subjects.generate_routed``, consumer ``Subjects.routed_consumer``); whoever
runs it first wins the create-only key ``<request id>`` of the ``<P>_ROUTING_CLAIMS`` key-value
bucket:

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

**The runner's strategy** (:class:`WorkerRouting`, chosen once when ``shared.worker.WorkerRunner``
is built): :class:`RoutedJobs` for a worker the API routes to (a handler with ``routable``): beside
the shared consumer the runner pulls from the worker's own consumer, within the same room; each
routed job is claimed before it runs (claimed elsewhere: acked and dropped), and its claim is marked
done once the job is settled. A stopping worker moves the jobs routed to it to the shared queue,
each once (:meth:`RoutedJobs.hand_back`, :meth:`RoutedJobs.hand_over`: the claim decides, as for the
watchdog). :class:`SharedQueueOnly` for the others.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Protocol

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError

from shared import metrics, protocol
from shared.claims import BucketSpec, ClaimState, KvClaims
from shared.config import NatsSettings
from shared.jetstream import Publisher
from shared.logs import REQUEST_ID
from shared.protocol import GenerationJob, RouteReason, Subjects

log = logging.getLogger(__name__)

#: A worker's routed consumer that has not pulled for this long is removed by the server (its
#: worker is gone; its jobs went to the shared queue through the watchdog).
ROUTED_CONSUMER_INACTIVE_S = 3600.0
#: How long one pull of a stopping worker's routed consumer waits (:meth:`RoutedJobs.hand_over`:
#: until one finds nothing).
ROUTED_HANDOVER_PULL_S = 0.5

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


# -- claims -----------------------------------------------------------------------------------
def claim_key(request_id: str) -> str:
    """The bucket key of a request's claim: its id when it is a valid key, else a digest of it."""
    if _KEY_OK.match(request_id) and len(request_id) <= 200:
        return request_id
    return "h-" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


class RoutingClaims:
    """The ``<P>_ROUTING_CLAIMS`` key-value bucket (see the module docstring) over
    :class:`shared.claims.KvClaims`. Raises what nats-py raises when NATS does not answer: callers
    decide (a worker naks, the API retries)."""

    def __init__(self, claims: KvClaims):
        self.claims = claims

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects, settings: NatsSettings) -> RoutingClaims:
        """Open the bucket, creating it when missing."""
        description = "epd routing claims: which worker runs a routed generation job"
        spec = BucketSpec("the routing claims", description, settings.stream_replicas, settings.stream_max_age_s)
        return cls(await KvClaims.open(js, subjects.routing_bucket, spec))

    async def get(self, request_id: str) -> ClaimState | None:
        return await self.claims.get(claim_key(request_id))

    async def claim(self, request_id: str, owner: str) -> tuple[bool, ClaimState | None]:
        """Claim the job for ``owner``: (True, state) when this call created the claim or it was
        ``owner``'s already (a redelivery); (False, state) when someone else holds it."""
        revision = await self.claims.create(claim_key(request_id), owner)
        if revision is not None:
            return True, ClaimState(owner, revision)
        state = await self.get(request_id)
        return (state is not None and state.value == owner), state

    async def replace(self, request_id: str, value: str, revision: int) -> bool:
        """Compare-and-set: write ``value`` if the claim is still at ``revision``."""
        return await self.claims.swap(claim_key(request_id), value, revision) is not None


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


async def ensure_routed_consumer(
    js: JetStreamContext, settings: NatsSettings, subjects: Subjects, worker_id: str
) -> str:
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


# -- the runner's strategy ----------------------------------------------------------------------
class WorkerRouting(Protocol):
    """How a worker takes the jobs the API routes to it (module docstring)."""

    async def subscribe(
        self, js: JetStreamContext, stream: str, publisher: Publisher
    ) -> JetStreamContext.PullSubscription | None:
        """The runner starts: the subscription of the worker's routed consumer (None: it has none)."""

    async def take(self, msg: Msg) -> RouteClaim | None:
        """A routed job came: its won claim, to run it with; None when this settled the message
        itself (claimed elsewhere: acked and dropped; the claim not answered: naked)."""

    async def hand_back(self, msg: Msg, claim: RouteClaim) -> None:
        """A routed job this stopping worker claimed but did not start: to the shared queue."""

    async def hand_over(self) -> None:
        """The worker stops: the routed jobs still waiting for it go to the shared queue."""


class SharedQueueOnly:
    """A worker the API does not route to: no routed consumer, so nothing to take or move."""

    async def subscribe(
        self, js: JetStreamContext, stream: str, publisher: Publisher
    ) -> JetStreamContext.PullSubscription | None:
        return None

    async def take(self, msg: Msg) -> RouteClaim | None:
        raise RuntimeError("a routed job for a worker without a routed consumer")

    async def hand_back(self, msg: Msg, claim: RouteClaim) -> None:
        raise RuntimeError("a routed claim for a worker without a routed consumer")

    async def hand_over(self) -> None:
        return None


class RoutedJobs:
    """A worker the API routes to (module docstring): its routed consumer and the claims."""

    def __init__(self, settings: NatsSettings, subjects: Subjects, worker_id: str):
        self.settings = settings
        self.subjects = subjects
        self.worker_id = worker_id
        self._claims: RoutingClaims | None = None
        self._publisher: Publisher | None = None
        self._js: JetStreamContext | None = None
        self._stream = ""

    async def subscribe(
        self, js: JetStreamContext, stream: str, publisher: Publisher
    ) -> JetStreamContext.PullSubscription | None:
        """Bind this worker's routed consumer (created here) and open the routing claims."""
        durable = await ensure_routed_consumer(js, self.settings, self.subjects, self.worker_id)
        self._claims = await RoutingClaims.open(js, self.subjects, self.settings)
        self._js, self._stream, self._publisher = js, stream, publisher
        rsub = await js.pull_subscribe_bind(durable=durable, stream=stream)
        log.info("worker %s consuming routed jobs %s/%s", self.worker_id, stream, durable)
        return rsub

    async def take(self, msg: Msg) -> RouteClaim | None:
        """Claim the routed job (module docstring); dropped when claimed elsewhere."""
        assert self._claims is not None
        request_id = (msg.headers or {}).get(protocol.HDR_REQUEST_ID, "")
        token = REQUEST_ID.set(request_id or "-")
        try:
            try:
                won, state = await self._claims.claim(request_id, self.worker_id)
            except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types: retry the job
                metrics.ROUTING_CLAIMS.labels("error").inc()
                log.warning("could not claim the routed job (%s: %s): retrying", type(exc).__name__, exc)
                await msg.nak(delay=1.0)
                return None
            if not won or state is None:
                metrics.ROUTING_CLAIMS.labels("lost").inc()
                log.info("routed job claimed by %s: dropped", state.value if state else "?")
                await msg.ack()
                return None
            metrics.ROUTING_CLAIMS.labels("won" if msg.metadata.num_delivered <= 1 else "redelivered").inc()
        except Exception:
            log.exception("could not settle the routed message")
            return None
        finally:
            REQUEST_ID.reset(token)
        return RouteClaim(self._claims, request_id, self.worker_id, state.revision)

    async def hand_back(self, msg: Msg, claim: RouteClaim) -> None:
        await self._reroute(msg, claim)  # (its own consumer is not pulled any more)

    async def hand_over(self) -> None:
        """Move the jobs waiting in this worker's routed consumer to the shared queue (each once:
        the routing claim decides, as the API's watchdog does)."""
        if self._js is None:
            return
        try:
            sub = await self._js.pull_subscribe_bind(
                durable=self.subjects.routed_consumer(self.worker_id), stream=self._stream
            )
        except Exception as exc:  # noqa: BLE001 - the API's watchdog falls back once the heartbeat stops
            log.warning("cannot hand over the routed jobs (%s: %s)", type(exc).__name__, exc)
            return
        moved = 0
        try:
            while True:
                try:
                    msgs = await sub.fetch(16, timeout=ROUTED_HANDOVER_PULL_S)
                except TimeoutError:
                    break
                for msg in msgs:
                    moved += await self._reroute(msg, None)
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("handing over the routed jobs failed (%s: %s)", type(exc).__name__, exc)
        finally:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.debug("unsubscribe: %s", exc)
        if moved:
            log.info("handed %d routed job(s) over to the shared queue", moved)

    async def _reroute(self, msg: Msg, claim: RouteClaim | None) -> bool:
        """A routed job this stopping worker will not run: win its claim as ``@fallback`` (from
        this worker's own claim, ``claim``, or a fresh one), publish the shared queue's copy, ack.
        Lost to someone else: ack only (they run it). True when this worker published the copy."""
        assert self._claims is not None and self._publisher is not None
        try:
            job = protocol.decode(msg.data, GenerationJob)
        except protocol.ProtocolError:
            await msg.term()
            return False
        rid = job.request_id
        if claim is not None:
            won = await self._claims.replace(rid, CLAIM_FALLBACK, claim.revision)
        else:
            won, state = await self._claims.claim(rid, CLAIM_FALLBACK)
            if not won and state is not None and state.value == self.worker_id:
                won = await self._claims.replace(rid, CLAIM_FALLBACK, state.revision)  # ours, not run
        if won:
            detail = f"{self.worker_id} stopping"
            await self._publisher.publish(
                self.subjects.generate_jobs,
                fallback_copy(job, detail),
                request_id=rid,
                msg_id=fallback_msg_id(rid),
                deadline=job.deadline,
            )
            metrics.ROUTING_DECISIONS.labels(RouteReason.FALLBACK).inc()
        await msg.ack()
        return won
