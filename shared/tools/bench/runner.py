"""The load generator of ``epd bench run``: streams chat completions at an OpenAI-compatible
endpoint and records what each request saw.

* Load: a *concurrency* run keeps ``spec.concurrency`` requests in flight (closed loop); a
  *poisson* run sends at the planned arrival offsets whatever is in flight (open loop); a sweep
  is one poisson run per rate, each with its own images (``workload.iter_plan``'s run index).
  A run stops taking requests after ``spec.requests`` or ``spec.duration_s``, whichever comes
  first, and ends when the requests it sent have ended.
* Per request (vLLM's definitions): TTFT is the time to the first chunk carrying a token (content
  or, against our API, token ids), ITL the gaps between such chunks, E2E the time to the stream's
  end; output tokens come from the usage chunk (else the token chunks). A failed request (HTTP
  error, error event in the stream, no ``[DONE]``, timeout, connection error) is recorded with
  ``ok=False`` and its error; nothing here raises for one request.
* Against epd-serve (``GET /health`` answers an ``encoder_fingerprint``), requests also ask for
  ``return_token_ids`` (every token gets a chunk, even one with no text yet), and after each run
  the runner reads every completed request's timeline from ``/debug/requests/<id>?format=json``:
  ``RequestRecord.stages`` gets each stage's wall time (the union of its spans, so per-image
  stages that overlap are not counted twice), ``exclusive_stages`` the partition of the request's
  time into stages (:func:`exclusive_stage_times`: each instant counted once, so they add up to
  the timeline's E2E) and ``ec_sources`` the worker's ``FinalResult.ec_sources``.
* Every wait is bounded: the client's timeouts, a whole-request bound, a per-timeline bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import ssl
import sys
import time
from collections.abc import Iterable
from typing import Any

import httpx
import msgspec

from shared.protocol import StageName
from shared.tools.bench.report import summarize
from shared.tools.bench.schema import UNTRACKED, BenchResult, RequestRecord, RunResult, WorkloadSpec
from shared.tools.bench.workload import PlannedRequest, check_spec, iter_plan

log = logging.getLogger(__name__)

#: Bound on one request, from sending to the stream's end (the API's own deadline is 300 s).
REQUEST_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 30.0
#: where ``epd bench run`` takes its API key from without ``--api-key`` (the openai client's variable)
API_KEY_ENV = "OPENAI_API_KEY"
#: a progress line at most this often when the output is not a terminal
PLAIN_PROGRESS_EVERY_S = 10.0
#: Bound on reading one timeline, and how many are read at once after a run.
TIMELINE_TIMEOUT_S = 60.0
TIMELINE_CONCURRENCY = 4
#: A timeline read right after the response may miss the last messages: read again this often.
TIMELINE_ATTEMPTS = 3
TERMINAL_STAGES = (StageName.DONE, StageName.ERROR, StageName.CANCELLED)


class BenchError(Exception):
    """The benchmark cannot run at all (endpoint unreachable, no model)."""


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


# -- one request --------------------------------------------------------------------------------
def _error_text(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return f"{err.get('code') or err.get('type') or 'error'}: {err.get('message', '')}"[:500]
    except (ValueError, AttributeError):
        pass
    return body.strip()[:500]


async def send_request(
    client: httpx.AsyncClient,
    req: PlannedRequest,
    *,
    model: str,
    spec: WorkloadSpec,
    run_t0: float,
    epd: bool,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> RequestRecord:
    """Stream one planned request; never raises for a failed request (the record says why)."""
    body = req.body(model, ignore_eos=spec.ignore_eos, extra={"return_token_ids": True} if epd else None)
    sent = time.perf_counter()
    ttft: float | None = None
    last = 0.0
    itl: list[float] = []
    chunks = ids = 0
    usage: dict[str, Any] = {}
    request_id, status, error = "", 0, ""
    done = finished = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                status = resp.status_code
                request_id = resp.headers.get("x-request-id", "")
                if status != 200:
                    error = _error_text((await resp.aread()).decode(errors="replace"))
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            error = _error_text(data)
                            break
                        request_id = event.get("id") or request_id
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or ():
                            n_ids = len(choice.get("token_ids") or ())
                            if (choice.get("delta") or {}).get("content") or n_ids:
                                now = time.perf_counter()
                                if ttft is None:
                                    ttft = now - sent
                                else:
                                    itl.append(now - last)
                                last = now
                                chunks += 1
                                ids += n_ids
                            finished = finished or bool(choice.get("finish_reason"))
                    if not error and not done:
                        error = "the stream ended without [DONE]" + ("" if finished else " or a finish reason")
    except TimeoutError:
        error = f"timed out after {timeout_s:g} s"
    except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: an undecodable event
        error = f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
    e2e = time.perf_counter() - sent
    ok = status == 200 and not error
    return RequestRecord(
        index=req.index,
        kind=req.kind,
        images=len(req.images),
        videos=len(req.videos),
        sent_at=sent - run_t0,
        ok=ok,
        status=status,
        error=error,
        request_id=request_id,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or ids or chunks),
        ttft_s=ttft,
        e2e_s=e2e if ok else None,
        itl_s=tuple(itl),
    )


# -- timelines (our API) ------------------------------------------------------------------------
def _union_length(spans: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def parse_timeline(doc: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """(stage name -> seconds, item hash -> EC source) from a ``/debug/requests/<id>?format=json``
    document (``{"case": RequestCase.to_json(), "timeline": Timeline.to_json()}``). A stage's
    seconds are the union of its spans (points, without a duration, are left out); EC sources are
    the last ``final_result``'s, else (E|P|D) the decode job's."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for stage in (doc.get("timeline") or {}).get("stages") or ():
        if stage.get("duration_s") is None or stage.get("end_s") is None:
            continue
        spans.setdefault(stage["name"], []).append((float(stage["start_s"]), float(stage["end_s"])))
    stages = {name: round(_union_length(s), 6) for name, s in spans.items()}
    case = doc.get("case") or {}
    rid = case.get("request_id")
    sources: dict[str, str] = {}
    for kind in ("final_result", "decode_job"):
        own = [
            m["message"]
            for m in case.get("messages") or ()
            if m.get("kind") == kind and isinstance(m.get("message"), dict) and m["message"].get("request_id") == rid
        ]
        if own and own[-1].get("ec_sources"):
            sources = dict(own[-1]["ec_sources"])
            break
    return stages, sources


