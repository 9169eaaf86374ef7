"""Cache-aware routing end to end (``shared.routing``, ``services.api.routing``): real NATS, real
S3, an API with ``EPD_ROUTING=affinity`` and a second API on the same workers with
``EPD_ROUTING=shared`` (today's behaviour, the control), one encoder, two PD workers (tiny Qwen2-VL,
transformers engine, one engine slot each, decode steps slowed to 50 ms so a test can act while a
request runs).

The tests share the stack and run in file order: the fault tests (SIGSTOP, SIGKILL) come last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import pytest

from shared import protocol
from shared.protocol import ECSource, FinalResult, GenerationJob, RouteReason, WorkerHeartbeat
from shared.tools.infra import free_port
from shared.tools.launcher import start_service, topology_env
from tests import fault_workers
from tests.stackutil import (
    GREEDY,
    chat_body,
    data_url,
    metric_value,
    noise_image,
    scrape,
    start_stack,
    stream_chat,
    stream_tokens,
    user_message,
    wait_for,
)

pytestmark = pytest.mark.slow

TAKEOVER_S = 5.0
TEXT = "Describe the image."


class Stack:
    """The running stack and the control API."""

    def __init__(self, running, shared_url: str):
        self.running = running
        self.shared_url = shared_url

    @property
    def workers(self):
        return [p for p in self.running.stack.processes if p.name == "prefill" and p.alive()]

    def worker_id(self, proc) -> str:
        return self.running.stack.worker_id("prefill", proc.index)

    def chat(self, images, *, shared: bool = False, text: str = TEXT, **params) -> dict:
        url = self.shared_url if shared else self.running.url
        body = {
            "model": "qwen2-vl-tiny",
            "messages": [user_message(text, [data_url(im) for im in images])],
            **{**GREEDY, "max_tokens": 4, **params},
        }
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def finals(self, request_id: str) -> list[FinalResult]:
        return self.running.messages_of("stream_results", FinalResult, request_id)

    def final(self, request_id: str) -> FinalResult:
        found = wait_for(lambda: self.finals(request_id), 60, f"the final result of {request_id}")
        assert len(found) == 1, found
        return found[0]

    def jobs(self, request_id: str) -> list[tuple[str, GenerationJob]]:
        """The request's generation jobs on record: (subject, job), in order."""
        return [
            (subject, m)
            for subject, _, m in self.running.stream_messages("stream_generate")
            if isinstance(m, GenerationJob) and m.request_id == request_id
        ]


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("routing-logs")
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        log_dir,
        services=["api", "encoder"],
        roles={"encoder": 1},
        service_modules={"prefill": fault_workers.MODULE},
        service_env={"prefill": {fault_workers.DECODE_STEP_DELAY_ENV: "0.05"}},
        EPD_ROUTING="affinity",
        EPD_ROUTING_AFFINITY_WEIGHT="3",  # a full holder would still win on score: only the capacity check skips it
        EPD_ROUTING_TAKEOVER_S=str(TAKEOVER_S),
        EPD_ROUTING_AFFINITY_TIMEOUT_S="2",
        EPD_MAX_CONCURRENT_JOBS="1",
        EPD_ACK_WAIT_S="6",
        EPD_MAX_IMAGE_BYTES=str(512 * 1024),
    )
    shared_api = None
    try:
        for i in range(2):
            running.stack.add("prefill", index=i)
        port = free_port()
        env = {
            **running.env,
            **topology_env(running.stack.topology),
            "EPD_PORT": str(port),
            "EPD_ROUTING": "shared",
            "EPD_WORKER_ID": f"api-shared-{os.getpid()}",
        }
        shared_api = start_service("api", env, log_dir / "api-shared.log")
        running.stack.wait_ready(timeout=300, roles={"encoder": 1, "prefill": 2})
        shared_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _workers(shared_url) >= 2, 120, "the shared-queue API to see both workers")
        yield Stack(running, shared_url)
    finally:
        if shared_api is not None:
            shared_api.stop()
        running.stack.stop()


def _workers(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).json().get("workers", {}).get("prefill", 0)
    except (httpx.HTTPError, ValueError):
        return 0


def _local_hits(stack: Stack, request_ids: list[str]) -> float:
    """The fraction of ``request_ids`` whose image came from their worker's local feature cache."""
    sources = [next(iter(stack.final(rid).ec_sources.values())) for rid in request_ids]
    return sum(s == ECSource.LOCAL_CACHE for s in sources) / len(sources)


def _repeat_workload(stack: Stack, images, *, shared: bool, rounds: int = 3) -> list[str]:
    """Each image asked ``rounds`` times, round by round; the request ids of the repeats."""
    repeats = []
    for r in range(rounds):
        for img in images:
            rid = stack.chat([img], shared=shared)["id"]
            if r:
                repeats.append(rid)
    return repeats


