"""P5: fabric overhead per request: end-to-end time minus the engine's own compute, text-only, 1 token.

Starts embedded NATS + S3 and an E|PD stack on the tiny model (transformers engine) and sends
``--requests`` text-only requests with ``max_tokens: 1``, one at a time (each repetition after a
warm-up). Per request, from its timeline (``/debug/requests/<id>?format=json``):

  overhead = client E2E (POST to the end of the SSE stream) - (prefill_s + decode_s)

where ``prefill_s`` and ``decode_s`` are the engine's own compute times the worker reports in its
``FinalResult.timings`` (the ``prefill`` stage of the timeline). The rest is the fabric: HTTP and the
API, the JetStream hops (generation job, token chunk, final result) and the worker's own handling. The
breakdown printed splits it into the API side (client E2E - the worker's ``total_s``, which runs from
taking the job to publishing the result) and the worker side (``total_s`` - compute), and into the server
side (the timeline's E2E, from the API receiving the request to the final result stored in its stream,
- compute) and the HTTP side (client E2E - that). Target: p50 <= 2 ms.

The client is ``shared.tools.bench.lean_http.LeanClient`` (one keep-alive connection, the request
in one write, the chunked SSE body read as it comes): the fabric's overhead, not the client's. The same requests
through httpx (the other benches' client) are reported beside it, taking turns with them in each
repetition: httpx's own Python work adds ~1.3 ms a request on this machine.

Run: ``.venv/bin/python bench/p5_fabric_overhead.py [--reps 3] [--requests 40]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

from shared.cancellation import CLOCK_SKEW_S
from shared.protocol import StageName, Timing
from shared.tools.bench.runner import parse_timeline

TARGET_MS = 2.0


def engine_compute_s(timings: dict[str, float]) -> float:
    """The engine's own compute in a request's final timings (what P5 takes off its E2E)."""
    return timings.get(Timing.PREFILL, 0.0) + timings.get(Timing.DECODE, 0.0)


async def measure(args: argparse.Namespace, bs: h.BenchStack) -> list[h.Ratio]:
    overhead = h.Ratio(
        "P5 fabric overhead p50 (E2E - engine compute, text-only, 1 token)", target=TARGET_MS, unit=" ms", decimals=2
    )
    e2e_fig = h.Ratio("P5 client E2E p50 (same requests)", unit=" ms", decimals=2)
    httpx_fig = h.Ratio(
        "P5 fabric overhead p50 through httpx (the same requests, sent with httpx)", unit=" ms", decimals=2
    )
    parts: dict[str, list[float]] = {}
    async with h.client() as http, contextlib.aclosing(h.LeanClient(bs.url)) as lean:

        async def lean_chat(body: dict) -> h.Probe:
            return await h.lean_chat(lean, body)

        async def httpx_chat(body: dict) -> h.Probe:
            return await h.chat(http, bs.url, body)

        # Warm-up, not counted: steady state, past a worker's first CLOCK_SKEW_S of listening
        # for cancellations (until then each job reads its request's records: one round trip).
        warm_until, i = time.monotonic() + CLOCK_SKEW_S + 1, 0
        while i < 5 or time.monotonic() < warm_until:
            await lean_chat(h.chat_body(bs.model, h.prompt(8, i), max_tokens=1))
            await httpx_chat(h.chat_body(bs.model, h.prompt(8, i), max_tokens=1))
            i += 1
        for rep in range(args.reps):
            probes, through_httpx = [], []
            for i in range(args.requests):  # the two clients take turns
                for send, into in ((lean_chat, probes), (httpx_chat, through_httpx)):
                    p = await send(h.chat_body(bs.model, h.prompt(8, i), max_tokens=1))
                    if not p.ok:
                        raise RuntimeError(f"request failed: {p.error}")
                    into.append(p)
            httpx_overheads = []
            for p in through_httpx:
                t = h.final_timings(await h.timeline(http, bs.url, p.request_id))
                httpx_overheads.append(p.e2e_s - engine_compute_s(t))
            httpx_fig.add(h.pct(httpx_overheads, 50) * 1e3)
            rows = []
            for p in probes:  # timelines after the timed part
                doc = await h.timeline(http, bs.url, p.request_id)
                t = h.final_timings(doc)
                compute = engine_compute_s(t)
                server_e2e = doc["case"]["summary"].get("e2e_s") or 0.0
                stages, _ = parse_timeline(doc)
                queued = stages.get(StageName.GENERATION_QUEUED, 0.0)
                rows.append(
                    {
                        "overhead": p.e2e_s - compute,
                        "e2e": p.e2e_s,
                        "compute": compute,
                        "api side (E2E - worker total)": p.e2e_s - t.get(Timing.TOTAL, 0.0),
                        "worker side (total - compute)": t.get(Timing.TOTAL, 0.0) - compute,
                        "server side (server E2E - compute)": server_e2e - compute,
                        "HTTP (client E2E - server E2E)": p.e2e_s - server_e2e,
                        "generation queued (API publish -> worker takes the job)": queued,
                    }
                )
            for k in rows[0]:
                parts.setdefault(k, []).extend(r[k] for r in rows)
            o50 = h.pct([r["overhead"] for r in rows], 50) * 1e3
            e50 = h.pct([r["e2e"] for r in rows], 50) * 1e3
            overhead.add(o50)
            e2e_fig.add(e50)
            print(
                f"  rep {rep}: E2E p50 {e50:.1f} ms, "
                f"compute p50 {h.pct([r['compute'] for r in rows], 50) * 1e3:.1f} ms, "
                f"overhead p50 {o50:.1f} ms ({len(rows)} requests); "
                f"through httpx: overhead p50 {h.pct(httpx_overheads, 50) * 1e3:.1f} ms",
                flush=True,
            )
    print(
        "  where the time goes (p50 over all requests): "
        + ", ".join(f"{k} {h.pct(v, 50) * 1e3:.1f} ms" for k, v in parts.items())
    )
    return [e2e_fig, httpx_fig, overhead]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=40, model_size="tiny")
    parser.add_argument("--topology", default="e-pd", choices=["agg", "e-pd", "e-p-d"])
    args = parser.parse_args()
    model = h.model_dir(args.model_size)
    with h.Bench("p5", keep=args.keep) as bench:
        bs = bench.start({"stack": (args.topology, {})}, model)["stack"]
        figures = asyncio.run(measure(args, bs))
    return h.finish(figures)


if __name__ == "__main__":
    h.main_guard(main)
