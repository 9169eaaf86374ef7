"""Helpers for end-to-end tests, one per job: images, stacks of real service processes, chat
requests and SSE parsing, metrics parsing, publishing a job and collecting its events, reading
what a request left on record (exactly-one final result, tokens grouped by attempt and seq), and
waiting on conditions."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import re
import signal
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
from PIL import Image

from shared import protocol
from shared.protocol import ErrorEvent, FinalResult, Subjects, TokenChunk
from shared.tools.infra import EmbeddedNats, EmbeddedS3
from shared.tools.launcher import Stack
from shared.tools.nats_identities import NatsIdentities

#: Greedy request parameters of the equality tests (the API's extension returns token ids).
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True, return_token_ids=True)


# -- test tiers -----------------------------------------------------------------------------------
#: The markers that put a test starting vLLM in a tier (pyproject.toml): ``vllm`` runs in
#: ``make test-vllm`` only (``make test`` starts no vLLM).
VLLM_TIERS = frozenset({"vllm"})
#: The running test's marker names, set by ``tests/conftest.py`` before its fixtures are set up.
_running_markers: set[str] = set()


@contextlib.asynccontextmanager
async def opened_claims(kind: Any, claims_env: tuple[str, Subjects, Any]) -> AsyncIterator[Any]:
    """``kind.open`` (``EncodeClaims``, ``RoutingClaims``) on the ``claims_env`` fixture's buckets, over a
    NATS connection of its own, closed on the way out."""
    url, subjects, settings = claims_env
    nc = await nats.connect(url)
    try:
        yield await kind.open(nc.jetstream(), subjects, settings)
    finally:
        await nc.close()


def set_running_test_markers(names: Iterable[str]) -> None:
    _running_markers.clear()
    _running_markers.update(names)


def require_vllm_tier(what: str) -> None:
    """Refuse to start vLLM (an engine, or services with ``EPD_ENGINE=vllm``) for a test marked
    ``vllm``: such a test would land in ``make test`` unnoticed, and
    each vLLM engine costs it ~1 min of start-up on 2 cores."""
    if not _running_markers & VLLM_TIERS:
        raise RuntimeError(
            f"{what}: starts vLLM, but the test is not marked `vllm` (make test-vllm): "
            "mark it (pytest.mark.vllm, module-level pytestmark or pytest.param marks)"
        )


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A deterministic RGB noise image of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def user_message(text: str, image_urls: list[str]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def engine_messages(text: str, n_images: int) -> list[dict[str, Any]]:
    """The same message as ``user_message`` in the engine's placeholder form."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def run_sync(coro):
    """Run a coroutine to completion from synchronous test code, in a thread of its own (so it
    works whether or not an event loop runs in the caller's thread). Engines own their compute
    and hand results to whichever loop awaits them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _events(aiter) -> list:
    return [ev async for ev in aiter]


def engine_encode(engine, images: list[Image.Image]) -> list:
    """``await engine.encode(images)`` from synchronous test code."""
    return run_sync(engine.encode(images))


def engine_events(engine, messages: list[dict[str, Any]], items: list, params, stats=None) -> list:
    """Every TokenEvent of ``engine.generate(...)`` from synchronous test code."""
    return run_sync(_events(engine.generate(messages, items, params, stats)))


def engine_tokens(engine, messages: list[dict[str, Any]], items: list, params, stats=None) -> list[int]:
    """The token ids of ``engine.generate(...)`` from synchronous test code."""
    return [ev.token_id for ev in engine_events(engine, messages, items, params, stats)]


@dataclass
class RunningStack:
    stack: Stack
    nats_url: str
    prefix: str
    namespace: str
    bucket: str
    env: dict[str, str]
    prefill_metrics_port: int | None = None
    request_timeout_s: float | None = None
    #: a NATS server of this stack's own (``start_stack(nats_identities=True)``), stopped by :meth:`stop`
    own_nats: EmbeddedNats | None = None
    #: its role identities (``shared.tools.nats_identities``)
    identities: NatsIdentities | None = None

    def stop(self) -> None:
        """Stop the services (and the stack's own NATS server)."""
        try:
            self.stack.stop()
        finally:
            if self.own_nats is not None:
                self.own_nats.stop()

    @property
    def url(self) -> str:
        return self.stack.base_url

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def chat(
        self, messages: list[dict], *, timeout: float = 120, headers: dict | None = None, **params: Any
    ) -> httpx.Response:
        body = {"model": "qwen2-vl-tiny", "messages": messages, **params}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout, headers=headers)

    def stream_messages(self, stream_attr: str) -> list[tuple[str, dict, protocol.Message]]:
        return read_stream(self.nats_url, getattr(self.subjects, stream_attr))

    def messages_of(self, stream_attr: str, cls: type, request_id: str) -> list:
        """The ``cls`` messages of ``request_id`` still in the stream ``stream_attr``, in order."""
        return [m for _, _, m in self.stream_messages(stream_attr) if isinstance(m, cls) and m.request_id == request_id]

    def log_of(self, service: str) -> str:
        """The logs of every process of ``service`` this stack started (live or not)."""
        return "\n".join(p.log_path.read_text() for p in self.stack.processes if p.name == service)


