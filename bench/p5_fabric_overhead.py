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

``--tls``: the cost of TLS on every link. Two E|PD stacks, one on plaintext NATS, S3 and HTTP, one with
every link TLS as ``epd up --tls`` sets it up (a throwaway CA; NATS TLS from the first byte, S3 over
HTTPS and the API over HTTPS, each verified against the CA, the clients here too). Each repetition
sends ``--requests`` requests to each, taking turns request by request (plaintext first, then TLS
first, ...), so a noisy second on the shared machine hits both; the connections are kept alive, so
what is timed is TLS in steady state (record encryption), not handshakes. Reported: TLS/plain of the
client E2E p50 and of the overhead p50 (and through httpx), TLS - plain overhead (of the p50s, and the
median of the paired differences: request i on one side against request i on the other, sent back to
back), and each side's absolute values.

Run: ``.venv/bin/python bench/p5_fabric_overhead.py [--reps 3] [--requests 40] [--tls]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
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


async def warm_up(bs: h.BenchStack, lean: h.LeanClient, http: h.httpx.AsyncClient) -> None:
    """Requests not counted, until steady state: past a worker's first CLOCK_SKEW_S of listening
    for cancellations (until then each job reads its request's records: one round trip)."""
    warm_until, i = time.monotonic() + CLOCK_SKEW_S + 1, 0
    while i < 5 or time.monotonic() < warm_until:
        await h.lean_chat(lean, h.chat_body(bs.model, h.prompt(8, i), max_tokens=1))
        await h.chat(http, bs.url, h.chat_body(bs.model, h.prompt(8, i), max_tokens=1))
        i += 1


@dataclass
class Target:
    """One stack and the two clients P5 sends its requests through."""

    bs: h.BenchStack
    lean: h.LeanClient
    http: h.httpx.AsyncClient


async def one_rep(targets: Sequence[Target], requests: int) -> list[tuple[list[dict[str, float]], list[float]]]:
    """One repetition: ``requests`` requests to each target through the lean client and as many
    through httpx, all taking turns request by request (target after target, the lean client
    first); per target the lean ones' rows (overhead, E2E, compute, the breakdown) and the httpx
    ones' overheads (in seconds), read from their timelines after the timed part."""
    probes: list[list[h.Probe]] = [[] for _ in targets]
    through_httpx: list[list[h.Probe]] = [[] for _ in targets]
    for i in range(requests):  # the clients (and the targets) take turns
        for t, target in enumerate(targets):
            for lean_client, into in ((True, probes[t]), (False, through_httpx[t])):
                body = h.chat_body(target.bs.model, h.prompt(8, i), max_tokens=1)
                p = await (h.lean_chat(target.lean, body) if lean_client else h.chat(target.http, target.bs.url, body))
                if not p.ok:
                    raise RuntimeError(f"request failed on {target.bs.label}: {p.error}")
                into.append(p)
    return [await _read_back(target, probes[t], through_httpx[t]) for t, target in enumerate(targets)]


async def _read_back(
    target: Target, probes: list[h.Probe], through_httpx: list[h.Probe]
) -> tuple[list[dict[str, float]], list[float]]:
    bs, http = target.bs, target.http
    httpx_overheads = []
    for p in through_httpx:
        t = h.final_timings(await h.timeline(http, bs.url, p.request_id))
        httpx_overheads.append(p.e2e_s - engine_compute_s(t))
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
    return rows, httpx_overheads


