"""P4: text-only TTFT (p50, p99) during a burst of 8 concurrent image requests / idle text-only TTFT,
E|PD and aggregated.

Starts embedded NATS + S3 and an ``agg`` and an ``e-pd`` stack on the bench model, every worker on the
``--engine`` (``transformers``, the default, or ``vllm``; the same engine settings on both sides; on
vLLM E|PD's encoder and PD worker get their own CPUs, as ``epd up --engine vllm`` binds them).
Each repetition, on each side (alternating the order): ``--probes`` text-only requests one at a time on
the idle stack, then a burst of ``--burst`` image requests (new images, all at once) while text-only
probes go out one after another until the burst has finished. Per repetition and side: p50 and p99 of
the probes' TTFT during the burst over those of the idle probes. An image request holds the aggregated
worker's one compute thread for its encode; on E|PD the encoder takes that, so text waits only for
prefills. Targets (issue 14), E|PD only: on vLLM p50 <= 1.5x and p99 <= 3x idle, on transformers p50 <= 3x;
agg is reported as context.

Run: ``.venv/bin/python bench/p4_text_during_burst.py [--engine vllm] [--dtype bfloat16] [--reps 3] [--burst 8]
[--probes 8]``
(with ``--engine vllm`` three vLLM engines start at once: 2-5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

from shared.cpus import available_cpus, split_cpus
from shared.protocol import StageName
from shared.tools.bench.schema import WorkloadSpec

SIDES = ("agg", "epd")
TOPOLOGY = {"agg": "agg", "epd": "e-pd"}
#: engine -> percentile -> target of E|PD's ratio (issue 14); agg has none
TARGETS = {"transformers": {50: 3.0}, "vllm": {50: 1.5, 99: 3.0}}


def burst_spec(args: argparse.Namespace, seed: int) -> WorkloadSpec:
    return WorkloadSpec(
        seed=seed,
        requests=args.burst,
        concurrency=args.burst,
        image_sizes={f"{args.image_size}x{args.image_size}": 1.0},
        prompt_words=(16, 16),
        output_tokens=(args.max_tokens, args.max_tokens),
    )


async def probe(http, bs: h.BenchStack, i: int, max_tokens: int) -> h.Probe:
    p = await h.chat(http, bs.url, h.chat_body(bs.model, h.prompt(16, i), max_tokens=max_tokens))
    if not p.ok:
        raise RuntimeError(f"text probe failed on {bs.label}: {p.error}")
    return p


async def slowest(http, bs: h.BenchStack, probes: list[h.Probe]) -> str:
    """Where the slowest probe of a burst spent its time: its TTFT on the client, the server's part
    (the API receiving it -> its first token chunk, from the timeline) and that part's stages, and
    the worker's own timings (``first_token_s``: job taken -> first token, engine queue included).
    Client minus server is the HTTP side: the API accepting the request and streaming the chunk."""
    from shared.tools.bench.runner import parse_timeline

    worst = max(probes, key=lambda p: p.ttft_s or 0.0)
    doc = await h.timeline(http, bs.url, worst.request_id)
    stages, _ = parse_timeline(doc)
    first = [st["start_s"] for st in doc["timeline"]["stages"] if st["name"] == StageName.FIRST_TOKEN]
    server = f"{first[0] * 1e3:.0f} ms" if first else "?"
    timings = h.final_timings(doc)
    worker = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(timings.items()) if isinstance(v, (int, float)))
    return (
        f"slowest probe {worst.request_id}: client TTFT {worst.ttft_s * 1e3:.0f} ms, "  # type: ignore[operator]  # ttft_s is None only for a probe without a token; the bench expects none
        f"server received -> first token {server}; "
        f"stages: {h.format_stages(stages)}; worker: {worker}"
    )


async def one_side(args: argparse.Namespace, bs: h.BenchStack, seed: int) -> tuple[list[float], list[float], h.Run]:
    async with h.client() as http:
        busy = await h.wait_quiet()  # not the other side's burst's tail
        idle_probes = [await probe(http, bs, i, args.probe_tokens) for i in range(args.probes)]
        worst = max(idle_probes, key=lambda p: p.ttft_s or 0.0)
        print(
            f"  {bs.label:>3} idle probes after the CPUs were {busy:.0%} busy: the slowest is "
            f"#{idle_probes.index(worst)}, {await slowest(http, bs, idle_probes)}",
            flush=True,
        )
        idle = [p.ttft_s for p in idle_probes]
        burst = asyncio.create_task(
            h.run_load(bs, burst_spec(args, seed), label=f"p4-{bs.label}-burst-{seed}", timelines=False)
        )
        probes: list[h.Probe] = []
        while not burst.done():  # a probe in flight when the burst ends was sent during it: counted
            probes.append(await probe(http, bs, 100 + len(probes), args.probe_tokens))
        run = await burst
        print(f"  {bs.label:>3} {await slowest(http, bs, probes)}", flush=True)
    if run.failed():
        print(f"  {run.label}: {run.failed()} failed: {[r.error for r in run.records if not r.ok][:3]}")
    return idle, [p.ttft_s for p in probes], run  # type: ignore[misc]  # ttft_s: as in slowest()


async def measure(args: argparse.Namespace, stacks: dict[str, h.BenchStack]) -> list[h.Ratio]:
    async with h.client() as http:  # warm-up, not counted
        for side in SIDES:
            await probe(http, stacks[side], 0, args.probe_tokens)
            await h.run_load(
                stacks[side], burst_spec(args, 1 + SIDES.index(side)), label=f"warmup-{side}", timelines=False
            )
    name = {"agg": "agg", "epd": "E|PD"}
    figures = {
        (side, q): h.Ratio(
            f"P4 {name[side]} ({args.engine}): text TTFT p{q} during burst / idle",
            target=TARGETS[args.engine].get(q) if side == "epd" else None,
        )
        for side in SIDES
        for q in (50, 99)
    }
    pooled: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in SIDES}
    runs: dict[str, list[h.Run]] = {f"{s}-burst": [] for s in SIDES}
    for rep, side in h.alternate(args.reps, SIDES):
        idle, busy, run = await one_side(args, stacks[side], 1000 * (rep + 1) + SIDES.index(side))
        runs[f"{side}-burst"].append(run)
        pooled[side][0].extend(idle)
        pooled[side][1].extend(busy)
        parts = []
        for q in (50, 99):
            i, b = h.pct(idle, q), h.pct(busy, q)
            figures[(side, q)].add(b / i)
            parts.append(f"p{q} idle {i * 1e3:.0f} ms, burst {b * 1e3:.0f} ms -> {b / i:.1f}x")
        burst_ttft = h.pct(run.ttfts(), 50)
        print(
            f"  rep {rep} {side:>3}: {len(busy)} probes during the burst; "
            + "; ".join(parts)
            + f"; burst image TTFT p50 {burst_ttft:.2f} s (load {h.load_average()})",
            flush=True,
        )
    for side in SIDES:
        idle, busy = pooled[side]
        print(
            f"  {side:>3} pooled: idle p50 {h.pct(idle, 50) * 1e3:.0f} ms p99 {h.pct(idle, 99) * 1e3:.0f} ms "
            f"({len(idle)}), burst p50 {h.pct(busy, 50) * 1e3:.0f} ms p99 {h.pct(busy, 99) * 1e3:.0f} ms "
            f"({len(busy)})"
        )
    h.save(args.out, runs)
    return list(figures.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=None, images=True)
    parser.add_argument("--burst", type=int, default=8, help="image requests in the burst (all at once)")
    parser.add_argument("--probes", type=int, default=8, help="idle text-only probes per repetition")
    parser.add_argument("--probe-tokens", type=int, default=4, help="output tokens of a text-only probe")
    parser.add_argument("--engine", default="transformers", choices=sorted(TARGETS), help="EPD_ENGINE of every worker")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="EPD_DTYPE of both stacks (the same on both)",
    )
    args = parser.parse_args()
    # vLLM: E|PD's encoder and PD worker on their own CPUs, as `epd up --engine vllm` binds them
    # (vLLM alone puts every engine on CPU 0 of 2); agg's one engine as vLLM binds it.
    split = split_cpus(available_cpus(), ["encoder", "prefill"])
    service_env = (
        {"epd": {svc: {"EPD_CPU_CORES": cores} for svc, cores in split.items()}} if args.engine == "vllm" else {}
    )
    return h.run_stacks(
        "p4",
        args,
        {s: (TOPOLOGY[s], {"EPD_ENGINE": args.engine, "EPD_DTYPE": args.dtype}) for s in SIDES},
        measure,
        ready_timeout=1200.0 if args.engine == "vllm" else 600.0,
        service_env=service_env,
    )


if __name__ == "__main__":
    h.main_guard(main)
