"""Bench statistics and the text report: :func:`summarize` turns the records of one run into a
:class:`~shared.tools.bench.schema.Summary` (the figures ``vllm bench serve`` prints, goodput under
an SLO, stage means, exclusive stage means and EC source counts); :func:`format_result` prints a result the way vLLM's
benchmark does, one block per run.

Definitions (vLLM's):

* percentiles use numpy's default (linear interpolation between closest ranks);
* TTFT and E2E are per completed request; ITL pools every gap between streamed token chunks of
  every completed request; TPOT per request is ``(e2e - ttft) / (output_tokens - 1)``, for
  requests with more than one output token;
* throughputs divide the completed requests' totals by the run's duration;
* goodput is the number of completed requests meeting every SLO bound, per second. A bound on
  TPOT is met by a one-token request (it has no TPOT).

Stages (epd-serve): ``stage_means_s`` are each stage's wall time (union of its spans) averaged over
the requests that have the stage; stages overlap (the prefill's wait for features spans the encode),
so they do not add up to anything. ``exclusive_stage_means_s`` average each request's partition of
its timeline (:func:`exclusive_means`): they add up to the mean server-side E2E.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence

import numpy as np

from shared.tools.bench.schema import UNTRACKED, BenchResult, LatencyStats, RequestRecord, RunResult, Summary

#: --slo keys -> the per-request figure they bound (milliseconds). e2el is vLLM's spelling.
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds; keys ttft, tpot, e2e)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise argparse.ArgumentTypeError(
                f"invalid SLO {part!r}: use e.g. ttft=500,tpot=50 (ms; keys ttft, tpot, e2e)"
            )
        try:
            bound = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid SLO bound {part!r}: a number of milliseconds") from None
        if bound <= 0:
            raise argparse.ArgumentTypeError(f"invalid SLO bound {part!r}: must be > 0 ms")
        out[SLO_KEYS[key]] = bound
    if not out:
        raise argparse.ArgumentTypeError(f"empty SLO {text!r}")
    return out


def latency_stats(values_s: Iterable[float]) -> LatencyStats | None:
    """Mean, median, p90, p99 and (population) std of ``values_s`` in milliseconds; None if empty."""
    ms = np.asarray(list(values_s), dtype=np.float64) * 1e3
    if ms.size == 0:
        return None
    return LatencyStats(
        mean=float(ms.mean()),
        median=float(np.percentile(ms, 50)),
        p90=float(np.percentile(ms, 90)),
        p99=float(np.percentile(ms, 99)),
        std=float(ms.std()),
    )


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first, seconds; None for a request without one."""
    if record.ttft_s is None or record.e2e_s is None or record.output_tokens <= 1:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    if not record.ok:
        return False
    for key, bound in slo_ms.items():
        if key == "ttft":
            value = record.ttft_s
        elif key == "e2e":
            value = record.e2e_s
        else:
            value = tpot_s(record)
            if value is None and record.output_tokens <= 1:
                continue
        if value is None or value * 1e3 > bound:
            return False
    return True


def ec_source_kind(source: str) -> str:
    """``recomputed:<reason>`` counts as ``recomputed``."""
    return source.partition(":")[0]


def exclusive_means(records: Iterable[RequestRecord]) -> dict[str, float]:
    """Stage name -> mean exclusive seconds per request, over the completed ``records`` that have
    exclusive times (a request without the stage counts 0), so the values add up to those
    requests' mean server-side E2E (received -> last event). Stages in the order they first
    appear, "untracked" last; {} when no record has exclusive times (results from before them)."""
    timed = [r for r in records if r.ok and r.exclusive_stages]
    totals: dict[str, float] = {}
    for r in timed:
        for name, seconds in r.exclusive_stages.items():
            totals[name] = totals.get(name, 0.0) + seconds
    order = sorted(totals, key=lambda name: name == UNTRACKED)  # stable: first appearance, untracked last
    return {name: totals[name] / len(timed) for name in order}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo_ms: dict[str, float] | None = None) -> Summary:
    """The summary of one run's ``records`` over ``duration_s`` seconds (see the module doc)."""
    done = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    stage_values: dict[str, list[float]] = {}
    ec_counts: dict[str, int] = {}
    for r in done:
        for name, seconds in r.stages.items():
            stage_values.setdefault(name, []).append(seconds)
        for source in r.ec_sources.values():
            kind = ec_source_kind(source)
            ec_counts[kind] = ec_counts.get(kind, 0) + 1
    goodput = None
    if slo_ms:
        goodput = sum(1 for r in done if meets_slo(r, slo_ms)) / duration
    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) / duration,
        output_token_throughput=output / duration,
        total_token_throughput=(output + prompt) / duration,
        ttft_ms=latency_stats(r.ttft_s for r in done if r.ttft_s is not None),
        tpot_ms=latency_stats(t for t in map(tpot_s, done) if t is not None),
        itl_ms=latency_stats(gap for r in done for gap in r.itl_s),
        e2e_ms=latency_stats(r.e2e_s for r in done if r.e2e_s is not None),
        goodput=goodput,
        slo_ms=dict(slo_ms or {}),
        stage_means_s={name: float(np.mean(v)) for name, v in stage_values.items()},
        exclusive_stage_means_s=exclusive_means(done),
        ec_counts=dict(sorted(ec_counts.items())),
    )


