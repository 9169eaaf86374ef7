"""Requests sent while a fault happens, each request's fate, and what the results stream says.

A request's fate (``FATES``): ``completed`` (200 with the single-node run's tokens), ``wrong``
(200 with other tokens), ``shaped_503`` / ``shaped_504`` (the documented OpenAI-shaped JSON
error), ``lost`` (any other answer: another status, an unshaped error, a broken connection) or
``hung`` (no answer within the client's timeout). :class:`Load` keeps a fixed number of requests in
flight, alternating over the API replicas, until told to stop; every request is a fresh image
(new EC to compute and store) or a text-only one, with its clean tokens computed beforehand.

What the streams say is read with a NATS identity (:class:`Login`): the site's NATS knows no
other (``site.Site.login``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from shared import protocol
from shared.protocol import FinalResult
from tests.faultutil import Outcome, post_chat
from tests.stackutil import GREEDY, chat_body, engine_encode, engine_messages, engine_tokens, noise_image

log = logging.getLogger(__name__)

FATES = ("completed", "wrong", "shaped_503", "shaped_504", "lost", "hung")
TEXT = "Describe this image."
TEXT_ONLY = "Count the colours of the rainbow."
IMAGE_SIZE = (64, 64)
_seeds = count(20_000)


# -- the tests' own NATS connections ---------------------------------------------------------------
@dataclass(frozen=True)
class Login:
    """A NATS identity the tests connect as (the password is never shown); ``ca``: the servers
    are TLS, verified against it, from the first byte (as the services' ``NatsSettings.tls_options``)."""

    user: str
    password: str = field(repr=False)
    ca: Path | None = None

    def options(self) -> dict[str, Any]:
        """nats-py's options: the credentials, the inbox only this identity may read, TLS."""
        from shared.nats_auth import inbox_prefix

        tls: dict[str, Any] = {}
        if self.ca is not None:
            tls = {"tls": ssl.create_default_context(cafile=str(self.ca)), "tls_handshake_first": True}
        return {"user": self.user, "password": self.password, "inbox_prefix": inbox_prefix(self.user), **tls}


async def _connect(urls: list[str], login: Login):
    import nats

    return await nats.connect(
        servers=urls, connect_timeout=3, max_reconnect_attempts=3, reconnect_time_wait=0.2, **login.options()
    )


# -- the single-node run --------------------------------------------------------------------------
@dataclass
class Reference:
    """Greedy tokens of the single-node run: the aggregated transformers engine in this process
    (the model the services load; the e2e tests hold every topology to it). Main thread only."""

    engine: Any
    cache: dict = field(default_factory=dict)

    def tokens(self, text: str, image) -> list[int]:
        from shared.engines.base import SamplingParams

        key = (text, None if image is None else image.tobytes())
        if key not in self.cache:
            images = [] if image is None else [image]
            params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
            self.cache[key] = engine_tokens(
                self.engine,
                engine_messages(text, len(images)),
                engine_encode(self.engine, images) if images else [],
                params,
            )
        return self.cache[key]


@dataclass
class Planned:
    kind: str  # "image" / "text"
    body: dict
    expected: list[int]


def plan(reference: Reference, n: int, *, text_every: int = 4) -> list[Planned]:
    """``n`` requests: fresh noise images (every ``text_every``-th one text-only), with clean tokens."""
    out = []
    for i in range(n):
        if text_every and i % text_every == text_every - 1:
            text = f"{TEXT_ONLY} ({next(_seeds)})"
            out.append(Planned("text", chat_body(text, [], **GREEDY), reference.tokens(text, None)))
        else:
            image = noise_image(next(_seeds), IMAGE_SIZE)
            out.append(Planned("image", chat_body(TEXT, [image], **GREEDY), reference.tokens(TEXT, image)))
    return out


# -- fates ---------------------------------------------------------------------------------------
def fate(outcome: Outcome, expected: list[int]) -> str:
    if outcome.status is None:
        return "hung" if (outcome.error or "").startswith("hung") else "lost"
    if outcome.status == 200:
        return "completed" if outcome.tokens == expected else "wrong"
    if outcome.status in (503, 504):
        err = outcome.body.get("error") if isinstance(outcome.body, dict) else None
        if isinstance(err, dict) and err.get("message") and err.get("code"):
            return f"shaped_{outcome.status}"
    return "lost"


@dataclass
class Sent:
    planned: Planned
    api: str
    outcome: Outcome

    @property
    def fate(self) -> str:
        return fate(self.outcome, self.planned.expected)

    @property
    def request_id(self) -> str | None:
        return self.outcome.body.get("id") if isinstance(self.outcome.body, dict) else None

    def why(self) -> str:
        """What went wrong, without request ids: the error message, or the fate."""
        o = self.outcome
        if o.error:
            return f"{self.fate}: {o.error.split(':')[0]}"
        err = o.body.get("error") if isinstance(o.body, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
        return f"{self.fate} {o.status}: {re.sub(r'(chat)?cmpl-[0-9a-f]+', '<id>', str(message or o.body))[:160]}"

    def describe(self, origin: float) -> str:
        o = self.outcome
        detail = o.error or (json.dumps(o.body)[:240] if o.status != 200 else f"{len(o.tokens or [])} tokens")
        return (
            f"[{self.fate}] {self.planned.kind} via {self.api}: sent {o.started - origin:+.2f}s, "
            f"{o.status} after {o.seconds:.2f}s ({detail})"
        )


class Load:
    """``concurrency`` requests in flight over ``apis`` (round robin) until :meth:`stop`, from
    the ``planned`` list (cycled when used up: then images repeat, EC hits)."""

    def __init__(
        self,
        apis: list[str],
        planned: list[Planned],
        *,
        concurrency: int,
        timeout: float,
        verify: ssl.SSLContext | bool = True,
    ):
        self.apis = apis
        self.verify = verify
        self.planned = planned
        self.timeout = timeout
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._limit: int | None = None
        self.origin = time.monotonic()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="mh-load")
        self._loops: list[Future] = [self._pool.submit(self._loop) for _ in range(concurrency)]

    def _take(self) -> tuple[Planned, str] | None:
        with self._lock:
            if self._stop.is_set() or (self._limit is not None and self._next >= self._limit):
                return None
            i = self._next
            self._next += 1
            return self.planned[i % len(self.planned)], self.apis[i % len(self.apis)]

    def _loop(self) -> None:
        while (job := self._take()) is not None:
            planned, api = job
            outcome = post_chat(api, planned.body, what=planned.kind, timeout=self.timeout, verify=self.verify)
            with self._lock:
                self.sent.append(Sent(planned, api, outcome))

    def done_count(self) -> int:
        with self._lock:
            return len(self.sent)

    def wait_done(self, n: int, timeout: float) -> None:
        """Wait until ``n`` requests have an outcome."""
        deadline = time.monotonic() + timeout
        while self.done_count() < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {self.done_count()} of {n} requests answered within {timeout:.0f}s")
            time.sleep(0.05)

    def finish(self, at_least: int | None = None) -> list[Sent]:
        """Send no more requests (once ``at_least`` were sent), wait for those in flight."""
        with self._lock:
            self._limit = max(self._next, at_least or 0)
        for loop in self._loops:
            loop.result(timeout=self.timeout + 60)
        self._pool.shutdown()
        return sorted(self.sent, key=lambda s: s.outcome.started)


# -- judging ---------------------------------------------------------------------------------------
def fates(sent: list[Sent]) -> dict[str, int]:
    c = Counter(s.fate for s in sent)
    return {f: c.get(f, 0) for f in FATES}


def largest_gap(sent: list[Sent], since: float, until: float | None = None) -> float:
    """The longest stretch from ``since`` on without a 200 completing: how long the cluster served
    nothing around a fault that began at ``since``. ``until``: the fault's end, while the load still
    ran (a stretch still open then counts up to it); None: up to the last completion."""
    ends = sorted(s.outcome.ended for s in sent if s.outcome.status == 200 and s.outcome.ended > since)
    if until is not None:
        ends = [e for e in ends if e <= until] + [until]
    points = [since, *ends]
    return max((b - a for a, b in zip(points, points[1:], strict=False)), default=float("inf"))


def resume_after(sent: list[Sent], since: float, api: str | None = None) -> float:
    """Seconds from ``since`` until the first 200 of a request sent at or after it (through ``api``)."""
    ends = [
        s.outcome.ended
        for s in sent
        if s.outcome.status == 200 and s.outcome.started >= since and (api is None or s.api == api)
    ]
    return min(ends) - since if ends else float("inf")


async def _answered(call, timeout: float = 30.0):
    """``await call()``, again while it fails the way a JetStream election does
    (``RETRYABLE_PUBLISH_ERRORS``: 503 / 10008, no answer, ...: a node just healed or restarted may
    still be catching up although /healthz is ok). Not ``through_elections``: that turns every
    other API error, the NotFoundError the callers expect among them, into ServiceUnavailable."""
    from shared.jetstream import RETRYABLE_PUBLISH_ERRORS

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except RETRYABLE_PUBLISH_ERRORS:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.3)


