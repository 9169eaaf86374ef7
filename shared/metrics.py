"""Prometheus metrics shared by all services (names in vLLM's ``prefix:name`` style).

Every process exposes the default registry on ``/metrics`` (the API on its own port, workers on
``EPD_METRICS_PORT`` when set). Importing this module turns off prometheus_client's ``*_created``
series (one per counter and histogram series: the time it was created), as vLLM's server does:
every process that exposes metrics imports it first.
"""

from __future__ import annotations

import enum
import json
import threading
import time
import weakref
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class LookupOutcome(enum.StrEnum):
    """What a lookup of one request item's encoder output came to: the ``outcome`` label of
    ``epd:ec_lookups_total`` (workers reading the store, the API's store check, the vLLM EC
    connector)."""

    #: validated bytes loaded from the store
    HIT = "hit"
    #: not stored (or not storable: a bad identifier): encoded locally
    MISS = "miss"
    #: stored but unusable (corrupt, other shape, too slow, ...): encoded locally
    FALLBACK = "fallback"
    #: unobtainable and the request carries no local input for it: vLLM fails the request
    UNAVAILABLE = "unavailable"
    #: vLLM still held the item (encoder or prefix cache): the connector was not asked
    ENGINE_CACHE = "engine_cache"


EC_LOOKUPS = Counter(
    "epd:ec_lookups_total",
    "Encoder-output lookups by where the features came from and why a source missed.",
    ["source", "outcome", "reason"],
)
EC_BYTES = Counter("epd:ec_bytes_total", "EC object bytes moved to/from the store.", ["direction"])
EC_STORE_LATENCY = Histogram(
    "epd:ec_store_latency_seconds", "Latency of EC store operations.", ["op"], buckets=_LATENCY_BUCKETS
)
ENCODE_SECONDS = Histogram("epd:encode_seconds", "Vision encoder time per image.", buckets=_LATENCY_BUCKETS)


class JobOutcome(enum.StrEnum):
    """The ``outcome`` label of the job counters (``ENCODE_JOBS``, ``GENERATION_JOBS``): the
    handler counts its successes, ``shared.worker`` the rest (``Reject(outcome=...)``). A
    ``StrEnum``: prometheus_client labels with ``str()``, which is the value."""

    #: a generation finished
    OK = "ok"
    #: an encode job wrote its EC object
    ENCODED = "encoded"
    #: an encode job found its EC object already stored (announced again)
    ALREADY_STORED = "already_stored"
    #: an encode job whose item a generating worker had stolen (``shared.ec_lifecycle.claims``):
    #: acked without encoding, the stealer announces it
    STOLEN = "stolen"
    #: the message did not decode as the handler's job type
    BAD_MESSAGE = "bad_message"
    #: failed, redelivered later
    RETRIED = "retried"
    #: its request was cancelled (dropped before it ran, or stopped)
    CANCELLED = "cancelled"
    #: a redelivered job whose request had already ended (its result published): acked, not run
    ALREADY_DONE = "already_done"
    #: ended its request with an error (``Reject``'s default)
    FAILED = "failed"
    #: the request's deadline passed before a worker took the job
    EXPIRED = "expired"
    #: the job itself is invalid (e.g. a model the worker does not serve)
    REJECTED = "rejected"
    #: a routed job another worker took over (``shared.routed_jobs``): dropped before its result
    SUPERSEDED = "superseded"


ROUTING_DECISIONS = Counter(
    "epd:routing_decisions_total",
    "Where the API sent generation jobs (EPD_ROUTING=affinity): a worker holding the images "
    "(affinity), the least loaded one (load), the shared queue after the routed worker did not take "
    "it (fallback), the shared queue from the start (no_affinity).",
    ["reason"],
)


class PrefixCacheKind(enum.StrEnum):
    """The ``kind`` label of ``PREFIX_CACHE_TOKENS``."""

    #: a generation job's prompt tokens
    QUERY = "query"
    #: those of them the engine's prefix cache already held
    HIT = "hit"