def where_it_goes(parts: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {h.pct(v, 50) * 1e3:.1f} ms" for k, v in parts.items())


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
        await warm_up(bs, lean, http)
        for rep in range(args.reps):
            ((rows, httpx_overheads),) = await one_rep([Target(bs, lean, http)], args.requests)
            httpx_fig.add(h.pct(httpx_overheads, 50) * 1e3)
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
    print("  where the time goes (p50 over all requests): " + where_it_goes(parts))
    return [e2e_fig, httpx_fig, overhead]


async def measure_tls(args: argparse.Namespace, stacks: dict[str, h.BenchStack]) -> list[h.Ratio]:
    """``--tls``: each repetition on the plaintext and the TLS stack, taking turns request by request
    (plain first, then TLS first, ...: a noisy second hits both); per repetition the TLS/plain
    ratio of the client E2E p50 and of the overhead p50."""
    sides = h.TLS_SIDES
    e2e_ratio = h.Ratio("P5 --tls: TLS/plain client E2E p50 (lean client)", decimals=3)
    overhead_ratio = h.Ratio("P5 --tls: TLS/plain fabric overhead p50 (lean client)", decimals=3)
    httpx_ratio = h.Ratio("P5 --tls: TLS/plain fabric overhead p50 through httpx", decimals=3)
    extra = h.Ratio("P5 --tls: TLS - plain fabric overhead p50 (lean client)", unit=" ms", decimals=2)
    paired = h.Ratio(
        "P5 --tls: TLS - plain overhead, median of the paired differences (request i on each side)",
        unit=" ms",
        decimals=2,
    )
    absolute = {
        (side, what): h.Ratio(f"P5 --tls: {side} {what} p50 (lean client)", unit=" ms", decimals=2)
        for side in sides
        for what in ("client E2E", "fabric overhead")
    }
    parts: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    async with contextlib.AsyncExitStack() as stack:
        https = {s: await stack.enter_async_context(h.client(verify=stacks[s].ssl_context)) for s in sides}
        leans = {s: await stack.enter_async_context(contextlib.aclosing(h.lean_client(stacks[s]))) for s in sides}
        for s in sides:
            await warm_up(stacks[s], leans[s], https[s])
        for s in sides:  # one untimed request per client again: a connection the server closed while
            body = h.chat_body(stacks[s].model, h.prompt(8), max_tokens=1)  # idle is opened again here,
            await h.lean_chat(leans[s], body)  # not in the timed part (handshakes are per connection)
            await h.chat(https[s], stacks[s].url, body)
        targets = {s: Target(stacks[s], leans[s], https[s]) for s in sides}
        for rep in range(args.reps):  # both sides in each repetition, request by request, A B then B A
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            results = dict(zip(order, await one_rep([targets[s] for s in order], args.requests), strict=True))
            got = {}
            for side in sides:
                rows, httpx_overheads = results[side]
                for k in rows[0]:
                    parts[side].setdefault(k, []).extend(r[k] for r in rows)
                e50, o50 = (h.pct([r[k] for r in rows], 50) * 1e3 for k in ("e2e", "overhead"))
                x50 = h.pct(httpx_overheads, 50) * 1e3
                got[side] = (e50, o50, x50)
                absolute[side, "client E2E"].add(e50)
                absolute[side, "fabric overhead"].add(o50)
                print(
                    f"  rep {rep} {side:>5}: E2E p50 {e50:.2f} ms, overhead p50 {o50:.2f} ms ({len(rows)} requests); "
                    f"through httpx: overhead p50 {x50:.2f} ms",
                    flush=True,
                )
            plain_rows, tls_rows = results["plain"][0], results["tls"][0]
            # each pair ran back to back: a slow second of the shared machine hits both of it
            paired.add(
                h.pct([t["overhead"] - p["overhead"] for p, t in zip(plain_rows, tls_rows, strict=True)], 50) * 1e3
            )
            (pe, po, px), (te, to, tx) = got["plain"], got["tls"]
            e2e_ratio.add(te / pe)
            overhead_ratio.add(to / po)
            httpx_ratio.add(tx / px)
            extra.add(to - po)
    for side in sides:
        print(f"  {side}: where the time goes (p50 over all requests): {where_it_goes(parts[side])}")
    return [*absolute.values(), extra, paired, httpx_ratio, overhead_ratio, e2e_ratio]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=40, model_size="tiny")
    parser.add_argument("--topology", default="e-pd", choices=["agg", "e-pd", "e-p-d"])
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the same stack with every link TLS beside a plaintext one, taking turns: the TLS/plain ratios",
    )
    args = parser.parse_args()
    if args.tls:
        return h.run_tls_stacks("p5", args, args.topology, measure_tls)
    model = h.model_dir(args.model_size)
    with h.Bench("p5", keep=args.keep) as bench:
        bs = bench.start({"stack": (args.topology, {})}, model)["stack"]
        figures = asyncio.run(measure(args, bs))
    return h.finish(figures)


if __name__ == "__main__":
    h.main_guard(main)