#: The user the tests' own connections without credentials are, on a stack's own NATS server.
TEST_USER = "tests"


def start_stack(
    nats_server,
    s3_server,
    model_dir,
    log_dir,
    *,
    topology="e-pd",
    services=None,
    roles=None,
    service_env=None,
    service_modules=None,
    ready_timeout=300,
    nats_identities=False,
    **env_overrides,
) -> RunningStack:
    """A ready stack on the session's NATS and S3: every service of ``topology``
    (``shared.topology.TOPOLOGIES``), or just ``services``; ``roles`` are the worker roles
    to wait for. ``env_overrides`` are ``EPD_*`` settings for every service, ``service_env`` per
    service; ``service_modules`` runs a service through another module (``tests.fault_workers``).
    ``nats_identities``: on a NATS server of its own (under ``log_dir``) that knows only the
    role identities of ``shared.nats_auth`` (as ``epd up``'s), each service connecting as its
    role; the tests' own connections without credentials are an unrestricted ``TEST_USER``.
    The caller stops it (``running.stop()``)."""
    from shared.tools.infra import free_port

    env, prefix, namespace, bucket = stack_env(nats_server, s3_server, model_dir, **env_overrides)
    own_nats, identities = None, None
    if nats_identities:
        identities = NatsIdentities.under(Path(log_dir) / "nats-identities", Subjects(prefix))
        own_nats = EmbeddedNats(
            Path(log_dir) / "nats", extra_config=identities.server_config(no_auth_user=TEST_USER)
        ).start()
        nats_server = own_nats
        env["EPD_NATS_URL"] = own_nats.url
        service_env = {
            name: {**identities.service_env().get(name, {}), **values}
            for name, values in {**{n: {} for n in identities.service_env()}, **(service_env or {})}.items()
        }
    if "vllm" in {env.get("EPD_ENGINE"), *(e.get("EPD_ENGINE") for e in (service_env or {}).values())}:
        require_vllm_tier("a stack with EPD_ENGINE=vllm")
    stack = Stack(
        env=env,
        log_dir=log_dir,
        topology=topology,
        api_port=free_port(),
        service_env=service_env or {},
        service_modules=service_modules or {},
    )
    running = RunningStack(
        stack, nats_server.url, prefix, namespace, bucket, env, own_nats=own_nats, identities=identities
    )
    try:
        if services is None:
            stack.start()
        else:
            for name in services:
                stack.add(name)
        stack.wait_ready(timeout=ready_timeout, roles=roles)
    except BaseException:
        running.stop()
        raise
    return running


# -- chat requests and SSE ------------------------------------------------------------------------
def chat_body(text: str, images: list[Image.Image], **params: Any) -> dict[str, Any]:
    """A chat completion body: one user turn with ``images`` (data URLs) then ``text``."""
    return {"model": "qwen2-vl-tiny", "messages": [user_message(text, [data_url(im) for im in images])], **params}


def api_tokens(stack: RunningStack, text: str, images: list[Image.Image], **params: Any) -> tuple[list[int], dict]:
    """Greedy (``GREEDY`` + ``params``) completion token ids through the API, and the response body."""
    resp = stack.chat([user_message(text, [data_url(im) for im in images])], **{**GREEDY, **params})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["choices"][0]["token_ids"], body


@dataclass
class SSEStream:
    """What a streaming chat completion sent: its ``data:`` events (parsed), whether ``[DONE]``
    closed it, and the token ids of every chunk in order."""

    events: list[dict] = field(default_factory=list)
    done: bool = False

    @property
    def token_ids(self) -> list[int]:
        return [t for ev in self.events for choice in ev.get("choices", []) for t in choice.get("token_ids", [])]

    @property
    def text(self) -> str:
        return "".join(
            (choice.get("delta") or {}).get("content") or "" for ev in self.events for choice in ev.get("choices", [])
        )

    @property
    def errors(self) -> list[dict]:
        return [ev["error"] for ev in self.events if "error" in ev]


