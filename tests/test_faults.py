"""The fault suite (issue 12): real nats-server and SeaweedFS processes that a test pauses, kills and
restarts under a running E|P|D stack of real service processes (tiny Qwen2-VL), supervised the
way ``epd up`` supervises its children (``shared.tools.launcher.Supervisor``), plus ``epd up``
itself through a NATS pause.

Every case checks the fault contract (docs/operations.md, "Faults and recovery"):

* a request sent during or after the fault completes with the tokens of a clean run (greedy,
  the in-process aggregated reference) or ends with a JSON 503 naming NATS / the store, or a 504
  at its deadline - never a hang (every client call is bounded), never wrong tokens, never
  another status;
* within 30 s after the fault ends (the issue's number) a new request succeeds: probes are sent
  every 2 s from the fault's end, and one sent within 30 s must succeed;
* a worker's heartbeat file (what ``epd healthcheck --role`` reads) goes red while the worker
  cannot pull - asserted for a 15 s stall, a NATS kill and a worker kill; a 5 s pause is too short
  to show it - and every heartbeat file and the API's ``/health`` are green again after.

Measured times are logged (``FAULT ...`` lines) and, with ``EPD_FAULT_REPORT=FILE``, appended to
FILE as JSON lines: the table in docs/operations.md holds them.

The stack is shared by the cases (module scope) and its servers are the module's own (not the
session's, which other tests use); a case first makes sure it serves (rebuilding it when an
earlier case left it broken, saying so), so each case's verdict is its own.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import httpx
import pytest

from shared.protocol import FinalResult, TokenChunk
from shared.store.format import MissReason
from shared.tools.infra import EmbeddedNats, EmbeddedS3, free_port, free_port_block
from shared.tools.launcher import Stack, StackError
from tests import faultutil
from tests.epdup import EpdUp
from tests.faultutil import (
    HealthMonitor,
    Outcome,
    Requests,
    SupervisorThread,
    contract_violation,
    health_sample,
    post_chat,
    probe_recovery,
)
from tests.stackutil import (
    GREEDY,
    RunningStack,
    busy_work_consumers,
    chat_body,
    engine_encode,
    engine_messages,
    engine_tokens,
    metric_value,
    noise_image,
    parse_sse,
    scrape,
    stack_env,
    wait_for,
)

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

#: The stack's request deadline: long enough for a tiny request on a loaded machine, short
#: enough that a request stuck in an outage ends (504) within the case.
REQUEST_TIMEOUT_S = 60
#: A client call that has no answer after this long hung (the deadline plus ample slack).
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 60
#: The issue's recovery bound: a request succeeds within this long after a fault ends.
RECOVERY_S = 30
#: A redelivered job comes back after the ack wait: short, so a killed worker's job returns soon.
ACK_WAIT_S = 10

TEXT = "Describe this image."
IMAGE = noise_image(1201, (64, 64))
TEXT_ONLY = "Count the colours of the rainbow."
_fresh_seeds = count(1300)


def _record(case: str, **figures) -> None:
    line = {"case": case, **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in figures.items()}}
    log.warning("FAULT %s", json.dumps(line))
    report = os.environ.get("EPD_FAULT_REPORT")
    if report:
        with open(report, "a") as fh:
            fh.write(json.dumps(line) + "\n")


# -- the clean run ---------------------------------------------------------------------------------
@dataclass
class Reference:
    """Greedy tokens of a clean run: the aggregated reference engine in this process (the e2e
    tests hold every topology to it), computed in the test's main thread only."""

    engine: object
    cache: dict = field(default_factory=dict)

    def tokens(self, text: str, image, max_tokens: int = GREEDY["max_tokens"]) -> list[int]:
        from shared.engines.base import SamplingParams

        key = (text, None if image is None else image.tobytes(), max_tokens)
        if key not in self.cache:
            images = [] if image is None else [image]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self.cache[key] = engine_tokens(
                self.engine,
                engine_messages(text, len(images)),
                engine_encode(self.engine, images) if images else [],
                params,
            )
        return self.cache[key]

    def request(self, text: str, image, **params) -> tuple[dict, list[int]]:
        """A greedy chat body and its clean-run tokens."""
        params = {**GREEDY, **params}
        body = chat_body(text, [] if image is None else [image], **params)
        return body, self.tokens(text, image, params["max_tokens"])