def test_repeated_images_go_to_the_worker_that_holds_them(stack: Stack) -> None:
    before = scrape(f"{stack.running.url}/metrics")
    # five images a round: an odd number, so that a shared queue alternating between the two
    # workers does not send each image to the same worker every round by chance
    images = [noise_image(100 + i, (56, 56)) for i in range(5)]
    repeats = _repeat_workload(stack, images, shared=False)
    ratio = _local_hits(stack, repeats)
    seen = [(stack.jobs(rid)[-1][1].route_reason, stack.final(rid).ec_sources) for rid in repeats]
    assert ratio >= 0.9, f"local hit ratio with affinity routing: {ratio:.2f}: {seen}"
    for rid in repeats:
        ((subject, job),) = stack.jobs(rid)
        assert job.route_reason == RouteReason.AFFINITY, job.route_detail
        assert subject == stack.running.subjects.generate_routed(job.routed_to)
        assert stack.final(rid).worker == job.routed_to
    after = scrape(f"{stack.running.url}/metrics")
    affinity = metric_value(after, "epd:routing_decisions_total", reason="affinity") - metric_value(
        before, "epd:routing_decisions_total", reason="affinity"
    )
    assert affinity == len(repeats)

    # the control: the same workload on the shared queue lands on the other worker about half the time
    control = [noise_image(200 + i, (56, 56)) for i in range(5)]
    shared_ratio = _local_hits(stack, _repeat_workload(stack, control, shared=True))
    assert shared_ratio <= 0.7, f"local hit ratio on the shared queue: {shared_ratio:.2f}"

    # the timeline says where the job went and why
    rid = repeats[-1]
    page = httpx.get(f"{stack.running.url}/debug/requests/{rid}?format=json", timeout=30).json()
    queued = [s for s in page["timeline"]["stages"] if s["name"] == "generation queued"]
    assert f"routed to {stack.final(rid).worker} (affinity" in queued[0]["detail"], queued


def test_outputs_equal_the_shared_queue_token_for_token(stack: Stack) -> None:
    img, other = noise_image(300, (64, 48)), noise_image(301, (64, 48))
    stack.chat([img])  # now held: the next one is routed by affinity
    routed = stack.chat([img], max_tokens=12)
    shared = stack.chat([img], shared=True, max_tokens=12)
    assert stack.jobs(routed["id"])[0][1].route_reason == RouteReason.AFFINITY
    assert routed["choices"][0]["token_ids"] == shared["choices"][0]["token_ids"]
    # negative control: another image changes the tokens, so the equality above can fail
    assert stack.chat([other], max_tokens=12)["choices"][0]["token_ids"] != routed["choices"][0]["token_ids"]


async def _heartbeat_where(nats_url: str, subject: str, predicate, timeout: float) -> WorkerHeartbeat:
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(subject)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            hb = protocol.decode(msg.data, WorkerHeartbeat)
            if predicate(hb):
                return hb
        raise AssertionError("no such heartbeat in time")
    finally:
        await nc.close()


def _holder(stack: Stack, img) -> str:
    """Make ``img`` held by some worker; returns that worker's id."""
    return stack.final(stack.chat([img])["id"]).worker


def _long_request(stack: Stack, img, *, max_tokens: int = 100):
    """Start a streaming request in a thread; returns (future, the request id once known)."""
    started: dict = {}
    pool = ThreadPoolExecutor(1)

    def on_event(event, _stream):
        started.setdefault("id", event.get("id"))

    body = chat_body(TEXT, [img], **{**GREEDY, "max_tokens": max_tokens, "stream": True})
    future = pool.submit(stream_chat, stack.running, body, timeout=120, on_event=on_event)
    pool.shutdown(wait=False)
    return future, started


def test_a_worker_at_capacity_is_skipped(stack: Stack) -> None:
    img = noise_image(400, (56, 56))
    holder = _holder(stack, img)
    future, started = _long_request(stack, img)  # routed to the holder, holds its only slot
    wait_for(lambda: started.get("id"), 60, "the long request's first token")
    for beat in (
        lambda hb: hb.worker_id == holder and hb.free_slots == 0,
        # and the other worker free in a beat since: the API's view of it may still be a beat sent
        # while it ran a job of the shared-queue API (up to HEARTBEAT_INTERVAL_S old), and with
        # every worker seen full the job goes to the shared queue, where the holder's outstanding
        # pull may take it (seen in CI: the job waited out the long request on the holder)
        lambda hb: hb.worker_id != holder and hb.free_slots > 0,
    ):
        asyncio.run(_heartbeat_where(stack.running.nats_url, stack.running.subjects.heartbeat("prefill"), beat, 30))
    body = stack.chat([img])
    jobs = [job for _, job in stack.jobs(body["id"])]
    job = jobs[0]
    assert (job.routed_to, job.route_reason) != (holder, RouteReason.AFFINITY), "routed to the full holder"
    assert job.route_reason == RouteReason.LOAD and len(jobs) == 1, [(j.routed_to, j.route_detail) for j in jobs]
    assert job.routed_to != holder and stack.final(body["id"]).worker == job.routed_to
    assert future.result(timeout=120).done
    assert stack.jobs(started["id"])[0][1].routed_to == holder