def exclusive_stage_times(doc: dict[str, Any]) -> dict[str, float]:
    """Stage name -> exclusive seconds: a partition of the request's time, from ``received`` (0)
    to its last event (the latest start or end of any stage, ``done`` / ``error`` included), into
    its stages, from a ``/debug/requests/<id>?format=json`` document. The values add up to that
    span (the server-side E2E) to the microsecond, the timelines' resolution; ``{}`` when the
    document has no stage.

    A sweep over the span boundaries (clipped to [0, last event]; a span of another request's
    encode job can start before this request was received) cuts the time into elementary
    intervals; each goes to the *innermost* span covering it, i.e. the one that **ends first**,
    ties going to the one that started latest; spans with the same start and end but different
    names share the interval equally (the leftover microseconds go to the names in sorted order).
    Intervals no span covers go to ``"untracked"`` (``schema.UNTRACKED``). Points (no end) take no time.

    Why "ends first" and not "started latest": for nested spans the two rules agree (the inner
    span both starts later and ends earlier, e.g. ``encode`` inside the prefill worker's
    ``EC loaded from store`` wait in E|PD, ``EC stored`` inside that wait too). Spans also
    overlap without nesting: in E|P|D the encoder can start ``encode`` before the prefill worker
    takes the job and starts waiting for the features, and finish inside that wait; "started
    latest" would then book the encoding as "EC loaded from store". The span that ends first is
    the one the others are waiting on (the wait for features cannot end before the encode it
    waits for), so the shared time goes to the work, and the wait keeps only what is left (the
    load itself). Equal spans are one interval told twice (each image's features source gets the
    worker's whole features span): no rule can pick one, so they share it.
    """
    spans: list[tuple[int, int, str]] = []
    last = 0
    for stage in (doc.get("timeline") or {}).get("stages") or ():
        start = _us(stage.get("start_s"))
        end = _us(stage.get("end_s"))
        if start is None:
            continue
        last = max(last, start if end is None else max(start, end))
        if end is not None and stage.get("duration_s") is not None:
            spans.append((start, end, str(stage["name"])))
    if last <= 0:
        return {}
    clipped = sorted({(max(a, 0), min(b, last), name) for a, b, name in spans if min(b, last) > max(a, 0)})
    cuts = sorted({0, last, *(t for a, b, _ in clipped for t in (a, b))})
    out_us: dict[str, int] = {}
    for lo, hi in zip(cuts, cuts[1:]):
        covering = [(b, -a, name) for a, b, name in clipped if a <= lo and b >= hi]
        if not covering:
            out_us[UNTRACKED] = out_us.get(UNTRACKED, 0) + hi - lo
            continue
        end, neg_start, _ = min(covering)
        names = sorted({name for b, na, name in covering if (b, na) == (end, neg_start)})
        share, extra = divmod(hi - lo, len(names))
        for i, name in enumerate(names):
            out_us[name] = out_us.get(name, 0) + share + (1 if i < extra else 0)
    return {name: us / 1e6 for name, us in out_us.items() if us > 0}