def parse_sse(lines: Iterable[str], stream: SSEStream | None = None) -> Iterator[dict]:
    """Parse SSE ``lines`` into ``stream`` (events, done), yielding each event as it arrives. A
    line after ``[DONE]``, or a ``data:`` line that is not JSON, fails the test."""
    stream = stream if stream is not None else SSEStream()
    for line in lines:
        if not line.startswith("data: "):
            assert line == "" or line.startswith(":"), f"not an SSE line: {line!r}"
            continue
        assert not stream.done, f"data after [DONE]: {line!r}"
        if line == "data: [DONE]":
            stream.done = True
            continue
        event = json.loads(line[len("data: ") :])
        stream.events.append(event)
        yield event


def stream_chat(stack: RunningStack, body: dict, *, timeout: float = 300, on_event=None) -> SSEStream:
    """POST ``body`` with ``stream: true`` and read the whole SSE stream; ``on_event(event,
    stream)`` is called after each event (e.g. to kill a worker mid-stream)."""
    out = SSEStream()
    with httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions", json={**body, "stream": True}, timeout=timeout
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for event in parse_sse(resp.iter_lines(), out):
            if on_event is not None:
                on_event(event, out)
    return out


# -- metrics --------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        samples.append((m["name"], dict(_LABEL.findall(m["labels"] or "")), float(m["value"])))
    return samples


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0.0 when none)."""
    return sum(
        v
        for n, lab, v in parse_metrics(text)
        if n == name and all(lab.get(k) == str(want) for k, want in labels.items())
    )


def scrape(url: str) -> str:
    """The text of a ``/metrics`` endpoint."""
    resp = httpx.get(url, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.text


def stack_env(
    nats: EmbeddedNats, s3: EmbeddedS3, model_dir: Path, **overrides: str
) -> tuple[dict[str, str], str, str, str]:
    tag = uuid.uuid4().hex[:8]
    prefix, namespace, bucket = f"t{tag}", f"ns{tag}", f"epd-{tag}"
    env = {
        "EPD_NATS_URL": nats.url,
        "EPD_S3_ENDPOINT": s3.endpoint,
        "EPD_S3_ACCESS_KEY": s3.access_key,
        "EPD_S3_SECRET_KEY": s3.secret_key,
        "EPD_S3_BUCKET": bucket,
        "EPD_NAMESPACE": namespace,
        "EPD_SUBJECT_PREFIX": prefix,
        "EPD_MODEL_PATH": str(model_dir),
        "EPD_MODEL_NAME": "qwen2-vl-tiny",
        "EPD_TORCH_THREADS": "1",
        "EPD_URL_ALLOW_NETWORKS": "127.0.0.0/8",
        "EPD_LOG_LEVEL": "INFO",
        # JetStream reserves max_bytes per stream up front: many test stacks share one server.
        "EPD_STREAM_MAX_BYTES": str(64 * 1024**2),
    }
    env.update(overrides)
    return env, prefix, namespace, bucket


async def connect_url(nats_url: str, tls: ssl.SSLContext | None = None):
    """A plain nats-py connection to ``nats_url``; credentials in the URL (``nats://user:pw@host``,
    e.g. :func:`admin_url`) connect as that identity, with the inbox only it may read. ``tls``:
    TLS from the first byte with that context (a server with ``handshake_first``)."""
    import urllib.parse

    import nats

    from shared.nats_auth import inbox_prefix

    user = urllib.parse.urlsplit(nats_url).username
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(user)} if user else {}
    if tls is not None:
        options.update(tls=tls, tls_handshake_first=True)
    return await nats.connect(nats_url, **options)


def admin_url(data_dir: Path, port: int) -> str:
    """The URL of the NATS of an ``epd up`` with ``data_dir``, as its admin identity."""
    password = (data_dir / "nats" / "identities" / "admin").read_text().strip()
    return f"nats://admin:{password}@127.0.0.1:{port}"


def read_stream(
    nats_url: str, stream: str, tls: ssl.SSLContext | None = None
) -> list[tuple[str, dict, protocol.Message]]:
    """Every message still in ``stream``: (subject, headers, decoded message), in order."""

    async def main():
        from nats.js.errors import NotFoundError

        nc = await connect_url(nats_url, tls)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            out = []
            if info.state.messages == 0:
                return out
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    raw = await js.get_msg(stream, seq)
                except NotFoundError:
                    continue
                out.append((raw.subject, dict(raw.headers or {}), protocol.decode(raw.data)))
            return out
        finally:
            await nc.close()

    return asyncio.run(main())


# -- a request's events --------------------------------------------------------------------------
@dataclass
class JobOutcome:
    """The events on a request's token subject after a job was published: its token chunks and
    the terminal event (``FinalResult`` or ``ErrorEvent``)."""

    chunks: list[TokenChunk]
    terminal: FinalResult | ErrorEvent

    @property
    def tokens(self) -> list[int]:
        return stream_tokens(self.chunks, self.terminal)


async def publish_and_collect(
    nats_url: str, subjects: Subjects, subject: str, msg: protocol.Message, request_id: str, *, timeout: float = 300
) -> JobOutcome:
    """Subscribe to ``request_id``'s token subject, publish ``msg`` to the JetStream ``subject``,
    and collect chunks until the terminal event (or fail after ``timeout``)."""
    import nats

    nc = await connect_url(nats_url)
    try:
        sub = await nc.subscribe(subjects.tokens(request_id))
        await nc.jetstream().publish(subject, protocol.encode(msg), headers=protocol.headers_for(msg, request_id))
        deadline = time.monotonic() + timeout
        chunks: list[TokenChunk] = []
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no final event for {request_id} within {timeout:.0f}s ({len(chunks)} chunks)"
            try:
                raw = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                continue
            event = protocol.decode(raw.data)
            if isinstance(event, TokenChunk):
                chunks.append(event)
            elif isinstance(event, (FinalResult, ErrorEvent)):
                return JobOutcome(chunks, event)
    finally:
        await nc.close()


def run_job(stack: RunningStack, subject: str, msg: protocol.Message, *, timeout: float = 300) -> JobOutcome:
    """:func:`publish_and_collect` on a running stack (``msg.request_id``)."""
    return asyncio.run(
        publish_and_collect(stack.nats_url, stack.subjects, subject, msg, msg.request_id, timeout=timeout)
    )


def stream_tokens(chunks: Iterable[TokenChunk], final: FinalResult | ErrorEvent | None = None) -> list[int]:
    """The token ids a client gets from these chunks. Chunks are grouped by (attempt, seq): a
    redelivered job re-emits the seq numbers it already sent, and every copy of a seq must carry
    the same tokens (else the test fails: a redelivery changed the output). Each seq counts once,
    taken from ``final``'s attempt where that attempt emitted it (earlier seqs may come from the
    prefill worker's own attempt). The chunk ``final`` carries (``FinalResult.last_chunk``) counts
    as one of them. Seqs must run 0..n-1 without a gap."""
    if isinstance(final, FinalResult) and final.last_chunk is not None:
        chunks = [*chunks, final.last_chunk]
    by_key: dict[tuple[int, int], tuple[int, ...]] = {}
    for c in chunks:
        assert by_key.setdefault((c.attempt, c.seq), c.token_ids) == c.token_ids, f"seq {c.seq} sent twice differently"
    by_seq: dict[int, tuple[int, ...]] = {}
    for (attempt, seq), ids in sorted(by_key.items()):
        if seq in by_seq:
            assert by_seq[seq] == ids, f"attempt {attempt} re-emitted seq {seq} as {ids}, not {by_seq[seq]}"
        if seq not in by_seq or (isinstance(final, FinalResult) and attempt == final.attempt):
            by_seq[seq] = ids
    assert sorted(by_seq) == list(range(len(by_seq))), f"seq numbers with a gap: {sorted(by_seq)}"
    return [t for seq in sorted(by_seq) for t in by_seq[seq]]


def work_consumers(nats_url: str, subjects: Subjects, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """JetStream consumer info of the stack's work consumers (encode, generate, decode), by
    durable name; a consumer the stack does not have (no such stage) is left out."""

    async def main():
        from nats.js.errors import NotFoundError

        nc = await connect_url(nats_url, tls)
        try:
            js = nc.jetstream()
            infos = {}
            for stream, durable in (
                (subjects.stream_encode, protocol.CONSUMER_ENCODER),
                (subjects.stream_generate, protocol.CONSUMER_PREFILL),
                (subjects.stream_decode, protocol.CONSUMER_DECODE),
            ):
                try:
                    infos[durable] = await js.consumer_info(stream, durable)
                except NotFoundError:
                    continue
            return infos
        finally:
            await nc.close()

    return asyncio.run(main())


def busy_work_consumers(nats_url: str, subjects: Subjects) -> dict[str, tuple[int, int]]:
    """The work consumers that still hold a job: name -> (pending, delivered but not acked). A
    worker acks a job only after publishing everything it sends for it, so once this is empty no
    further event of a finished request can appear."""
    return {
        name: (info.num_pending, info.num_ack_pending)
        for name, info in work_consumers(nats_url, subjects).items()
        if info.num_pending or info.num_ack_pending
    }


def final_result(stack: RunningStack, request_id: str, *, timeout: float = 120) -> FinalResult:
    """The one ``FinalResult`` of ``request_id`` on record. Waits until it is there and until
    the stack's workers hold no job (so a second final - a redelivered job finished twice -
    would be on record too); two finals fail the test, and so does an ``ErrorEvent``."""

    def finals():
        events = [m for m in stack.messages_of("stream_results", (FinalResult, ErrorEvent), request_id)]
        assert not any(isinstance(m, ErrorEvent) for m in events), events
        return events

    wait_for(finals, timeout, f"the final result of {request_id}")
    busy: dict = {}

    def settled():
        busy.clear()
        busy.update(busy_work_consumers(stack.nats_url, stack.subjects))
        return not busy

    try:
        wait_for(settled, timeout, f"the workers to ack every job after {request_id}", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (still held: {busy})") from None
    found = finals()
    attempts = [(f.attempt, f.worker) for f in found]
    assert len(found) == 1, f"{len(found)} final results for {request_id} (attempt, worker): {attempts}"
    return found[0]


def worker_id_of(proc, service: str) -> str:
    """A worker process's id, from its runner's ``<service> worker <id> consuming ...`` log line."""
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if f"{service} worker " in line and " consuming " in line:
            return line.split(f"{service} worker ", 1)[1].split(" ", 1)[0]
    raise AssertionError(f"no worker id in {proc.log_path}")


def wait_for(predicate, timeout: float, what: str, *, interval: float = 0.1):
    """Poll ``predicate()`` until it returns something truthy (returned) or ``timeout`` passes.
    Use generous timeouts: they bound a failure, they are not a speed requirement."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


