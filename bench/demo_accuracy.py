"""Demo model accuracy: held-out questions per template, through the API, greedy, on every
topology and engine (the figure in docs/getting-started.md; ``tests/test_demo_model.py`` checks a
smaller sample in ``make test``).

Starts one stack per (engine, topology) on the shipped demo model (``shared/tools/models/
qwen2-vl-shapes``, trained by ``epd model train-demo``), or measures a running one (``--url``, e.g.
``make run``'s), sends ``--cases`` cases per template and generator four at a time, and prints a
table of the share answered correctly (the bare word, a final period allowed), and a JSON line per
stack and generator. Generators: ``train`` - held-out cases of the training generator
(:mod:`shared.tools.models.shapes`, seeds 0..N-1; training draws seeds from 1e6 up); ``test`` - the
same scenes drawn by a generator written apart from it (:mod:`tests.shapes_testgen`: other drawing
code and randomisation), which a model that only fits its generator's quirks fails. The video
templates (direction, moving_colour) send one clip each (an mp4, or the test generator's MJPG AVI),
sampled at its own rate (every frame).

Run: ``.venv/bin/python bench/demo_accuracy.py [--cases 200] [--generators train test] [--engines
transformers vllm] [--topologies agg e-pd e-p-d] [--templates direction moving_colour]`` or ``...
--url http://127.0.0.1:8000``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness as h

from shared.tools.models.demo import MODEL_NAME, SHIPPED_DIR
from shared.tools.models.shapes import Case, Template, make_case
from tests.shapes_testgen import make_test_case

GENERATORS: dict[str, Callable[[Template, int], Case]] = {"train": make_case, "test": make_test_case}


def ask(url: str, case: Case) -> str:
    resp = httpx.post(f"{url}/v1/chat/completions", json=case.chat_request(MODEL_NAME), timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def measure(
    url: str, n: int, generator: str, templates: list[Template] | None = None
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """The share of ``n`` cases per template answered right, and the misses (answer -> reply)."""
    make = GENERATORS[generator]
    templates = templates or list(Template)
    cases = [make(t, seed) for t in templates for seed in range(n)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda c: ask(url, c), cases))
    right = {t.value: 0 for t in templates}
    misses: dict[str, list[str]] = {t.value: [] for t in templates}
    for case, reply in zip(cases, replies, strict=True):
        right[case.template.value] += case.correct(reply)
        if not case.correct(reply):
            misses[case.template.value].append(f"{case.answer}->{reply.strip()}")
    return {t: r / n for t, r in right.items()}, misses


def measure_row(url: str, n: int, generator: str, templates: list[Template], **labels: str) -> dict:
    started = time.perf_counter()
    accuracy, misses = measure(url, n, generator, templates)
    row = {**labels, "generator": generator, "cases_per_template": n, **accuracy}
    print(json.dumps(row), f"({time.perf_counter() - started:.0f} s)", json.dumps(misses), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="held-out cases per template")
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    parser.add_argument("--topologies", nargs="+", default=["agg", "e-pd", "e-p-d"])
    parser.add_argument("--generators", nargs="+", choices=sorted(GENERATORS), default=["train", "test"])
    parser.add_argument(
        "--templates", nargs="+", choices=[t.value for t in Template], default=[t.value for t in Template]
    )
    parser.add_argument("--url", help="measure this running stack (e.g. make run's) instead of starting stacks")
    args = parser.parse_args()
    args.templates = [Template(t) for t in args.templates]
    rows = []
    if args.url:
        rows = [
            measure_row(args.url, args.cases, g, args.templates, engine="(running)", topology="(running)")
            for g in args.generators
        ]
    else:
        rows = bench_stacks(args)
    templates = [t.value for t in args.templates]
    print("\n| generator | engine | topology | " + " | ".join(templates) + " |")
    print("|---|---|---|" + "---|" * len(templates))
    for row in rows:
        cells = " | ".join(f"{row[t]:.1%}" for t in templates)
        print(f"| {row['generator']} | {row['engine']} | {row['topology']} | {cells} |")
    return 0 if all(row[t] >= 0.95 for row in rows for t in templates) else 1


def bench_stacks(args: argparse.Namespace) -> list[dict]:
    rows = []
    with h.Bench("demo-accuracy") as bench:
        for engine in args.engines:
            for topology in args.topologies:
                label = f"{engine}-{topology}"
                overrides = {
                    "EPD_ENGINE": engine,
                    "EPD_MODEL_NAME": MODEL_NAME,
                    "EPD_MAX_IMAGES_PER_REQUEST": "2",
                    "EPD_MAX_IMAGE_BYTES": str(1024 * 1024),
                }
                (bs,) = bench.start({label: (topology, overrides)}, SHIPPED_DIR, timeout=900).values()
                try:
                    for generator in args.generators:
                        rows.append(
                            measure_row(bs.url, args.cases, generator, args.templates, engine=engine, topology=topology)
                        )
                finally:
                    bs.stack.stop()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
