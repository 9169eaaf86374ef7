"""Failover on a real 3-node NATS cluster (``shared.tools.infra.NatsCluster``, localhost): replicas as
configuration, a redelivered job of an answered request acked without running, publishes through a
leader election, a client leaving a stalled server, the subscription confirm while the meta leader
is re-elected. Every wait is bounded; the nodes are healed after each test."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import ClassVar

import nats
import pytest

from shared import cancellation, metrics, protocol
from shared.cancellation import Ended, RequestRecords, cancel_record
from shared.config import NatsSettings, WorkerSettings
from shared.ec_lifecycle.index import ECIndex
from shared.errors import ConfigError, ServiceUnavailable
from shared.jetstream import (
    JetStreamPublisher,
    close_connection,
    confirm_subscriptions,
    connect,
    ensure_topology,
)
from shared.metrics import JobOutcome
from shared.protocol import FinalResult, GenerationJob, SamplingSpec, Subjects
from shared.tools.infra import EmbeddedNats, NatsCluster
from shared.topology import Role, Service
from shared.worker import Delivery, Handler, WorkerRunner
from tests.stackutil import until

ACK_WAIT_S = 2.0
MAX_BYTES = 8 * 1024**2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = NatsCluster(tmp_path_factory.mktemp("nats-cluster"), 3)
    c.start(timeout=60)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def healed(cluster: NatsCluster):
    """Every node running and the cluster agreeing on a meta leader after each test."""
    yield
    for i, node in enumerate(cluster.nodes):
        node.resume()
        if not node.is_running():
            cluster.start(i, timeout=60)
    cluster.wait_ready(60)


def _prefix() -> str:
    return "c" + uuid.uuid4().hex[:8]


def _settings(cluster: NatsCluster, prefix: str, **kw) -> NatsSettings:
    # small streams: JetStream reserves each stream's max_bytes on every replica's node
    return NatsSettings(
        nats_url=cluster.seeds, subject_prefix=prefix, stream_replicas=3, stream_max_bytes=MAX_BYTES, **kw
    )


def _job(rid: str) -> GenerationJob:
    return GenerationJob(
        request_id=rid,
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        images=(),
        fingerprint="fp",
        sampling=SamplingSpec(temperature=0, max_tokens=1),
        stream=False,
        deadline=time.time() + 300,
        created_at=time.time(),
    )


def _final(rid: str) -> FinalResult:
    return FinalResult(
        request_id=rid,
        attempt=1,
        token_ids=(1,),
        text="x",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=1,
    )


def _node_of(cluster: NatsCluster, nc) -> int:
    port = nc.connected_url.port
    return next(i for i, node in enumerate(cluster.nodes) if node.requested_port == port)


# -- replication as configuration ---------------------------------------------------------------
async def test_replicas_are_configuration_and_more_than_the_cluster_is_refused(cluster, nats_server: EmbeddedNats):
    prefix = _prefix()
    settings = _settings(cluster, prefix)
    subjects = Subjects(prefix)
    nc = await connect(settings, name="test-replicas")
    try:
        js = nc.jetstream(timeout=10)
        await ensure_topology(js, settings, subjects, nc=nc)
        for stream in subjects.streams():
            assert (await js.stream_info(stream)).config.num_replicas == 3, stream
        consumer = await js.consumer_info(subjects.stream_generate, protocol.CONSUMER_PREFILL)
        assert consumer.config.num_replicas == 3
        index = await ECIndex.open(js, subjects.ec_index_bucket, replicas=3)
        assert (await index.kv.status()).stream_info.config.num_replicas == 3
        # more than the cluster: a clear refusal naming the setting and the size, not a JetStream error
        too_many = _settings(cluster, _prefix()).model_copy(update={"stream_replicas": 5})
        with pytest.raises(ConfigError, match=r"EPD_STREAM_REPLICAS=5.*3 server"):
            await ensure_topology(js, too_many, Subjects(too_many.subject_prefix), nc=nc)
        with pytest.raises(ConfigError, match=r"EPD_STREAM_REPLICAS=5.*EC index"):
            await ECIndex.open(js, Subjects(_prefix()).ec_index_bucket, replicas=5)
    finally:
        await nc.close()
    # a server without a cluster refuses anything above 1, before creating a stream
    single = NatsSettings(nats_url=nats_server.url, subject_prefix=_prefix(), stream_replicas=3)
    nc = await connect(single, name="test-replicas-single")
    try:
        with pytest.raises(ConfigError, match=r"EPD_STREAM_REPLICAS=3.*not clustered \(cluster size 1\)"):
            await ensure_topology(nc.jetstream(), single, Subjects(single.subject_prefix), nc=nc)
        assert [s async for s in _streams(nc, single.subject_prefix.upper())] == []
    finally:
        await nc.close()


async def _streams(nc, prefix: str):
    for info in await nc.jetstream().streams_info():
        if info.config.name.startswith(prefix):
            yield info.config.name


async def test_a_client_seeded_with_every_node_connects_when_the_first_seed_is_down(cluster):
    cluster.stop(0)
    settings = NatsSettings(nats_url=cluster.seeds, subject_prefix=_prefix(), stream_replicas=3)
    # the seeds in order (no shuffling): the first one is tried first and refused
    nc = await connect(settings, name="test-seeds", dont_randomize=True)
    try:
        assert _node_of(cluster, nc) != 0
        js = nc.jetstream(timeout=10)
        await js.add_stream(name=settings.subject_prefix, subjects=[f"{settings.subject_prefix}.>"], num_replicas=1)
        assert (await js.publish(f"{settings.subject_prefix}.x", b"ok")).seq == 1
    finally:
        await nc.close()


# -- a completed request's redelivered job --------------------------------------------------------
class FinishingHandler(Handler):
    """A generating worker without an engine: publishes the request's FinalResult, then (for the
    request ids in ``lose_ack``, first delivery) ends without acking, as a worker whose ack was lost
    in a failover; ``hold`` keeps jobs running until set."""

    service = Service.PREFILL
    role = Role.AGG
    job_type = GenerationJob
    queue = protocol.WorkQueue.GENERATE
    durable = protocol.CONSUMER_PREFILL
    jobs_metric = metrics.GENERATION_JOBS
    check: ClassVar[bool] = True

    def __init__(self, lose_ack: set[str], hold: asyncio.Event | None = None):
        self.lose_ack = lose_ack
        self.hold = hold
        self.runs: dict[str, int] = {}
        self.started = 0

    async def setup(self, ctx) -> None:
        self.ctx = ctx

    async def ended(self, job, records: RequestRecords) -> Ended | None:
        return await super().ended(job, records) if self.check else None

    async def handle(self, job: GenerationJob, delivery: Delivery) -> None:
        self.runs[job.request_id] = self.runs.get(job.request_id, 0) + 1
        self.started += 1
        if self.hold is not None:
            await self.hold.wait()
        await self.ctx.publisher.publish(
            self.ctx.subjects.tokens(job.request_id),
            _final(job.request_id),
            request_id=job.request_id,
            msg_id=protocol.final_result_msg_id(job.request_id),
        )
        if job.request_id in self.lose_ack and delivery.num_delivered == 1:
            raise asyncio.CancelledError  # no ack, no nak: redelivered after the ack wait


class UncheckedHandler(FinishingHandler):
    check = False


async def _finals(js, subjects: Subjects, rid: str) -> int:
    """The messages on ``rid``'s results subject. The ordered consumer is created through the
    elections a killed node leaves behind (its create request times out while the results stream
    has no leader: seen once in CI on a loaded machine)."""

    async def ordered_consumer():
        try:
            return await js.subscribe(subjects.tokens(rid), ordered_consumer=True)
        except Exception:  # noqa: BLE001 - nats raises several unrelated types while the stream has no leader
            return None

    n = 0
    sub = await until(ordered_consumer, 90, f"an ordered consumer on {rid}'s results", interval=0.2)
    try:
        while True:
            try:
                await sub.next_msg(timeout=0.5)
                n += 1
            except TimeoutError:
                return n
    finally:
        await sub.unsubscribe()


async def _run_jobs(cluster, handler_cls, *, n: int, lose: int, kill_leader: bool):
    prefix = _prefix()
    subjects = Subjects(prefix)
    settings = WorkerSettings(
        nats_url=cluster.seeds,
        subject_prefix=prefix,
        stream_replicas=3,
        stream_max_bytes=MAX_BYTES,
        ack_wait_s=ACK_WAIT_S,
        max_deliver=5,
        publish_retry_s=30,
    )
    rids = [f"{prefix}-r{i}" for i in range(n)]
    hold = asyncio.Event()
    handler = handler_cls(set(rids[:lose]), hold)
    runner = WorkerRunner(handler, settings, concurrency=n)
    running = asyncio.create_task(runner.run())
    nc = await connect(settings.nats, name="test-client")
    before = metrics.GENERATION_JOBS.labels(JobOutcome.ALREADY_DONE)._value.get()
    killed = None
    try:
        js = nc.jetstream(timeout=10)
        await until(lambda: _consumer_ready(js, subjects), 60, "the runner's topology")
        publisher = JetStreamPublisher(js, retry_s=30)
        for rid in rids:
            await publisher.publish(subjects.generate_jobs, _job(rid), request_id=rid, msg_id=rid)
        await until(lambda: handler.started >= n, 60, "every job running")
        if kill_leader:  # in flight: their final results and acks go through the election
            killed = await asyncio.to_thread(cluster.wait_stream_leader, subjects.stream_generate, 30)
            await asyncio.to_thread(cluster.kill, killed)
        hold.set()

        async def settled():
            info = await js.consumer_info(subjects.stream_generate, protocol.CONSUMER_PREFILL, timeout=2)
            return info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered >= 0

        await until(lambda: _quiet(settled), 90, "every job acked")
        finals = {rid: await _finals(js, subjects, rid) for rid in rids}
    finally:
        runner.request_stop()
        await asyncio.wait_for(running, 60)
        await nc.close()
    already_done = metrics.GENERATION_JOBS.labels(JobOutcome.ALREADY_DONE)._value.get() - before
    return handler, rids, finals, already_done, killed


async def _quiet(check):
    try:
        return await check()
    except Exception:  # noqa: BLE001 - no leader for a moment: ask again
        return False


async def _consumer_ready(js, subjects: Subjects) -> bool:
    """The runner created the job consumer and it has a leader (an R3 consumer elects one first)."""
    try:
        info = await js.consumer_info(subjects.stream_generate, protocol.CONSUMER_PREFILL, timeout=1)
    except Exception:  # noqa: BLE001 - not created yet
        return False
    return bool(info.cluster and info.cluster.leader)


async def test_a_redelivered_job_of_a_completed_request_is_acked_without_running(cluster):
    """Two of four jobs publish their FinalResult and lose their ack: JetStream redelivers them
    after the ack wait, and the worker acks them without running (one run, one final each).
    Negative control: without the completion check they run twice."""
    handler, rids, finals, already_done, _ = await _run_jobs(cluster, FinishingHandler, n=4, lose=2, kill_leader=False)
    assert handler.runs == {rid: 1 for rid in rids}
    assert finals == {rid: 1 for rid in rids}
    assert already_done == 2
    unchecked, rids, finals, _, _ = await _run_jobs(cluster, UncheckedHandler, n=4, lose=2, kill_leader=False)
    assert unchecked.runs == {rids[0]: 2, rids[1]: 2, rids[2]: 1, rids[3]: 1}
    assert finals == {rid: 1 for rid in rids}  # the repeat's final result is a duplicate: dropped


async def test_killing_the_generate_stream_leader_with_jobs_in_flight_runs_nothing_twice(cluster):
    """SIGKILL of the node leading the job stream while 12 jobs run (4 of them lose their ack):
    each request runs once and has one final result; the redeliveries are acked as already done."""
    handler, rids, finals, already_done, killed = await _run_jobs(
        cluster, FinishingHandler, n=12, lose=4, kill_leader=True
    )
    assert killed is not None and not cluster.nodes[killed].is_running()
    assert handler.runs == {rid: 1 for rid in rids}
    assert finals == {rid: 1 for rid in rids}
    assert already_done >= 4


class CountsReads(FinishingHandler):
    """Counts the request-record reads (``Handler.ended``: JetStream round trips)."""

    reads = 0

    async def ended(self, job, records: RequestRecords) -> Ended | None:
        self.reads += 1
        return await super().ended(job, records)


@pytest.mark.parametrize("trusted", [True, False])
async def test_a_cancelled_request_s_first_delivery_is_dropped_by_the_cancellations_heard(
    cluster, monkeypatch, trusted
):
    """The runner hears every cancellation on its core subscription: a job published after it
    started listening is checked against them, no JetStream read (``trusted``). Negative control
    (a clock skew allowance longer than the run): every job reads its records, with the same fate."""
    monkeypatch.setattr(cancellation, "CLOCK_SKEW_S", 0.0 if trusted else 3600.0)
    prefix = _prefix()
    subjects = Subjects(prefix)
    settings = WorkerSettings(
        nats_url=cluster.seeds, subject_prefix=prefix, stream_replicas=3, stream_max_bytes=MAX_BYTES, ack_wait_s=30
    )
    handler = CountsReads(set())
    runner = WorkerRunner(handler, settings, concurrency=4)
    running = asyncio.create_task(runner.run())
    nc = await connect(settings.nats, name="test-client")
    cancelled, live = f"{prefix}-cancelled", f"{prefix}-live"
    before = metrics.GENERATION_JOBS.labels(JobOutcome.CANCELLED)._value.get()
    try:
        js = nc.jetstream(timeout=10)
        await until(lambda: _consumer_ready(js, subjects), 60, "the runner's topology")
        publisher = JetStreamPublisher(js, retry_s=30)

        def heard(rid: str) -> bool | None:  # what the runner heard (None: not listening yet)
            records = runner._records
            return records.heard_cancelled(rid, time.time() + 7200) if records is not None else None

        await until(lambda: heard(cancelled) is not None, 60, "the runner to listen for cancellations")
        await publisher.publish(subjects.cancel(cancelled), cancel_record(cancelled, "test"), request_id=cancelled)
        await until(lambda: heard(cancelled), 60, "the runner to hear the cancellation")
        for rid in (cancelled, live):
            await publisher.publish(subjects.generate_jobs, _job(rid), request_id=rid, msg_id=rid)

        async def settled():
            info = await js.consumer_info(subjects.stream_generate, protocol.CONSUMER_PREFILL, timeout=2)
            return info.num_ack_pending == 0 and info.num_pending == 0 and info.delivered.stream_seq >= 2

        await until(lambda: _quiet(settled), 60, "both jobs acked")
    finally:
        runner.request_stop()
        await asyncio.wait_for(running, 60)
        await nc.close()
    assert handler.runs == {live: 1}  # the cancelled request's job never ran
    assert metrics.GENERATION_JOBS.labels(JobOutcome.CANCELLED)._value.get() == before + 1
    assert handler.reads == (0 if trusted else 2)


# -- publishing through an election ----------------------------------------------------------------
async def test_a_publish_during_a_leader_election_succeeds_within_its_deadline(cluster):
    prefix = _prefix()
    settings = _settings(cluster, prefix)
    subjects = Subjects(prefix)
    nc = await connect(settings, name="test-election")
    try:
        js = nc.jetstream(timeout=10)
        await ensure_topology(js, settings, subjects, nc=nc)
        leader = await asyncio.to_thread(cluster.wait_stream_leader, subjects.stream_generate, 30)
        if _node_of(cluster, nc) == leader:  # the election, not the reconnect, is under test here
            await nc.close()
            nc = await connect(
                NatsSettings(nats_url=cluster.url((leader + 1) % 3), subject_prefix=prefix), name="test-election"
            )
            js = nc.jetstream(timeout=10)
        await asyncio.to_thread(cluster.kill, leader)
        # control: a single try (no msg id) right after the kill fails - the stream has no leader
        once = JetStreamPublisher(js, timeout=0.5)
        with pytest.raises(ServiceUnavailable, match="publishing GenerationJob"):
            await once.publish(subjects.generate_jobs, _job(f"{prefix}-once"), request_id=f"{prefix}-once")
        retries = metrics.PUBLISH_RETRIES._value.get()
        publisher = JetStreamPublisher(js, try_s=0.5)
        t0 = time.monotonic()
        rid = f"{prefix}-r"
        fresh = await publisher.publish(
            subjects.generate_jobs, _job(rid), request_id=rid, msg_id=rid, deadline=time.time() + 30
        )
        took = time.monotonic() - t0
        assert fresh and metrics.PUBLISH_RETRIES._value.get() > retries  # it did wait out the election
        assert took < 30
        new = cluster.stream_leader(subjects.stream_generate)
        assert new is not None and new != leader
        print(f"publish through the election: {took:.2f}s")
    finally:
        await nc.close()


# -- a stalled server --------------------------------------------------------------------------
async def test_a_client_whose_server_stalls_moves_to_another_seed(cluster):
    prefix = _prefix()
    settings = _settings(cluster, prefix)  # the default pings: 2 s x 2
    subjects = Subjects(prefix)
    nc = await connect(settings, name="test-stall")
    # control: nats-py's default pings (2 minutes) stay on the stalled server
    lazy = await connect(settings, name="test-stall-lazy", ping_interval=120)
    stalled = -1
    try:
        js = nc.jetstream(timeout=10)
        await ensure_topology(js, settings, subjects, nc=nc)
        stalled = _node_of(cluster, nc)
        if _node_of(cluster, lazy) != stalled:
            await lazy.close()
            lazy = await connect(
                NatsSettings(nats_url=cluster.url(stalled), subject_prefix=prefix),
                name="test-stall-lazy",
                ping_interval=120,
            )
        t0 = time.monotonic()
        cluster.pause(stalled)
        publisher = JetStreamPublisher(js, try_s=1.0)
        rid = f"{prefix}-r"
        await publisher.publish(
            subjects.generate_jobs, _job(rid), request_id=rid, msg_id=rid, deadline=time.time() + 30
        )
        took = time.monotonic() - t0
        assert _node_of(cluster, nc) != stalled
        assert took < 15, took  # 2 s x (2 + 1) pings, a reconnect, maybe a stream election
        assert _node_of(cluster, lazy) == stalled and lazy.is_connected
        print(f"served again {took:.2f}s after the stall")
        # stopping (SIGTERM) with a stalled server: closed at once instead of a drain that never ends
        t1 = time.monotonic()
        await asyncio.wait_for(close_connection(lazy, timeout_s=30), 10)
        assert lazy.is_closed and time.monotonic() - t1 < 5
    finally:
        if stalled >= 0:
            cluster.resume(stalled)
        await nc.close()
        if not lazy.is_closed:
            await lazy.close()


async def test_the_subscription_confirm_answers_while_the_meta_leader_is_re_elected(cluster):
    meta = cluster.meta_leader()
    assert meta is not None
    other = (meta + 1) % 3
    nc = await nats.connect(cluster.url(other), connect_timeout=10)
    try:
        await nc.subscribe("confirm.test")
        await asyncio.to_thread(cluster.kill, meta)
        t0 = time.monotonic()
        assert await confirm_subscriptions(nc, what="confirm.test")
        took = time.monotonic() - t0
        # the election was on: the JetStream API (only the meta leader answers it) did not answer
        with pytest.raises(Exception):  # noqa: B017 - nats raises timeout or no-responders
            await asyncio.wait_for(nc.jetstream().account_info(), 0.5)
        assert took < 0.5, took
    finally:
        await nc.close()
