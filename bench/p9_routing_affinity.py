"""P9: cache-aware routing on multi-turn image conversations, affinity vs shared queue, in one run.

Starts embedded NATS + S3 and one E|PD stack with two PD workers (``--engine``: transformers, or vLLM
with its automatic prefix caching), one encoder and two APIs on the same workers: one with
``EPD_ROUTING=affinity``, one with ``EPD_ROUTING=shared`` (today). Both sides therefore run on the very
same workers, taking turns (A B, then B A, ...), so the machine's load hits both alike.

A conversation: turn 1 asks about a new image; turns 2..``--turns`` repeat the whole history (the
same image, the earlier questions and answers) plus a new question, as a chat client does. Each side
runs ``--conversations`` conversations per repetition, ``--parallel`` at a time, turn after turn. Per
side: TTFT of turn 1 and of the later turns (p50, p90), the later-turn/first-turn ratio, where each
later turn's image features came from (``local_cache`` = no S3 GET; ``store`` = one EC GET;
``recomputed`` = the image's GET and an encode) and the S3 GETs per later-turn request.

The issue's target (issue 27): later-turn / first-turn TTFT <= 0.15 with affinity on the vLLM engine
(a repeated image + prefix is a prefix-cache hit there), S3 GETs per repeated image near zero. The
transformers engine has no prefix cache: a later turn is prefilled again, so only the S3 GET (and the
load of the features) is saved.

Run: ``.venv/bin/python bench/p9_routing_affinity.py [--reps 3] [--conversations 4] [--turns 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import numpy as np
from PIL import Image

from shared.tools.infra import free_port
from shared.tools.launcher import Stack, http_json, start_service, topology_env
from shared.topology import Service

SIDES = ("affinity", "shared")
TARGET_LATER_OVER_FIRST = 0.15  # vLLM, affinity


def image_url(seed: int, size: int) -> str:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }


async def conversation(http, url: str, model: str, seed: int, args) -> list[dict[str, Any]]:
    """One conversation's turns: [{turn, ttft_s, sources}] (sources: the turn's EC sources)."""
    messages: list[dict[str, Any]] = []
    out = []
    for turn in range(args.turns):
        question = h.prompt(12, salt=seed + turn)
        if turn == 0:
            content: Any = [
                {"type": "image_url", "image_url": {"url": image_url(seed, args.image_size)}},
                {"type": "text", "text": question},
            ]
        else:
            content = question
        messages.append({"role": "user", "content": content})
        probe = await h.chat(http, url, body(model, messages, args.max_tokens))
        if not probe.ok:
            raise RuntimeError(f"turn {turn} of conversation {seed} failed: {probe.error}")
        debug = await h.timeline(http, url, probe.request_id)
        final = h.final_result(debug) or {}
        routed = [m.get("message", {}) for m in debug["case"]["messages"] if m.get("kind") == "generation_job"]
        out.append(
            {
                "turn": turn,
                "ttft_s": probe.ttft_s,
                "sources": list((final.get("ec_sources") or {}).values()),
                "route": routed[-1].get("route_reason", "") if routed else "",
            }
        )
        messages.append({"role": "assistant", "content": final.get("text", "")})
    return out


async def side_run(http, url: str, model: str, seeds: list[int], args) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for i in range(0, len(seeds), args.parallel):  # ``--parallel`` conversations at a time
        group = seeds[i : i + args.parallel]
        for conv in await asyncio.gather(*(conversation(http, url, model, s, args) for s in group)):
            turns += conv
    return turns


def gets(sources: list[str]) -> int:
    """S3 GETs a request's features cost: an EC object per ``store``, the image per ``recomputed``."""
    return sum(1 for s in sources if s == "store" or s.startswith("recomputed"))