# -- text ---------------------------------------------------------------------------------------
WIDTH = 50


def _title(text: str, fill: str = "-") -> str:
    return f"{text:{fill}^{WIDTH}}"


def _row(name: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40}{value}"


def _latency(lines: list[str], title: str, short: str, stats: LatencyStats | None) -> None:
    if stats is None:
        return
    lines.append(_title(title))
    lines += [
        _row(f"Mean {short} (ms):", stats.mean),
        _row(f"Median {short} (ms):", stats.median),
        _row(f"P90 {short} (ms):", stats.p90),
        _row(f"P99 {short} (ms):", stats.p99),
    ]


def format_run(result: BenchResult, run: RunResult) -> str:
    s = run.summary
    load = f"rate {run.rate:g} req/s (Poisson)" if run.rate is not None else f"concurrency {run.concurrency}"
    lines = [
        _title(" Serving Benchmark Result ", "="),
        _row("Label:", result.label or "-"),
        _row("Endpoint:", result.url),
        _row("Model:", result.model),
        _row("Load:", load),
        _row("Successful requests:", s.completed),
        _row("Failed requests:", s.failed),
        _row("Benchmark duration (s):", s.duration_s),
        _row("Total input tokens:", sum(r.prompt_tokens for r in run.requests if r.ok)),
        _row("Total generated tokens:", sum(r.output_tokens for r in run.requests if r.ok)),
        _row("Request throughput (req/s):", s.request_throughput),
    ]
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s.slo_ms.items())
        lines.append(_row("Request goodput (req/s):", s.goodput) + f" ({slo})")
    lines += [
        _row("Output token throughput (tok/s):", s.output_token_throughput),
        _row("Total token throughput (tok/s):", s.total_token_throughput),
    ]
    _latency(lines, "Time to First Token", "TTFT", s.ttft_ms)
    _latency(lines, "Time per Output Token (excl. 1st token)", "TPOT", s.tpot_ms)
    _latency(lines, "Inter-token Latency", "ITL", s.itl_ms)
    _latency(lines, "End-to-end Latency", "E2EL", s.e2e_ms)
    if s.stage_means_s:
        lines.append(_title("Stages (mean ms, requests that have it)"))
        counts = {name: sum(1 for r in run.requests if r.ok and name in r.stages) for name in s.stage_means_s}
        # In the order the timelines list stages (by start time), as the runner recorded them.
        for name, mean in s.stage_means_s.items():
            lines.append(_row(f"{name} ({counts[name]}):", mean * 1e3))
    if s.exclusive_stage_means_s:
        # Each instant of a request's timeline in one stage (the innermost running): these add up.
        timed = sum(1 for r in run.requests if r.ok and r.exclusive_stages)
        lines.append(_title(f"Exclusive stages (mean ms per request, {timed})"))
        lines += [_row(f"{name}:", mean * 1e3) for name, mean in s.exclusive_stage_means_s.items()]
        lines.append(_row("total = server-side E2E:", sum(s.exclusive_stage_means_s.values()) * 1e3))
    if s.ec_counts:
        lines.append(_title("EC sources (images)"))
        lines += [_row(f"{kind}:", n) for kind, n in s.ec_counts.items()]
    failed = [r for r in run.requests if not r.ok]
    if failed:
        lines.append(_title("Failures (first 3)"))
        lines += [f"#{r.index} HTTP {r.status or '-'}: {r.error[:120]}" for r in failed[:3]]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_result(result: BenchResult) -> str:
    """The text report of every run of ``result``."""
    return "\n\n".join(format_run(result, run) for run in result.runs)
