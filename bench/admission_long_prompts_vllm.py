"""Benchmark: the worker's admission of long prompts on the vLLM engine (``shared.admission``).

One vLLM engine as a PD worker starts it (bench model, float32, the CPU step budget of 256 tokens),
pinned to one core, fed the way the worker feeds it: each request holds a ``PrioritySlots`` slot,
marked prefilled at its first token. Per repetition and side, taking turns: ``--burst`` long prompts
(~``--long-tokens`` tokens each, the size of a 448x448 image prompt; text stands in for the image:
the language model's prefill is the same work) ready at once, and short text probes sent one after
another until the burst ends. Sides: ``LONG_PROMPTS_AT_ONCE`` 1 and 2 (the default), and ``off``
(no limit: every prompt goes into the engine at once, as before the rule). This is the case of
image prompts whose features are ready together (stored, or repeats); in P4 the encoder hands them
over one by one and the rule rarely binds.

Run: ``.venv/bin/python bench/admission_long_prompts_vllm.py [--reps 3] [--burst 8]``. Prints, per
side, the probes' TTFT p50 and max, and the burst's duration, with their ratios to ``off`` (from
the same run: the machine is shared, so only ratios from one run mean anything).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SIDES = ("1", "2", "off")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--burst", type=int, default=8, help="long prompts ready at once")
    parser.add_argument("--long-tokens", type=int, default=358, help="tokens of a long prompt (a 448x448 image's)")
    parser.add_argument("--cpu", type=int, default=0, help="the core the engine runs on")
    args = parser.parse_args()

    os.sched_setaffinity(0, {args.cpu})  # vLLM's engine process inherits it, as EPD_CPU_CORES binds a worker
    import harness as h

    import shared.admission as admission
    from shared.engines.base import SamplingParams
    from shared.engines.vllm_engine import VllmEngine
    from tests.stackutil import engine_messages

    model = args.model or h.model_dir("bench")
    (ROOT / "var").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="admission-bench-", dir=ROOT / "var"))
    engine = VllmEngine(model, dtype="float32", model_id=model.name, work_dir=work / "vllm")
    long_prompt = admission.long_prompt_tokens(None, engine.prefill_tokens_per_step)
    assert long_prompt is not None

    def tokens(text: str) -> int:
        return len(engine.tokenizer(engine.render_prompt(engine_messages(text, 0), ()))["input_ids"])

    filler = " ".join(f"w{i % 50}" for i in range(args.long_tokens))
    while tokens(filler) > args.long_tokens:
        filler = filler.rsplit(" ", 1)[0]

    async def one(slots, text: str, max_tokens: int) -> tuple[float, float]:
        """TTFT and end-to-end seconds of one request let in through ``slots``, at the cost of its
        real prompt tokens (what the worker's estimate gives an image prompt: its image tokens are
        known; for text, ``prompt_cost`` guesses 4 characters a token, and this filler has fewer)."""
        t = time.perf_counter()
        first = None
        messages = engine_messages(text, 0)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async with slots.slot(tokens(text)) as slot:
            async for _ in engine.generate(messages, [], params):
                if first is None:
                    first = time.perf_counter() - t
                    slot.prefilled()
        assert first is not None
        return first, time.perf_counter() - t

    async def burst(side: str, salt: str) -> tuple[list[float], float]:
        slots = (
            admission.PrioritySlots(16)
            if side == "off"
            else admission.PrioritySlots(16, long_prompt, long_at_once=int(side))
        )
        longs = [asyncio.create_task(one(slots, f"{salt} {i} {filler}", 8)) for i in range(args.burst)]
        t0 = time.perf_counter()
        probes = []
        while not all(task.done() for task in longs):
            probes.append((await one(slots, f"probe {salt} {len(probes)}: what is two and two?", 4))[0])
        await asyncio.gather(*longs)
        return probes, time.perf_counter() - t0

    async def measure() -> list[h.Ratio]:
        idle = [(await one(admission.PrioritySlots(16), f"idle {i}: what is two and two?", 4))[0] for i in range(6)]
        print(
            f"long prompt {tokens(filler)} tokens (long: over {long_prompt}), short "
            f"{tokens('probe x 0: what is two and two?')}; idle TTFT p50 {statistics.median(idle) * 1e3:.0f} ms",
            flush=True,
        )
        await burst("off", "warm-up")
        figures = {
            (side, what): h.Ratio(f"long prompts {side} at once / off: {label}")
            for side in SIDES[:-1]
            for what, label in (("max", "probe TTFT max"), ("p50", "probe TTFT p50"), ("burst", "burst duration"))
        }
        by_rep: dict[int, dict[str, tuple[float, float, float]]] = {}
        for rep, side in h.alternate(args.reps, SIDES):
            probes, took = await burst(side, f"r{rep}{side}")
            row = (max(probes), statistics.median(probes), took)
            by_rep.setdefault(rep, {})[side] = row
            print(
                f"  rep {rep} {side:>3}: {len(probes)} probes, TTFT p50 {row[1] * 1e3:.0f} ms "
                f"max {row[0] * 1e3:.0f} ms; "
                f"{args.burst} long prompts done in {took:.2f} s (load {h.load_average()})",
                flush=True,
            )
        for sides in by_rep.values():
            for side in SIDES[:-1]:
                for i, what in enumerate(("max", "p50", "burst")):
                    figures[(side, what)].add(sides[side][i] / sides["off"][i])
        return list(figures.values())

    try:
        return h.finish(asyncio.run(measure()))
    finally:
        from tests.vllmutil import close_engine

        close_engine(engine)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
