"""What the bench/ scripts share: their servers, their stacks, their requests, their ratios.

* :class:`Bench` - a temporary folder under ``var/`` with an embedded ``nats-server`` and S3 server on
  free ports, the stacks a script asks for (:meth:`Bench.start`: ``shared.tools.launcher.Stack``, one
  topology each, every stack on its own subject prefix, namespace, bucket and vLLM folder, so several
  share the servers), everything stopped and removed at exit (also on Ctrl-C). ``Bench(..., tls=True)``:
  every link TLS, as ``epd up --tls`` sets it up - a throwaway CA and server certificates in the folder
  (``shared.tools.certs.make_certs``), NATS's client port TLS from the first byte, S3 over HTTPS, the API
  over HTTPS, every client verifying against the CA (:attr:`BenchStack.ssl_context` for the bench's own).
  A script's ``--tls`` runs a plaintext and a TLS bench side by side (:func:`run_tls_stacks`).
* :func:`model_dir` - the bench (~130M) or tiny Qwen2-VL, built once into ``var/models``.
* :func:`run_load` - one load run against a stack with ``epd bench run``'s load generator
  (``shared.tools.bench.runner.run``): TTFT, E2E, stages and EC sources per request; :func:`chat` - one
  streaming request, timed on the client, for probes sent beside a load run; :func:`timeline` - a
  request's ``/debug/requests/<id>?format=json`` (its messages and stage timeline); :func:`debug_docs` - those
  of every request of a run, :func:`final_result` - the worker's ``FinalResult`` (token ids, timings) in
  one, to compare outputs between sides; :func:`load_average` - how busy the shared machine was.
* :func:`alternate` - both sides of a comparison in one run, A B, B A, A B, ... so that a noisy
  machine hits both; :class:`Ratio` - the per-repetition ratios, median and spread (min-max), and the
  last line a script prints (``P1 c=1: E|PD/agg TTFT p50 = 0.97 [0.91-1.04] (target <= 1.0) MET``).

Only ratios from one run mean anything on a shared machine; absolute times are printed for context.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402 - after the sys.path setup above
import numpy as np  # noqa: E402 - after the sys.path setup above

from shared.tools.bench.lean_http import LeanClient  # noqa: E402 - after the sys.path setup above
from shared.tools.bench.schema import BenchResult, RequestRecord, WorkloadSpec  # noqa: E402 - after the sys.path setup above
from shared.tools.infra import EmbeddedNats, EmbeddedS3, ServerTLS, free_port  # noqa: E402 - after the sys.path setup above
from shared.tools.launcher import Stack  # noqa: E402 - after the sys.path setup above
from shared.topology import Service  # noqa: E402 - after the sys.path setup above

log = logging.getLogger("bench")

MODELS = ROOT / "var" / "models"


# -- model -------------------------------------------------------------------------------------
def model_dir(size: str = "bench") -> Path:
    """``var/models/qwen2-vl-<size>`` (``epd model build-tiny --size <size>``), built if missing."""
    out = MODELS / f"qwen2-vl-{size}"
    if (out / "config.json").is_file():
        return out
    from shared.tools.models.tiny import build_tiny_model

    print(f"building the {size} model into {out} (once)", flush=True)
    MODELS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=MODELS))
    build_tiny_model(tmp, arch="qwen2_vl", size=size, seed=0)
    try:
        tmp.rename(out)  # atomic: a half-built folder is never taken for a model
    except OSError:  # built meanwhile by another run
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- servers and stacks ------------------------------------------------------------------------
@dataclass
class BenchStack:
    """A started stack and what a script needs to talk to it."""

    label: str
    stack: Stack
    model: str
    #: the CA the API's certificate (and NATS's, S3's) is verified against; None: plaintext
    ca: Path | None = None

    @property
    def url(self) -> str:
        return self.stack.base_url

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context verifying the API against :attr:`ca`; None for a plaintext stack."""
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca is not None else None

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- {p.label}\n{p.log_tail(lines)}" for p in self.stack.processes)


