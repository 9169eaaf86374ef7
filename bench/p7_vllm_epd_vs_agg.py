"""P7: E|PD on the vLLM engine vs the same vLLM engine aggregated: a burst of single-image requests
sent at once, and a closed loop at concurrency 2; request throughput and TTFT ratios.

Starts embedded NATS + S3 and two stacks on the bench model (~130M Qwen2-VL), every worker with
``EPD_ENGINE=vllm`` and the same engine settings (the ``EPD_VLLM_*`` defaults, or what the environment
sets): ``agg`` (api + one worker whose vLLM encodes, prefills and decodes) and ``e-pd`` (api + an
encoder worker whose vLLM is an encoder-only EC producer + a prefill/decode worker whose vLLM loads the
features from the store). Each repetition, on each side (alternating the order, the same requests on
both sides - new images every repetition, so nothing is cached anywhere):

* burst: ``--burst`` requests, one new ``--image-size`` image each, all sent at once. Request
  throughput (completed requests / time from the first send to the last response) and image TTFT
  p50 / p99;
* concurrency 2: ``--c2-requests`` requests in a closed loop of 2. Throughput and TTFT p50.

Per side, the stage breakdown (means of the request timelines' stages, and of the worker's own
``FinalResult.timings``). The outputs of the two sides are compared token for token (greedy,
``ignore_eos``) for every request both completed; the count of equal / different is printed.
Targets (issue 14): burst throughput E|PD / agg >= 1.2, burst image TTFT p50 E|PD / agg <= 1.0; the
concurrency-2 ratios are reported.

Cores: by default (``--cores split-epd``) each side runs as ``epd up --engine vllm`` runs it: E|PD's encoder
and PD worker each on its own core (``EPD_CPU_CORES``), agg's one engine as vLLM binds it. ``--cores auto``
leaves every engine to vLLM's own binding, which on a 2-core host reserves one core, so every engine here -
agg's one, E|PD's two - computes on core 0. ``--cores split`` also gives agg's worker both cores (slower
for agg on this shared machine). The script prints each engine's binding (from its log).

Run: ``.venv/bin/python bench/p7_vllm_epd_vs_agg.py [--reps 3] [--burst 40] [--c2-requests 12] [--cores split-epd]``
(three vLLM engines start at once: 2-5 minutes on 2 cores; a repetition ~1-2 minutes).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

from shared.protocol import StageName
from shared.tools.bench.schema import WorkloadSpec

SIDES = ("agg", "epd")
TOPOLOGY = {"agg": "agg", "epd": "e-pd"}
WORKLOADS = ("burst", "c2")


def _bind(cores: str) -> dict[str, str]:
    # EPD_CPU_CORES: the worker binds itself (and sets vLLM's binding); VLLM_CPU_OMP_THREADS_BIND also
    # binds vLLM's OpenMP threads where the worker has no EPD_CPU_CORES.
    return {"EPD_CPU_CORES": cores, "VLLM_CPU_OMP_THREADS_BIND": cores}


#: --cores: label -> service -> environment
CORES = {
    "auto": {},
    "split": {"agg": {"prefill": _bind("0-1")}, "epd": {"encoder": _bind("1"), "prefill": _bind("0")}},
    "split-epd": {"epd": {"encoder": _bind("1"), "prefill": _bind("0")}},
}


def spec(args: argparse.Namespace, seed: int, workload: str) -> WorkloadSpec:
    n, c = (args.burst, args.burst) if workload == "burst" else (args.c2_requests, 2)
    return WorkloadSpec(
        seed=seed,
        requests=n,
        concurrency=c,
        image_sizes={f"{args.image_size}x{args.image_size}": 1.0},
        prompt_words=(16, 16),
        output_tokens=(args.max_tokens, args.max_tokens),
    )


def throughput(run: h.Run) -> float:
    assert run.result is not None
    return run.result.runs[0].summary.request_throughput


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def picture(docs) -> str:
    """Where a burst's time went, across its requests (times from the first request's arrival):
    the encodes (span, busy time, how many ran at once on average), the generation worker's job
    slots (slot time = job taken -> done, and the share of it spent waiting for the features),
    the last first token and the last response."""
    spans: dict[str, list[tuple[float, float]]] = {}
    slot, firsts, dones = [], [], []
    docs = list(docs)
    if not docs:
        return "no timelines"
    t0 = min(d["timeline"]["t0"] for d in docs)
    for d in docs:
        off = d["timeline"]["t0"] - t0
        taken = done = None
        for st in d["timeline"]["stages"]:
            a = st["start_s"] + off
            b = None if st["end_s"] is None else st["end_s"] + off
            if st["name"] == StageName.GENERATION_QUEUED and b is not None:
                taken = b
            elif st["name"] == StageName.FIRST_TOKEN:
                firsts.append(a)
            elif st["name"] == StageName.DONE:
                done = a
            if b is not None:
                spans.setdefault(st["name"], []).append((a, b))
        if taken is not None and done is not None:
            slot.append((taken, done))
            dones.append(done)
    enc = spans.get("encode", [])  # the encoder worker's; agg's vLLM encodes inside its "prefill"
    wait = sum(b - a for a, b in spans.get("EC loaded from store", []))
    slot_s = sum(b - a for a, b in slot)
    parts = []
    if enc:
        busy = _union(enc)
        parts.append(
            f"encodes {min(a for a, _ in enc):.1f}-{max(b for _, b in enc):.1f} s, busy {busy:.1f} s, "
            f"{sum(b - a for a, b in enc) / busy if busy else 0:.1f} at once"
        )
    if slot:
        parts.append(
            f"worker slots taken {min(a for a, _ in slot):.1f}-{max(b for _, b in slot):.1f} s, "
            f"{slot_s / _union(slot):.1f} jobs at once, {wait / slot_s:.0%} of slot time waiting for features"
        )
    if firsts and dones:
        parts.append(f"first tokens {min(firsts):.1f}-{max(firsts):.1f} s, last done {max(dones):.1f} s")
    return "; ".join(parts)


def core_binding(bs: h.BenchStack) -> str:
    """Each vLLM engine's OpenMP core binding, as its log states it (``core ids=[...]``)."""
    found = []
    for proc in bs.stack.processes:
        try:
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            continue
        ids = re.findall(r"core ids=(\[[^\]]*\])", text)
        if ids:
            found.append(f"{proc.name} {ids[-1]}")
    return ", ".join(found) or "not in the logs"


