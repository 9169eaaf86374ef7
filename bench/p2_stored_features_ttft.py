"""P2: TTFT when the image's features are already stored / cold TTFT, on both paths.

Starts embedded NATS + S3 and two E|PD stacks on the bench model (transformers engine):

* ``cache``: default settings: a repeated image's features come from the prefill worker's local
  feature cache (``EPD_LOCAL_CACHE_BYTES``, 512 MiB);
* ``store``: ``EPD_LOCAL_CACHE_BYTES=0`` (the prefill worker keeps nothing in memory): they are
  loaded from the S3 store (and the API queues no encode job: the EC object is there).

Each repetition sends ``--requests`` pairs of requests one at a time: a request with a new image (cold:
encode + store + load), then the same request again (same image, same prompt: stored). The ratio is p50 TTFT
(stored) / p50 TTFT (cold) per repetition; the EC source of every stored request is checked from its
timeline (``local_cache`` / ``store``). Target <= 0.25 on transformers (prefill is the floor: the
transformers engine has no prefix cache, so a repeated image + prompt is prefilled again).

Run: ``.venv/bin/python bench/p2_stored_features_ttft.py [--reps 3] [--requests 8]``
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

from shared.protocol import ECSource
from shared.tools.bench.schema import WorkloadSpec

TARGET = 0.25
PATHS = {
    "cache": ("worker local cache", ECSource.LOCAL_CACHE, {}),
    "store": ("S3 store, local cache off", ECSource.STORE, {"EPD_LOCAL_CACHE_BYTES": "0"}),
}


def spec(args: argparse.Namespace, seed: int, requests: int) -> WorkloadSpec:
    return WorkloadSpec(
        seed=seed,
        requests=requests,
        concurrency=1,
        image_sizes={f"{args.image_size}x{args.image_size}": 1.0},
        prompt_words=(16, 16),
        output_tokens=(args.max_tokens, args.max_tokens),
    )


async def measure(args: argparse.Namespace, stacks: dict[str, h.BenchStack]) -> list[h.Ratio]:
    for i, path in enumerate(PATHS):  # warm-up, not counted
        await h.run_load(stacks[path], spec(args, 1 + i, 2), label=f"warmup-{path}")
    figures: list[h.Ratio] = []
    runs: dict[str, list[h.Run]] = {}
    for path, (title, want, _) in PATHS.items():
        ratio = h.Ratio(f"P2 {path} ({title}): stored/cold TTFT p50", target=TARGET)
        cold_all, warm_all = [], []
        sources: collections.Counter[str] = collections.Counter()
        for rep in range(args.reps):
            cold_rep, warm_rep = [], []
            for i in range(args.requests):  # cold, then stored: one request each, taking turns
                seed = 100_000 * (rep + 1) + 1000 * list(PATHS).index(path) + i
                cold = await h.run_load(stacks[path], spec(args, seed, 1), label=f"p2-{path}-cold-{rep}-{i}")
                warm = await h.run_load(stacks[path], spec(args, seed, 1), label=f"p2-{path}-stored-{rep}-{i}")
                runs.setdefault(f"{path}-cold", []).append(cold)
                runs.setdefault(f"{path}-stored", []).append(warm)
                for run in (cold, warm):
                    if run.failed():
                        print(f"  {run.label}: failed: {[r.error for r in run.records if not r.ok][:3]}")
                sources.update(s for r in warm.ok() for s in r.ec_sources.values())
                cold_rep += cold.ok()
                warm_rep += warm.ok()
            c50 = h.pct([r.ttft_s for r in cold_rep if r.ttft_s is not None], 50)
            w50 = h.pct([r.ttft_s for r in warm_rep if r.ttft_s is not None], 50)
            ratio.add(w50 / c50)
            cold_all += cold_rep
            warm_all += warm_rep
            print(
                f"  {path} rep {rep}: TTFT p50 cold {c50 * 1e3:.0f} ms, stored {w50 * 1e3:.0f} ms -> {w50 / c50:.2f}",
                flush=True,
            )
        print(f"  {path}: EC sources of the stored requests: {dict(sources)} (expected: {want})")
        if set(sources) != {want}:
            print(f"  WARNING {path}: not every stored request took its features from {want}")
        for name, recs in (("cold", cold_all), ("stored", warm_all)):
            print(f"  {path} {name:>6}: stage means: {h.format_stages(h.stage_means(recs))}")
        figures.append(ratio)
    h.save(args.out, runs)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=8, images=True)
    args = parser.parse_args()
    return h.run_stacks("p2", args, {p: ("e-pd", env) for p, (_, _, env) in PATHS.items()}, measure)


if __name__ == "__main__":
    h.main_guard(main)