class Bench:
    """Embedded NATS + S3 in a temporary folder, and the stacks started on them; a context manager.

    ``keep``: leave the folder (logs, NATS and S3 data) behind for a look afterwards. ``tls``: every
    link TLS (the module docstring), with a throwaway CA made in the folder."""

    def __init__(self, name: str, *, keep: bool = False, tls: bool = False):
        (ROOT / "var").mkdir(exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=ROOT / "var"))
        self.keep = keep
        server_tls: dict[str, ServerTLS] = {}
        self.ca: Path | None = None
        #: the API's certificate and key (``EPD_TLS_CERT`` / ``EPD_TLS_KEY``) with ``tls``
        self.api_tls: dict[str, str] = {}
        if tls:
            from shared.tools.certs import make_certs

            certs = make_certs(self.work / "tls", days=1)
            self.ca = certs.ca_cert
            server_tls = {n: ServerTLS(crt, key, certs.ca_cert) for n, (crt, key) in certs.servers.items()}
            self.api_tls = {"EPD_TLS_CERT": str(certs.servers["api"][0]), "EPD_TLS_KEY": str(certs.servers["api"][1])}
        self.nats = EmbeddedNats(self.work / "nats", tls=server_tls.get("nats"))
        self.s3 = EmbeddedS3(self.work / "s3", tls=server_tls.get("s3"))
        self.stacks: list[BenchStack] = []
        self._closed = False

    def __enter__(self) -> Bench:
        atexit.register(self.close)
        # SIGTERM (a timeout, a CI runner) must stop the children too: make it an exception.
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.nats.start()
            self.s3.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self, model: Path, **overrides: str) -> dict[str, str]:
        """One stack's ``EPD_*`` settings, as ``epd up`` sets them, on its own prefix, namespace, bucket."""
        tag = uuid.uuid4().hex[:8]
        env = {
            "EPD_NATS_URL": self.nats.url,
            "EPD_S3_ENDPOINT": self.s3.endpoint,
            "EPD_S3_ACCESS_KEY": self.s3.access_key,
            "EPD_S3_SECRET_KEY": self.s3.secret_key,
            "EPD_S3_BUCKET": f"bench-{tag}",
            "EPD_NAMESPACE": f"b{tag}",
            "EPD_SUBJECT_PREFIX": f"b{tag}",
            "EPD_MODEL_PATH": str(model),
            "EPD_MODEL_NAME": model.name,
            "EPD_ENGINE": "transformers",
            # JetStream reserves a stream's max_bytes up front: several stacks share one server here.
            "EPD_STREAM_MAX_BYTES": str(256 * 1024**2),
            # The services run from the tree the script is in (a fresh clone's editable install may point elsewhere).
            "PYTHONPATH": str(ROOT),
            # EPD_ENGINE=vllm: each stack's vLLM caches and IPC sockets in the bench folder, removed with it.
            "EPD_VLLM_DIR": str(self.work / f"vllm-{tag}"),
        }
        if self.ca is not None:  # every service a client of NATS and S3 over TLS, verified against the CA
            env |= {"EPD_NATS_TLS_CA": str(self.ca), "EPD_S3_SECURE": "true", "EPD_S3_TLS_CA": str(self.ca)}
        env.update(overrides)
        return env

    def start(
        self,
        specs: dict[str, tuple[str, dict[str, str]]],
        model: Path,
        *,
        timeout: float = 600.0,
        service_env: dict[str, dict[str, dict[str, str]]] | None = None,
        replicas: dict[str, dict[str, int]] | None = None,
        wait: bool = True,
    ) -> dict[str, BenchStack]:
        """Start one stack per ``label -> (topology, EPD_* overrides)``, all at once (they load their
        engines in parallel), and wait until every one is ready (an API heartbeat from each worker;
        ``wait=False``: the caller waits, ``stack.wait_ready``).
        ``service_env``: label -> service (``encoder``, ``prefill``, ...) -> more environment for
        that service only (e.g. one engine's core binding); ``replicas``: label -> service -> how
        many workers of it (default one each)."""
        started: dict[str, BenchStack] = {}
        for label, (topology, overrides) in specs.items():
            services = dict((service_env or {}).get(label, {}))
            if self.ca is not None:  # the API serves HTTPS (its certificate for its process only, as epd up --tls)
                api = Service.API.value
                services[api] = {**self.api_tls, "EPD_TLS_CA": str(self.ca), **services.get(api, {})}
            stack = Stack(
                env=self.env(model, **overrides),
                log_dir=self.work / "logs" / label,
                topology=topology,
                api_port=free_port(),
                service_env=services,
                replicas={Service(k): n for k, n in (replicas or {}).get(label, {}).items()},
            )
            bs = BenchStack(label, stack, model.name, ca=self.ca)
            self.stacks.append(bs)
            started[label] = bs
            stack.start()
        if not wait:
            return started
        t = time.perf_counter()
        for bs in started.values():
            bs.stack.wait_ready(timeout=timeout)
        print(
            f"stacks ready ({', '.join(f'{k}: {v[0]}' for k, v in specs.items())}) in "
            f"{time.perf_counter() - t:.1f}s; logs under {self.work / 'logs'}",
            flush=True,
        )
        return started

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for bs in reversed(self.stacks):
            try:
                bs.stack.stop()
            except Exception:  # stop the rest regardless
                log.exception("stopping %s", bs.label)
        for server in (self.s3, self.nats):
            try:
                server.stop()
            except Exception:
                log.exception("stopping %s", server.name)
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