def report(side: str, turns: list[dict[str, Any]]) -> tuple[float, float, float]:
    first = [t["ttft_s"] for t in turns if t["turn"] == 0]
    later = [t for t in turns if t["turn"] > 0]
    later_ttft = [t["ttft_s"] for t in later]
    sources = Counter(s.split(":")[0] for t in later for s in t["sources"])
    routes = Counter(t["route"] or "-" for t in turns)
    g = sum(gets(t["sources"]) for t in later) / max(1, len(later))
    print(
        f"  {side}: TTFT turn 1 p50 {h.pct(first, 50) * 1e3:.0f} ms; later turns p50 {h.pct(later_ttft, 50) * 1e3:.0f}"
        f" ms, p90 {h.pct(later_ttft, 90) * 1e3:.0f} ms; later-turn sources {dict(sources)}; S3 GETs per later"
        f" turn {g:.2f}; routes {dict(routes)}",
        flush=True,
    )
    return h.pct(first, 50), h.pct(later_ttft, 50), g


async def measure(args, urls: dict[str, str], model: str) -> list[h.Ratio]:
    later_over_first = {s: h.Ratio(f"P9 {s}: later-turn / first-turn TTFT p50") for s in SIDES}
    later_over_first["affinity"].target = TARGET_LATER_OVER_FIRST if args.engine == "vllm" else None
    affinity_over_shared = h.Ratio("P9 later-turn TTFT p50, affinity / shared")
    s3 = {s: h.Ratio(f"P9 {s}: S3 GETs per later-turn request", unit="") for s in SIDES}
    async with h.client() as http:
        for side in SIDES:  # warm-up, not counted
            await side_run(http, urls[side], model, [10_000 + SIDES.index(side)], args)
        by_rep: dict[int, dict[str, float]] = {}
        for rep, side in h.alternate(args.reps, SIDES):
            seeds = [100_000 * (rep + 1) + 1000 * SIDES.index(side) + i for i in range(args.conversations)]
            turns = await side_run(http, urls[side], model, seeds, args)
            print(f"rep {rep}", flush=True)
            first, later, g = report(side, turns)
            later_over_first[side].add(later / first)
            s3[side].add(g)
            by_rep.setdefault(rep, {})[side] = later
        for sides in by_rep.values():
            affinity_over_shared.add(sides["affinity"] / sides["shared"])
    return [*later_over_first.values(), affinity_over_shared, *s3.values()]


def _live_workers(url: str) -> int:
    try:
        status, health = http_json(f"{url}/health")
    except (OSError, ValueError):
        return 0
    return health.get("workers", {}).get("prefill", 0) if status == 200 else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h.common_args(parser, reps=3, requests=None, images=True)
    parser.add_argument("--conversations", type=int, default=6, help="conversations per side per repetition")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--parallel",
        type=int,
        default=3,
        help="conversations at a time (odd, more than the 2 workers: a shared queue that alternates between "
        "them must not keep each conversation on one worker by chance)",
    )
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    parser.set_defaults(image_size=224)
    args = parser.parse_args()
    model = h.model_dir(args.model_size)
    print(f"load average at start: {h.load_average()}", flush=True)
    with h.Bench("p9", keep=args.keep) as bench:
        env = bench.env(model, EPD_ROUTING="affinity", EPD_ENGINE=args.engine)
        stack = Stack(
            env=env,
            log_dir=bench.work / "logs",
            topology="e-pd",
            api_port=free_port(),
            replicas={Service.PREFILL: 2},
        )
        bench.stacks.append(h.BenchStack("p9", stack, model.name))
        stack.start(staggered=args.engine == "vllm")
        port = free_port()
        shared_api = start_service(
            "api",
            {
                **env,
                **topology_env(stack.topology),
                "EPD_PORT": str(port),
                "EPD_ROUTING": "shared",
                "EPD_WORKER_ID": f"api-shared-{os.getpid()}",
            },
            bench.work / "logs" / "api-shared.log",
        )
        stack.processes.append(shared_api)  # stopped with the stack
        stack.wait_ready(timeout=1800, roles={"encoder": 1, "prefill": 2})
        urls = {"affinity": stack.base_url, "shared": f"http://127.0.0.1:{port}"}
        deadline = time.monotonic() + 300
        while _live_workers(urls["shared"]) < 2:  # the second API has seen both workers' heartbeats
            if time.monotonic() > deadline:
                raise SystemExit(f"the shared-queue API did not see both workers; log {shared_api.log_path}")
            time.sleep(0.5)
        figures = asyncio.run(measure(args, urls, model.name))
    return h.finish(figures)


if __name__ == "__main__":
    h.main_guard(main)
