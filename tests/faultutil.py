"""Helpers of the fault suite (``tests/test_faults.py``): infrastructure servers a test may pause,
kill and restart; a stack kept running the way ``epd up`` keeps it (a :class:`Supervisor`
restarting dead services); worker-side fault switches; requests whose outcome is checked against
the fault contract; health sampling; and ``epd up`` as a real process.

The fault contract (docs/operations.md, "Faults and recovery"): a request sent during or after a fault either
completes with a clean run's tokens (greedy) or ends with a JSON 503 / 504 error - it never hangs
and is never wrong; after the fault ends a new request succeeds within 30 s; a worker's health is
red while it cannot pull from its consumer and green again after.

Worker-side switches: ``python -m tests.faultutil <service>`` runs ``services.<service>`` with a
delay that a test switches on and off by writing a file, so one long-lived stack serves every case
at full speed except while a case holds a worker on purpose:

* ``$EPD_TEST_FAULT_DIR/encoder.delay`` (seconds): sleep before each encode, after logging
  ``fault injection: ...`` (the worker holds the job then);
* ``$EPD_TEST_FAULT_DIR/prefill.delay``: sleep before each prefill (E|P|D hand-off engines);
* ``$EPD_TEST_FAULT_DIR/decode.delay``: sleep after each batched decode step (transformers).

Numerics are unchanged; production code has no such knobs.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import ssl
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FAULT_DIR_ENV = "EPD_TEST_FAULT_DIR"
MODULE = __name__
REPO = Path(__file__).resolve().parents[1]


# -- worker side -----------------------------------------------------------------------------------
def _switch(service: str) -> float:
    """The delay the test switched on for ``service`` (0 when the file is absent)."""
    folder = os.environ.get(FAULT_DIR_ENV)
    if not folder:
        return 0.0
    try:
        return float((Path(folder) / f"{service}.delay").read_text() or 0)
    except (OSError, ValueError):
        return 0.0


def _patch_async(cls: type, method: str, service: str) -> None:
    original = getattr(cls, method)

    async def delayed(self, *args, _original=original, **kwargs):
        delay = _switch(service)
        if delay:
            log.warning("fault injection: sleeping %.1fs before %s", delay, method)
            await asyncio.sleep(delay)
        return await _original(self, *args, **kwargs)

    setattr(cls, method, delayed)


def _patch_decode_steps() -> None:
    from shared.engines.transformers_batch import BatchDecoder

    original = BatchDecoder.step

    def step(self):
        events = original(self)
        delay = _switch("decode")
        if delay:
            time.sleep(delay)
        return events

    BatchDecoder.step = step


def worker_main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tests.faultutil encoder|prefill|decode")
    service = argv[0]
    from shared.config import ModelSettings
    from shared.engines import engine_class
    from shared.engines.base import FeaturesThroughConnector, FeaturesThroughWorker, KVStateHandoff

    engine_cls = engine_class(ModelSettings().engine)
    if service == "encoder":
        for mixin, method in ((FeaturesThroughWorker, "encode"), (FeaturesThroughConnector, "produce")):
            if issubclass(engine_cls, mixin):
                _patch_async(engine_cls, method, "encoder")
    elif service == "prefill" and issubclass(engine_cls, KVStateHandoff):
        _patch_async(engine_cls, "prefill", "prefill")
    elif service == "decode":
        _patch_decode_steps()
    importlib.import_module(f"services.{service}.main").main()


# -- the fault contract ----------------------------------------------------------------------------
@dataclass
class Outcome:
    """What a client got: ``status`` None when no answer came at all (a hang, or a connection
    error: ``error`` says which)."""

    what: str
    started: float  # monotonic
    ended: float
    status: int | None = None
    body: Any = None
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def tokens(self) -> list[int] | None:
        try:
            return self.body["choices"][0]["token_ids"]
        except (TypeError, KeyError, IndexError):
            return None

    def describe(self, origin: float) -> str:
        detail = self.error or (
            json.dumps(self.body)[:300] if self.status != 200 else f"{len(self.tokens or [])} tokens"
        )
        return f"{self.what}: sent at {self.started - origin:+.1f}s, {self.status} after {self.seconds:.1f}s ({detail})"


def post_chat(url: str, body: dict, *, what: str, timeout: float, verify: ssl.SSLContext | bool = True) -> Outcome:
    """POST a (non-streaming) chat completion; never raises for the request's own failure (no
    answer within ``timeout``: ``error`` starts with ``hung:``). ``verify``: what an https
    ``url``'s certificate is verified with (httpx's: True, the system CAs)."""
    import httpx

    out = Outcome(what, time.monotonic(), 0.0)
    try:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, verify=verify)
        out.status = resp.status_code
        try:
            out.body = resp.json()
        except ValueError:
            out.body = resp.text[:500]
    except httpx.TimeoutException as exc:
        out.error = f"hung: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - recorded, judged by contract_violation
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


def contract_violation(outcome: Outcome, expected: list[int]) -> str | None:
    """Why ``outcome`` breaks the fault contract, or None: 200 with ``expected`` tokens, or an
    OpenAI-shaped JSON 503 / 504."""
    if outcome.status is None:
        return f"no answer ({outcome.error}): the request hung or the connection broke"
    if outcome.status == 200:
        if outcome.tokens != expected:
            return f"200 with wrong tokens {outcome.tokens}, a clean run gives {expected}"
        return None
    if outcome.status not in (503, 504):
        return f"{outcome.status} is neither 200 nor the documented 503 / 504"
    err = outcome.body.get("error") if isinstance(outcome.body, dict) else None
    if not isinstance(err, dict) or not err.get("message") or not err.get("code"):
        return f"{outcome.status} without an OpenAI-shaped JSON error: {outcome.body!r}"
    return None


class Requests:
    """Requests sent in the background while a fault happens, judged at the end."""

    def __init__(self, url: str, timeout: float):
        self.url = url
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(16, thread_name_prefix="fault-req")
        self.sent: list[tuple[Future, list[int]]] = []

    def send(self, what: str, body: dict, expected: list[int]) -> Future:
        fut = self.pool.submit(post_chat, self.url, body, what=what, timeout=self.timeout)
        self.sent.append((fut, expected))
        return fut

    def outcomes(self) -> list[tuple[Outcome, list[int]]]:
        """Every request's outcome (waits for all; each is bounded by ``timeout``)."""
        return [(fut.result(timeout=self.timeout + 60), expected) for fut, expected in self.sent]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def probe_recovery(
    url: str,
    make: Callable[[], tuple[dict, list[int]]],
    *,
    since: float,
    bound: float,
    timeout: float,
    expected_of: dict[str, list[int]],
    interval: float = 2.0,
) -> tuple[Outcome | None, list[Outcome]]:
    """Send a request (``make()``: body and clean-run tokens, called in this thread) every
    ``interval`` s from now until one succeeds or ``bound`` s after ``since`` (the fault's end)
    have passed; then wait for every probe sent. Returns the first probe to succeed with the
    right tokens (None: none sent within ``bound`` did) and all probes in send order;
    ``expected_of`` gets each probe's clean-run tokens by its name. Probes overlap: one stuck
    until its deadline does not hold back the next."""
    probes: list[Future] = []

    def succeeded() -> bool:
        return any(p.done() and p.result().status == 200 for p in probes)

    with ThreadPoolExecutor(16, thread_name_prefix="fault-probe") as pool:
        n = 0
        while time.monotonic() - since <= bound and not succeeded():
            n += 1
            body, expected = make()
            expected_of[f"probe {n}"] = expected
            probes.append(pool.submit(post_chat, url, body, what=f"probe {n}", timeout=timeout))
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline and not succeeded():
                time.sleep(0.05)
        outcomes = [p.result(timeout=timeout + 60) for p in probes]
    ok = [o for o in outcomes if o.status == 200 and o.tokens == expected_of[o.what] and o.started - since <= bound]
    return (min(ok, key=lambda o: o.ended) if ok else None), outcomes


