"""The scaling signal per worker role, on the API's ``/metrics`` (one place to scrape; issue 44).

For each role - ``encoder``, ``prefill`` (PD and prefill workers: the generation queue), ``decode``:

* ``epd:queue_lag_jobs{role}``: the jobs in the role's queue, ``num_pending + num_ack_pending`` summed
  over its consumers - the shared one (what KEDA's ``nats-jetstream`` scaler reads) and, for the
  generation queue, every worker's routed consumer (``shared.routed_jobs``), which that scaler misses;
* ``epd:job_cost_seconds{role}``: the role's cost per job, the median of its last
  :data:`COST_WINDOW` jobs' busy seconds, from the stage timings ``epd plan`` sizes fleets with:
  an encode's ``encode_s`` (every ``ECReady`` of a real encode, an encoder's or a steal's), a
  generation job's ``prefill_s`` (+ ``decode_s`` where the same worker decodes: E|PD, agg), a decode
  job's ``decode_s`` (E|P|D); :data:`DEFAULT_JOB_COST_S` until the role's first job;
* ``epd:pending_work_seconds{role}``: lag x cost - the seconds of work waiting for the role, which
  rises with the backlog and with costlier jobs (video, large images) where a job count does not.
  ``epd plan --emit kubernetes`` turns an SLO into a threshold on it (docs/kubernetes.md).

Every API replica polls the consumers every :data:`POLL_S` and exports the same lag; costs come
from the requests each replica serves itself (and every encode), so they agree within noise:
scale on ``max()`` over the replicas.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
from typing import Any

from shared import metrics, protocol
from shared.protocol import ECReady, FinalResult, Subjects, Timing, WorkQueue
from shared.topology import Service

log = logging.getLogger(__name__)

#: How often the consumers' lag is read (the workers' heartbeat interval).
POLL_S = 2.0
#: A role's cost per job is the median of this many recent jobs.
COST_WINDOW = 64
#: A role's cost per job before any of its jobs was seen (seconds).
DEFAULT_JOB_COST_S = 1.0

#: The roles scaled, their work queue and shared consumer.
ROLES: dict[Service, tuple[WorkQueue, str]] = {Service(name): work for name, work in protocol.WORK_CONSUMERS.items()}


class JobCosts:
    """Recent jobs' busy seconds per role (the module docstring)."""

    def __init__(self, window: int = COST_WINDOW) -> None:
        self._seconds = {role: collections.deque[float](maxlen=window) for role in ROLES}

    def add(self, role: Service, seconds: float) -> None:
        if seconds > 0:
            self._seconds[role].append(seconds)

    def cost(self, role: Service) -> float:
        recent = self._seconds[role]
        return statistics.median(recent) if recent else DEFAULT_JOB_COST_S

    def encoded(self, ready: ECReady) -> None:
        """An item was encoded (not one found stored: ``encode_started_at`` 0)."""
        if ready.encode_started_at:
            self.add(Service.ENCODER, ready.encode_s)

    def finished(self, final: FinalResult) -> None:
        """A request ended: its generation job's cost, and its decode job's in E|P|D."""
        t = final.timings
        handed_off = Timing.DECODE_FIRST_TOKEN in t
        self.add(Service.PREFILL, t.get(Timing.PREFILL, 0.0) + (0.0 if handed_off else t.get(Timing.DECODE, 0.0)))
        if handed_off:
            self.add(Service.DECODE, t.get(Timing.DECODE, 0.0))


class ScalingSignal:
    """Polls the work queues' consumers and sets the gauges (the module docstring)."""

    def __init__(self, subjects: Subjects, costs: JobCosts | None = None, poll_s: float = POLL_S):
        self.subjects = subjects
        self.costs = costs if costs is not None else JobCosts()
        self.poll_s = poll_s
        self.js: Any = None
        self._task: asyncio.Task[None] | None = None
        self._sub: Any = None

    async def start(self, nc: Any) -> None:
        """Hear every encode (``ECReady``) and poll the consumers from now on."""
        self.js = nc.jetstream()
        self._sub = await nc.subscribe(self.subjects.ec_ready_all, cb=self._on_ready)
        self._task = asyncio.create_task(self._poll_forever(), name="scaling-signal")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.debug("unsubscribe: %s", exc)

    async def _on_ready(self, msg: Any) -> None:
        try:
            self.costs.encoded(protocol.decode(msg.data, ECReady))
        except protocol.ProtocolError:
            return

    async def lag(self, role: Service) -> int:
        """The role's queued jobs now (its consumers' ``num_pending + num_ack_pending``)."""
        queue, shared = ROLES[role]
        stream = self.subjects.work_stream(queue)
        if role is Service.PREFILL:  # the shared consumer and every worker's routed one
            infos = await self.js.consumers_info(stream)
            mine = [i for i in infos if i.name == shared or i.name.startswith(protocol.CONSUMER_ROUTED_PREFIX)]
        else:
            mine = [await self.js.consumer_info(stream, shared)]
        return sum((i.num_pending or 0) + (i.num_ack_pending or 0) for i in mine)

    async def poll(self) -> None:
        """Read every role's lag once and set its gauges (a role whose consumer does not exist
        yet - no worker of it ever started - has no lag)."""
        for role in ROLES:
            try:
                lag = await self.lag(role)
            except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types (no consumer yet, timeout)
                log.debug("lag of %s: %s: %s", role.value, type(exc).__name__, exc)
                lag = 0
            cost = self.costs.cost(role)
            metrics.QUEUE_LAG_JOBS.labels(role.value).set(lag)
            metrics.JOB_COST_SECONDS.labels(role.value).set(cost)
            metrics.PENDING_WORK_SECONDS.labels(role.value).set(lag * cost)

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.poll_s)