# -- the rig: own servers, an E|P|D stack, a supervisor --------------------------------------------
@dataclass
class Rig:
    tmp: Path
    nats: EmbeddedNats
    s3: EmbeddedS3
    model_dir: Path
    ref: Reference
    fault_dir: Path
    running: RunningStack | None = None
    supervisor: SupervisorThread | None = None
    generation: int = 0

    # -- lifecycle
    def start_stack(self, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            try:
                return self._start_stack()
            except StackError as exc:
                # A worker's /metrics port (picked free a moment before) was taken meanwhile.
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise
                log.warning("fault rig: a port was taken, starting the stack again: %s", str(exc)[-300:])

    def _start_stack(self) -> None:
        self.generation += 1
        env, prefix, namespace, bucket = stack_env(
            self.nats,
            self.s3,
            self.model_dir,
            EPD_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
            EPD_ACK_WAIT_S=str(ACK_WAIT_S),
            # the encoder faults need the encoder to hold its jobs: the prefill worker steals none
            # (a killed stealer is tests/test_encode_steal.py's case)
            EPD_ENCODE_STEALS="0",
            **{faultutil.FAULT_DIR_ENV: str(self.fault_dir)},
        )
        api_port = free_port()
        stack = Stack(
            env=env,
            log_dir=self.tmp / f"logs-{self.generation}",
            topology="e-p-d",
            api_port=api_port,
            service_modules={s: faultutil.MODULE for s in ("encoder", "prefill", "decode")},
            metrics_port_base=free_port_block(4, exclude=[api_port, self.nats.port, self.s3.port]),
        )
        self.running = RunningStack(
            stack, self.nats.url, prefix, namespace, bucket, env, request_timeout_s=REQUEST_TIMEOUT_S
        )
        try:
            stack.start()
            stack.wait_ready(timeout=300)
        except BaseException:
            stack.stop()
            raise
        self.supervisor = SupervisorThread(stack)
        log.info("fault rig stack %d ready (logs %s)", self.generation, stack.log_dir)

    def stop_stack(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.running is not None:
            self.running.stack.stop()

    def switch(self, service: str, delay: float | None) -> None:
        """Turn a worker-side fault switch on (``delay`` seconds) or off (None)."""
        path = self.fault_dir / f"{service}.delay"
        if delay is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(str(delay))

    def switches_off(self) -> None:
        for service in ("encoder", "prefill", "decode"):
            self.switch(service, None)

    # -- views
    @property
    def url(self) -> str:
        return self.running.url

    @property
    def stack(self) -> Stack:
        return self.running.stack

    def process(self, label: str):
        [proc] = [p for p in self.stack.processes if p.label == label]
        return proc

    def health_files(self) -> dict[str, tuple[Path, str]]:
        return {p.label: (Path(p.env["EPD_HEALTH_FILE"]), p.name) for p in self.stack.processes if p.name != "api"}

    def all_healthy(self) -> bool:
        s = health_sample(self.url, self.health_files())
        roles = {role for _, role in self.health_files().values()}
        return all(s.workers.values()) and s.api_status == 200 and all(s.api_workers.get(r, 0) >= 1 for r in roles)

    def logs(self) -> str:
        return str(self.stack.log_dir)

    def log_grep(self, label: str, needle: str) -> list[str]:
        return [
            line for line in self.process(label).log_path.read_text(errors="replace").splitlines() if needle in line
        ]

    def ensure_serving(self) -> None:
        """Before a case: the stack serves a clean request, every worker healthy. If an earlier case
        left it broken, say so and rebuild it (servers included), so this case judges only itself."""
        self.switches_off()
        body, expected = self.ref.request(TEXT, IMAGE)

        def serving():
            if not self.all_healthy():
                return False
            out = post_chat(self.url, body, what="precondition", timeout=CLIENT_TIMEOUT_S)
            return out.status == 200 and out.tokens == expected

        try:
            wait_for(serving, 90, "the stack to serve before the fault", interval=1)
            return
        except AssertionError:
            log.error("FAULT the stack left by an earlier case does not serve (logs %s); rebuilding it", self.logs())
        self.stop_stack()
        for server in (self.nats, self.s3):
            if not server.is_running():
                server.start()
        self.start_stack()
        wait_for(serving, 120, "the rebuilt stack to serve", interval=1)


@pytest.fixture(scope="module")
def reference(reference_engine) -> Reference:
    return Reference(reference_engine)


@pytest.fixture(scope="module")
def rig(tiny_model_dir, reference, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    # Fixed ports: the services reconnect to the same URLs when a server comes back.
    nats = EmbeddedNats(tmp / "nats", port=free_port(), monitor_port=free_port())
    s3 = EmbeddedS3(
        tmp / "s3", port=free_port(), access_key="fault" + secrets.token_hex(4), secret_key=secrets.token_urlsafe(24)
    )
    fault_dir = tmp / "switches"
    fault_dir.mkdir()
    rig = Rig(tmp, nats, s3, tiny_model_dir, reference, fault_dir)
    try:
        nats.start()
        s3.start()
        rig.start_stack()
        # The clean run itself: the stack gives the reference's tokens (image and text-only).
        for text, image in ((TEXT, IMAGE), (TEXT_ONLY, None)):
            body, expected = reference.request(text, image)
            out = post_chat(rig.url, body, what="clean run", timeout=CLIENT_TIMEOUT_S)
            assert out.status == 200 and out.tokens == expected, out.describe(out.started)
        yield rig
    finally:
        rig.switches_off()
        rig.stop_stack()
        s3.stop()
        nats.stop()
        log.info("fault rig logs: %s", tmp)


# -- one infrastructure fault, judged ---------------------------------------------------------------
@dataclass
class Verdict:
    case: str
    origin: float
    fault: tuple[float, float] = (0.0, 0.0)
    during: list[tuple[Outcome, list[int]]] = field(default_factory=list)
    probes: list[Outcome] = field(default_factory=list)
    recovered: Outcome | None = None
    healthy_again_s: float | None = None
    problems: list[str] = field(default_factory=list)

    def judge_contract(self, expected_of: dict[str, list[int]]) -> None:
        for outcome, expected in self.during + [(p, expected_of[p.what]) for p in self.probes]:
            why = contract_violation(outcome, expected)
            if why is None and outcome.status == 504 and outcome.seconds < REQUEST_TIMEOUT_S - 1:
                why = (
                    f"504 after {outcome.seconds:.1f}s, before the {REQUEST_TIMEOUT_S}s deadline: an outage "
                    f"answered as a deadline (503 expected)"
                )
            if why is None and outcome.status == 503:
                message = outcome.body["error"]["message"]
                if not any(word in message.lower() for word in ("nats", "store", "s3")):
                    why = f"503 that names neither NATS nor the store: {message!r}"
            if why:
                self.problems.append(f"{outcome.describe(self.origin)}: {why}")

    def report(self, monitor: HealthMonitor | None, logs: str) -> str:
        lines = [f"case {self.case}: fault {self.fault[0] - self.origin:+.1f}s .. {self.fault[1] - self.origin:+.1f}s"]
        lines += [o.describe(self.origin) for o, _ in self.during]
        lines += [o.describe(self.origin) for o in self.probes]
        if monitor is not None:
            lines.append("health:\n" + monitor.summary(self.origin))
        lines.append(f"service logs: {logs}")
        return "\n".join(lines)


def run_fault(rig: Rig, case: str, fault, *, expect_unhealthy: bool, probe=None) -> Verdict:
    """Run ``fault(verdict, during)`` (returns the fault's monotonic (start, end); calls
    ``during()`` once the fault is on, to send requests into it), then probe recovery and judge.
    ``probe()`` gives each recovery probe's (body, clean tokens); default: the image request."""
    rig.ensure_serving()
    files = rig.health_files()
    monitor = HealthMonitor(rig.url, files)
    requests = Requests(rig.url, CLIENT_TIMEOUT_S)
    verdict = Verdict(case, time.monotonic())
    image_body, image_tokens = rig.ref.request(TEXT, IMAGE)
    text_body, text_tokens = rig.ref.request(TEXT_ONLY, None)
    sent = count(1)

    def during():
        n = next(sent)
        requests.send(f"image request {n} (during)", image_body, image_tokens)
        requests.send(f"text request {n} (during)", text_body, text_tokens)

    expected_of: dict[str, list[int]] = {}
    try:
        verdict.fault = fault(verdict, during)
        end = verdict.fault[1]
        during()  # and right after it ends
        verdict.recovered, verdict.probes = probe_recovery(
            rig.url,
            probe or (lambda: (image_body, image_tokens)),
            since=end,
            bound=RECOVERY_S,
            timeout=CLIENT_TIMEOUT_S,
            expected_of=expected_of,
        )
        try:
            wait_for(rig.all_healthy, 120, "every worker healthy again", interval=0.5)
            verdict.healthy_again_s = time.monotonic() - end
        except AssertionError as exc:
            verdict.problems.append(f"health: {exc}")
        verdict.during = requests.outcomes()
    finally:
        monitor.stop()
        requests.close()

    verdict.judge_contract(expected_of)
    start, end = verdict.fault
    if verdict.recovered is None:
        verdict.problems.append(f"no request sent within {RECOVERY_S}s after the fault ended succeeded")
        green = [
            s
            for s in monitor.between(end, verdict.probes[-1].ended if verdict.probes else end)
            if all(s.workers.values())
        ]
        if green:
            verdict.problems.append(
                f"health said every worker was healthy {green[-1].at - end:.1f}s after the fault "
                f"while no request succeeded"
            )
    red = {label: monitor.first_unhealthy(label, start, end + 1.0) for label in files}
    if expect_unhealthy:
        for label, sample in red.items():
            if sample is None:
                verdict.problems.append(f"{label} never reported unhealthy during the fault (it could not pull)")
    _record(
        case,
        fault_s=end - start,
        unhealthy_after_s={label: None if s is None else round(s.at - start, 1) for label, s in red.items()},
        recovery_s=None if verdict.recovered is None else verdict.recovered.ended - end,
        healthy_again_s=verdict.healthy_again_s,
        during=[(o.status, round(o.seconds, 1)) for o, _ in verdict.during],
        probes=[(o.status, round(o.started - end, 1), round(o.seconds, 1)) for o in verdict.probes],
        ok=not verdict.problems,
    )
    report = verdict.report(monitor, rig.logs())
    log.info("%s", report)
    assert not verdict.problems, "\n".join(verdict.problems) + "\n\n" + report
    return verdict


def _pause(pid: int, seconds: float, during) -> tuple[float, float]:
    """SIGSTOP a server's process group for ``seconds`` (the fault itself), sending requests into it
    at its start and half-way."""
    sent_mid = []

    def tick(elapsed: float) -> None:
        if not sent_mid and elapsed >= 0.3:
            during()
            sent_mid.append(1)
        elif len(sent_mid) == 1 and elapsed >= seconds / 2:
            during()
            sent_mid.append(2)

    start = time.monotonic()
    os.killpg(pid, signal.SIGSTOP)
    try:
        while (left := start + seconds - time.monotonic()) > 0:
            tick(time.monotonic() - start)
            time.sleep(min(0.2, left))
    finally:
        os.killpg(pid, signal.SIGCONT)
    return start, time.monotonic()


# -- epd up through a NATS pause (the done-when) --------------------------------------------
def test_epd_up_serves_within_30s_after_a_5s_nats_pause(tiny_model_dir, reference, tmp_path):
    # (a deadline of its own, as for the rig: a request stuck in the outage ends within the case)
    up = EpdUp(tmp_path, "--model", str(tiny_model_dir), env={"EPD_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)})
    try:
        up.wait_ready()
        body, expected = reference.request(TEXT, IMAGE)
        before = post_chat(up.url, body, what="before", timeout=CLIENT_TIMEOUT_S)
        assert before.status == 200 and before.tokens == expected, before.describe(before.started)
        [nats] = [p.pid for p in up.children() if "nats-server" in p.cmdline]
        verdict = Verdict("epd_up_nats_sigstop_5s", time.monotonic())
        requests = Requests(up.url, CLIENT_TIMEOUT_S)
        monitor = HealthMonitor(up.url, up.health_files())
        expected_of: dict[str, list[int]] = {}
        try:
            verdict.fault = _pause(nats, 5.0, lambda: requests.send("image request (during)", body, expected))
            end = verdict.fault[1]
            verdict.recovered, verdict.probes = probe_recovery(
                up.url,
                lambda: (body, expected),
                since=end,
                bound=RECOVERY_S,
                timeout=CLIENT_TIMEOUT_S,
                expected_of=expected_of,
            )
            verdict.during = requests.outcomes()
            try:
                wait_for(
                    lambda: all(health_sample(up.url, up.health_files()).workers.values()),
                    120,
                    "every worker healthy again",
                    interval=0.5,
                )
                verdict.healthy_again_s = time.monotonic() - end
            except AssertionError as exc:
                verdict.problems.append(f"health: {exc}")
        finally:
            monitor.stop()
            requests.close()
        for outcome, want in verdict.during + [(p, expected) for p in verdict.probes]:
            why = contract_violation(outcome, want)
            if why:
                verdict.problems.append(f"{outcome.describe(verdict.origin)}: {why}")
        if verdict.recovered is None:
            verdict.problems.append(f"no request sent within {RECOVERY_S}s after the pause succeeded")
        assert up.proc.poll() is None, f"epd up exited ({up.proc.returncode}):\n{up.output()[-3000:]}"
        _record(
            verdict.case,
            fault_s=verdict.fault[1] - verdict.fault[0],
            recovery_s=None if verdict.recovered is None else verdict.recovered.ended - end,
            healthy_again_s=verdict.healthy_again_s,
            during=[(o.status, round(o.seconds, 1)) for o, _ in verdict.during],
            probes=[(o.status, round(o.started - end, 1), round(o.seconds, 1)) for o in verdict.probes],
            ok=not verdict.problems,
        )
        report = verdict.report(monitor, str(up.data_dir / "logs")) + "\nepd up output:\n" + up.output()[-2000:]
        log.info("%s", report)
        assert not verdict.problems, "\n".join(verdict.problems) + "\n\n" + report
    finally:
        up.close()


# -- NATS ------------------------------------------------------------------------------------------
def test_nats_sigstop_5s(rig):
    """A 5 s stall: too short for a heartbeat file to go stale (10 s), so health is not asserted
    red during it; what matters is that the workers pull again after it."""
    run_fault(rig, "nats_sigstop_5s", lambda v, during: _pause(rig.nats.pid, 5.0, during), expect_unhealthy=False)


def test_nats_sigstop_15s(rig):
    run_fault(rig, "nats_sigstop_15s", lambda v, during: _pause(rig.nats.pid, 15.0, during), expect_unhealthy=True)


def test_nats_sigkill_and_restart_on_the_same_store(rig):
    """nats-server killed; it stays down until every worker reports unhealthy (bounded), then
    starts again on the same ports and JetStream store directory."""

    def fault(verdict, during):
        files = rig.health_files()
        start = time.monotonic()
        os.killpg(rig.nats.pid, signal.SIGKILL)
        during()
        try:
            wait_for(
                lambda: not any(health_sample(rig.url, files).workers.values()),
                60,
                "every worker to report unhealthy while NATS is down",
                interval=0.5,
            )
        except AssertionError as exc:
            verdict.problems.append(str(exc))
        during()
        rig.nats.start()
        return start, time.monotonic()

    run_fault(rig, "nats_sigkill_restart", fault, expect_unhealthy=True)


# -- S3 --------------------------------------------------------------------------------------------
def test_s3_sigstop_10s(rig):
    """The store stalls: workers can still pull (health is not asserted red), requests that need
    the store wait or end 503 / 504."""
    run_fault(rig, "s3_sigstop_10s", lambda v, during: _pause(rig.s3.pid, 10.0, during), expect_unhealthy=False)


def test_s3_killed_and_restarted(rig):
    """The store is killed, down 10 s (the fault), and started again on the same port and data."""

    def fault(verdict, during):
        start = time.monotonic()
        os.killpg(rig.s3.pid, signal.SIGKILL)
        during()
        while time.monotonic() - start < 10.0:  # the outage itself
            time.sleep(0.2)
        during()
        rig.s3.start()
        return start, time.monotonic()

    # Fresh images: a request whose features are in the store already needs the store less.
    def probe():
        return rig.ref.request(TEXT, noise_image(next(_fresh_seeds), (64, 64)))

    run_fault(rig, "s3_kill_restart", fault, expect_unhealthy=False, probe=probe)


# -- worker kills under supervision ----------------------------------------------------------------
def _kill_worker_mid_request(
    rig: Rig,
    case: str,
    label: str,
    *,
    body: dict,
    expected: list[int],
    hold,
    stream: bool = False,
    probe=None,
    check=None,
) -> None:
    """Send ``body``; once ``hold()`` says the victim works on it, SIGKILL the victim's process
    group. The supervisor restarts it; the request completes with the clean run's tokens; a new
    request succeeds within 30 s of the kill; the victim is unhealthy after the kill and healthy
    again (its restarted process) after. ``check(final)`` adds problems about the request's
    ``FinalResult``."""
    files = rig.health_files()
    monitor = HealthMonitor(rig.url, files)
    verdict = Verdict(case, time.monotonic())
    victim = rig.process(label)
    old_pid = victim.popen.pid
    expected_of: dict[str, list[int]] = {}
    result: dict = {}
    try:

        def client():
            try:
                if stream:
                    from tests.stackutil import SSEStream

                    out = SSEStream()
                    with httpx.stream(
                        "POST",
                        f"{rig.url}/v1/chat/completions",
                        json={**body, "stream": True},
                        timeout=CLIENT_TIMEOUT_S,
                    ) as resp:
                        result["status"] = resp.status_code
                        for _ in parse_sse(resp.iter_lines(), out):
                            result["seen"] = len(out.token_ids)
                    result["stream"] = out
                else:
                    result["outcome"] = post_chat(rig.url, body, what="request in flight", timeout=CLIENT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - judged below
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["ended"] = time.monotonic()

        thread = threading.Thread(target=client, name="fault-client", daemon=True)
        thread.start()
        hold(result)
        kill_at = time.monotonic()
        os.killpg(old_pid, signal.SIGKILL)
        rig.switches_off()  # the restarted worker works at full speed
        verdict.fault = (kill_at, kill_at)
        verdict.recovered, verdict.probes = probe_recovery(
            rig.url,
            probe or (lambda: rig.ref.request(TEXT, IMAGE)),
            since=kill_at,
            bound=RECOVERY_S,
            timeout=CLIENT_TIMEOUT_S,
            expected_of=expected_of,
        )
        thread.join(CLIENT_TIMEOUT_S + 60)
        assert not thread.is_alive(), "the request in flight hung"
        try:
            wait_for(
                lambda: rig.supervisor.seen("healthy", label, kill_at) and rig.all_healthy(),
                120,
                f"{label} restarted and every worker healthy",
                interval=0.5,
            )
            verdict.healthy_again_s = time.monotonic() - kill_at
        except AssertionError as exc:
            verdict.problems.append(f"health: {exc}")
    finally:
        monitor.stop()
        rig.switches_off()

    if "error" in result:
        verdict.problems.append(f"the request in flight failed client-side: {result['error']}")
    elif stream:
        out = result["stream"]
        if result.get("status") != 200 or out.errors or not out.done or out.token_ids != expected:
            verdict.problems.append(
                f"the stream in flight: status {result.get('status')}, errors {out.errors}, "
                f"[DONE] {out.done}, tokens {out.token_ids} (clean run {expected})"
            )
    else:
        outcome = result["outcome"]
        if outcome.status != 200 or outcome.tokens != expected:
            verdict.problems.append(f"the request in flight: {outcome.describe(verdict.origin)}; clean run {expected}")
    rid = (
        result["stream"].events[-1]["id"]
        if "stream" in result and result["stream"].events
        else result["outcome"].body.get("id")
        if "outcome" in result and isinstance(result["outcome"].body, dict)
        else None
    )
    if check is not None and rid is not None:
        finals = rig.running.messages_of("stream_results", FinalResult, rid)
        if finals:
            verdict.problems += check(finals[-1])
    verdict.judge_contract(expected_of)
    if verdict.recovered is None:
        verdict.problems.append(f"no request sent within {RECOVERY_S}s after the kill succeeded")
    if monitor.first_unhealthy(label, kill_at, kill_at + 30) is None:  # (its pid is gone)
        verdict.problems.append(f"{label} was not reported unhealthy after its process was killed")
    new_pid = rig.process(label).popen.pid
    if new_pid == old_pid:
        verdict.problems.append(f"{label} was not restarted (still pid {old_pid})")
    unhealthy = monitor.first_unhealthy(label, kill_at, kill_at + 30)
    restarted_at, healthy_at = (rig.supervisor.first_at(kind, label, kill_at) for kind in ("restarted", "healthy"))
    _record(
        case,
        recovery_s=None if verdict.recovered is None else verdict.recovered.ended - kill_at,
        unhealthy_after_s=None if unhealthy is None else unhealthy.at - kill_at,
        restarted_s=None if restarted_at is None else restarted_at - kill_at,
        supervisor_healthy_s=None if healthy_at is None else healthy_at - kill_at,
        healthy_again_s=verdict.healthy_again_s,
        in_flight_done_s=result.get("ended", kill_at) - kill_at,
        probes=[(o.status, round(o.started - kill_at, 1), round(o.seconds, 1)) for o in verdict.probes],
        ok=not verdict.problems,
    )
    report = verdict.report(monitor, rig.logs())
    log.info("%s", report)
    assert not verdict.problems, "\n".join(verdict.problems) + "\n\n" + report


def _wait_injection(rig: Rig, label: str, before: int):
    """A ``hold``: wait until ``label`` logs a new ``fault injection`` line (it holds the job)."""

    def hold(result):
        wait_for(
            lambda: "error" in result or "outcome" in result or len(rig.log_grep(label, "fault injection")) > before,
            120,
            f"{label} to take the job",
            interval=0.05,
        )
        assert "error" not in result and "outcome" not in result, f"the request ended before the kill: {result}"

    return hold


def test_encoder_sigkill_mid_request(rig):
    """The encoder dies holding the encode job of a request in flight (a fresh image, so the job is
    queued): restarted, the job redelivered, the request completes with the clean run's tokens.
    Recovery probes use fresh images too, so they need the encoder."""
    rig.ensure_serving()
    before = len(rig.log_grep("encoder-0", "fault injection"))
    body, expected = rig.ref.request(TEXT, noise_image(next(_fresh_seeds), (64, 48)))
    rig.switch("encoder", 120)

    def check(final):
        # The redelivered encode job served it ("store"); or, while no encoder was alive (the only one
        # killed, not yet back: its heartbeats stopped), the prefill worker encoded the image itself at
        # once (issue 44, "recomputed:no_encoder") - and then the killed job must still reach the
        # restarted encoder, which finds the item stored. "recomputed:timeout" would mean the job was
        # lost and the prefill worker waited EPD_EC_WAIT_S for nothing.
        sources = set(final.ec_sources.values())
        if sources == {"store"}:
            return []
        if sources == {f"recomputed:{MissReason.NO_ENCODER.value}"}:
            (item,) = final.ec_sources
            try:
                wait_for(lambda: rig.log_grep("encoder-0", f"item {item[:12]} already stored"), 120, "the job")
            except AssertionError:
                return ["encoded in the prefill worker, but the killed encode job never reached the restarted encoder"]
            return []
        return [f"the features came from {final.ec_sources}, not from the redelivered encode job (store)"]

    _kill_worker_mid_request(
        rig,
        "encoder_sigkill",
        "encoder-0",
        body=body,
        expected=expected,
        hold=_wait_injection(rig, "encoder-0", before),
        check=check,
        probe=lambda: rig.ref.request(TEXT, noise_image(next(_fresh_seeds), (64, 48))),
    )


def test_prefill_sigkill_mid_request(rig):
    rig.ensure_serving()
    before = len(rig.log_grep("prefill-0", "fault injection"))
    body, expected = rig.ref.request(TEXT, IMAGE)
    rig.switch("prefill", 120)
    _kill_worker_mid_request(
        rig,
        "prefill_sigkill",
        "prefill-0",
        body=body,
        expected=expected,
        hold=_wait_injection(rig, "prefill-0", before),
    )


def test_decode_sigkill_mid_stream(rig):
    """The decode worker dies while it streams a request's tokens (slowed to 50 ms a step): the
    job is redelivered to its restarted self; the client sees each token once, in order, the clean
    run's, and [DONE]."""
    rig.ensure_serving()
    body, expected = rig.ref.request(TEXT, IMAGE, max_tokens=60)
    rig.switch("decode", 0.05)

    def hold(result):
        wait_for(
            lambda: "error" in result or "stream" in result or result.get("seen", 0) >= 3,
            120,
            "the first streamed tokens",
            interval=0.02,
        )
        assert "error" not in result and "stream" not in result, f"the stream ended before the kill: {result}"

    _kill_worker_mid_request(rig, "decode_sigkill", "decode-0", body=body, expected=expected, hold=hold, stream=True)


# -- client disconnect -----------------------------------------------------------------------------
def test_client_disconnect_mid_stream_stops_generation(rig):
    """A streaming client hangs up after 2 token chunks of a 4000-token request (decode slowed to
    20 ms a step: the whole request would take 80 s and more). The request is cancelled everywhere:
    the workers hold no job within 30 s, far fewer than 4000 tokens were ever published for it,
    ``epd:requests_cancelled_total`` counts it, and the stack serves the next request."""
    rig.ensure_serving()
    max_tokens = 4000
    body = chat_body(TEXT, [IMAGE], **{**GREEDY, "max_tokens": max_tokens})
    rig.switch("decode", 0.02)
    origin = time.monotonic()
    rid = None
    try:
        with httpx.stream(
            "POST", f"{rig.url}/v1/chat/completions", json={**body, "stream": True}, timeout=CLIENT_TIMEOUT_S
        ) as resp:
            assert resp.status_code == 200, resp.read()
            chunks = 0
            for event in parse_sse(resp.iter_lines()):
                rid = event.get("id", rid)
                if event.get("choices") and event["choices"][0].get("token_ids"):
                    chunks += 1
                if chunks >= 2:
                    break  # leaving the block closes the connection
        hung_up = time.monotonic()
        busy: dict = {}

        def idle():
            busy.clear()
            busy.update(busy_work_consumers(rig.nats.url, rig.running.subjects))
            return not busy

        problems = []
        try:
            wait_for(idle, 30, "the workers to drop the abandoned request", interval=0.5)
            idle_after = time.monotonic() - hung_up
        except AssertionError as exc:
            idle_after = None
            problems.append(f"{exc} (still held: {busy})")
    finally:
        rig.switches_off()
    published = sum(len(c.token_ids) for c in rig.running.messages_of("stream_results", TokenChunk, rid))
    if published >= max_tokens // 8:
        problems.append(f"{published} of {max_tokens} tokens were generated for the abandoned request")
    cancelled = sum(
        metric_value(scrape(f"http://127.0.0.1:{port}/metrics"), "epd:requests_cancelled_total")
        for port in rig.stack.metrics_ports.values()
    )
    if cancelled < 1:
        problems.append("epd:requests_cancelled_total did not count the abandoned request on any worker")
    probe_body, expected = rig.ref.request(TEXT, IMAGE)
    after = post_chat(rig.url, probe_body, what="next request", timeout=CLIENT_TIMEOUT_S)
    if contract_violation(after, expected) or after.status != 200:
        problems.append(f"the next request: {after.describe(origin)}")
    _record(
        "client_disconnect",
        idle_after_s=idle_after,
        tokens_published=published,
        cancelled_metric=cancelled,
        next_request_s=after.seconds,
        ok=not problems,
    )
    assert not problems, "\n".join(problems) + f"\nrequest {rid}; service logs: {rig.logs()}"
