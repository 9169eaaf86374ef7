"""The bench result format: what ``epd bench run`` writes (JSON) and ``compare`` / ``plan`` read.

Plain msgspec structs, versioned by ``BenchResult.schema``. Times are seconds (floats) unless a
name says otherwise; latency statistics are milliseconds (``LatencyStats``), as vLLM prints them.
"""

from __future__ import annotations

import msgspec

SCHEMA = 1

#: The exclusive-time bucket (``RequestRecord.exclusive_stages``) for instants of a request no stage
#: span covers: hops between services, the API's own work, a worker's time between the end of its
#: prefill and the first token's message, ...
UNTRACKED = "untracked"


class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A workload, from flags or a YAML file (same field names). Deterministic for a ``seed``."""

    seed: int = 0
    #: stop after this many requests (per sweep point), or after ``duration_s`` (whichever is set)
    requests: int | None = 50
    duration_s: float | None = None
    #: "concurrency": ``concurrency`` requests always in flight; "poisson": arrivals at ``rate`` req/s
    arrival: str = "concurrency"
    concurrency: int = 1
    rate: float | None = None
    #: a rate sweep: one run per rate (arrival "poisson")
    sweep: tuple[float, ...] = ()
    #: images per image request -> weight (e.g. {1: 0.8, 2: 0.2})
    images_per_request: dict[int, float] = msgspec.field(default_factory=lambda: {1: 1.0})
    #: image size buckets "WxH" -> weight
    image_sizes: dict[str, float] = msgspec.field(default_factory=lambda: {"448x448": 1.0})
    #: share of image requests whose images repeat an earlier one, chosen among the last ``repeat_window`` images
    repeat_share: float = 0.0
    repeat_window: int = 16
    #: share of requests with no image at all
    text_only_share: float = 0.0
    #: prompt length in words and output length in tokens: [min, max], uniform
    prompt_words: tuple[int, int] = (16, 16)
    output_tokens: tuple[int, int] = (32, 32)
    #: turns per conversation about one image (each turn's request carries the history so far)
    turns: int = 1
    #: share of the requests with media that carry one video clip instead of images
    video_share: float = 0.0
    #: frames per clip, [min, max] uniform (4-32): every frame is sampled (``media_io_kwargs.video.fps``
    #: = the clip's rate); Qwen-VL loaders take an even count (an odd one samples one frame less)
    video_frames: tuple[int, int] = (8, 8)
    #: clip frame size buckets "WxH" -> weight
    video_sizes: dict[str, float] = msgspec.field(default_factory=lambda: {"224x224": 1.0})
    #: share of video requests that send again a clip among the last ``repeat_window`` clips (the
    #: case the EC store speeds up); the others send a clip never sent before
    video_repeat_share: float = 0.0
    ignore_eos: bool = True
    #: the served model name (default: the first of GET /v1/models)
    model: str | None = None


class LatencyStats(msgspec.Struct, frozen=True, kw_only=True):
    """Milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float
    std: float = 0.0


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the client saw it (and, against our API, as its timeline tells)."""

    index: int
    #: "text" | "image" | "repeat" (an image request whose images were all seen before) | "video" |
    #: "video_repeat" (its clip was sent before)
    kind: str
    images: int
    sent_at: float  # seconds since the run started
    ok: bool
    status: int = 0  # HTTP status (0: no answer)
    error: str = ""
    request_id: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    #: inter-token latencies (gaps between streamed token chunks), seconds
    itl_s: tuple[float, ...] = ()
    #: our API only: stage name -> seconds (from /debug/requests/<id>?format=json timelines)
    stages: dict[str, float] = msgspec.field(default_factory=dict)
    #: our API only: stage name -> exclusive seconds, a partition of the timeline from received to its
    #: last event (each instant to one stage, "untracked" where none ran: ``runner.exclusive_stage_times``),
    #: so they add up to the server-side E2E; empty in results written before it was recorded
    exclusive_stages: dict[str, float] = msgspec.field(default_factory=dict)
    #: our API only: item hash -> where its features came from (store, local_cache, recomputed:..., local)
    ec_sources: dict[str, str] = msgspec.field(default_factory=dict)
    #: video clips the request carried
    videos: int = 0


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """What ``vllm bench serve`` prints, plus goodput and (our API) stage means and EC counts."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # req/s
    output_token_throughput: float  # tok/s
    total_token_throughput: float  # tok/s (prompt + output)
    ttft_ms: LatencyStats | None
    tpot_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None
    #: requests/s that met every SLO bound (``--slo ttft=500,tpot=50``, milliseconds); None without an SLO
    goodput: float | None = None
    slo_ms: dict[str, float] = msgspec.field(default_factory=dict)
    #: stage name -> mean seconds over the requests that have it
    stage_means_s: dict[str, float] = msgspec.field(default_factory=dict)
    #: stage name -> mean exclusive seconds per request over the completed requests that have exclusive
    #: times (a request without the stage counts 0): they add up to those requests' mean server-side E2E
    exclusive_stage_means_s: dict[str, float] = msgspec.field(default_factory=dict)
    #: EC source -> count (store / local_cache / recomputed / local / ...)
    ec_counts: dict[str, int] = msgspec.field(default_factory=dict)


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """One run at one load point (a sweep has several)."""

    rate: float | None  # req/s (poisson), None for a concurrency run
    concurrency: int | None
    requests: tuple[RequestRecord, ...]
    summary: Summary


class BenchResult(msgspec.Struct, frozen=True, kw_only=True):
    schema: int = SCHEMA
    label: str
    url: str
    model: str
    #: True when the endpoint is epd-serve (per-stage breakdown available)
    epd: bool
    started_at: float  # epoch
    machine: str  # e.g. "2 cores, Linux 6.x, Python 3.11"
    spec: WorkloadSpec
    runs: tuple[RunResult, ...]


def dump(result: BenchResult) -> bytes:
    return msgspec.json.format(msgspec.json.encode(result), indent=2)


def load(data: bytes) -> BenchResult:
    return msgspec.json.decode(data, type=BenchResult)