# -- health ----------------------------------------------------------------------------------------
@dataclass
class HealthSample:
    at: float  # monotonic
    workers: dict[str, bool]  # label -> `epd healthcheck` verdict on its heartbeat file
    reasons: dict[str, str]
    api_status: int | None  # /health status (None: no answer)
    api_workers: dict[str, int]


def health_sample(api_url: str, health_files: dict[str, tuple[Path, str]]) -> HealthSample:
    """Every worker's heartbeat-file verdict (``shared.health.check_worker``, what ``epd
    healthcheck --role`` says) and the API's ``/health``."""
    import httpx

    from shared.health import check_worker

    workers, reasons = {}, {}
    for label, (path, role) in health_files.items():
        workers[label], reasons[label] = check_worker(path, role=role)
    status, api_workers = None, {}
    try:
        resp = httpx.get(f"{api_url}/health", timeout=2)
        status = resp.status_code
        api_workers = resp.json().get("workers", {})
    except Exception:  # noqa: BLE001 - a stalled API is a data point, not an error
        pass
    return HealthSample(time.monotonic(), workers, reasons, status, api_workers)


class HealthMonitor:
    """Samples health twice a second in a thread until stopped; answers what was seen when."""

    def __init__(self, api_url: str, health_files: dict[str, tuple[Path, str]], interval: float = 0.5):
        self.api_url, self.health_files, self.interval = api_url, health_files, interval
        self.samples: list[HealthSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(health_sample(self.api_url, self.health_files))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def between(self, start: float, end: float) -> list[HealthSample]:
        return [s for s in list(self.samples) if start <= s.at <= end]

    def first_unhealthy(self, label: str, start: float, end: float) -> HealthSample | None:
        return next((s for s in self.between(start, end) if not s.workers.get(label, True)), None)

    def summary(self, origin: float) -> str:
        """One line per change of the verdicts, relative to ``origin``."""
        lines, last = [], None
        for s in list(self.samples):
            key = (tuple(sorted(s.workers.items())), s.api_status, tuple(sorted(s.api_workers.items())))
            if key != last:
                red = [f"{k} ({s.reasons[k]})" for k, ok in s.workers.items() if not ok]
                lines.append(
                    f"{s.at - origin:+6.1f}s api /health {s.api_status} workers {s.api_workers}; "
                    f"unhealthy: {'; '.join(red) or 'none'}"
                )
                last = key
        return "\n".join(lines)


# -- a stack supervised like `epd up` ----------------------------------------------------------------
class SupervisorThread:
    """``Supervisor.check()`` twice a second, as ``epd up``'s loop does, in a thread."""

    def __init__(self, stack):
        from shared.tools.launcher import Supervisor

        self.supervisor = Supervisor(stack)
        self.events: list[tuple[float, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self.supervisor.check():
                    log.info("supervisor: %s", event.line())
                    self.events.append((time.monotonic(), event))
            except Exception:  # keep supervising; the test sees the service missing
                log.exception("supervisor check failed")
            self._stop.wait(0.5)

    def seen(self, kind: str, label: str, since: float = 0.0) -> list[Any]:
        return [e for t, e in list(self.events) if t >= since and e.kind == kind and e.process == label]

    def first_at(self, kind: str, label: str, since: float = 0.0) -> float | None:
        """When the supervisor first reported ``kind`` for ``label`` at or after ``since`` (monotonic)."""
        return next((t for t, e in list(self.events) if t >= since and e.kind == kind and e.process == label), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