PREFIX_CACHE_TOKENS = Counter(
    "epd:prefix_cache_tokens_total",
    "Prompt tokens of generation jobs (kind=query) and those the engine's prefix cache already held "
    "(kind=hit; vLLM's automatic prefix caching, reported per request): hit / query is the prefix-cache "
    "hit ratio that cache-aware routing raises.",
    ["kind"],
)
ROUTING_CLAIMS = Counter(
    "epd:routing_claims_total",
    "Routed generation jobs a worker took: claimed (won), already claimed by itself (redelivered), "
    "claimed elsewhere and dropped (lost), or not checkable (error, retried).",
    ["outcome"],
)
ENCODE_JOBS = Counter("epd:encode_jobs_total", "Encode jobs handled by outcome.", ["outcome"])
EC_STEALS = Counter(
    "epd:ec_steals_total",
    "Items of queued encode jobs a generating worker took for its own engine (EPD_ENCODE_STEALS), by outcome: "
    "stolen, then announced (stored) or failed.",
    ["outcome"],
)
GENERATION_JOBS = Counter("epd:generation_jobs_total", "Generation jobs handled by outcome.", ["outcome"])
QUEUE_SECONDS = Histogram(
    "epd:queue_time_seconds",
    "Time a job waited in its stream before a worker took it.",
    ["stream"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram("epd:time_to_first_token_seconds", "Time to first token seen by the API.", buckets=_LATENCY_BUCKETS)
E2E = Histogram("epd:e2e_request_latency_seconds", "End-to-end request latency at the API.", buckets=_LATENCY_BUCKETS)
REQUESTS = Counter("epd:requests_total", "API requests by final status code.", ["status"])
IN_FLIGHT = Gauge("epd:requests_in_flight", "Requests being processed.", ["service"])

# HTTP request metrics of the API, as prometheus-fastapi-instrumentator's defaults (vLLM's server
# exports these): the route template as ``handler`` ("none": no route), status grouped ("2xx").
#: routes left out of the HTTP metrics (as vLLM's server leaves them out)
HTTP_EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/ping", "/version"})
HTTP_REQUESTS = Counter(
    "http_requests_total", "Total number of requests by method, status and handler.", ["method", "status", "handler"]
)
HTTP_REQUEST_DURATION = Histogram(
    "http_request_duration_seconds",
    "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important.",
    ["method", "handler"],
    buckets=(0.1, 0.5, 1.0),
)

# E|P|D: KV hand-off from prefill to decode workers, batched decode.
KV_LOOKUPS = Counter(
    "epd:kv_lookups_total", "KV object loads by decode workers by outcome and miss reason.", ["outcome", "reason"]
)
KV_BYTES = Counter("epd:kv_bytes_total", "KV object bytes moved to/from the store.", ["direction"])


class KVHandoffOutcome(enum.StrEnum):
    """The ``outcome`` label of ``KV_HANDOFFS`` (a prefill worker in role ``prefill``)."""

    #: the KV object is stored and the decode job published
    HANDED_OFF = "handed_off"
    #: the first token was the last: nothing to hand off
    FINISHED_IN_PREFILL = "finished_in_prefill"
    #: decoded here: the KV object (or the decode job) was over its size limit
    LOCAL_TOO_LARGE = "local_too_large"
    #: decoded here: the store could not take the KV object
    LOCAL_STORE_ERROR = "local_store_error"
    #: decoded here: the engine could not hand off (vLLM KV connector)
    LOCAL_ENGINE_ERROR = "local_engine_error"


KV_HANDOFFS = Counter(
    "epd:kv_handoffs_total",
    "Prefill outcomes in role 'prefill': handed off, finished by prefill, or decoded locally (and why).",
    ["outcome"],
)
REPREFILLS = Counter(
    "epd:reprefills_total", "Requests sent back to prefill because their KV object was unusable.", ["reason"]
)
DECODE_BATCH_ROWS = Histogram(
    "epd:decode_batch_rows", "Rows (requests) per batched decode step.", buckets=(1, 2, 4, 8, 16, 32, 64)
)

# Observability (replay, timelines): per-token latency, bytes moved, consumer lag, in-flight jobs.
TPOT = Histogram(
    "epd:time_per_output_token_seconds",
    "Time per output token after the first, seen by the API.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5),
)
PROMPT_TOKENS = Counter("epd:prompt_tokens_total", "Prompt tokens of completed requests.")
GENERATION_TOKENS = Counter("epd:generation_tokens_total", "Completion tokens of completed requests.")
MEDIA_BYTES = Counter("epd:media_bytes_total", "Image bytes moved to/from the store.", ["direction"])
MESSAGE_BYTES = Counter("epd:message_bytes_total", "Payload bytes published to JetStream, by message kind.", ["kind"])
PUBLISH_RETRIES = Counter(
    "epd:publish_retries_total",
    "Publishes (and the API's EC index reads) tried again while JetStream had no stream leader "
    "(a NATS election or reconnect).",
)
CONSUMER_PENDING = Gauge(
    "epd:consumer_num_pending",
    "Messages in a stream not yet delivered to its durable consumer (consumer lag), polled by the workers.",
    ["stream", "consumer"],
)
CONSUMER_ACK_PENDING = Gauge(
    "epd:consumer_num_ack_pending",
    "Messages delivered to a durable consumer and not yet acknowledged (being worked on).",
    ["stream", "consumer"],
)
REQUESTS_CANCELLED = Counter(
    "epd:requests_cancelled_total",
    "Cancelled requests, by where the cancellation took effect: api (the caller "
    "gave up), or the worker stage that dropped a queued job or stopped a running one.",
    ["stage"],
)
ENCODE_BATCH_IMAGES = Histogram(
    "epd:encode_batch_images",
    "Images per vision-tower forward (transformers engine: concurrent encodes share forwards).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)

# EC store lifecycle (shared.ec_lifecycle.janitor, shared.ec_lifecycle.index).
EC_STORE_BYTES = Gauge(
    "epd:ec_store_bytes", "Bytes of EC objects in the store by encoder fingerprint (janitor's index).", ["fingerprint"]
)
EC_STORE_OBJECTS = Gauge(
    "epd:ec_store_objects", "EC objects in the store by encoder fingerprint (janitor's index).", ["fingerprint"]
)
EC_EVICTIONS = Counter(
    "epd:ec_evictions_total",
    "EC objects removed from the store, by why: bytes / objects "
    "(over a bound, LRU), ttl (unused too long), retired (model version gone), purge (epd ec "
    "purge), gone (removed behind the index's back).",
    ["reason"],
)
EC_USES_RECORDED = Counter(
    "epd:ec_uses_recorded_total", "EC object uses written to the index (one per object per flush, however many hits)."
)
EC_INVALIDATIONS = Counter(
    "epd:ec_invalidations_total",
    "Local copies of EC objects dropped after an invalidation event, by holder.",
    ["holder"],
)

# -- scaling signals (the API's ``services.api.scaling``; docs/kubernetes.md, docs/scaling-out.md) --
#: the names deployments scale on (``shared.tools.kubernetes``'s KEDA triggers)
PENDING_WORK_METRIC = "epd:pending_work_seconds"
QUEUE_LAG_METRIC = "epd:queue_lag_jobs"
PENDING_WORK_SECONDS = Gauge(
    PENDING_WORK_METRIC,
    "A worker role's pending work in seconds: its queue's jobs (delivered or not, shared and routed "
    "consumers alike) x the role's cost per job measured from recent jobs.",
    ["role"],
)
QUEUE_LAG_JOBS = Gauge(
    QUEUE_LAG_METRIC,
    "A worker role's queued jobs: num_pending + num_ack_pending of its consumers (what KEDA's "
    "nats-jetstream scaler reads of the shared one).",
    ["role"],
)
JOB_COST_SECONDS = Gauge(
    "epd:job_cost_seconds",
    "A worker role's cost per job: the median busy seconds of its recent jobs (a default before any).",
    ["role"],
)

# -- vLLM-compatible metrics (vllm:*) of the whole disaggregated system, measured at the API ------
#
# Names, help texts, label names and bucket boundaries are vLLM 0.32's
# (vllm/v1/metrics/loggers.py, vllm/v1/metrics/buckets.py), so dashboards and autoscalers built for
# vLLM read them unchanged. vLLM labels per engine (``model_name``, ``engine``); the API is one
# front end for every worker, so these carry ``model_name`` only. Registered on first use by
# :class:`ApiRequestMetrics` (the API process only): worker processes running vLLM register
# vLLM's own per-engine ``vllm:*`` metrics under the same names.

VLLM_TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
#: vLLM's ``FinishReason`` strings: every ``vllm:request_success_total`` series exists from the start
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
#: ``vllm:request_prompt_tokens`` etc. when the model's context length is unknown
DEFAULT_MAX_MODEL_LEN = 32768


def vllm_request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def model_max_len(model_dir: Path, override: int | None = None) -> int:
    """The context length the token-count histograms are bucketed up to: ``override``
    (``EPD_MAX_MODEL_LEN``), else the model's ``max_position_embeddings`` (its
    ``text_config``'s for a VLM), else :data:`DEFAULT_MAX_MODEL_LEN`."""
    if override:
        return override
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_MODEL_LEN
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_MODEL_LEN


class _Vllm:
    """The vllm:* collectors (one set per process, in the default registry)."""

    def __init__(self, max_model_len: int):
        labels = ["model_name"]
        tokens = vllm_request_tokens_buckets(max_model_len)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels)
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"]
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, buckets=tokens
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", labels, buckets=tokens
        )
        self.request_params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", labels, buckets=tokens
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=VLLM_TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS,
        )
        # vLLM's name for the same observations before 0.11 (removed in 0.13): dashboards still use it.
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            labels,
            buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.models: set[str] = set()

    def add_model(self, model: str) -> None:
        """Create ``model``'s series (so they read 0 before its first request) and point its
        running / waiting gauges at the live requests."""
        if model in self.models:
            return
        self.models.add(model)
        self.running.labels(model).set_function(lambda: _live_count(model, _RequestState.RUNNING))
        self.waiting.labels(model).set_function(lambda: _live_count(model, _RequestState.WAITING))
        for metric in (self.prompt_tokens, self.generation_tokens):
            metric.labels(model)
        for reason in VLLM_FINISH_REASONS:
            self.request_success.labels(model, reason)
        for hist in (
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_params_max_tokens,
            self.ttft,
            self.itl,
            self.tpot,
            self.request_tpot,
            self.e2e,
        ):
            hist.labels(model)


