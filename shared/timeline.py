"""A request's stage timeline, built from its messages alone, as text or a self-contained HTML page.

Sources of the times (all wall clock, seconds since the epoch):

* each message's JetStream timestamp (when the stream stored it);
* trace headers (``Epd-Stage``: who published, ``Epd-Started-At``: when that worker took the job
  it was working on, ``Epd-Received-At``: when the API received the request);
* payload fields: ``ChatRequestRecord.received_at``, ``ECReady.encode_started_at/encode_s/
  created_at``, and the worker's stage durations in ``FinalResult.timings`` (``features_s``,
  ``admission_s``, ``prefill_s``) and ``ec_sources`` (where each image's features came from, and why).

Stages (names are stable: tests, the HTML page and the docs use them): ``received``,
``image intake``, ``encode queued`` (until an encoder took the job), ``no encode job`` (EC already
stored) / ``encode deduplicated`` (another request's job encodes the image), ``encode``,
``EC stored``, ``EC announced`` (already stored, not recomputed), ``encode failed``,
``generation queued`` (until a prefill worker took the job; with ``EPD_ROUTING=affinity`` its detail
names the worker the job was routed to and why, and a fallback to the shared queue is a second
``generation queued``), ``EC from local cache`` /
``EC loaded from store`` / ``EC recomputed locally`` (with the reason) / ``EC encoded in process``
(agg), ``waiting for an engine slot`` (ready, every slot busy: ``shared.admission``), ``prefill``,
``first token``, ``redelivered``, ``KV hand-off`` / ``decode queued`` (E|P|D),
``decode``, ``done`` / ``error`` / ``cancelled`` (the client disconnected or the API gave up: the
workers were told to stop). A span has an end; a point does not.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any

from shared import protocol
from shared.errors import Cancelled
from shared.history import RequestCase, Stored, Summary, iso_time
from shared.protocol import (
    PREFILL_TIMINGS,
    STAGE_REPLAY,
    DecodeJob,
    ECFailed,
    ECReady,
    ECSource,
    EncodeJob,
    FinalResult,
    GenerationJob,
    StageName,
    Timing,
    recompute_reason,
)
from shared.topology import Service

#: A wait for an engine slot shorter than this is not shown as a stage.
ADMISSION_SHOWN_S = 0.001

#: The ``service`` of a stage (who did it; from the ``Epd-Stage`` header) -> its colour.
SERVICE_COLORS: dict[str, str] = {
    Service.API: "#4e79a7",
    Service.ENCODER: "#f28e2b",
    Service.PREFILL: "#59a14f",
    Service.DECODE: "#b07aa1",
    STAGE_REPLAY: "#76b7b2",
}


def _route(job: GenerationJob) -> str:
    """Where the API sent a generation job and why (``shared.routing``); "" when it did not route."""
    reason = getattr(job, "route_reason", "")
    if not reason:
        return ""
    where = f"routed to {job.routed_to}" if job.routed_to else "shared queue"
    return f"; {where} ({reason}" + (f": {job.route_detail})" if job.route_detail else ")")


@dataclass(frozen=True)
class Stage:
    name: str
    service: str
    start: float
    end: float | None = None
    detail: str = ""

    @property
    def duration(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - self.start)

    def to_json(self, t0: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "service": self.service,
            "detail": self.detail,
            "start_s": round(self.start - t0, 6),
            "end_s": None if self.end is None else round(self.end - t0, 6),
            "duration_s": None if self.duration is None else round(self.duration, 6),
        }


@dataclass
class Timeline:
    request_id: str
    t0: float
    stages: list[Stage]
    summary: Summary
    notes: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "t0": self.t0,
            "t0_iso": iso_time(self.t0),
            "summary": self.summary.to_json(),
            "stages": [s.to_json(self.t0) for s in self.stages],
            "notes": list(self.notes),
        }


_SOURCE_STAGE: dict[str, str] = {
    ECSource.LOCAL_CACHE: StageName.EC_FROM_LOCAL_CACHE,
    ECSource.STORE: StageName.EC_LOADED_FROM_STORE,
    ECSource.LOCAL: StageName.EC_ENCODED_IN_PROCESS,
}


def _ec_stage(source: str) -> tuple[str, str]:
    """("EC recomputed locally", "reason") for "recomputed:<reason>" etc."""
    if source.startswith(ECSource.RECOMPUTED):
        return StageName.EC_RECOMPUTED, recompute_reason(source) or "unknown"
    return _SOURCE_STAGE.get(source, f"EC from {source}"), ""


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f} ms"


def build_timeline(case: RequestCase) -> Timeline:
    """The request's stages, stage by stage (intake, encode, generation, tokens, decode, end),
    sorted by start (a point before a span that starts with it)."""
    t0 = case.received_at
    summary = case.summary()
    own = [m for m in case.messages if m.request_id == case.request_id]
    prefill_msgs = [m for m in own if m.stage == Service.PREFILL]
    taken = prefill_msgs[0].header_time(protocol.HDR_STARTED_AT) if prefill_msgs else None
    decode_job = next((m for m in own if m.kind == "decode_job"), None)
    chunks = case.chunks()
    first_token = chunks[0].time if chunks else None
    stages = [
        *_intake_stages(case, own, summary, t0),
        *_encode_job_stages(case, t0),
        *_encode_event_stages(case),
        *_generation_queued_stages(case, taken),
        *_prefill_stages(case.final, *_worker_timings(case.final, decode_job), taken),
        *_token_stages(case, t0),
        *_decode_stages(case, decode_job, first_token),
        *_end_stages(case, t0),
    ]
    stages.sort(key=lambda s: (s.start, 0 if s.end is None else 1))
    return Timeline(case.request_id, t0, stages, summary, list(case.notes))


def _intake_stages(case: RequestCase, own: list[Stored], summary: Summary, t0: float) -> list[Stage]:
    """``received`` (the replay tool's when it replayed the request) and ``image intake``."""
    first_stage = own[0].stage if own and own[0].stage else Service.API
    detail = f"{summary.images} image(s)"
    if summary.model:
        detail += f", model {summary.model}"
    if summary.replay_of:
        detail += f", replay of {summary.replay_of}"
    stages = [Stage(StageName.RECEIVED, STAGE_REPLAY if first_stage == STAGE_REPLAY else Service.API, t0, None, detail)]
    api_out = [m.time for m in own if m.stage == Service.API and m.time >= t0]
    if summary.images and api_out:
        stages.append(
            Stage(
                StageName.IMAGE_INTAKE,
                Service.API,
                t0,
                min(api_out),
                f"fetch, decode, hash and store {summary.images} image(s)",
            )
        )
    return stages


def _encode_job_stages(case: RequestCase, t0: float) -> list[Stage]:
    """Per image item: ``encode queued`` (this request's job), or why it had none (``no encode
    job``, ``encode deduplicated``)."""
    rid, record, job = case.request_id, case.record, case.generation_job
    queued = {m.msg.image.item_hash: m for m in case.of(EncodeJob) if m.request_id == rid}
    refs = list(record.images if record else ()) or list(job.images if job else ())
    distinct = {r.item_hash: r for r in refs}
    ready = {m.msg.item_hash: m for m in case.of(ECReady)}
    stages: list[Stage] = []
    for item, ref in distinct.items():
        if item in queued:
            continue
        if not ref.encode_queued:
            stages.append(
                Stage(
                    StageName.NO_ENCODE_JOB,
                    Service.API,
                    _queued_time(case, t0),
                    None,
                    f"item {item[:12]}: EC object already stored (or encoded in the worker)",
                )
            )
        else:
            by = ready[item].msg.request_id if item in ready else "another request"
            stages.append(
                Stage(
                    StageName.ENCODE_DEDUPLICATED,
                    Service.API,
                    _queued_time(case, t0),
                    None,
                    f"item {item[:12]}: an encode job was already queued by {by}",
                )
            )
    for item, m in queued.items():
        ev_msg = ready.get(item)
        taken = ev_msg.header_time(protocol.HDR_STARTED_AT) if ev_msg else None
        stages.append(Stage(StageName.ENCODE_QUEUED, Service.API, m.time, taken, f"item {item[:12]}"))
    return stages


def _encode_event_stages(case: RequestCase) -> list[Stage]:
    """What the encoders announced: ``encode`` + ``EC stored``, ``EC announced``, ``encode failed``."""
    stages: list[Stage] = []
    for m in case.of(ECReady):
        ev = m.msg
        whose = "" if ev.request_id == case.request_id else f" (job of request {ev.request_id})"
        if ev.encode_started_at:
            end = ev.encode_started_at + ev.encode_s
            stages.append(
                Stage(
                    StageName.ENCODE,
                    Service.ENCODER,
                    ev.encode_started_at,
                    end,
                    f"item {ev.item_hash[:12]}: {ev.n_tokens} tokens on {ev.producer}{whose}",
                )
            )
            stages.append(
                Stage(
                    StageName.EC_STORED,
                    Service.ENCODER,
                    end,
                    max(end, ev.created_at),
                    f"{ev.nbytes} bytes -> {ev.ec_key}",
                )
            )
        else:
            stages.append(
                Stage(
                    StageName.EC_ANNOUNCED,
                    Service.ENCODER,
                    ev.created_at,
                    None,
                    f"item {ev.item_hash[:12]}: already stored, not recomputed{whose}",
                )
            )
    for f in case.of(ECFailed):
        stages.append(
            Stage(
                StageName.ENCODE_FAILED,
                Service.ENCODER,
                f.time,
                None,
                f"item {f.msg.item_hash[:12]}: {f.msg.code}: {f.msg.message}",
            )
        )
    return stages


def _generation_queued_stages(case: RequestCase, taken: float | None) -> list[Stage]:
    """``generation queued`` per generation job (the first until a prefill worker ``taken`` it;
    a re-prefill's job: ``re-prefill queued``, published by the decode worker)."""
    stages: list[Stage] = []
    for i, gm in enumerate(m for m in case.of(GenerationJob) if m.request_id == case.request_id):
        job = gm.msg
        again = job.reprefill
        stages.append(
            Stage(
                StageName.GENERATION_QUEUED if not again else StageName.REPREFILL_QUEUED,
                Service.API if not again else Service.DECODE,
                gm.time,
                taken if i == 0 else None,
                f"{len(job.images)} image placeholder(s), max_tokens "
                f"{job.sampling.max_tokens}, temperature {job.sampling.temperature:g}" + _route(job),
            )
        )
    return stages


def _worker_timings(final: FinalResult | None, decode_job: Stored | None) -> tuple[dict[str, float], dict[str, str]]:
    """The worker's stage durations and where each image's EC came from: the ``FinalResult``'s,
    the prefill's from the decode job on E|P|D (the prefill's timings travel in it)."""
    timings: dict[str, float] = dict(final.timings) if final else {}
    sources: dict[str, str] = dict(final.ec_sources) if final else {}
    if decode_job is not None:
        dj = decode_job.msg if isinstance(decode_job.msg, DecodeJob) else None
        timings = {
            **(dict(dj.timings) if dj else {}),
            **{k: v for k, v in timings.items() if k not in PREFILL_TIMINGS},
        }
        sources = sources or (dict(dj.ec_sources) if dj else {})
    return timings, sources


def _prefill_stages(
    final: FinalResult | None, timings: dict[str, float], sources: dict[str, str], taken: float | None
) -> list[Stage]:
    """From when a prefill worker took the job: each image's EC (``EC from local cache``, ...),
    ``waiting for an engine slot``, ``prefill``."""
    if taken is None:
        return []
    features_end = taken + timings.get(Timing.FEATURES, 0.0)
    stages: list[Stage] = []
    for item, source in sources.items():
        name, reason = _ec_stage(source)
        detail = f"item {item[:12]}" + (f": {reason}" if reason else "")
        stages.append(Stage(name, Service.PREFILL, taken, features_end, detail))
    prefill_start = features_end + timings.get(Timing.ADMISSION, 0.0)
    if timings.get(Timing.ADMISSION, 0.0) >= ADMISSION_SHOWN_S:
        stages.append(
            Stage(
                StageName.WAITING_FOR_SLOT,
                Service.PREFILL,
                features_end,
                prefill_start,
                "ready, every engine slot of the worker busy",
            )
        )
    if Timing.PREFILL in timings:
        stages.append(
            Stage(
                StageName.PREFILL,
                Service.PREFILL,
                prefill_start,
                prefill_start + timings[Timing.PREFILL],
                f"{final.prompt_tokens} prompt tokens" if final else "",
            )
        )
    return stages


def _token_stages(case: RequestCase, t0: float) -> list[Stage]:
    """``redelivered`` per attempt after the first, and ``first token`` (of the last attempt)."""
    chunks = case.chunks()
    all_chunks = case.token_chunks()
    stages: list[Stage] = []
    for a in sorted({m.msg.attempt for m in all_chunks})[1:]:
        first_of = min(m.time for m in all_chunks if m.msg.attempt == a)
        stages.append(
            Stage(
                StageName.REDELIVERED,
                chunks[0].stage or Service.PREFILL,
                first_of,
                None,
                f"the job was delivered again (attempt {a}); tokens restart at seq 0",
            )
        )
    if chunks:
        first_token = chunks[0].time
        stages.append(
            Stage(
                StageName.FIRST_TOKEN,
                chunks[0].stage or Service.PREFILL,
                first_token,
                None,
                f"TTFT {_ms(first_token - t0)}",
            )
        )
    return stages


def _decode_stages(case: RequestCase, decode_job: Stored | None, first_token: float | None) -> list[Stage]:
    """E|P|D: ``KV hand-off``, ``decode queued`` and ``decode`` on the decode worker; else the
    generating worker's ``decode`` (first token to result)."""
    final, end_msg = case.final, case.terminal
    if first_token is None:
        return []
    if decode_job is not None:
        kv_nbytes = decode_job.msg.kv_nbytes if isinstance(decode_job.msg, DecodeJob) else 0
        stages = [
            Stage(StageName.KV_HANDOFF, Service.PREFILL, first_token, decode_job.time, f"{kv_nbytes} bytes KV object")
        ]
        decode_taken = (
            end_msg.header_time(protocol.HDR_STARTED_AT) if end_msg and end_msg.stage == Service.DECODE else None
        )
        stages.append(Stage(StageName.DECODE_QUEUED, Service.PREFILL, decode_job.time, decode_taken))
        if decode_taken and end_msg is not None:
            stages.append(
                Stage(StageName.DECODE, Service.DECODE, decode_taken, end_msg.time, _decode_detail(final, case))
            )
        return stages
    if end_msg is not None and final is not None:
        return [
            Stage(
                StageName.DECODE,
                end_msg.stage or Service.PREFILL,
                first_token,
                end_msg.time,
                _decode_detail(final, case),
            )
        ]
    return []


def _end_stages(case: RequestCase, t0: float) -> list[Stage]:
    """``done``, ``error`` or ``cancelled`` (the caller gave up; its workers were told to stop)."""
    final, error, end_msg = case.final, case.error, case.terminal
    if end_msg is None:
        return []
    if final is not None:
        return [
            Stage(
                StageName.DONE,
                end_msg.stage or Service.PREFILL,
                end_msg.time,
                None,
                f"finish={final.finish_reason}, {final.completion_tokens} tokens, E2E "
                f"{_ms(end_msg.time - t0)}, worker {final.worker}",
            )
        ]
    if error is not None:
        cancelled = error.code == Cancelled.code
        return [
            Stage(
                StageName.CANCELLED if cancelled else StageName.ERROR,
                error.stage or end_msg.stage or Service.API,
                end_msg.time,
                None,
                f"{error.code} (HTTP {error.http_status}): {error.message}",
            )
        ]
    return []


def _queued_time(case: RequestCase, t0: float) -> float:
    """When the generation job was published (the API decided about encode jobs by then)."""
    gen = [m for m in case.of(GenerationJob) if m.request_id == case.request_id]
    return gen[0].time if gen else t0


def _decode_detail(final: FinalResult | None, case: RequestCase) -> str:
    if final is None:
        return ""
    n = final.completion_tokens
    decode_s = final.timings.get(Timing.DECODE)
    per = f", {decode_s / (n - 1) * 1e3:.1f} ms/token" if decode_s and n > 1 else ""
    return f"{n} tokens{per}"


# -- text ---------------------------------------------------------------------------------------
def render_summary(s: Summary) -> str:
    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}s"

    tokens = "-" if s.completion_tokens is None else str(s.completion_tokens)
    line = (
        f"{s.request_id}  {iso_time(s.received_at)}  {s.status:<10}  images {s.images}  tokens {tokens:>4}  "
        f"TTFT {sec(s.ttft_s):>7}  E2E {sec(s.e2e_s):>7}"
    )
    if s.replay_of:
        line += f"  replay of {s.replay_of}"
    if s.error:
        line += f"  {s.error}"
    return line