def test_uniform_load_stays_even(stack: Stack) -> None:
    """A uniform workload - distinct images (the shared queue, as before routing), then each image
    again (routed by affinity, or by load while its holder is busy), two requests at a time on two
    one-slot workers: the jobs per worker stay even."""
    images = [noise_image(700 + i, (56, 56)) for i in range(12)]
    with ThreadPoolExecutor(2) as pool:
        ids = list(pool.map(lambda im: stack.chat([im])["id"], images))
        ids += list(pool.map(lambda im: stack.chat([im])["id"], images))
    per_worker = Counter(stack.final(rid).worker for rid in ids)
    reasons = Counter(job.route_reason for rid in ids for _, job in stack.jobs(rid))
    assert len(per_worker) == 2 and max(per_worker.values()) / min(per_worker.values()) < 1.5, (per_worker, reasons)
    assert reasons[RouteReason.AFFINITY] + reasons[RouteReason.LOAD] >= len(images) - 2, reasons  # the repeats routed


def _fault_case(stack: Stack, sig: int, seed: int):
    """A routed request whose worker gets ``sig`` once it streams: (the victim process, its id,
    the request id, the tokens the client got, the reference tokens from the shared queue)."""
    img = noise_image(seed, (56, 56))
    stack.chat([img])  # held by a worker now: the next request is routed to it
    hit: list = []

    def on_event(event, stream):
        assert "error" not in event, event
        if not hit and len(stream.token_ids) >= 2:
            ((_, job),) = stack.jobs(event["id"])
            (victim,) = [p for p in stack.workers if stack.worker_id(p) == job.routed_to]
            if sig == signal.SIGKILL:
                os.killpg(victim.popen.pid, sig)
            else:
                victim.popen.send_signal(sig)
            hit.append((victim, job.routed_to, event["id"]))

    body = chat_body(TEXT, [img], **{**GREEDY, "max_tokens": 40, "stream": True})
    out = stream_chat(stack.running, body, timeout=120, on_event=on_event)
    assert out.done and hit
    victim, victim_id, rid = hit[0]
    reference = stack.chat([img], shared=True, max_tokens=40)["choices"][0]["token_ids"]
    return victim, victim_id, rid, out.token_ids, reference


def _routed_settled(stack: Stack, worker_id: str) -> bool:
    """Whether ``worker_id``'s routed consumer holds no unacked job."""

    async def main():
        nc = await nats.connect(stack.running.nats_url)
        try:
            subjects = stack.running.subjects
            info = await nc.jetstream().consumer_info(subjects.stream_generate, subjects.routed_consumer(worker_id))
            return info.num_ack_pending == 0 and info.num_pending == 0
        finally:
            await nc.close()

    return asyncio.run(main())


def _assert_taken_over(stack: Stack, rid: str, victim_id: str) -> FinalResult:
    jobs = stack.jobs(rid)
    assert [(j.routed_to, j.route_reason) for _, j in jobs] == [
        (victim_id, RouteReason.AFFINITY),
        ("", RouteReason.FALLBACK),
    ], jobs
    assert "gone after claiming" in jobs[1][1].route_detail
    final = stack.final(rid)
    assert final.worker != victim_id
    return final


def test_a_stopped_routed_worker_job_completes_elsewhere_once(stack: Stack) -> None:
    victim, victim_id, rid, tokens, reference = _fault_case(stack, signal.SIGSTOP, 500)
    try:
        assert tokens == reference
        _assert_taken_over(stack, rid, victim_id)
    finally:
        victim.popen.send_signal(signal.SIGCONT)
    # back, the victim finishes its generation, finds its claim taken over and sends no result (a copy
    # JetStream redelivered to it meanwhile - it was stopped longer than the ack wait - loses the claim)
    dropped = "routed job taken over by another worker: dropped"
    wait_for(
        lambda: dropped in victim.log_path.read_text() or len(stack.finals(rid)) > 1, 60, "the victim to drop its run"
    )
    wait_for(lambda: _routed_settled(stack, victim_id), 60, "the victim to ack its routed job")
    assert len(stack.finals(rid)) == 1, [(f.worker, f.attempt) for f in stack.finals(rid)]
    chunks = stack.running.messages_of("stream_results", protocol.TokenChunk, rid)
    assert stream_tokens(chunks, stack.finals(rid)[0]) == reference


def test_a_killed_routed_worker_job_completes_elsewhere_once(stack: Stack) -> None:
    victim, victim_id, rid, tokens, reference = _fault_case(stack, signal.SIGKILL, 600)
    assert tokens == reference
    _assert_taken_over(stack, rid, victim_id)
    # restarted under the same id, the worker gets its unacked routed job again and drops it
    victim.popen.wait(timeout=30)
    logged = victim.log_path.stat().st_size
    again = stack.running.stack.add("prefill", index=victim.index)
    wait_for(
        lambda: "routed job claimed by @takeover" in again.log_path.read_text()[logged:],
        120,
        "the redelivered job dropped",
    )
    assert len(stack.finals(rid)) == 1
