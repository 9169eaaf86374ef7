"""Demo model accuracy: held-out questions per template, through the API, greedy, on every
topology and engine (the figure in docs/getting-started.md; ``tests/test_demo_model.py`` checks a
smaller sample in ``make test``).

Starts one stack per (engine, topology) on the shipped demo model (``shared/tools/models/
qwen2-vl-shapes``, trained by ``epd model train-demo``), sends ``--cases`` held-out cases per
template (seeds 0..N-1; training draws seeds from 1e6 up) four at a time, and prints a table of the
share answered correctly (the bare word, a final period allowed), and a JSON line per stack.

Run: ``.venv/bin/python bench/demo_accuracy.py [--cases 200] [--engines transformers vllm]
[--topologies agg e-pd e-p-d]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness as h

from shared.tools.models.demo import MODEL_NAME, SHIPPED_DIR
from shared.tools.models.shapes import Case, Template, make_case


def ask(url: str, case: Case) -> str:
    resp = httpx.post(f"{url}/v1/chat/completions", json=case.chat_request(MODEL_NAME), timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def measure(url: str, n: int) -> dict[str, float]:
    cases = [make_case(t, seed) for t in Template for seed in range(n)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda c: ask(url, c), cases))
    right = {t.value: 0 for t in Template}
    for case, reply in zip(cases, replies, strict=True):
        right[case.template.value] += case.correct(reply)
    return {t: r / n for t, r in right.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="held-out cases per template")
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    parser.add_argument("--topologies", nargs="+", default=["agg", "e-pd", "e-p-d"])
    args = parser.parse_args()
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
                started = time.perf_counter()
                (bs,) = bench.start({label: (topology, overrides)}, SHIPPED_DIR, timeout=900).values()
                try:
                    accuracy = measure(bs.url, args.cases)
                finally:
                    bs.stack.stop()
                row = {"engine": engine, "topology": topology, "cases_per_template": args.cases, **accuracy}
                print(json.dumps(row), f"({time.perf_counter() - started:.0f} s)", flush=True)
                rows.append(row)
    templates = [t.value for t in Template]
    print("\n| engine | topology | " + " | ".join(templates) + " |")
    print("|---|---|" + "---|" * len(templates))
    for row in rows:
        cells = " | ".join(f"{row[t]:.1%}" for t in templates)
        print(f"| {row['engine']} | {row['topology']} | {cells} |")
    return 0 if all(row[t] >= 0.95 for row in rows for t in templates) else 1


if __name__ == "__main__":
    raise SystemExit(main())
