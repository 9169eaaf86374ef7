"""Prometheus metrics shared by all services (names in vLLM's ``prefix:name`` style).

Every process exposes the default registry on ``/metrics`` (the API on its own port, workers on
``EPD_METRICS_PORT`` when set).
"""

from __future__ import annotations

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
ENCODE_JOBS = Counter("epd:encode_jobs_total", "Encode jobs handled by outcome.", ["outcome"])
GENERATION_JOBS = Counter("epd:generation_jobs_total", "Generation jobs handled by outcome.", ["outcome"])
QUEUE_SECONDS = Histogram(
    "epd:queue_time_seconds", "Time a job waited in its stream before a worker took it.", ["stream"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram("epd:time_to_first_token_seconds", "Time to first token seen by the API.", buckets=_LATENCY_BUCKETS)
E2E = Histogram("epd:e2e_request_latency_seconds", "End-to-end request latency at the API.", buckets=_LATENCY_BUCKETS)
REQUESTS = Counter("epd:requests_total", "API requests by final status code.", ["status"])
IN_FLIGHT = Gauge("epd:requests_in_flight", "Requests being processed.", ["service"])