async def _finals(
    urls: list[str], login: Login, stream: str, first_seq: int
) -> tuple[dict[str, list[tuple[int, str]]], int]:
    from nats.js.errors import NotFoundError

    nc = await _connect(urls, login)
    try:
        js = nc.jetstream()
        info = await _answered(lambda: js.stream_info(stream))
        out: dict[str, list[tuple[int, str]]] = {}
        for seq in range(max(first_seq, info.state.first_seq), info.state.last_seq + 1):
            try:
                raw = await _answered(lambda seq=seq: js.get_msg(stream, seq))
            except NotFoundError:
                continue
            msg = protocol.decode(raw.data or b"")
            if isinstance(msg, FinalResult):
                out.setdefault(msg.request_id, []).append((msg.attempt, msg.worker))
        return out, info.state.last_seq
    finally:
        await nc.close()


def finals_since(
    urls: list[str], stream: str, first_seq: int, *, login: Login
) -> tuple[dict[str, list[tuple[int, str]]], int]:
    """FinalResults in ``stream`` from ``first_seq`` on: request id -> [(attempt, worker)], and
    the stream's last sequence (``login``: the viewer reads every stream)."""
    from tests.multihost.site import run_async

    return run_async(_finals(urls, login, stream, first_seq))


async def _work_busy(urls: list[str], login: Login, pairs: list[tuple[str, str]]) -> dict[str, tuple[int, int]]:
    from nats.js.errors import NotFoundError

    nc = await _connect(urls, login)
    try:
        js = nc.jetstream()
        busy = {}
        for stream, durable in pairs:
            try:
                info = await _answered(lambda s=stream, d=durable: js.consumer_info(s, d, timeout=3))
            except NotFoundError:
                continue
            if info.num_pending or info.num_ack_pending:
                busy[durable] = (info.num_pending, info.num_ack_pending)
        return busy
    finally:
        await nc.close()