async def until(predicate, timeout: float, what: str, *, interval: float = 0.05):
    """:func:`wait_for` inside an event loop: poll ``predicate()`` (a plain function or a
    coroutine function) until it gives something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def kv_keys(store, stack) -> set[str]:
    """Keys of the KV objects (E|P|D hand-offs) in a RunningStack's bucket."""
    return {info.key for info in store.list(f"{stack.namespace}/kv/")}


# -- decode workers of a running E|P|D stack ------------------------------------------------------
def decoders(stack):
    """The live decode worker processes of a RunningStack."""
    return [p for p in stack.stack.processes if p.name == "decode" and p.alive()]


def start_decoder(stack, **env):
    """Start one more decode worker (the launcher's command and env, plus ``env``)."""
    index = sum(1 for p in stack.stack.processes if p.name == "decode")
    return stack.stack.add("decode", index=index, extra_env={k: str(v) for k, v in env.items()})


def stop_decoders(stack, sig=signal.SIGTERM):
    for proc in decoders(stack):
        proc.stop(sig)


def stream_killing_a_decoder(stack, body: dict, victim, *, after: int = 3, timeout: float = 600):
    """Stream a chat completion; once ``after`` tokens have arrived, SIGKILL ``victim`` (a decode
    worker process: its whole process group) and start a new decode worker. Returns (token ids,
    request id, tokens seen when killing or None, whether [DONE] arrived)."""
    killed: list[int] = []

    def on_event(event, stream):
        assert "error" not in event, event
        if not killed and len(stream.token_ids) >= after:
            victim.stop(signal.SIGKILL)
            killed.append(len(stream.token_ids))
            start_decoder(stack)

    out = stream_chat(stack, body, timeout=timeout, on_event=on_event)
    return out.token_ids, out.events[-1]["id"] if out.events else None, (killed or [None])[0], out.done


def epd_cli(env: dict[str, str], *args: str, timeout: float = 300):
    """Run the ``epd`` CLI (``shared.tools.cli.main``) in a subprocess of this interpreter, from the
    repository root, with ``env`` (e.g. a RunningStack's ``env``) added to this process's
    environment. Returns the ``subprocess.CompletedProcess`` (text stdout / stderr)."""
    import os
    import subprocess
    import sys

    # (the operator CLI must not pull in torch: it runs where no engine is installed)
    code = (
        "import sys; from shared.tools.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'the epd CLI imported torch'; sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[1],
    )
