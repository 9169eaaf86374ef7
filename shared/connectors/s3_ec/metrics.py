"""EC connector counters: vLLM ``ECConnectorStats`` (sent from the engine-core process to the
front-end as plain data), logged by vLLM as "EC Transfer metrics" and exported to Prometheus as
``epd:ec_connector_*``."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from collections.abc import Iterator
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

from shared.connectors.s3_ec.state import LookupOutcome
from shared.store.format import MissReason

_MAX_LATENCY_SAMPLES = 1000  # per stats interval


class Transfer(str, enum.Enum):
    """Direction of EC object bytes."""

    GET = "get"
    PUT = "put"


class Timing(str, enum.Enum):
    """Timed connector operations."""

    #: existence check + GET + validation (scheduler side, consumer)
    FETCH = "fetch"
    #: one encoder output written (worker side, producer)
    SAVE = "save"


class Event(str, enum.Enum):
    """Counted worker-side events."""

    #: encoder outputs put into the worker's encoder cache
    LOADS = "loads"
    #: outputs not stored: their identifier cannot be a key
    SAVE_SKIPPED = "save_skipped"
    SAVE_FAILURES = "save_failures"


_LOOKUPS, _BYTES, _EVENTS, _SECONDS = "lookups", "bytes", "events", "seconds"


@dataclasses.dataclass
class S3ECStats(ECConnectorStats):
    """One interval's counters. ``data`` is plain (it crosses processes)::

    {"lookups": {outcome: {reason: n}}, "bytes": {direction: n},
     "events": {event: n}, "seconds": {op: [latency samples]}}
    """

    def reset(self) -> None:
        self.data = {}

    # -- recording
    def count_lookup(self, outcome: LookupOutcome, reason: MissReason | None = None, n: int = 1) -> None:
        by_reason = self.data.setdefault(_LOOKUPS, {}).setdefault(outcome.value, {})
        key = reason.value if reason is not None else ""
        by_reason[key] = by_reason.get(key, 0) + n

    def add_bytes(self, direction: Transfer, n: int) -> None:
        self._add(_BYTES, direction.value, n)

    def count(self, event: Event, n: int = 1) -> None:
        self._add(_EVENTS, event.value, n)

    def observe(self, timing: Timing, seconds: float) -> None:
        samples = self.data.setdefault(_SECONDS, {}).setdefault(timing.value, [])
        if len(samples) < _MAX_LATENCY_SAMPLES:
            samples.append(seconds)

    def _add(self, group: str, name: str, n: float) -> None:
        counts = self.data.setdefault(group, {})
        counts[name] = counts.get(name, 0) + n

    # -- reading
    def lookups(self, outcome: LookupOutcome, reason: MissReason | None = None) -> int:
        return self.data.get(_LOOKUPS, {}).get(outcome.value, {}).get(reason.value if reason else "", 0)

    def bytes(self, direction: Transfer) -> int:
        return self.data.get(_BYTES, {}).get(direction.value, 0)

    def events(self, event: Event) -> int:
        return self.data.get(_EVENTS, {}).get(event.value, 0)

    def samples(self, timing: Timing) -> list[float]:
        return list(self.data.get(_SECONDS, {}).get(timing.value, []))

    # -- vLLM's interface
    def aggregate(self, other: ECConnectorStats) -> S3ECStats:
        data = other.data or {}
        for outcome, by_reason in data.get(_LOOKUPS, {}).items():
            mine = self.data.setdefault(_LOOKUPS, {}).setdefault(outcome, {})
            for reason, n in by_reason.items():
                mine[reason] = mine.get(reason, 0) + n
        for group in (_BYTES, _EVENTS):
            for name, n in data.get(group, {}).items():
                self._add(group, name, n)
        for op, values in data.get(_SECONDS, {}).items():
            samples = self.data.setdefault(_SECONDS, {}).setdefault(op, [])
            samples.extend(values[: max(0, _MAX_LATENCY_SAMPLES - len(samples))])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for outcome, by_reason in self.data.get(_LOOKUPS, {}).items():
            for reason, n in by_reason.items():
                out["_".join(filter(None, ("lookup", outcome, reason)))] = n
        for name, n in self.data.get(_BYTES, {}).items():
            out[f"bytes_{name}"] = n
        for name, n in self.data.get(_EVENTS, {}).items():
            out[f"count_{name}"] = n
        for op, values in self.data.get(_SECONDS, {}).items():
            if values:
                out[f"seconds_{op}_avg_ms"] = round(1e3 * sum(values) / len(values), 3)
                out[f"seconds_{op}_n"] = len(values)
        return dict(sorted(out.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsRecorder:
    """A connector's counters of the current interval, shared by its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = S3ECStats()

    @contextlib.contextmanager
    def record(self) -> Iterator[S3ECStats]:
        with self._lock:
            yield self._stats

    def take(self) -> S3ECStats | None:
        """The interval's counters (None when nothing was counted); starts a new interval."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, S3ECStats()
        return stats


class S3ECPromMetrics(ECConnectorPromMetrics):
    """``epd:ec_connector_*`` Prometheus metrics in the vLLM front-end process."""

    _lock = threading.Lock()
    _shared: dict[str, Any] = {}

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        with self._lock:  # one set per process, however many engines it creates
            if not self._shared:
                self._shared.update(
                    lookups=self._counter_cls(
                        "epd:ec_connector_lookups_total",
                        "EC connector lookups per request item: hit (loaded from the store), miss (not "
                        "stored), fallback (stored but unusable: encoded locally), unavailable (failed), "
                        "engine_cache (vLLM still had it).",
                        labelnames=names + ["outcome", "reason"],
                    ),
                    bytes=self._counter_cls(
                        "epd:ec_connector_bytes_total",
                        "EC object bytes moved by the connector.",
                        labelnames=names + ["direction"],
                    ),
                    seconds=self._histogram_cls(  # type: ignore[call-arg]  # vLLM types it as any metric class; it is a Histogram
                        "epd:ec_connector_seconds",
                        "EC connector latency: fetch (existence check + GET + validation) and save.",
                        labelnames=names + ["op"],
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                    ),
                )
        self._metrics = self._shared

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for outcome, by_reason in transfer_stats_data.get(_LOOKUPS, {}).items():
            for reason, n in by_reason.items():
                self._metrics["lookups"].labels(*base, outcome, reason).inc(n)
        for direction, n in transfer_stats_data.get(_BYTES, {}).items():
            self._metrics["bytes"].labels(*base, direction).inc(n)
        for op, samples in transfer_stats_data.get(_SECONDS, {}).items():
            for sample in samples:
                self._metrics["seconds"].labels(*base, op).observe(sample)
