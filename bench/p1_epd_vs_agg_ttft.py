"""P1: E|PD time to first token / aggregated TTFT, cold images, concurrency 1 and 4.

Starts embedded NATS + S3 and two stacks on the bench model (~130M Qwen2-VL, transformers engine):
``agg`` (api + one worker that encodes, prefills and decodes) and ``e-pd`` (api + encoder + prefill/decode
worker). Every request carries a new image (nothing cached anywhere). For each concurrency, each
repetition runs ``--requests`` requests on each side, the sides taking turns (A B, B A, ...) every
request at concurrency 1 and every ``--requests`` at higher concurrency (a sustained load), so machine
noise hits both; the ratio is p50 TTFT(E|PD) / p50 TTFT(agg) per repetition; reported: median and
spread (min-max) over the repetitions.
Targets: <= 1.0 at concurrency 1 (splitting must not cost latency), <= 0.6 at concurrency 4 (the encoder
and the prefill worker work in parallel).

``--tls``: the cost of TLS on every link under a burst of image requests. Two E|PD stacks instead, one
on plaintext NATS, S3 and HTTP, one with every link TLS as ``epd up --tls`` sets it up (a throwaway CA;
NATS TLS from the first byte, S3 over HTTPS, the API over HTTPS, each verified against the CA, the load
generator too); after an untimed burst of ``--concurrency`` requests on each, each repetition sends
``--requests`` new-image requests at each ``--concurrency`` to each side (the same images to both), the
sides taking turns (A B, B A, ...); reported: TLS/plain of the TTFT p50, of the E2E p50
and of the throughput (requests / the run's wall time), and each side's absolute values.

Run: ``.venv/bin/python bench/p1_epd_vs_agg_ttft.py [--reps 3] [--requests 8] [--concurrency 1,4] [--tls]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

from shared.tools.bench.schema import WorkloadSpec

TARGETS = {1: 1.0, 4: 0.6}
SIDES = ("agg", "epd")
TOPOLOGY = {"agg": "agg", "epd": "e-pd"}


def spec(args: argparse.Namespace, seed: int, concurrency: int, requests: int) -> WorkloadSpec:
    return WorkloadSpec(
        seed=seed,
        requests=requests,
        concurrency=concurrency,
        image_sizes={f"{args.image_size}x{args.image_size}": 1.0},
        prompt_words=(16, 16),
        output_tokens=(args.max_tokens, args.max_tokens),
    )


async def measure(args: argparse.Namespace, stacks: dict[str, h.BenchStack]) -> list[h.Ratio]:
    for i, side in enumerate(SIDES):  # warm-up: first requests pay for lazy set-up; not counted
        await h.run_load(stacks[side], spec(args, 1 + i, 1, 2), label=f"warmup-{side}")
    figures: list[h.Ratio] = []
    runs: dict[str, list[h.Run]] = {s: [] for s in SIDES}
    for c in args.concurrency:
        ratio = h.Ratio(f"P1 c={c}: E|PD/agg TTFT p50", target=TARGETS.get(c))
        slot = args.slot or (1 if c == 1 else args.requests)  # requests per turn of a side
        by_rep: dict[int, dict[str, list[h.Run]]] = {}
        turns = args.requests // slot
        for turn, side in h.alternate(args.reps * turns, SIDES):
            rep = turn // turns
            seed = 100_000 * (rep + 1) + 1000 * c + 10 * turn + SIDES.index(side)  # new images every run: cold
            run = await h.run_load(stacks[side], spec(args, seed, c, slot), label=f"p1-c{c}-{side}-{turn}")
            runs[side].append(run)
            if run.failed():
                print(f"  {run.label}: {run.failed()} failed: {[r.error for r in run.records if not r.ok][:3]}")
            by_rep.setdefault(rep, {}).setdefault(side, []).append(run)
        for rep, sides in by_rep.items():
            agg, epd = (h.pct([t for run in sides[s] for t in run.ttfts()], 50) for s in SIDES)
            ratio.add(epd / agg)
            print(
                f"  c={c} rep {rep}: TTFT p50 agg {agg * 1e3:.0f} ms, E|PD {epd * 1e3:.0f} ms -> {epd / agg:.2f}",
                flush=True,
            )
        for side in SIDES:
            recs = [rec for sides in by_rep.values() for run in sides[side] for rec in run.ok()]
            ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
            print(
                f"  c={c} {side:>3}: TTFT p50 {h.pct(ttfts, 50) * 1e3:.0f} ms, p90 {h.pct(ttfts, 90) * 1e3:.0f} ms "
                f"({len(ttfts)} requests); stage means: {h.format_stages(h.stage_means(recs))}"
            )
        figures.append(ratio)
    h.save(args.out, runs)
    return figures


async def measure_tls(args: argparse.Namespace, stacks: dict[str, h.BenchStack]) -> list[h.Ratio]:
    """``--tls``: the plaintext and the TLS E|PD stack, ``--requests`` at each concurrency per side
    and repetition, taking turns; TLS/plain per repetition."""
    sides = h.TLS_SIDES
    for i, side in enumerate(sides):  # warm-up: first requests pay for lazy set-up; not counted
        await h.run_load(stacks[side], spec(args, 1 + i, 1, 2), label=f"warmup-{side}")
    figures: list[h.Ratio] = []
    runs: dict[str, list[h.Run]] = {s: [] for s in sides}
    for c in args.concurrency:
        for i, side in enumerate(sides):  # and one untimed burst at c: the first batch of c pays set-up
            await h.run_load(stacks[side], spec(args, 10 + i, c, c), label=f"warmup-c{c}-{side}")
        what = {"ttft": "TTFT p50", "e2e": "E2E p50", "rps": "throughput"}
        ratios = {k: h.Ratio(f"P1 --tls c={c}: TLS/plain {name}", decimals=3) for k, name in what.items()}
        absolute = {
            (side, k): h.Ratio(f"P1 --tls c={c}: {side} {name}", unit=" req/s" if k == "rps" else " ms", decimals=2)
            for side in sides
            for k, name in what.items()
        }
        by_rep: dict[int, dict[str, dict[str, float]]] = {}
        for rep, side in h.alternate(args.reps, sides):
            # new images every run (cold); the two sides get the same ones
            seed = 100_000 * (rep + 1) + 1000 * c
            run = await h.run_load(stacks[side], spec(args, seed, c, args.requests), label=f"p1-tls-c{c}-{side}-{rep}")
            runs[side].append(run)
            if run.failed():
                print(f"  {run.label}: {run.failed()} failed: {[r.error for r in run.records if not r.ok][:3]}")
            assert run.result is not None
            duration = sum(rr.summary.duration_s for rr in run.result.runs)
            got = {
                "ttft": h.pct(run.ttfts(), 50) * 1e3,
                "e2e": h.pct([r.e2e_s for r in run.ok() if r.e2e_s is not None], 50) * 1e3,
                "rps": len(run.ok()) / duration,
            }
            by_rep.setdefault(rep, {})[side] = got
            for k, v in got.items():
                absolute[side, k].add(v)
            print(
                f"  c={c} rep {rep} {side:>5}: TTFT p50 {got['ttft']:.0f} ms, E2E p50 {got['e2e']:.0f} ms, "
                f"{got['rps']:.3f} req/s ({len(run.ok())} requests); stage means: "
                f"{h.format_stages(h.stage_means(run.ok()))}",
                flush=True,
            )
        for got in (by_rep[r] for r in sorted(by_rep)):
            for k, ratio in ratios.items():
                ratio.add(got["tls"][k] / got["plain"][k])
        figures += [*absolute.values(), ratios["rps"], ratios["e2e"], ratios["ttft"]]
    h.save(args.out, runs)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=8, images=True)
    parser.add_argument("--concurrency", default="1,4", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--slot",
        type=int,
        default=None,
        help="requests per turn of a side (default: 1 at concurrency 1, else all of a repetition's)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="E|PD with every link TLS beside E|PD in plaintext, taking turns (instead of E|PD beside agg)",
    )
    args = parser.parse_args()
    if args.tls:
        return h.run_tls_stacks("p1", args, "e-pd", measure_tls)
    return h.run_stacks("p1", args, {s: (TOPOLOGY[s], {}) for s in SIDES}, measure)


if __name__ == "__main__":
    h.main_guard(main)
