"""``epd plan``: worker counts per role (E:PD, E:P:D, or one aggregated pool) for a target request
rate and SLO, from measured stage costs.

The model (docs/benchmarking.md, "epd plan: sizing", explains it for users):

* Each role is a queue with ``c`` workers; one worker serves one job at a time for the job's
  service time (the measured stage cost, which already contains whatever batching or core sharing
  the measured run had). Arrivals are Poisson.
* Service times per job: encoder = encode + storing the EC object, per *cold* item (one encode
  job per distinct image or video clip not stored yet). Images and clips are two kinds of item,
  each with its own measured cost (a clip's encode covers all its sampled frames): per request,
  ``images x (1 - text-only share) x (1 - video share) x (1 - repeat share)`` cold images and
  ``(1 - text-only share) x video share x (1 - video repeat share)`` cold clips (as
  ``workload.iter_plan`` draws them; the later turns of a conversation bring none). The encoder's
  service time is the mean over its jobs of both kinds. prefill = loading each item's features
  (cold or not, at the kind's load cost; not the wait for the encoder, which is the encoder's
  time) + prefill (+ the KV hand-off in E|P|D); decode = decode seconds per output token x output
  tokens; PD (E|PD) = prefill + decode on one worker; agg = everything on one worker.
* A mix with a kind of item the costs have no figure for (cold clips, but no measured or given
  per-clip encode; clips at all, but no per-clip EC load) is refused (:class:`PlanError`, exit 2),
  never planned as if that kind cost nothing.
* Utilisation ``rho = lambda x S / c``; the count is the smallest ``c`` (at least 1) with
  ``rho <= target`` (default 0.8, headroom for bursts: waits grow as 1 / (1 - rho)).
* With an SLO, each bound is shared among the roles on its path in proportion to their service
  time on that path (TTFT: encoder, then the prefill side up to the first token; TPOT: decode wait
  + decode over the output tokens; E2E: every role), and a role gets workers until its M/M/c
  (Erlang C) mean queue wait + service on the path fits its share. A bound smaller than the sum of
  the service times on its path cannot be met by adding workers: the plan says so (exit 1).

Measured costs come from a bench result against epd-serve (the per-request stage seconds from the
timelines, :data:`ENCODER_STAGES` etc.), from the timelines of the last N minutes read from the
streams (``--from-streams``, through ``shared.history`` and ``shared.timeline``, parsed like the
bench runner does; a request's images and clips counted from its record's media refs, as the
stream summary counts both as images), or from ``--costs``. ``--validate`` starts the plan's
topology scaled down on this machine and runs the workload (:func:`validate`). Exit codes: 0 a
plan (and, with ``--validate``, the SLO held); 1 the SLO cannot be met (or failed validation); 2
bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.protocol import MediaKind, StageName
from shared.tools.bench.schema import BenchResult, RequestRecord, WorkloadSpec

EXIT_SLO = 1
EXIT_ERROR = 2
DEFAULT_TARGET = 0.8
#: Give up adding workers to one role beyond this (an SLO its service time almost fills).
MAX_WORKERS = 1024
_EPS = 1e-9

#: Timeline stage names (shared.timeline) whose seconds are a worker's busy time, per side.
ENCODER_STAGES = (StageName.ENCODE, StageName.EC_STORED)
#: On the prefill (or PD / agg) worker before its prefill: loading or computing the features.
FEATURE_STAGES = (StageName.EC_FROM_LOCAL_CACHE, StageName.EC_LOADED_FROM_STORE, StageName.EC_RECOMPUTED)
#: Of those, the loads (a recompute waited ``EPD_EC_WAIT_S`` first: not a cost of the mix).
LOAD_STAGES = (StageName.EC_FROM_LOCAL_CACHE, StageName.EC_LOADED_FROM_STORE)
#: The encoder-side stages a load of a freshly encoded image includes (it waits for them).
ENCODE_WAIT_STAGES = (StageName.ENCODE_QUEUED, StageName.ENCODE, StageName.EC_STORED)
IN_PROCESS_ENCODE = StageName.EC_ENCODED_IN_PROCESS  # agg: the encode happens inside the one worker
PREFILL_STAGE = StageName.PREFILL
HANDOFF_STAGE = StageName.KV_HANDOFF
DECODE_STAGE = StageName.DECODE

TOPOLOGIES = ("e-pd", "e-p-d", "agg")
#: The ``epd up`` flag per role, and the ratio letters.
ROLE_FLAGS = {
    "encoder": "--encoders",
    "pd": "--prefills",
    "prefill": "--prefills",
    "decode": "--decoders",
    "agg": "--prefills",
}
ROLE_LETTERS = {"encoder": "E", "pd": "PD", "prefill": "P", "decode": "D", "agg": "A"}


class PlanError(Exception):
    """Bad or insufficient input (no stage timings in the result, a non-positive rate, ...)."""


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageCosts:
    """Seconds of worker time: encode per cold image, prefill per request, decode per output
    token, loading features on the prefill side per image, the KV hand-off per request; and the
    same two per video clip (encode, EC load): None where not measured or given (a mix with clips
    then cannot be planned: :func:`check_costs`)."""

    encode_s: float
    prefill_s: float
    decode_s_per_token: float
    handoff_s: float = 0.0
    ec_load_s: float = 0.0
    source: str = "given"
    video_encode_s: float | None = None
    video_ec_load_s: float | None = None


@dataclass(frozen=True)
class Mix:
    """The workload, per request on average: images that need an encode, output tokens, and all
    images (cold or not: each is loaded by the prefill side; None: as many as cold ones); video
    clips likewise (cold ones and all of them)."""

    cold_images: float
    output_tokens: float
    images: float | None = None
    cold_videos: float = 0.0
    videos: float | None = None

    @property
    def all_images(self) -> float:
        return self.cold_images if self.images is None else self.images

    @property
    def all_videos(self) -> float:
        return self.cold_videos if self.videos is None else self.videos

    @property
    def cold_items(self) -> float:
        """Encode jobs per request: cold images and cold clips."""
        return self.cold_images + self.cold_videos


def mix_from_spec(
    spec: WorkloadSpec,
    *,
    images: float | None = None,
    repeat_share: float | None = None,
    text_only_share: float | None = None,
    output_tokens: float | None = None,
    video_share: float | None = None,
    video_repeat_share: float | None = None,
) -> Mix:
    """The mix ``workload.iter_plan`` draws from ``spec``, per request. A conversation is text-only
    (text-only share), else one video clip (video share of those) or images: cold images = mean
    images per image request x (1 - text-only share) x (1 - video share) x (1 - repeat share),
    cold clips = (1 - text-only share) x video share x (1 - video repeat share) (the first clip or
    image of a run is always new: ignored), both divided among a conversation's turns, which all
    carry its images or clip; output tokens = the mean of the spec's uniform range. Keyword
    arguments override the spec's fields."""
    if images is None:
        total = sum(spec.images_per_request.values())
        images = sum(k * w for k, w in spec.images_per_request.items()) / total if total > 0 else 0.0
    rs = spec.repeat_share if repeat_share is None else repeat_share
    ts = spec.text_only_share if text_only_share is None else text_only_share
    vs = spec.video_share if video_share is None else video_share
    vrs = spec.video_repeat_share if video_repeat_share is None else video_repeat_share
    out = (spec.output_tokens[0] + spec.output_tokens[1]) / 2 if output_tokens is None else output_tokens
    for name, share in (
        ("repeat share", rs),
        ("text-only share", ts),
        ("video share", vs),
        ("video repeat share", vrs),
    ):
        if not 0.0 <= share <= 1.0:
            raise PlanError(f"{name} {share:g} is not in [0, 1]")
    if images < 0 or out < 0:
        raise PlanError("images and output tokens must be >= 0")
    # A conversation is one text-only request, or ``turns`` requests of which only the first can
    # bring new images or a new clip (the later turns ask about the same ones).
    # (The factors in this order: with no videos, the figures are bit for bit the ones from before.)
    requests_per_conversation = ts + (1.0 - ts) * spec.turns
    return Mix(
        cold_images=images * (1.0 - ts) * (1.0 - vs) * (1.0 - rs) / requests_per_conversation,
        output_tokens=out,
        images=images * (1.0 - ts) * (1.0 - vs) * spec.turns / requests_per_conversation,
        cold_videos=(1.0 - ts) * vs * (1.0 - vrs) / requests_per_conversation,
        videos=(1.0 - ts) * vs * spec.turns / requests_per_conversation or None,
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _item_costs(done: list[RequestRecord], items: Any) -> tuple[float, float, float, float]:
    """(encode seconds, items encoded, EC load seconds, items loaded) of the requests ``items``
    (a request -> its items of one kind, 0 for a request that has none or other kinds too) counts:
    see :func:`costs_from_records`."""
    encoded = [
        (sum(r.stages.get(s, 0.0) for s in ENCODER_STAGES) + r.stages.get(IN_PROCESS_ENCODE, 0.0), items(r))
        for r in done
        if items(r) > 0
    ]
    encoded = [(s, n) for s, n in encoded if s > 0]
    # A stage's seconds are the union of its spans (runner.parse_timeline): the items of one
    # request encoded in parallel overlap, so single-item requests give the per-item cost.
    single = [(s, n) for s, n in encoded if n == 1]
    enc_s, enc_n = sum(s for s, _ in single or encoded), sum(n for _, n in single or encoded)
    loading = [
        r
        for r in done
        if items(r) > 0 and any(s in r.stages for s in LOAD_STAGES) and StageName.EC_RECOMPUTED not in r.stages
    ]
    pure = [r for r in loading if not any(s in r.stages for s in ENCODE_WAIT_STAGES)]
    loads = [
        (
            sum(r.stages.get(s, 0.0) for s in LOAD_STAGES)
            - (0.0 if pure else sum(r.stages.get(s, 0.0) for s in ENCODE_WAIT_STAGES)),
            items(r),
        )
        for r in pure or loading
    ]
    return enc_s, enc_n, sum(max(0.0, s) for s, _ in loads), sum(n for _, n in loads)


def _images_only(r: RequestRecord) -> int:
    return r.images if not r.videos else 0


def _videos_only(r: RequestRecord) -> int:
    return r.videos if not r.images else 0


def costs_from_records(records: list[RequestRecord], source: str = "records") -> StageCosts:
    """Stage costs from completed requests' timeline stages (epd-serve results).

    Per kind of item (images; video clips, ``RequestRecord.videos``), over the requests that
    carried only that kind (a request with both images and clips is left out of both kinds'
    encode and EC load: its stages cannot be split between them; the bench workload never sends
    one): encode = (encode + EC stored) / items over the requests that encoded (on an agg result:
    the in-process encode), from single-item requests when there are any. EC load per item: the
    loads (store or local cache) of requests that encoded nothing (a load of a fresh item includes
    waiting for its encoder, which is the encoder's time); without such requests, the loads minus
    the encoder-side stages they waited for. Requests whose features were recomputed (they waited
    ``EPD_EC_WAIT_S`` first) are left out of the EC load. Without any clip request the video costs
    are None (not measured), and without an encoded clip the per-clip encode is; an image cost not
    measured is 0, as it always was. A clip encoded in segments (``EPD_VIDEO_SEGMENT_FRAMES``) on
    several encoders at once counts the union of its segments' spans, less than the encoders' busy
    time: measure clips of one segment, or with one encoder, for an exact figure.

    prefill: the mean prefill stage (of every request, whatever it carried). decode: total decode
    seconds / total output tokens. KV hand-off: mean over the requests that had one (E|P|D).
    """
    done = [r for r in records if r.ok and r.stages]
    if not done:
        raise PlanError(f"{source}: no completed request with stage timings (was it run against epd-serve?)")
    enc_s, enc_n, load_s, load_n = _item_costs(done, _images_only)
    v_enc_s, v_enc_n, v_load_s, v_load_n = _item_costs(done, _videos_only)
    clips = sum(1 for r in done if _videos_only(r) > 0)
    mixed = sum(1 for r in done if r.images and r.videos)
    prefills = [r.stages[PREFILL_STAGE] for r in done if PREFILL_STAGE in r.stages]
    dec = [(r.stages[DECODE_STAGE], r.output_tokens) for r in done if DECODE_STAGE in r.stages and r.output_tokens]
    if not prefills or not dec:
        raise PlanError(f"{source}: the timelines have no prefill or decode stage")
    what = f"{int(enc_n)} encoded images"
    if clips or mixed:
        what += f", {int(v_enc_n)} encoded video clips"
    if mixed:
        what += f"; {mixed} with both left out of the per-item costs"
    return StageCosts(
        encode_s=enc_s / enc_n if enc_n else 0.0,
        prefill_s=_mean(prefills) or 0.0,
        decode_s_per_token=sum(s for s, _ in dec) / sum(n for _, n in dec),
        handoff_s=_mean([r.stages[HANDOFF_STAGE] for r in done if HANDOFF_STAGE in r.stages]) or 0.0,
        ec_load_s=load_s / load_n if load_n else 0.0,
        source=f"{source}: {len(done)} requests ({what})",
        video_encode_s=v_enc_s / v_enc_n if v_enc_n else None,
        video_ec_load_s=(v_load_s / v_load_n if v_load_n else 0.0) if clips else None,
    )


def costs_from_result(result: BenchResult, run_index: int | None = None, source: str = "result") -> StageCosts:
    """:func:`costs_from_records` over every run of ``result`` (or run ``run_index`` of a sweep)."""
    if not result.epd:
        raise PlanError(f"{source}: not an epd-serve result (no stage timings); measure epd-serve, or pass --costs")
    runs = result.runs
    if run_index is not None:
        if not 0 <= run_index < len(runs):
            raise PlanError(f"{source}: no run {run_index} (it has {len(runs)})")
        runs = (runs[run_index],)
    return costs_from_records([r for run in runs for r in run.requests], source)


def mix_from_records(records: list[RequestRecord]) -> Mix:
    """The observed mix: images and video clips of the requests whose timeline has an encode (per
    request; all of a request's items count as cold then, as all its images always did), all
    images and clips, and the mean output tokens, over the completed requests."""
    done = [r for r in records if r.ok]
    if not done:
        raise PlanError("no completed requests")
    encoded = [r for r in done if any(s in r.stages for s in (*ENCODER_STAGES, IN_PROCESS_ENCODE))]
    videos = sum(r.videos for r in done)
    return Mix(
        cold_images=sum(r.images for r in encoded) / len(done),
        output_tokens=sum(r.output_tokens for r in done) / len(done),
        images=sum(r.images for r in done) / len(done),
        cold_videos=sum(r.videos for r in encoded) / len(done),
        videos=videos / len(done) if videos else None,
    )


def media_counts(case: Any, items: int) -> tuple[int, int]:
    """(images, video clips) of a ``history.RequestCase`` whose summary counts ``items`` media
    items: the clips are its record's (else its generation job's) refs of kind video."""
    record, job = case.record, case.generation_job
    refs = record.images if record is not None else (job.images if job is not None else ())
    videos = sum(1 for ref in refs if ref.kind == MediaKind.VIDEO)
    return max(0, items - videos), videos


async def records_from_streams(nc: Any, subjects: Any, *, since_s: float, limit: int) -> list[RequestRecord]:
    """The completed requests of the last ``since_s`` seconds (newest first, at most ``limit``) as
    bench records, their stages read from the streams the way ``/debug/requests`` and the bench
    runner read them (``shared.history`` -> ``shared.timeline`` -> ``runner.parse_timeline``).

    The summary's ``images`` counts every media item (``ChatRequestRecord.images`` holds a ref per
    image and per clip): the clips are the refs of kind video (:func:`media_counts`)."""
    from shared import history, timeline
    from shared.tools.bench.runner import parse_timeline

    reader = history.StreamReader(nc)
    listed = await history.list_requests(
        nc, subjects, since_s=since_s, status=history.RequestStatus.OK, limit=limit, reader=reader
    )
    records = []
    for i, summ in enumerate(listed):
        case = await history.find_case(nc, subjects, summ.request_id, reader=reader)
        stages, sources = parse_timeline({"case": case.to_json(), "timeline": timeline.build_timeline(case).to_json()})
        images, videos = media_counts(case, summ.images)
        records.append(
            RequestRecord(
                index=i,
                kind="video" if videos else "image" if images else "text",
                images=images,
                videos=videos,
                sent_at=0.0,
                ok=True,
                request_id=summ.request_id,
                prompt_tokens=summ.prompt_tokens or 0,
                output_tokens=summ.completion_tokens or 0,
                ttft_s=summ.ttft_s,
                e2e_s=summ.e2e_s,
                stages=stages,
                ec_sources=sources,
            )
        )
    return records


def read_streams(since_s: float, limit: int, nats_url: str | None, prefix: str | None) -> list[RequestRecord]:
    """:func:`records_from_streams` on the deployment the ``EPD_*`` settings (or the flags) name."""
    import asyncio

    from shared.config import ToolSettings
    from shared.errors import EPDError
    from shared.jetstream import connect, redact_url
    from shared.protocol import Subjects
    from shared.tools.replay_cli import NATS_HINT, _quiet

    overrides: dict[str, Any] = {k: v for k, v in (("nats_url", nats_url), ("subject_prefix", prefix)) if v}
    try:
        settings = ToolSettings(**overrides)
    except ValueError as exc:  # settings validation (e.g. a bad --prefix)
        raise PlanError(f"invalid settings: {exc}") from exc

    async def main() -> list[RequestRecord]:
        try:
            nc = await asyncio.wait_for(
                connect(
                    settings.nats,
                    name="epd-plan",
                    connect_timeout=5.0,
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    error_cb=_quiet,  # the one error raised says it all
                ),
                timeout=15.0,
            )
        except (TimeoutError, OSError) as exc:
            raise PlanError(
                f"cannot connect to NATS at {redact_url(settings.nats.nats_url)}: {exc or 'timed out'}; {NATS_HINT}"
            ) from exc
        except EPDError as exc:  # connect's own "cannot connect" (ServiceUnavailable)
            raise PlanError(f"{exc.message}; {NATS_HINT}") from exc
        try:
            return await records_from_streams(nc, Subjects(settings.nats.subject_prefix), since_s=since_s, limit=limit)
        finally:
            await nc.close()

    try:
        return asyncio.run(main())
    except EPDError as exc:
        raise PlanError(f"reading the streams: {exc.code}: {exc.message}") from exc


def parse_costs(text: str) -> StageCosts:
    """``encode=0.2,prefill=0.3,decode=0.05[,handoff=0.01][,ec_load=0.005][,video_encode=1.5]
    [,video_ec_load=0.05]`` (seconds; decode per output token, ec_load per image, the video ones
    per clip; video_ec_load is 0 when only video_encode is given, as ec_load is; without either,
    no video cost: a mix with clips is refused)."""
    keys = {
        "encode": "encode_s",
        "prefill": "prefill_s",
        "decode": "decode_s_per_token",
        "handoff": "handoff_s",
        "ec_load": "ec_load_s",
        "video_encode": "video_encode_s",
        "video_ec_load": "video_ec_load_s",
    }
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key.strip() not in keys:
            raise argparse.ArgumentTypeError(
                f"invalid cost {part!r}: use encode=S,prefill=S,decode=S_PER_TOKEN (optional: handoff, ec_load, "
                "video_encode, video_ec_load)"
            )
        try:
            values[keys[key.strip()]] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid cost {part!r}: seconds") from None
    missing = {"encode_s", "prefill_s", "decode_s_per_token"} - values.keys()
    if missing or any(v < 0 for v in values.values()):
        raise argparse.ArgumentTypeError(f"invalid costs {text!r}: need encode, prefill and decode, each >= 0")
    if "video_encode_s" in values:
        values.setdefault("video_ec_load_s", 0.0)
    return StageCosts(**values, source="--costs")


# -- queueing --------------------------------------------------------------------------------------
def erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``servers`` servers and offered
    ``load`` = lambda x S (Erlang C), via the Erlang B recursion (no factorials). 1.0 if load >= c."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return servers * b / (servers - load * (1.0 - b))


def mmc_wait(arrival: float, service: float, servers: int) -> float:
    """Mean queue wait (seconds) of M/M/c: ``C(c, a) x S / (c - a)``; inf when unstable."""
    load = arrival * service
    if load <= 0:
        return 0.0
    if load >= servers:
        return math.inf
    return erlang_c(servers, load) * service / (servers - load)


def min_workers(arrival: float, service: float, target: float) -> int:
    """The smallest c >= 1 with ``arrival x service / c <= target``."""
    return max(1, math.ceil(arrival * service / target - _EPS))


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class RolePlan:
    role: str
    jobs_per_request: float
    service_s: float
    workers: int
    rate: float
    why: list[str] = field(default_factory=list)

    @property
    def arrival(self) -> float:
        return self.rate * self.jobs_per_request

    @property
    def load(self) -> float:
        return self.arrival * self.service_s

    @property
    def utilisation(self) -> float:
        return self.load / self.workers

    @property
    def wait_s(self) -> float:
        return mmc_wait(self.arrival, self.service_s, self.workers)

    @property
    def max_rate(self) -> float:
        """Request rate at which this role's workers are busy 100% of the time."""
        per_request = self.jobs_per_request * self.service_s
        return math.inf if per_request <= 0 else self.workers / per_request


@dataclass(frozen=True)
class PathItem:
    """A role on an SLO's path: its service seconds on the path; ``waits``: its queue wait counts."""

    role: str
    service_s: float
    waits: bool


@dataclass
class Plan:
    topology: str
    rate: float
    target: float
    costs: StageCosts
    mix: Mix
    slo_ms: dict[str, float]
    roles: list[RolePlan]
    #: SLO key -> the roles on a request's path for that figure (see :func:`_roles`)
    paths: dict[str, list[PathItem]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    feasible: bool = True

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    @property
    def counts(self) -> dict[str, int]:
        return {r.role: r.workers for r in self.roles}

    @property
    def ratio(self) -> str:
        return ":".join(str(r.workers) for r in self.roles)

    def expected_ms(self, key: str) -> float:
        """The model's mean ``key`` (ttft, tpot, e2e) in ms at these counts: queue waits + service
        on the path (no network, image intake or scheduling hops; TPOT per output token)."""
        by_name = {r.role: r for r in self.roles}
        total = sum((by_name[p.role].wait_s if p.waits else 0.0) + p.service_s for p in self.paths[key])
        per = self.mix.output_tokens if key == "tpot" else 1.0
        return math.nan if per <= 0 else total / per * 1e3

    @property
    def bottleneck(self) -> RolePlan:
        """The role that saturates first as the rate grows (highest utilisation)."""
        return max(self.roles, key=lambda r: (r.utilisation, -self.roles.index(r)))

    def to_json(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "rate": self.rate,
            "target": self.target,
            "slo_ms": self.slo_ms,
            "costs": asdict(self.costs),
            "mix": asdict(self.mix),
            "ratio": self.ratio,
            "feasible": self.feasible,
            "bottleneck": self.bottleneck.role,
            "notes": self.notes,
            "expected_ms": {k: self.expected_ms(k) for k in self.paths if math.isfinite(self.expected_ms(k))},
            "roles": [
                {
                    "role": r.role,
                    "workers": r.workers,
                    "jobs_per_s": r.arrival,
                    "service_s": r.service_s,
                    "utilisation": r.utilisation,
                    "wait_s": r.wait_s if math.isfinite(r.wait_s) else None,
                    "max_rate": r.max_rate if math.isfinite(r.max_rate) else None,
                    "why": r.why,
                }
                for r in self.roles
            ],
        }


MEASURE_VIDEOS = (
    "measure a workload with video clips against epd-serve (epd bench run --video-share F, with "
    "--video-repeat-share below 1 for the encode), or give them: --costs ...,video_encode=S,video_ec_load=S"
)


def check_costs(c: StageCosts, m: Mix) -> None:
    """PlanError when ``m`` has a kind of item ``c`` has no cost for (clips without video costs)."""
    if m.cold_videos > 0 and c.video_encode_s is None:
        raise PlanError(
            f"the workload has {m.cold_videos:.3g} cold video clip(s) per request but the costs ({c.source}) "
            f"have no per-clip video encode: {MEASURE_VIDEOS}"
        )
    if m.all_videos > 0 and c.video_ec_load_s is None:
        raise PlanError(
            f"the workload has {m.all_videos:.3g} video clip(s) per request but the costs ({c.source}) have "
            f"no per-clip video EC load: {MEASURE_VIDEOS}"
        )


def _roles(topology: str, c: StageCosts, m: Mix, rate: float) -> tuple[list[RolePlan], dict[str, list[PathItem]]]:
    """The role pools of ``topology`` and, per SLO key, the path of a request through them."""
    check_costs(c, m)
    video_enc = m.cold_videos * (c.video_encode_s or 0.0)
    enc = m.cold_images * c.encode_s + video_enc  # per request
    dec = m.output_tokens * c.decode_s_per_token
    # The prefill side loads every item's features.
    pre = c.prefill_s + m.all_images * c.ec_load_s + m.all_videos * (c.video_ec_load_s or 0.0)
    # One encode job per cold item; its service time the mean over both kinds (images only: encode_s).
    jobs = m.cold_items
    enc_job = enc / jobs if m.cold_videos > 0 else c.encode_s
    encoder = RolePlan("encoder", jobs, enc_job, 1, rate)
    e_path = [PathItem("encoder", enc_job, True)] if jobs > 0 else []
    if topology == "agg":
        agg = RolePlan("agg", 1.0, enc + c.prefill_s + dec, 1, rate)
        return [agg], {
            "ttft": [PathItem("agg", enc + c.prefill_s, True)],
            "tpot": [PathItem("agg", dec, False)],
            "e2e": [PathItem("agg", agg.service_s, True)],
        }
    if topology == "e-pd":
        pd = RolePlan("pd", 1.0, pre + dec, 1, rate)
        return [encoder, pd], {
            "ttft": e_path + [PathItem("pd", pre, True)],
            "tpot": [PathItem("pd", dec, False)],
            "e2e": e_path + [PathItem("pd", pd.service_s, True)],
        }
    if topology == "e-p-d":
        prefill = RolePlan("prefill", 1.0, pre + c.handoff_s, 1, rate)
        decode = RolePlan("decode", 1.0, dec, 1, rate)
        # The first token comes before the hand-off; the decode queue wait shows in TPOT, not TTFT.
        return [encoder, prefill, decode], {
            "ttft": e_path + [PathItem("prefill", pre, True)],
            "tpot": [PathItem("decode", dec, True)],
            "e2e": e_path + [PathItem("prefill", prefill.service_s, True), PathItem("decode", dec, True)],
        }
    raise PlanError(f"unknown topology {topology!r}: use {', '.join(TOPOLOGIES)}")


def fixed_plan(costs: StageCosts, mix: Mix, rate: float, topology: str, counts: dict[str, int]) -> Plan:
    """The model's figures (utilisation, waits, expected means) for given worker counts."""
    roles, paths = _roles(topology, costs, mix, rate)
    for r in roles:
        r.workers = max(1, int(counts[r.role]))
    return Plan(topology, rate, DEFAULT_TARGET, costs, mix, {}, roles, paths)


def make_plan(
    costs: StageCosts,
    mix: Mix,
    rate: float,
    topology: str = "e-pd",
    *,
    target: float = DEFAULT_TARGET,
    slo_ms: dict[str, float] | None = None,
) -> Plan:
    """Worker counts per role of ``topology`` for ``rate`` req/s (see the module doc for the model)."""
    if not rate > 0:
        raise PlanError(f"rate must be > 0 req/s, not {rate:g}")
    if not 0 < target < 1:
        raise PlanError(f"utilisation target must be in (0, 1), not {target:g}")
    slo_ms = dict(slo_ms or {})
    roles, paths = _roles(topology, costs, mix, rate)
    plan = Plan(topology, rate, target, costs, mix, slo_ms, roles, paths)
    by_name = {r.role: r for r in roles}
    for r in roles:
        r.workers = min_workers(r.arrival, r.service_s, target)
        r.why.append(
            f"{r.arrival:.3g} jobs/s x {r.service_s:.3g} s = {r.load:.3g} busy workers; "
            f"at most {target:g} busy each -> {r.workers}"
        )
    for key, bound_ms in slo_ms.items():
        per = mix.output_tokens if key == "tpot" else 1.0
        if key == "tpot" and per <= 0:
            continue
        bound = bound_ms / 1e3 * per  # seconds over the path (TPOT x tokens)
        path = [p for p in paths[key] if p.service_s > 0]
        total = sum(p.service_s for p in path)
        unit = " per token" if key == "tpot" else ""
        if total >= bound - _EPS and any(p.waits for p in path) or total > bound + _EPS:
            plan.feasible = False
            plan.notes.append(
                f"{key} {bound_ms:g} ms{unit} cannot be met by adding workers: the service time on "
                f"its path alone is {total / per * 1e3:.1f} ms ({' + '.join(p.role for p in path)})"
            )
            continue
        for p in path:
            r = by_name[p.role]
            if not p.waits:
                r.why.append(
                    f"{key} {bound_ms:g} ms{unit}: {p.service_s / per * 1e3:.1f} ms of service, no queue on this path"
                )
                continue
            share = bound * p.service_s / total
            before = r.workers
            while r.wait_s + p.service_s > share + _EPS and r.workers < MAX_WORKERS:
                r.workers += 1
            if r.wait_s + p.service_s > share + _EPS:
                plan.feasible = False
                plan.notes.append(
                    f"{key}: {p.role} cannot fit its share {share * 1e3:.1f} ms with {MAX_WORKERS} workers"
                )
            elif r.workers > before:
                r.why.append(
                    f"{key} {bound_ms:g} ms{unit}: its share {share / per * 1e3:.1f} ms "
                    f"({p.service_s:.3g} of {total:.3g} s on the path); wait + service with {before} "
                    f"workers {(mmc_wait(r.arrival, r.service_s, before) + p.service_s) / per * 1e3:.1f} ms"
                    f" -> {r.workers} workers: {(r.wait_s + p.service_s) / per * 1e3:.1f} ms"
                )
            else:
                r.why.append(
                    f"{key} {bound_ms:g} ms{unit}: wait + service {(r.wait_s + p.service_s) / per * 1e3:.1f}"
                    f" ms within its share {share / per * 1e3:.1f} ms"
                )
    if mix.cold_items <= 0 and "encoder" in by_name:
        plan.notes.append("no cold images (or clips) in this mix: one encoder is kept for images outside it")
    return plan


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def format_plan(plan: Plan) -> str:
    c, m = plan.costs, plan.mix
    slo = ", ".join(f"{k}={v:g} ms" for k, v in plan.slo_ms.items()) or "none"
    lines = [
        f"== {plan.topology} at {plan.rate:g} req/s (utilisation target {plan.target:g}, SLO {slo}) ==",
        f"costs ({c.source}): encode {c.encode_s * 1e3:.1f} ms/image, prefill {c.prefill_s * 1e3:.1f} ms/request, "
        f"decode {c.decode_s_per_token * 1e3:.2f} ms/token, EC load {c.ec_load_s * 1e3:.1f} ms/image, "
        f"KV hand-off {c.handoff_s * 1e3:.1f} ms"
        + (
            f"; video encode {_ms(c.video_encode_s)} ms/clip, video EC load {_ms(c.video_ec_load_s)} ms/clip"
            if c.video_encode_s is not None or c.video_ec_load_s is not None
            else ""
        ),
        f"workload: {m.cold_images:.3g} cold of {m.all_images:.3g} image(s)"
        + (f", {m.cold_videos:.3g} cold of {m.all_videos:.3g} video clip(s)" if m.all_videos > 0 else "")
        + f" and {m.output_tokens:.3g} output tokens per request",
        "",
    ]
    head = ("role", "workers", "jobs/s", "service ms", "busy", "util", "wait ms", "max req/s")
    rows = [head]
    for r in plan.roles:
        wait = "inf" if not math.isfinite(r.wait_s) else f"{r.wait_s * 1e3:.1f}"
        rows.append(
            (
                r.role,
                str(r.workers),
                f"{r.arrival:.3g}",
                f"{r.service_s * 1e3:.1f}",
                f"{r.load:.3g}",
                f"{r.utilisation:.2f}",
                wait,
                "inf" if not math.isfinite(r.max_rate) else f"{r.max_rate:.3g}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(row)))
    letters = ":".join(ROLE_LETTERS[r.role] for r in plan.roles)
    b = plan.bottleneck
    lines += [
        "",
        f"recommended {letters} = {plan.ratio} ({sum(r.workers for r in plan.roles)} workers); "
        f"bottleneck: {b.role} (utilisation {b.utilisation:.2f}; saturates at {b.max_rate:.3g} req/s)",
        "expected means: "
        + ", ".join(
            f"{k.upper()} {plan.expected_ms(k):.1f} ms" for k in plan.paths if math.isfinite(plan.expected_ms(k))
        )
        + " (queue waits + service; transport and image intake not modelled)",
        "  epd up --topology "
        + plan.topology
        + " "
        + " ".join(f"{ROLE_FLAGS[r.role]} {r.workers}" for r in plan.roles),
        "reasoning:",
    ]
    for r in plan.roles:
        lines += [f"  {r.role}: {why}" for why in r.why]
    lines += [f"  note: {n}" for n in plan.notes]
    if not plan.feasible:
        lines.append("  the SLO cannot be met at this rate with these stage costs")
    return "\n".join(lines)


# -- --validate ------------------------------------------------------------------------------------
def scale_down(plan: Plan, max_workers: int) -> tuple[dict[str, int], float]:
    """Counts and rate for a small-scale check: every count times the same factor (floored, at
    least 1), and the rate times the smallest factor a loaded role got, so no role is busier than
    planned. (Fewer workers pool less: waits at small scale are longer than at full scale.)"""
    counts = plan.counts
    total = sum(counts.values())
    if total <= max_workers:
        return counts, plan.rate
    factor = max_workers / total
    small = {role: max(1, math.floor(c * factor)) for role, c in counts.items()}
    loaded = [r for r in plan.roles if r.load > 0]
    rate = plan.rate * min((small[r.role] / r.workers for r in loaded), default=1.0)
    return small, rate


def validation_spec(
    spec: WorkloadSpec,
    rate: float,
    requests: int,
    *,
    images: float | None = None,
    repeat_share: float | None = None,
    text_only_share: float | None = None,
    output_tokens: float | None = None,
    video_share: float | None = None,
    video_repeat_share: float | None = None,
) -> WorkloadSpec:
    """``spec`` as Poisson arrivals at ``rate`` for ``requests`` requests, with the plan's overrides."""
    import msgspec

    changes: dict[str, Any] = {
        "arrival": "poisson",
        "rate": rate,
        "sweep": (),
        "requests": requests,
        "duration_s": None,
    }
    if images is not None:
        changes["images_per_request"] = {max(1, round(images)): 1.0}
    if repeat_share is not None:
        changes["repeat_share"] = repeat_share
    if text_only_share is not None:
        changes["text_only_share"] = text_only_share
    if output_tokens is not None:
        changes["output_tokens"] = (round(output_tokens), round(output_tokens))
    if video_share is not None:
        changes["video_share"] = video_share
    if video_repeat_share is not None:
        changes["video_repeat_share"] = video_repeat_share
    return msgspec.structs.replace(spec, **changes)


def validate(
    plan: Plan,
    spec: WorkloadSpec,
    *,
    data_dir: Path,
    max_workers: int,
    requests: int,
    model: str | None = None,
    engine: str | None = None,
    ready_timeout: float = 300.0,
    out: Path | None = None,
) -> tuple[bool, str]:
    """Start ``plan``'s topology scaled down to ``max_workers`` workers (embedded NATS and S3 on
    free ports, as ``epd up`` does), run ``spec`` at the scaled rate with the bench runner, and
    compare the measured means with the model's and with the SLO. (ok, report text)."""
    import asyncio
    import os

    from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, ModelSettings, StoreSettings
    from shared.tools.bench import runner
    from shared.tools.infra import EmbeddedNats, EmbeddedS3, free_port
    from shared.tools.launcher import Stack
    from shared.tools.models.tiny import default_model_dir, tiny_model_is_current
    from shared.topology import Service

    counts, rate = scale_down(plan, max_workers)
    small = fixed_plan(plan.costs, plan.mix, rate, plan.topology, counts)
    spec = validation_spec(spec, rate, requests)
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    store = StoreSettings()
    model_path = Path(model) if model else ModelSettings().model_path
    if model_path is None:
        model_path = default_model_dir(data_dir)
        if not tiny_model_is_current(model_path):
            from shared.tools.models.tiny import build_tiny_model

            build_tiny_model(model_path, arch="qwen2_vl", size="tiny", seed=0)
    access, secret = store.s3_access_key.get_secret_value(), store.s3_secret_key.get_secret_value()
    nats = EmbeddedNats(data_dir / "nats")
    s3 = EmbeddedS3(data_dir / "s3", access_key=access or None, secret_key=secret or None)
    stack: Stack | None = None
    engine = engine or os.environ.get("EPD_ENGINE", "transformers")
    replicas = {
        Service.ENCODER: counts.get("encoder", 1),
        Service.PREFILL: counts.get("pd") or counts.get("prefill") or counts.get("agg") or 1,
        Service.DECODE: counts.get("decode", 1),
    }
    print(
        f"validating {plan.topology} {small.ratio} at {rate:.3g} req/s ({requests} requests, model "
        f"{model_path.name}, engine {engine}; data {data_dir})",
        flush=True,
    )
    try:
        nats.start()
        s3.start()
        env = {
            "EPD_NATS_URL": nats.url,
            "EPD_S3_ENDPOINT": s3.endpoint,
            S3_ACCESS_KEY_ENV: s3.access_key,
            S3_SECRET_KEY_ENV: s3.secret_key,
            "EPD_MODEL_PATH": str(model_path.resolve()),
            "EPD_ENGINE": engine,
            "EPD_VLLM_DIR": os.environ.get("EPD_VLLM_DIR") or str(data_dir / "vllm"),
        }
        stack = Stack(
            env=env, log_dir=data_dir / "logs", topology=plan.topology, api_port=free_port(), replicas=replicas
        )
        stack.start()
        stack.wait_ready(timeout=ready_timeout)
        result = asyncio.run(
            runner.run(
                stack.base_url, spec, label=f"plan-validate {plan.topology} {small.ratio}", slo_ms=plan.slo_ms or None
            )
        )
    finally:
        if stack is not None:
            stack.stop()
        s3.stop()
        nats.stop()
    if out is not None:
        from shared.tools.bench.schema import dump

        out.write_bytes(dump(result))
    return judge(plan, small, result)


def judge(plan: Plan, small: Plan, result: BenchResult) -> tuple[bool, str]:
    """Measured means against the small-scale model and the SLO: ok when every request completed
    and each SLO bound holds for the measured mean."""
    s = result.runs[0].summary
    measured = {
        "ttft": s.ttft_ms.mean if s.ttft_ms else None,
        "tpot": s.tpot_ms.mean if s.tpot_ms else None,
        "e2e": s.e2e_ms.mean if s.e2e_ms else None,
    }
    lines = [
        f"validation: {s.completed} completed, {s.failed} failed, {s.request_throughput:.3g} req/s",
        f"  {'figure':<8} {'model ms':>10} {'measured ms':>12} {'SLO ms':>8}",
    ]
    ok = s.failed == 0 and s.completed > 0
    for key, value in measured.items():
        bound = plan.slo_ms.get(key)
        model_ms = small.expected_ms(key)
        held = bound is None or (value is not None and value <= bound)
        ok = ok and held
        lines.append(
            f"  {key.upper():<8} {model_ms:>10.1f} {'-' if value is None else f'{value:.1f}':>12} "
            f"{'-' if bound is None else f'{bound:g}':>8}{'' if held else '  MISSED'}"
        )
    try:
        measured_costs = costs_from_result(result, source="validation run")
        lines.append(
            f"  stage costs measured now: encode {measured_costs.encode_s * 1e3:.1f} ms/image, prefill "
            f"{measured_costs.prefill_s * 1e3:.1f} ms, decode {measured_costs.decode_s_per_token * 1e3:.2f}"
            f" ms/token (planned with {plan.costs.encode_s * 1e3:.1f} / {plan.costs.prefill_s * 1e3:.1f} / "
            f"{plan.costs.decode_s_per_token * 1e3:.2f})"
            + (
                f"; video encode {_ms(measured_costs.video_encode_s)} ms/clip (planned with "
                f"{_ms(plan.costs.video_encode_s)})"
                if measured_costs.video_encode_s is not None or plan.mix.cold_videos > 0
                else ""
            )
        )
    except PlanError as exc:
        lines.append(f"  (no stage costs from the validation run: {exc})")
    lines.append("  SLO held" if ok and plan.slo_ms else ("  done" if ok else "  SLO NOT held (or requests failed)"))
    return ok, "\n".join(lines)


# -- Kubernetes ------------------------------------------------------------------------------------
def wait_budget_s(plan: Plan, role: RolePlan) -> float:
    """The queue wait ``role`` may have: for each SLO bound on its path, its share of the bound (as
    :func:`make_plan` shares it) less its service there, the tightest; without an SLO, one service
    time. Never below a tenth of the service time (an SLO the plan cannot meet)."""
    budgets = []
    for key, bound_ms in plan.slo_ms.items():
        per = plan.mix.output_tokens if key == "tpot" else 1.0
        path = [p for p in plan.paths.get(key, []) if p.service_s > 0]
        total = sum(p.service_s for p in path)
        for p in path:
            if p.role == role.role and p.waits and total > 0 and per > 0:
                budgets.append(bound_ms / 1e3 * per * p.service_s / total - p.service_s)
    budget = min(budgets) if budgets else role.service_s
    return max(budget, 0.1 * role.service_s)


def emit_kubernetes(plan: Plan, out: Path, accelerator: str) -> list[Path]:
    """``--emit kubernetes DIR``: the plan's KEDA bounds and thresholds as an overlay of the committed
    ``deploy/kubernetes/<topology>-<accelerator>`` (shared.tools.kubernetes.scaling_from_plan)."""
    from shared.tools import kubernetes as kube

    scaling = {
        kube.PLAN_ROLE_SERVICE[r.role]: kube.scaling_from_plan(
            r.role, workers=r.workers, jobs_per_s=r.arrival, wait_s=wait_budget_s(plan, r)
        )
        for r in plan.roles
    }
    note = (
        f"# From `epd plan`: {plan.topology} at {plan.rate:g} req/s, ratio {plan.ratio}, utilisation target "
        f"{plan.target:g}{', SLO ' + str(plan.slo_ms) if plan.slo_ms else ''}; costs: {plan.costs.source}.\n"
    )
    name = kube.overlay_name(plan.topology, accelerator)
    return kube.write_plan_overlay(out / name, plan.topology, accelerator, scaling, note=note)


# -- CLI -------------------------------------------------------------------------------------------
def _parse_duration(text: str) -> float:
    from shared.tools.replay_cli import parse_duration

    return parse_duration(text)


def _parse_slo(text: str) -> dict[str, float]:
    from shared.tools.bench.report import parse_slo  # numpy: only when the flag is given

    return parse_slo(text)


def add_parser(sub: Any) -> None:
    """Add ``plan`` to the ``epd`` parser."""
    p = sub.add_parser("plan", help="worker counts per role for a request rate and SLO, from measured stage costs")
    p.add_argument(
        "result",
        nargs="?",
        type=Path,
        metavar="RESULT.json",
        help="an epd bench result against epd-serve: its stage timings and workload",
    )
    p.add_argument(
        "--costs",
        type=parse_costs,
        metavar="encode=S,prefill=S,decode=S",
        help="stage costs instead of a result (seconds; decode per output token; optional handoff=S, "
        "ec_load=S per image, video_encode=S and video_ec_load=S per clip)",
    )
    p.add_argument(
        "--from-streams",
        type=_parse_duration,
        metavar="DURATION",
        help="costs and mix from the completed requests of the last DURATION (15m, 2h) in the streams",
    )
    p.add_argument("--nats-url", help="with --from-streams: NATS URL (default: EPD_NATS_URL)")
    p.add_argument("--prefix", help="with --from-streams: subject prefix (default: EPD_SUBJECT_PREFIX)")
    p.add_argument("--limit", type=int, default=1000, help="with --from-streams: newest requests read (default 1000)")
    p.add_argument("--run", type=int, default=None, help="take costs from this run of a sweep (default: all)")
    p.add_argument("--rate", type=float, required=True, help="target request rate, req/s")
    p.add_argument(
        "--slo",
        type=_parse_slo,
        default=None,
        metavar="ttft=MS,tpot=MS",
        help="mean latency bounds (ms; keys ttft, tpot, e2e)",
    )
    p.add_argument("--target", type=float, default=DEFAULT_TARGET, help="utilisation target per role (default 0.8)")
    p.add_argument(
        "--topology",
        action="append",
        choices=TOPOLOGIES,
        help="plan this topology (repeatable; default: e-pd and e-p-d)",
    )
    p.add_argument("--images", type=float, help="images per image request (default: the result's workload)")
    p.add_argument("--repeat-share", type=float, help="share of image requests whose images were seen before")
    p.add_argument("--text-only-share", type=float, help="share of requests without images")
    p.add_argument("--output-tokens", type=float, help="output tokens per request")
    p.add_argument("--video-share", type=float, help="share of requests with media that carry a video clip")
    p.add_argument("--video-repeat-share", type=float, help="share of video requests whose clip was sent before")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument(
        "--emit",
        nargs=2,
        metavar=("kubernetes", "DIR"),
        help="write each plan as a Kubernetes overlay DIR/<topology>-<accelerator>: KEDA bounds and thresholds "
        "over deploy/kubernetes/ (docs/kubernetes.md)",
    )
    p.add_argument(
        "--accelerator", choices=["cpu", "gpu"], default="cpu", help="with --emit: the overlay's (default cpu)"
    )
    v = p.add_argument_group("--validate", "start the recommended topology locally at small scale and run the workload")
    v.add_argument("--validate", action="store_true", help="check the (first) plan on this machine")
    v.add_argument("--max-workers", type=int, default=3, help="workers to scale the plan down to (default 3)")
    v.add_argument("--validate-requests", type=int, default=30, help="requests of the validation run (default 30)")
    v.add_argument(
        "--data-dir",
        type=Path,
        default=Path("var") / "plan-validate",
        help="data folder of the validation stack (default var/plan-validate)",
    )
    v.add_argument("--model", help="model folder (default: EPD_MODEL_PATH, else the tiny test model)")
    v.add_argument("--validate-out", type=Path, metavar="FILE.json", help="write the validation run's bench result")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.tools.bench.schema import load

    try:
        if sum(x is not None for x in (args.result, args.costs, args.from_streams)) != 1:
            raise PlanError("give one of: a bench result file, --costs, --from-streams")
        spec = WorkloadSpec()
        observed: Mix | None = None
        if args.from_streams is not None:
            records = read_streams(args.from_streams, args.limit, args.nats_url, args.prefix)
            costs = costs_from_records(records, source=f"streams, last {args.from_streams:g} s")
            observed = mix_from_records(records)
        elif args.result is not None:
            try:
                result = load(args.result.read_bytes())
            except OSError as exc:
                raise PlanError(f"{args.result}: {exc.strerror or exc}") from exc
            except ValueError as exc:  # msgspec's DecodeError / ValidationError
                raise PlanError(f"{args.result}: not a bench result: {exc}") from exc
            costs = costs_from_result(result, args.run, source=str(args.result))
            spec = result.spec
        else:
            costs = args.costs
        overrides = {
            "images": args.images,
            "repeat_share": args.repeat_share,
            "text_only_share": args.text_only_share,
            "output_tokens": args.output_tokens,
            "video_share": args.video_share,
            "video_repeat_share": args.video_repeat_share,
        }
        if observed is not None and all(f is None for f in overrides.values()):
            mix = observed
        else:
            mix = mix_from_spec(spec, **overrides)
        plans = [
            make_plan(costs, mix, args.rate, t, target=args.target, slo_ms=args.slo)
            for t in (args.topology or ["e-pd", "e-p-d"])
        ]
    except PlanError as exc:
        print(f"epd plan: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps([p.to_json() for p in plans], indent=2))
    else:
        print("\n\n".join(format_plan(p) for p in plans))
    if args.emit:
        fmt, out = args.emit
        if fmt != "kubernetes":
            print(f"epd plan: --emit {fmt}: the one format is kubernetes", file=sys.stderr)
            return EXIT_ERROR
        for p in plans:
            for path in emit_kubernetes(p, Path(out), args.accelerator):
                print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    ok = all(p.feasible for p in plans)
    if args.validate:
        from shared.tools.infra import InfraError
        from shared.tools.launcher import StackError

        vspec = validation_spec(spec, plans[0].rate, args.validate_requests, **overrides)
        try:
            held, text = validate(
                plans[0],
                vspec,
                data_dir=args.data_dir,
                max_workers=args.max_workers,
                requests=args.validate_requests,
                model=args.model,
                out=args.validate_out,
            )
        except (InfraError, StackError, OSError, ValueError) as exc:
            print(f"epd plan --validate: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print()
        print(text)
        ok = ok and held
    return 0 if ok else EXIT_SLO