def render_text(tl: Timeline) -> str:
    lines = [
        f"timeline (t0 = received {iso_time(tl.t0)}):",
        f"  {'start':>10} {'end':>10} {'duration':>10}  {'service':<8} {'stage':<22} detail",
    ]
    for s in tl.stages:
        end = "" if s.end is None else f"{(s.end - tl.t0) * 1e3:+.1f}"
        lines.append(
            f"  {f'{(s.start - tl.t0) * 1e3:+.1f}':>10} {end:>10} {_ms(s.duration):>10}  "
            f"{s.service:<8} {s.name:<22} {s.detail}"
        )
    lines.append("  (times in ms after t0)")
    return "\n".join(lines)


def render_messages(case: RequestCase) -> str:
    t0 = case.received_at
    lines = [f"messages ({len(case.messages)}, in time order):"]
    for m in case.messages:
        body = protocol.to_builtins(m.msg) if m.msg is not None else {"undecodable": m.error}
        headers = {k: v for k, v in m.headers.items() if k.startswith(("Epd-", "Nats-Msg-Id"))}
        lines.append(f"  {(m.time - t0) * 1e3:+10.1f} ms  {m.stream}#{m.seq}  {m.subject}  {m.kind}")
        lines.append(f"      headers {json.dumps(headers, sort_keys=True)}")
        lines.append(f"      {json.dumps(body, sort_keys=True, ensure_ascii=False)}")
    return "\n".join(lines)