def _us(seconds: Any) -> int | None:
    """Whole microseconds (the timelines round to them), so the partition adds up exactly."""
    return None if seconds is None else round(float(seconds) * 1e6)


async def read_timeline(
    client: httpx.AsyncClient, request_id: str
) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """The stages (union seconds), the exclusive stage seconds and the EC sources of one
    request; ({}, {}, {}) when its timeline cannot be read."""
    doc: dict[str, Any] = {}
    for attempt in range(TIMELINE_ATTEMPTS):
        try:
            resp = await client.get(
                f"/debug/requests/{request_id}", params={"format": "json"}, timeout=TIMELINE_TIMEOUT_S
            )
            resp.raise_for_status()
            doc = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("timeline of %s not read: %s: %s", request_id, type(exc).__name__, exc)
            return {}, {}, {}
        names = {s.get("name") for s in (doc.get("timeline") or {}).get("stages") or ()}
        if names & set(TERMINAL_STAGES):
            break
        await asyncio.sleep(0.2 * (attempt + 1))  # the request's last messages are still on their way
    stages, sources = parse_timeline(doc)
    return stages, exclusive_stage_times(doc), sources


async def add_timelines(
    client: httpx.AsyncClient, records: list[RequestRecord], *, progress: bool
) -> list[RequestRecord]:
    limit = asyncio.Semaphore(TIMELINE_CONCURRENCY)
    todo = [r for r in records if r.ok and r.request_id]
    bar = progress_bar(len(todo), "timelines", enabled=progress, leave=False)

    async def one(record: RequestRecord) -> RequestRecord:
        async with limit:
            stages, exclusive, sources = await read_timeline(client, record.request_id)
        bar.update()
        return msgspec.structs.replace(record, stages=stages, exclusive_stages=exclusive, ec_sources=sources)

    try:
        done = {r.index: r for r in await asyncio.gather(*(one(r) for r in todo))}
    finally:
        bar.close()
    return [done.get(r.index, r) for r in records]


class PlainProgress:
    """A progress report as plain lines (``desc: 10/50 req``), for output that is not a terminal
    (a log file, CI): a line when a tenth more is done or every :data:`PLAIN_PROGRESS_EVERY_S`,
    and one at the end - no carriage returns, no redrawn bar."""

    def __init__(self, total: int | None, desc: str, unit: str, file: Any) -> None:
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.n = 0
        self._said_n = 0
        self._said_at = time.monotonic()
        self._closed = False

    def _say(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}", file=self.file, flush=True)
        self._said_n, self._said_at = self.n, time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        step = max(1, (self.total or 0) // 10)
        if self.n - self._said_n >= step or time.monotonic() - self._said_at >= PLAIN_PROGRESS_EVERY_S:
            self._say()

    def close(self) -> None:
        if not self._closed and self.n != self._said_n:
            self._say()
        self._closed = True


def progress_bar(total: int | None, desc: str, *, enabled: bool, unit: str = "req", leave: bool = True) -> Any:
    """tqdm's bar on a terminal (stderr); plain lines (:class:`PlainProgress`) otherwise."""
    from tqdm import tqdm

    if enabled and not sys.stderr.isatty():
        return PlainProgress(total, desc, unit, sys.stderr)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, leave=leave)


# -- runs ---------------------------------------------------------------------------------------
async def detect_epd(client: httpx.AsyncClient) -> bool:
    """True when the endpoint is epd-serve (its /health names an encoder fingerprint)."""
    try:
        resp = await client.get("/health", timeout=CONNECT_TIMEOUT_S)
        body = resp.json()
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(body, dict) and "encoder_fingerprint" in body


