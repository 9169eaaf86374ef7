"""Prometheus metrics shared by all services (names in vLLM's ``prefix:name`` style).

Every process exposes the default registry on ``/metrics`` (the API on its own port, workers on
``EPD_METRICS_PORT`` when set).
"""

from __future__ import annotations

import enum

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

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
    #: the message did not decode as the handler's job type
    BAD_MESSAGE = "bad_message"
    #: failed, redelivered later
    RETRIED = "retried"
    #: its request was cancelled (dropped before it ran, or stopped)
    CANCELLED = "cancelled"
    #: ended its request with an error (``Reject``'s default)
    FAILED = "failed"
    #: the request's deadline passed before a worker took the job
    EXPIRED = "expired"
    #: the job itself is invalid (e.g. a model the worker does not serve)
    REJECTED = "rejected"


ENCODE_JOBS = Counter("epd:encode_jobs_total", "Encode jobs handled by outcome.", ["outcome"])
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