# -- question and answer ------------------------------------------------------------------------
#: characters of the question and of the answer the waterfall page shows (all of both: its messages)
SHOWN_TEXT_CHARS = 4000


def _part_text(part: Any) -> str:
    if isinstance(part, dict):
        if part.get("type") == "text":
            return str(part.get("text", ""))
        kind = str(part.get("type", "part"))
        return "[image]" if kind.startswith("image") else f"[{kind}]"  # (an image_ref in the record)
    return str(part)


def question_text(case: RequestCase) -> str | None:
    """What the request asked, from its record: each chat message as ``role: text`` (an image
    as ``[image]``), or a completion's prompt; None without a record."""
    record = case.record
    if record is None:
        return None
    body = record.body
    messages = body.get("messages")
    if isinstance(messages, list):
        lines = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            text = " ".join(_part_text(p) for p in content) if isinstance(content, list) else str(content or "")
            lines.append(f"{m.get('role', '?')}: {text}")
        return "\n".join(lines)
    prompt = body.get("prompt")
    if prompt is None:
        return None
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def answer_text(case: RequestCase) -> str:
    """The generated text as stored (the last attempt's token chunks, in order)."""
    return "".join(m.msg.text for m in case.chunks())


def bounded(text: str, limit: int = SHOWN_TEXT_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\u2026 ({len(text) - limit} more characters)"


# -- HTML ---------------------------------------------------------------------------------------
def render_html(case: RequestCase, tl: Timeline | None = None, *, index_href: str | None = None) -> str:
    """A self-contained page (inline CSS and SVG, no script, no external asset): the request's
    summary, its question and answer (bounded: :data:`SHOWN_TEXT_CHARS` each), a waterfall of
    its stages across services, the stage table and every message. ``index_href``: a link back
    to the list of requests (the API's ``/debug/requests``)."""
    tl = tl or build_timeline(case)
    e = html.escape
    question = question_text(case)
    answer = answer_text(case)
    exchange = (
        "<h2>Question</h2>"
        + (f'<pre class="text">{e(bounded(question))}</pre>' if question is not None else "<p>(no record)</p>")
        + "<h2>Answer</h2>"
        + (f'<pre class="text">{e(bounded(answer))}</pre>' if answer else "<p>(no tokens)</p>")
    )
    back = f'<p><a href="{e(index_href)}">&larr; recent requests</a></p>' if index_href else ""
    t0 = tl.t0
    svg = _waterfall_svg(tl)

    sm = tl.summary
    facts = [
        ("status", sm.status),
        ("received", iso_time(sm.received_at)),
        ("images", str(sm.images)),
        ("prompt tokens", "-" if sm.prompt_tokens is None else str(sm.prompt_tokens)),
        ("completion tokens", "-" if sm.completion_tokens is None else str(sm.completion_tokens)),
        ("TTFT", _ms(sm.ttft_s) or "-"),
        ("E2E", _ms(sm.e2e_s) or "-"),
        ("source", case.source),
    ]
    if sm.replay_of:
        facts.append(("replay of", sm.replay_of))
    if sm.error:
        facts.append(("error", sm.error))
    legend = " ".join(f'<span class="key" style="background:{c}"></span>{e(n)}' for n, c in SERVICE_COLORS.items())
    rows = "".join(
        f"<tr><td>{(s.start - t0) * 1e3:+.1f} ms</td><td>{'' if s.end is None else f'{(s.end - t0) * 1e3:+.1f} ms'}"
        f"</td><td>{_ms(s.duration)}</td><td>{e(s.service)}</td><td>{e(s.name)}</td><td>{e(s.detail)}</td></tr>"
        for s in tl.stages
    )
    msgs = "".join(
        f"<details><summary>{(m.time - t0) * 1e3:+.1f} ms &middot; {e(m.stream)}#{m.seq} &middot; {e(m.subject)} "
        f"&middot; <b>{e(m.kind)}</b></summary><pre>{e(json.dumps(m.to_json(), indent=2, ensure_ascii=False))}"
        f"</pre></details>"
        for m in case.messages
    )
    notes = "".join(f"<li>{e(n)}</li>" for n in tl.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>epd request {e(tl.request_id)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 18px; }} h2 {{ font-size: 15px; margin-top: 28px; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 10px; border-bottom: 1px solid #eee; text-align: left; }}
.facts td:first-child {{ color: #666; }}
svg .label {{ font-size: 12px; text-anchor: end; }} svg .dur {{ font-size: 11px; fill: #444; }}
svg .tick {{ font-size: 10px; fill: #888; text-anchor: middle; }} svg .grid {{ stroke: #eee; }}
.key {{ display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; }}
pre {{ background: #f7f7f7; padding: 8px; overflow-x: auto; }} details {{ margin: 2px 0; }}
pre.text {{ white-space: pre-wrap; overflow-wrap: anywhere; max-width: 1100px; }}
</style></head>
<body>
{back}
<h1>Request <code>{e(tl.request_id)}</code></h1>
<table class="facts">{"".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in facts)}</table>
{exchange}
<h2>Waterfall</h2>
<div>{legend}</div>
{svg}
<h2>Stages</h2>
<table><tr><th>start</th><th>end</th><th>duration</th><th>service</th><th>stage</th><th>detail</th></tr>{rows}</table>
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
<h2>Messages ({len(case.messages)})</h2>
{msgs}
</body></html>
"""


def _waterfall_svg(tl: Timeline) -> str:
    """The stages as an inline SVG waterfall: a bar per span, a diamond per point, coloured by service."""
    e = html.escape
    t0 = tl.t0
    lo = min([s.start for s in tl.stages] + [t0]) - t0  # < 0 only for clock skew between machines
    hi = max([s.end or s.start for s in tl.stages] + [t0]) - t0
    total = max(hi - lo, 1e-3)
    label_w, chart_w, row_h, top = 230, 640, 22, 24
    height = top + row_h * len(tl.stages) + 10
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + chart_w + 120}" height="{height}" '
        f'role="img" aria-label="waterfall of request {e(tl.request_id)}">'
    ]
    for i in range(5):  # grid with time ticks
        x = label_w + chart_w * i / 4
        svg.append(
            f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 6}" class="grid"/>'
            f'<text x="{x:.1f}" y="{top - 10}" class="tick">{(lo + total * i / 4) * 1e3:.1f} ms</text>'
        )
    for row, s in enumerate(tl.stages):
        y = top + row * row_h
        color = SERVICE_COLORS.get(s.service, "#9c755f")
        x = label_w + chart_w * (s.start - t0 - lo) / total
        svg.append(f'<text x="{label_w - 8}" y="{y + 15}" class="label">{e(s.name)}</text>')
        tip = f"{s.name} ({s.service}) {(s.start - t0) * 1e3:+.1f} ms"
        if s.end is None:
            svg.append(
                f'<path d="M{x:.1f} {y + 4} l6 7 l-6 7 l-6 -7 z" fill="{color}"><title>{e(tip)}</title></path>'
                f'<text x="{x + 10:.1f}" y="{y + 15}" class="dur">{(s.start - t0) * 1e3:+.1f} ms</text>'
            )
        else:
            w = max(1.5, chart_w * (s.end - s.start) / total)
            svg.append(
                f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" rx="2" fill="{color}">'
                f"<title>{e(tip)}, {_ms(s.duration)}</title></rect>"
                f'<text x="{x + w + 4:.1f}" y="{y + 15}" class="dur">{_ms(s.duration)}</text>'
            )
    svg.append("</svg>")
    return "".join(svg)