# -- requests ----------------------------------------------------------------------------------
_WORDS = (
    "describe the picture in detail and name every colour shape and object you can see in it "
    "then say what might happen next"
).split()


def prompt(words: int, salt: int = 0) -> str:
    return " ".join(_WORDS[(i + salt) % len(_WORDS)] for i in range(words))


def chat_body(model: str, text: str, images: Sequence[str] = (), *, max_tokens: int = 8) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    parts.append({"type": "text", "text": text})
    return {
        "model": model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }


@dataclass
class Probe:
    """One request as the client saw it."""

    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    request_id: str = ""
    error: str = ""
    #: every chunk's token ids, in order
    token_ids: list[int] = field(default_factory=list)
    #: the stream ended with ``[DONE]``
    done: bool = False


async def chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> Probe:
    """POST one streaming chat completion (``body``: a dict, or JSON already encoded); TTFT is the
    first chunk that carries token ids."""
    sent = time.perf_counter()
    probe = Probe(ok=False)
    payload: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", headers=headers, **payload) as resp:
            probe.request_id = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                probe.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return probe
            ended = False
            async for line in resp.aiter_lines():  # to the response's end: the connection is kept
                if not ended and _sse_line(probe, line, sent):  # (left unread, httpx would close it)
                    ended = True
            if probe.error:
                return probe
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an undecodable event
        probe.error = f"{type(exc).__name__}: {exc}"
        return probe
    probe.e2e_s = time.perf_counter() - sent
    probe.ok = probe.ttft_s is not None
    return probe


def _sse_line(probe: Probe, line: str, sent: float) -> bool:
    """Take one SSE line of a chat completion stream into ``probe``; True at its end (``[DONE]``,
    or an error event: ``probe.error``). Raises ValueError on an undecodable event."""
    if line == "data: [DONE]":
        probe.done = True
        return True
    if not line.startswith("data: "):
        return False
    event = json.loads(line[6:])
    if "error" in event:
        probe.error = str(event["error"])
        return True
    for choice in event.get("choices", ()):
        ids = choice.get("token_ids") or ()
        if ids and probe.ttft_s is None:
            probe.ttft_s = time.perf_counter() - sent
        probe.token_ids.extend(ids)
    return False


async def lean_chat(lean: LeanClient, body: dict[str, Any]) -> Probe:
    """POST one streaming chat completion through ``lean`` (``shared.tools.bench.lean_http``: one
    keep-alive connection, ~0.1 ms of client work a request); timed as :func:`chat` times it, to
    ``[DONE]``."""
    sent = time.perf_counter()
    probe = Probe(ok=False)

    def on_line(line: str) -> None:
        if not probe.done and _sse_line(probe, line, sent) and probe.done:
            probe.e2e_s = time.perf_counter() - sent

    try:
        response = await lean.post("/v1/chat/completions", body, on_line)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
        probe.error = probe.error or f"{type(exc).__name__}: {exc}"
        return probe
    probe.request_id = response.headers.get("x-request-id", "")
    if response.status != 200:
        probe.error = f"HTTP {response.status}: {response.body[:200]!r}"
    elif not probe.done and not probe.error:
        probe.error = "the stream ended without [DONE]"
    probe.ok = probe.ttft_s is not None and not probe.error
    return probe