def work_busy(urls: list[str], subjects: protocol.Subjects, *, login: Login) -> dict[str, tuple[int, int]]:
    """Work consumers still holding a job: durable -> (pending, delivered not acked) (``login``:
    the viewer may look at any consumer of the streams, not pull from the work ones)."""
    from tests.multihost.site import run_async

    pairs = [
        (subjects.stream_encode, protocol.CONSUMER_ENCODER),
        (subjects.stream_generate, protocol.CONSUMER_PREFILL),
    ]
    return run_async(_work_busy(urls, login, pairs))


async def _replicas(urls: list[str], login: Login, names: list[str]) -> dict[str, tuple[int, int]]:
    from nats.js.errors import NotFoundError

    nc = await _connect(urls, login)
    try:
        out = {}
        js = nc.jetstream()
        for name in names:
            try:
                info = await _answered(lambda name=name: js.stream_info(name))
            except NotFoundError:
                continue
            peers = 1 + len(info.cluster.replicas or []) if info.cluster else 1
            out[info.config.name or "?"] = (info.config.num_replicas or 1, peers)
        return out
    finally:
        await nc.close()


def stream_replicas(urls: list[str], subjects: protocol.Subjects, *, login: Login) -> dict[str, tuple[int, int]]:
    """Every stream of the site (work queues, results, the KV buckets' streams) that exists: name
    -> (configured replicas, leader + replicas the cluster reports). By name: no role may list the
    account's streams; ``login``: the admin, which may look up each of them (the viewer may not look
    at the routing and claims buckets)."""
    from tests.multihost.site import run_async

    buckets = [subjects.ec_index_bucket, subjects.routing_bucket, subjects.ec_claims_bucket]
    names = [*subjects.streams(), subjects.stream_imported, *(protocol.kv_stream(b) for b in buckets)]
    return run_async(_replicas(urls, login, names))


# -- the results file ------------------------------------------------------------------------------
def _figure(v: Any) -> Any:
    """Seconds rounded; ``inf`` (it never happened within the case) as None; dicts alike."""
    if isinstance(v, float):
        return None if v == float("inf") else round(v, 2)
    if isinstance(v, dict):
        return {k: _figure(x) for k, x in v.items()}
    return v


class Results:
    """Per case: fates, recovery figures and notes; rewritten as JSON and markdown after each case."""

    def __init__(self, path: Path):
        self.path = path
        self.cases: dict[str, dict[str, Any]] = {}
        self.meta: dict[str, Any] = {}

    def record(self, case: str, **figures: Any) -> None:
        entry = {k: _figure(v) for k, v in figures.items()}
        self.cases[case] = entry
        log.warning("MULTIHOST %s %s", case, json.dumps(entry))
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"meta": self.meta, "cases": self.cases}, indent=2) + "\n")
        lines = ["# Multi-host test results", ""]
        lines += [f"- {k}: {v}" for k, v in self.meta.items()]
        lines += ["", "| case | " + " | ".join(FATES) + " | figures |", "|---" * (len(FATES) + 2) + "|"]
        for case, entry in self.cases.items():
            f = entry.get("fates", {})
            rest = {k: v for k, v in entry.items() if k != "fates"}
            lines.append(
                f"| {case} | "
                + " | ".join(str(f.get(x, "")) for x in FATES)
                + " | "
                + "; ".join(f"{k}={v}" for k, v in rest.items())
                + " |"
            )
        self.path.with_suffix(".md").write_text("\n".join(lines) + "\n")