async def served_model(client: httpx.AsyncClient) -> str:
    try:
        resp = await client.get("/v1/models", timeout=CONNECT_TIMEOUT_S)
        if resp.status_code in (401, 403):
            sent = "Authorization" in client.headers
            raise BenchError(
                f"{client.base_url}/v1/models answered {resp.status_code}: "
                + (
                    f"the server refused the API key given (--api-key, else {API_KEY_ENV})"
                    if sent
                    else f"the server asks for an API key: pass --api-key or set {API_KEY_ENV}"
                )
            )
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(
            f"cannot list the served models at {client.base_url}/v1/models "
            f"({type(exc).__name__}: {exc}); pass the model name with --model"
        ) from None


async def _run_point(
    client: httpx.AsyncClient,
    spec: WorkloadSpec,
    *,
    model: str,
    rate: float | None,
    run_index: int,
    epd: bool,
    progress: bool,
    timeout_s: float,
) -> tuple[list[RequestRecord], float]:
    import PIL.Image  # noqa: F401 - drawing the first image should not pay for the import

    desc = f"rate {rate:g}/s" if rate else f"concurrency {spec.concurrency}"
    bar = progress_bar(spec.requests, desc, enabled=progress)
    records: list[RequestRecord] = []
    plan = iter_plan(spec, rate=rate, run_index=run_index)
    t0 = time.perf_counter()
    deadline = None if spec.duration_s is None else t0 + spec.duration_s

    async def send(req: PlannedRequest) -> None:
        records.append(await send_request(client, req, model=model, spec=spec, run_t0=t0, epd=epd, timeout_s=timeout_s))
        bar.update()

    def more(sent: int) -> bool:
        return (spec.requests is None or sent < spec.requests) and (deadline is None or time.perf_counter() < deadline)

    try:
        if rate:  # open loop: send at the planned arrivals
            tasks: list[asyncio.Task[Any]] = []
            for req in plan:
                if spec.requests is not None and len(tasks) >= spec.requests:
                    break
                if spec.duration_s is not None and req.arrival_s > spec.duration_s:
                    break
                delay = t0 + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the arrival schedule, not a synchronisation
                tasks.append(asyncio.create_task(send(req)))
            await asyncio.gather(*tasks)
        else:  # closed loop: each of `concurrency` senders takes the next request when its own ends
            sent = 0

            async def sender() -> None:
                nonlocal sent
                while more(sent):
                    sent += 1
                    await send(next(plan))

            await asyncio.gather(*(sender() for _ in range(spec.concurrency)))
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return records, duration


async def run(
    url: str,
    spec: WorkloadSpec,
    *,
    api_key: str | None = None,
    label: str = "",
    progress: bool = True,
    slo_ms: dict[str, float] | None = None,
    timelines: bool = True,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    verify: ssl.SSLContext | bool = True,
) -> BenchResult:
    """Run ``spec`` against ``url`` (an OpenAI-compatible server's base URL, without ``/v1``):
    one :class:`RunResult` per load point (one, or one per sweep rate). Raises :class:`BenchError`
    only when nothing can run (the server does not answer ``/v1/models`` and no model is given).
    ``verify``: an https server's certificate check (a context with the CA; True: the system CAs)."""
    check_spec(spec)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(spec.concurrency, 32))
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=timeout, limits=limits, verify=verify
    ) as client:
        epd = await detect_epd(client)
        model = spec.model or await served_model(client)
        started_at = time.time()
        if spec.sweep:
            points: list[float | None] = list(spec.sweep)
        else:
            points = [spec.rate if spec.arrival == "poisson" else None]
        runs = []
        for i, rate in enumerate(points):
            records, duration = await _run_point(
                client,
                spec,
                model=model,
                rate=rate,
                run_index=i,
                epd=epd,
                progress=progress,
                timeout_s=request_timeout_s,
            )
            if epd and timelines:
                records = await add_timelines(client, records, progress=progress)
            runs.append(
                RunResult(
                    rate=rate,
                    concurrency=None if rate else spec.concurrency,
                    requests=tuple(records),
                    summary=summarize(records, duration, slo_ms),
                )
            )
    return BenchResult(
        label=label,
        url=url,
        model=model,
        epd=epd,
        started_at=started_at,
        machine=machine(),
        spec=spec,
        runs=tuple(runs),
    )