_VLLM: _Vllm | None = None
_VLLM_LOCK = threading.Lock()


class _RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


#: the requests the API is tracking; a tracker dropped without ``close`` (a response generator
#: that never ran) leaves with its last reference
_LIVE: weakref.WeakSet[RequestMetrics] = weakref.WeakSet()


def _live_count(model: str, state: _RequestState) -> int:
    return sum(1 for r in list(_LIVE) if r.model_name == model and r.state is state)


class ApiRequestMetrics:
    """The API's request metrics: ``epd:*`` latencies and tokens, and the ``vllm:*`` ones of the
    whole system under the served model's name. One per API; :meth:`submitted` starts tracking a
    request once its generation job is published."""

    def __init__(self, model_name: str, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN):
        global _VLLM
        with _VLLM_LOCK:
            if _VLLM is None:
                _VLLM = _Vllm(max_model_len)
            _VLLM.add_model(model_name)
        self.vllm = _VLLM
        self.model_name = model_name

    def submitted(self, received_at: float, *, max_tokens: int | None = None) -> RequestMetrics:
        """A request whose generation job was published (``received_at``: when the API got it)."""
        return RequestMetrics(self, received_at, max_tokens)


class RequestMetrics:
    """One request at the API, from its generation job's publication to its end.

    * waiting (``vllm:num_requests_waiting``): published, no token yet - its images being encoded,
      its job queued for a prefill worker, or being prefilled (the API cannot tell these apart);
    * running (``vllm:num_requests_running``): its first token arrived, its end not yet;
    * done: it ended (:meth:`finished` with its result, or :meth:`close` without one).
    """

    def __init__(self, owner: ApiRequestMetrics, received_at: float, max_tokens: int | None):
        self.owner = owner
        self.model_name = owner.model_name
        self.received_at = received_at
        self.max_tokens = max_tokens
        self.state = _RequestState.WAITING
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        _LIVE.add(self)

    def tokens(self, count: int, now: float | None = None) -> None:
        """A chunk of ``count`` new tokens arrived: the first one's time to first token (epd and
        vllm), a later one's inter-token latency (one observation per chunk, as vLLM makes one
        per engine step)."""
        if self.state is _RequestState.DONE or count <= 0:
            return
        now = time.time() if now is None else now
        vllm, model = self.owner.vllm, self.model_name
        if self.first_token_at is None:
            self.first_token_at = now
            self.state = _RequestState.RUNNING
            TTFT.observe(now - self.received_at)
            vllm.ttft.labels(model).observe(now - self.received_at)
        else:
            gap = now - (self.last_token_at or now)
            vllm.itl.labels(model).observe(gap)
            vllm.tpot.labels(model).observe(gap)
        self.last_token_at = now

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """The request completed with a result (its usage): E2E, time per output token, tokens,
        and ``vllm:request_success_total{finished_reason}``."""
        if self.state is _RequestState.DONE:
            return
        now = time.time()
        vllm, model = self.owner.vllm, self.model_name
        E2E.observe(now - self.received_at)
        if self.first_token_at is not None and completion_tokens > 1:
            TPOT.observe((now - self.first_token_at) / (completion_tokens - 1))
        PROMPT_TOKENS.inc(prompt_tokens)
        GENERATION_TOKENS.inc(completion_tokens)

        vllm.e2e.labels(model).observe(now - self.received_at)
        vllm.request_success.labels(model, finish_reason).inc()
        vllm.prompt_tokens.labels(model).inc(prompt_tokens)
        vllm.generation_tokens.labels(model).inc(completion_tokens)
        vllm.request_prompt_tokens.labels(model).observe(prompt_tokens)
        vllm.request_generation_tokens.labels(model).observe(completion_tokens)
        # vLLM: decode time (first to last token) / tokens after the first; 0 for one token.
        decode_s = (self.last_token_at or now) - (self.first_token_at or now)
        vllm.request_tpot.labels(model).observe(decode_s / (completion_tokens - 1) if completion_tokens > 1 else 0.0)
        if self.max_tokens:
            vllm.request_params_max_tokens.labels(model).observe(self.max_tokens)
        self.close()

    def close(self) -> None:
        """The request ended (with or without a result): it leaves the running / waiting gauges."""
        self.state = _RequestState.DONE
        _LIVE.discard(self)
