"""A dead worker's job comes back within the ack wait; a live one keeps its job (issue 41, item 2).

The ack wait (``EPD_ACK_WAIT_S``, 4 s by default) is how long JetStream waits after a job's last
sign of life before it redelivers it; a running job's worker sends ``in_progress`` 4 times per ack
wait from its event loop while the engine computes in its own thread. So: a SIGKILLed worker's
streamed request resumes about one ack wait after the kill (it paused ~30 s with the old default),
and with both cores busy and every job computing for longer than the ack wait, no live job is
redelivered (each request's final result comes from its first delivery, so ``max_deliver`` is
never used up). The stack runs with the default ack wait: nothing here sets it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shared.config import NatsSettings
from shared.protocol import FinalResult
from tests import fault_workers
from tests.stackutil import (
    GREEDY,
    chat_body,
    final_result,
    noise_image,
    start_stack,
    stream_chat,
    wait_for,
)

pytestmark = pytest.mark.slow

ACK_WAIT_S = NatsSettings.model_fields["ack_wait_s"].default
#: Beyond the ack wait, what a resumed stream needs on a loaded machine: the new worker prefills
#: again and regenerates the tokens already sent (the API drops their repeats) before a new one.
RESUME_SLACK_S = 5.0


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """E|PD with two prefill workers (a killed one's job goes to the other), the default ack wait;
    each decode step computes 30 ms more (in the engine's thread), so a request of 150 tokens
    computes for longer than the ack wait."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("failover-logs"),
        service_modules={"prefill": fault_workers.MODULE},
        service_env={"prefill": {fault_workers.DECODE_STEP_BUSY_ENV: "0.03"}},
    )
    try:
        running.stack.add("prefill", index=1)
        running.stack.wait_ready(timeout=300, roles={"encoder": 1, "prefill": 2})
        yield running
    finally:
        running.stack.stop()


def _body(seed: int, max_tokens: int) -> dict:
    return chat_body("Tell a long story.", [noise_image(seed, (48, 48))], **{**GREEDY, "max_tokens": max_tokens})


def _holder(stack, since: float):
    """The live prefill worker process running a job, as its heartbeat file written after ``since``
    (epoch) says (refreshed every 2 s; one request in flight on the stack, so one such worker)."""
    for proc in stack.stack.processes:
        if proc.name != "prefill" or not proc.alive():
            continue
        try:
            beat = json.loads(Path(proc.env["EPD_HEALTH_FILE"]).read_text())
        except (OSError, ValueError):
            continue
        if beat.get("pid") == proc.popen.pid and beat.get("written_at", 0) > since and beat.get("in_flight", 0) >= 1:
            return proc
    return None


def _timed_stream(stack, body: dict):
    t0 = time.monotonic()
    out = stream_chat(stack, body, timeout=600)
    return out, time.monotonic() - t0


def _since(path: Path, offset: int) -> list[str]:
    with path.open("rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace").splitlines()


def test_with_both_cores_busy_no_live_job_is_redelivered(stack):
    """Three CPU hogs on the 2 cores, four requests at once whose jobs each compute for longer than
    the ack wait: every worker's ``in_progress`` still arrives in time, so no job is redelivered
    (every worker says when it takes a redelivery; a live job redelivered runs twice, and its
    deliveries can run out) and every request completes from its first delivery."""
    logs = {p.log_path: p.log_path.stat().st_size for p in stack.stack.processes if p.name == "prefill"}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        bodies = [_body(2100 + i, 150) for i in range(4)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(bodies)) as pool:
            timed = list(pool.map(lambda b: _timed_stream(stack, b), bodies))
        took = time.monotonic() - t0
    finally:
        for hog in hogs:  # only what this test started
            hog.kill()
            hog.wait()
    streams = [s for s, _ in timed]
    assert all(s.done and not s.errors and len(s.token_ids) == 150 for s in streams), [s.errors for s in streams]
    # Each job was held past the ack wait (the case itself: else nothing waited on in_progress).
    assert min(t for _, t in timed) > ACK_WAIT_S, [round(t, 1) for _, t in timed]
    finals = [final_result(stack, s.events[-1]["id"]) for s in streams]
    attempts = [f.attempt for f in finals]
    assert attempts == [1] * len(finals), f"live jobs redelivered (attempts {attempts}) in {took:.1f}s"
    # (A redelivered job whose request a first attempt completed meanwhile is dropped: the workers
    # say when they take a redelivery.)
    said = [line for path, size in logs.items() for line in _since(path, size) if "job redelivered" in line]
    assert not said, f"live jobs redelivered in {took:.1f}s:\n" + "\n".join(said)


def test_a_killed_workers_request_resumes_within_the_ack_wait(stack):
    """SIGKILL of the prefill worker streaming a request: the other one takes the job about one ack
    wait after the kill (not the old default's 30 s), and the client's stream goes on with the
    tokens of an unkilled run."""
    body = _body(2200, 250)
    clean = stream_chat(stack, body, timeout=600)
    assert clean.done and len(clean.token_ids) == 250, clean.errors
    killed: list[float] = []
    arrived: list[float] = []
    victim_index: list[int] = []

    def on_event(event, stream):
        if event.get("choices") and event["choices"][0].get("token_ids"):
            arrived.append(time.monotonic())
        if not killed and len(stream.token_ids) >= 5:
            running_since = time.time()  # (the clean run's worker may still have an older beat saying busy)
            victim = wait_for(lambda: _holder(stack, running_since), 30, "the prefill worker holding the job")
            victim_index.append(victim.index)
            victim.stop(signal.SIGKILL)
            killed.append(time.monotonic())
            stack.stack.processes.remove(victim)  # (gone for good: the stack's readiness checks skip it)

    out = stream_chat(stack, body, timeout=600, on_event=on_event)
    assert killed, "the prefill worker was not killed"
    assert out.done and not out.errors and out.token_ids == clean.token_ids
    # Tokens sent before the kill may still arrive after it: the stream resumed where its longest
    # pause after the kill ended.
    edges = [killed[0], *(t for t in arrived if t > killed[0])]
    resumed = max((b - a, b) for a, b in zip(edges, edges[1:]))[1] - killed[0]
    final: FinalResult = final_result(stack, out.events[-1]["id"])
    assert final.attempt == 2, final.attempt  # a redelivery finished it
    taken = [p for p in stack.stack.processes if p.name == "prefill" and "job redelivered" in p.log_path.read_text()]
    assert taken, "no worker said it took a redelivered job"
    assert resumed <= ACK_WAIT_S + RESUME_SLACK_S, f"resumed {resumed:.1f}s after the kill (ack wait {ACK_WAIT_S}s)"
    # Two prefill workers again for whatever runs next.
    stack.stack.add("prefill", index=victim_index[0] + 10)  # (an index of its own: its worker id, heartbeat file)
    stack.stack.wait_ready(timeout=300, roles={"encoder": 1, "prefill": 2})