def client(timeout: float = 600.0, *, verify: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    """The benches' httpx client; ``verify``: an https API's CA (:attr:`BenchStack.ssl_context`)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30.0),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        **({"verify": verify} if verify is not None else {}),
    )


def lean_client(bs: BenchStack) -> LeanClient:
    """A :class:`LeanClient` for ``bs``'s API (https verified against its CA on a TLS stack)."""
    return LeanClient(bs.url, ssl_context=bs.ssl_context)


async def timeline(http: httpx.AsyncClient, url: str, request_id: str) -> dict[str, Any]:
    """The request's ``/debug/requests/<id>?format=json`` (its case and timeline)."""
    resp = await http.get(f"{url}/debug/requests/{request_id}", params={"format": "json"})
    resp.raise_for_status()
    return resp.json()


def final_result(debug: dict[str, Any]) -> dict[str, Any] | None:
    """The request's own ``FinalResult`` (token ids, timings, EC sources), from a debug JSON; None
    when it has none."""
    rid = debug["case"]["request_id"]
    for m in debug["case"]["messages"]:
        msg = m.get("message") or {}
        if m.get("kind") == "final_result" and msg.get("request_id") == rid:
            return msg
    return None


def final_timings(debug: dict[str, Any]) -> dict[str, float]:
    """The worker's own ``FinalResult.timings`` (features_s, prefill_s, decode_s, total_s, ...), from a
    debug JSON; {} when the request has no final result."""
    return dict((final_result(debug) or {}).get("timings") or {})


async def debug_docs(bs: BenchStack, records: Iterable[RequestRecord]) -> dict[int, dict[str, Any]]:
    """Each completed request's ``/debug/requests/<id>?format=json`` (:func:`timeline`), by record
    index; a request whose timeline cannot be read is left out."""
    out: dict[int, dict[str, Any]] = {}
    async with client(120.0, verify=bs.ssl_context) as http:
        for r in records:
            if not (r.ok and r.request_id):
                continue
            try:
                out[r.index] = await timeline(http, bs.url, r.request_id)
            except httpx.HTTPError as exc:
                log.warning("timeline of %s not read: %s", r.request_id, exc)
    return out


def load_average() -> str:
    """``uptime``'s 1, 5 and 15 minute load averages (the machine is shared: say how busy it was)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _cpu_busy_idle() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, idle


async def wait_quiet(busy_below: float = 0.3, window_s: float = 0.5, max_s: float = 15.0) -> float:
    """Wait until the machine's CPUs were busy less than ``busy_below`` of a ``window_s`` window
    (the other side's engines done with the tail of their burst), at most ``max_s``; returns the
    busy fraction of the last window: an idle baseline is not measured while the other side still
    finishes its burst."""
    deadline = time.monotonic() + max_s
    while True:
        b0, i0 = _cpu_busy_idle()
        await asyncio.sleep(window_s)  # the measuring window itself
        b1, i1 = _cpu_busy_idle()
        busy = (b1 - b0) / max(1, (b1 - b0) + (i1 - i0))
        if busy < busy_below or time.monotonic() > deadline:
            return busy


# -- load runs ---------------------------------------------------------------------------------
@dataclass
class Run:
    """One load run of one side: its records and (with ``epd bench``'s runner) the full result."""

    label: str
    records: list[RequestRecord]
    result: BenchResult | None = None

    def ok(self, kind: str | None = None) -> list[RequestRecord]:
        return [r for r in self.records if r.ok and (kind is None or r.kind == kind)]

    def ttfts(self, kind: str | None = None) -> list[float]:
        return [r.ttft_s for r in self.ok(kind) if r.ttft_s is not None]

    def failed(self) -> int:
        return sum(1 for r in self.records if not r.ok)


async def run_load(bs: BenchStack, spec: WorkloadSpec, *, label: str, timelines: bool = True) -> Run:
    """``spec`` against ``bs`` with ``epd bench``'s load generator (``shared.tools.bench.runner``): the
    requests, then (``timelines``) each one's stages and EC sources from its timeline."""
    from shared.tools.bench import runner

    tls: dict[str, Any] = {"verify": bs.ssl_context} if bs.ca is not None else {}  # (an https API's CA)
    result = await runner.run(bs.url, spec, label=label, progress=False, timelines=timelines, **tls)
    return Run(label, [r for run in result.runs for r in run.requests], result)


# -- statistics and the verdict ----------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation (numpy's default)."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def stage_means(records: Iterable[RequestRecord]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for r in records:
        for k, v in r.stages.items():
            sums.setdefault(k, []).append(v)
    return {k: statistics.fmean(v) for k, v in sums.items()}


def format_stages(means: dict[str, float], keys: Sequence[str] | None = None) -> str:
    keys = keys or [k for k, _ in sorted(means.items(), key=lambda kv: -kv[1])]
    return ", ".join(f"{k} {means[k] * 1e3:.0f} ms" for k in keys if k in means)


@dataclass
class Ratio:
    """One figure: a ratio (or a value) per repetition, its median and spread, against a target."""

    name: str
    values: list[float] = field(default_factory=list)
    target: float | None = None  # upper bound (a "<=" or "<" target); None: reported only
    strict: bool = False  # "<" rather than "<="
    at_least: bool = False  # the target is a lower bound (">=", or ">" when strict)
    unit: str = ""  # "" for a ratio, e.g. " ms" / " s" for a value
    per: str = "reps"  # what each value is one of
    decimals: int | None = None  # printed; None: 2 for a ratio, 1 for a value

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def met(self) -> bool | None:
        if self.target is None or not self.values:
            return None
        if self.at_least:
            return self.median > self.target if self.strict else self.median >= self.target
        return self.median < self.target if self.strict else self.median <= self.target

    def line(self) -> str:
        decimals = self.decimals if self.decimals is not None else (1 if self.unit else 2)
        fmt = f"{{:.{decimals}f}}"
        spread = (
            (
                f" [{fmt.format(min(self.values))}-{fmt.format(max(self.values))}]{self.unit}, "
                f"{len(self.values)} {self.per}"
            )
            if self.values
            else ""
        )
        text = f"{self.name} = {fmt.format(self.median)}{self.unit if not spread else ''}{spread}"
        if self.target is None:
            return text + " (no target: reported)"
        op = ("<" if self.strict else "<=") if not self.at_least else (">" if self.strict else ">=")
        return f"{text} (target {op} {self.target}{self.unit}) {'MET' if self.met else 'MISSED'}"


def alternate(reps: int, sides: Sequence[str]) -> list[tuple[int, str]]:
    """(repetition, side) in run order: A B, then B A, then A B ... (the order flips every
    repetition, so neither side always runs first after the other)."""
    order = []
    for rep in range(reps):
        seq = list(sides) if rep % 2 == 0 else list(reversed(sides))
        order.extend((rep, s) for s in seq)
    return order


def merge(label: str, runs: Sequence[Run]) -> BenchResult:
    """One ``epd bench`` result of several runs of one side: the requests of runs at the same load
    point pooled (renumbered) into one run, summarised again (``report.summarize``)."""
    import msgspec

    from shared.tools.bench.report import summarize
    from shared.tools.bench.schema import RunResult

    results = [r.result for r in runs if r.result is not None]
    points: dict[tuple[float | None, int | None], list[RunResult]] = {}
    for res in results:
        for rr in res.runs:
            points.setdefault((rr.rate, rr.concurrency), []).append(rr)
    merged = []
    for (rate, concurrency), rrs in points.items():
        records = [
            msgspec.structs.replace(rec, index=i) for i, rec in enumerate(rec for rr in rrs for rec in rr.requests)
        ]
        duration = sum(rr.summary.duration_s for rr in rrs)
        merged.append(
            RunResult(rate=rate, concurrency=concurrency, requests=tuple(records), summary=summarize(records, duration))
        )
    return msgspec.structs.replace(results[0], label=label, runs=tuple(merged))


def save(out_dir: Path | None, sides: dict[str, Sequence[Run]]) -> None:
    """Write one ``epd bench`` result JSON per side into ``out_dir`` (``<side>.json``: its runs pooled
    per load point, :func:`merge`), for ``epd bench compare`` and its plots."""
    if out_dir is None:
        return
    from shared.tools.bench.schema import dump

    out_dir.mkdir(parents=True, exist_ok=True)
    for side, runs in sides.items():
        if any(r.result is not None for r in runs):
            (out_dir / f"{side}.json").write_bytes(dump(merge(side, runs)))
    print(f"wrote {', '.join(f'{s}.json' for s in sides)} to {out_dir} (epd bench compare ... --plots DIR)", flush=True)


def common_args(
    parser: argparse.ArgumentParser,
    *,
    reps: int = 3,
    requests: int | None = 8,
    images: bool = False,
    model_size: str = "bench",
) -> None:
    """The flags every script has; ``images``: also --image-size and --max-tokens (image workloads)."""
    parser.add_argument("--reps", type=int, default=reps, help="repetitions per side (alternating)")
    parser.add_argument("--model-size", default=model_size, choices=["bench", "tiny"])
    if images:
        parser.add_argument("--image-size", type=int, default=448)
        parser.add_argument("--max-tokens", type=int, default=8, help="output tokens of an image request")
    if requests is not None:
        parser.add_argument("--requests", type=int, default=requests, help="requests per side per repetition")
    parser.add_argument("--out", type=Path, default=None, help="write each run's epd bench JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, data)")


def run_stacks(
    name: str,
    args: argparse.Namespace,
    specs: dict[str, tuple[str, dict[str, str]]],
    measure: Any,
    *,
    ready_timeout: float = 600.0,
    service_env: dict[str, dict[str, dict[str, str]]] | None = None,
    replicas: dict[str, dict[str, int]] | None = None,
) -> int:
    """A script's body: start ``specs`` (:meth:`Bench.start`) on the ``--model-size`` model, run
    ``asyncio.run(measure(args, stacks))``, stop everything, print the figures (:func:`finish`).
    ``ready_timeout``: a hang bound on the stacks' start (vLLM engines take minutes on 2 cores);
    ``service_env``, ``replicas``: per-service environment and worker counts (:meth:`Bench.start`)."""
    model = model_dir(args.model_size)
    print(f"load average at start: {load_average()}", flush=True)
    with Bench(name, keep=args.keep) as bench:
        stacks = bench.start(specs, model, timeout=ready_timeout, service_env=service_env, replicas=replicas)
        figures = asyncio.run(measure(args, stacks))
    return finish(figures)


#: a script's ``--tls`` sides: the same stack with every link plaintext, and with every link TLS
TLS_SIDES = ("plain", "tls")


def run_tls_stacks(
    name: str, args: argparse.Namespace, topology: str, measure: Any, *, ready_timeout: float = 600.0
) -> int:
    """A script's ``--tls`` body: one ``topology`` stack on plaintext servers (``plain``) and one on
    TLS servers (``tls``: :class:`Bench` with ``tls``), started together on the ``--model-size``
    model, then ``asyncio.run(measure(args, stacks))`` (which takes turns between the two,
    :func:`alternate`), the load average printed before and after."""
    model = model_dir(args.model_size)
    print(f"load average at start: {load_average()}", flush=True)
    with Bench(name, keep=args.keep) as plain, Bench(f"{name}-tls", keep=args.keep, tls=True) as secure:
        stacks = {**plain.start({"plain": (topology, {})}, model, wait=False)}
        stacks |= secure.start({"tls": (topology, {})}, model, wait=False)
        t = time.perf_counter()
        for bs in stacks.values():
            bs.stack.wait_ready(timeout=ready_timeout)
        print(f"stacks ready (plain and TLS: {topology}) in {time.perf_counter() - t:.1f}s", flush=True)
        figures = asyncio.run(measure(args, stacks))
    print(f"load average at the end: {load_average()}", flush=True)
    return finish(figures)


def finish(figures: Sequence[Ratio]) -> int:
    """Print every figure, then all of them on one line, last; exit status 0 (a missed target is a
    result, not an error)."""
    for f in figures:
        print(f.line())
    print("; ".join(f.line() for f in figures), flush=True)
    return 0


def main_guard(fn: Callable[[], int]) -> None:
    logging.basicConfig(level=os.environ.get("BENCH_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(fn())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