def timing_means(finals: list[dict]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for f in finals:
        for k, v in (f.get("timings") or {}).items():
            if isinstance(v, (int, float)):
                sums.setdefault(k, []).append(float(v))
    return {k: statistics.fmean(v) for k, v in sums.items()}


async def measure(args: argparse.Namespace, stacks: dict[str, h.BenchStack]) -> list[h.Ratio]:
    for side in SIDES:
        print(f"  {side:>3} vLLM engines' cores: {core_binding(stacks[side])}", flush=True)
    for i, side in enumerate(SIDES):  # warm-up: first requests pay for lazy set-up; not counted
        await h.run_load(stacks[side], spec(args, 1 + i, "c2"), label=f"warmup-{side}", timelines=False)
    figures = {
        "burst_tput": h.Ratio(f"P7 burst of {args.burst}: E|PD/agg request throughput", target=1.2, at_least=True),
        "burst_p50": h.Ratio(f"P7 burst of {args.burst}: E|PD/agg image TTFT p50", target=1.0),
        "burst_p99": h.Ratio(f"P7 burst of {args.burst}: E|PD/agg image TTFT p99"),
        "c2_tput": h.Ratio("P7 c=2: E|PD/agg request throughput"),
        "c2_p50": h.Ratio("P7 c=2: E|PD/agg TTFT p50"),
    }
    runs: dict[str, list[h.Run]] = {f"{s}-{w}": [] for s in SIDES for w in WORKLOADS}
    finals: dict[str, list[dict]] = {f"{s}-{w}": [] for s in SIDES for w in WORKLOADS}
    equal = differ = 0
    for rep in range(args.reps):
        for workload in WORKLOADS:
            seed = 10_000 * (rep + 1) + WORKLOADS.index(workload)  # the same requests on both sides
            got: dict[str, h.Run] = {}
            tokens: dict[str, dict[int, tuple[int, ...]]] = {}
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:  # A B, then B A, ...
                load = h.load_average()
                run = await h.run_load(stacks[side], spec(args, seed, workload), label=f"p7-{workload}-{side}-{rep}")
                if run.failed():
                    print(
                        f"  {run.label}: {run.failed()} failed: {[r.error for r in run.records if not r.ok][:3]}",
                        flush=True,
                    )
                docs = await h.debug_docs(stacks[side], run.records)
                fin = {i: f for i, d in docs.items() if (f := h.final_result(d)) is not None}
                got[side] = run
                tokens[side] = {i: tuple(f.get("token_ids") or ()) for i, f in fin.items()}
                runs[f"{side}-{workload}"].append(run)
                finals[f"{side}-{workload}"].extend(fin.values())
                ttfts = run.ttfts()
                print(
                    f"  rep {rep} {workload:>5} {side:>3}: {throughput(run):.2f} req/s, TTFT p50 "
                    f"{h.pct(ttfts, 50):.2f} s p99 {h.pct(ttfts, 99):.2f} s ({len(ttfts)} ok; load {load})",
                    flush=True,
                )
                if workload == "burst":
                    print(f"        {picture(docs.values())}", flush=True)
            for i in tokens["agg"].keys() & tokens["epd"].keys():
                if tokens["agg"][i] == tokens["epd"][i]:
                    equal += 1
                else:
                    differ += 1
            agg, epd = (got[s] for s in SIDES)
            if workload == "burst":
                figures["burst_tput"].add(throughput(epd) / throughput(agg))
                figures["burst_p50"].add(h.pct(epd.ttfts(), 50) / h.pct(agg.ttfts(), 50))
                figures["burst_p99"].add(h.pct(epd.ttfts(), 99) / h.pct(agg.ttfts(), 99))
            else:
                figures["c2_tput"].add(throughput(epd) / throughput(agg))
                figures["c2_p50"].add(h.pct(epd.ttfts(), 50) / h.pct(agg.ttfts(), 50))
    for workload in WORKLOADS:
        for side in SIDES:
            rs = runs[f"{side}-{workload}"]
            recs = [r for run in rs for r in run.ok()]
            ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
            tput = [throughput(run) for run in rs]
            print(
                f"  {workload:>5} {side:>3}: {statistics.median(tput):.2f} req/s [{min(tput):.2f}-{max(tput):.2f}], "
                f"TTFT p50 {h.pct(ttfts, 50):.2f} s p99 {h.pct(ttfts, 99):.2f} s ({len(ttfts)} requests)"
            )
            print(f"        stages (timeline means): {h.format_stages(h.stage_means(recs))}")
            means = timing_means(finals[f"{side}-{workload}"])
            listed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(means.items()))
            print(f"        worker timings (means): {listed}")
    verdict = "EQUAL" if differ == 0 and equal else "DIFFERENT"
    print(
        f"  outputs E|PD vs agg, same requests, greedy: {equal} equal token for token, {differ} different -> {verdict}",
        flush=True,
    )
    print(f"load average at the end: {h.load_average()}", flush=True)
    h.save(args.out, runs)
    return list(figures.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=None, images=True)
    parser.set_defaults(image_size=224)
    parser.add_argument("--burst", type=int, default=40, help="image requests in a burst (all at once)")
    parser.add_argument("--c2-requests", type=int, default=12, help="requests of a concurrency-2 run")
    parser.add_argument(
        "--cores",
        default="split-epd",
        choices=sorted(CORES),
        help="the workers' cores (EPD_CPU_CORES, VLLM_CPU_OMP_THREADS_BIND): auto = vLLM's own "
        "binding (on 2 cores every engine takes core 0 and leaves core 1 to the rest); split = "
        "agg's worker on cores 0-1, E|PD's encoder on core 1 and its PD worker on core 0; "
        "split-epd = "
        "E|PD's split, agg's as in auto",
    )
    args = parser.parse_args()
    specs = {s: (TOPOLOGY[s], {"EPD_ENGINE": "vllm"}) for s in SIDES}
    return h.run_stacks("p7", args, specs, measure, ready_timeout=1200.0, service_env=CORES[args.cores])


if __name__ == "__main__":
    h.main_guard(main)
