"""P11: video (issue 43): a repeated clip's TTFT / its cold TTFT (E|PD), and a burst of video requests,
E|PD against agg (request throughput), on the bench model (~130M Qwen2-VL).

Clips are made here: a coloured square moving across a plain background (``--size`` px, ``--frames``
frames at ``--clip-fps``), each clip its own start, direction and colours (distinct content: cold);
requests ask ``media_io_kwargs.video.fps`` = ``--clip-fps``, so every frame is sampled (``--frames``).

* repeat: per repetition, ``--requests`` pairs sent one at a time to the E|PD stack - a new clip (cold:
  decode + sample in the API, encode, store, load), then the same request again (its features stored:
  on vLLM the PD engine may also hold it in its encoder cache). Ratio: p50 TTFT stored / p50 TTFT cold.
  Target <= 0.3 (issue 43, on the vLLM engine).
* burst: per repetition, ``--burst`` requests with distinct clips sent at once to each stack (E|PD and
  agg take turns); ratio: E|PD req/s / agg req/s. Target >= 1.3 (on 2 cores the PD worker and the encoder
  share them: the encoder's work overlaps the PD's only where a core is free).

* ``--plain-vllm`` (the vLLM engine; with the burst): a plain vLLM OpenAI server as a third side
  (``python -m vllm.entrypoints.openai.api_server`` on the same folder and engine settings - float32, seed
  0, eager, ``--max-num-seqs``, ``--kv-cache-gib`` - aggregated, none of the project's code: vLLM's proxy
  that we pin carries no ``video_url``, so its E|PD cannot be the reference here). Each burst goes to it
  with the E|PD side's clips: ratio E|PD req/s / plain vLLM req/s, and how many of the outputs are equal
  token for token.

* long (``--long N``, instead of the two above): one N-frame video at a time (``--requests`` distinct
  clips a repetition, cold), on an E|PD stack with two encoders and segments of ``--segment`` frames
  (each segment its own encode job: both encoders work on the one video) against one with one encoder
  encoding it whole (``EPD_VIDEO_SEGMENT_FRAMES=0``), taking turns; ratio: TTFT p50 segmented / whole,
  and where each side's time goes (the timeline's stages, medians). No target: on 2 cores the two
  encoders and the PD worker share the same cores.

Run: ``.venv/bin/python bench/p11_video.py [--engine vllm|transformers] [--reps 3] [--requests 4]
[--burst 16] [--plain-vllm] [--frames 16] [--size 224] [--long 32 --segment 16]``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import p10_vllm_proxy_burst as p10

from shared.tools.bench.workload import video_clip
from shared.tools.infra import free_port


def clip_bytes(seed: int, frames: int, size: int, fps: float) -> bytes:
    """An mp4 of a square moving across a plain background (``shared.tools.bench.workload.video_clip``,
    which ``epd bench run``'s video workload draws too); ``seed`` picks colours, start and direction."""
    return video_clip(seed, frames, size, size, fps)


def body(args: argparse.Namespace, model: str, clip: bytes) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "Which way is the square moving?"},
                ],
            }
        ],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "media_io_kwargs": {"video": {"fps": args.clip_fps}},
    }


class PlainVllm(p10.VllmEpd):
    """A plain vLLM OpenAI server (aggregated, no connector) on the bench model: P10's server as
    vLLM's example starts it, less the EC transfer config."""

    def __init__(self, work: Path, model: Path, args: argparse.Namespace):
        super().__init__(work, model, args, cores={})
        self.servers = ("plain",)
        self.ports = {"plain": free_port()}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['plain']}"

    def server_argv(self, role: str) -> list[str]:
        argv = super().server_argv(role)
        at = argv.index("--ec-transfer-config")
        # (per-request media_io_kwargs - the clips' fps - are refused without it: vLLM's default)
        return [*argv[:at], *argv[at + 2 :], "--trust-request-mm-kwargs"]

    async def wait_ready(self, timeout: float) -> None:
        await self._wait("plain", f"{self.url}/health", time.monotonic() + timeout)


async def repeat(args: argparse.Namespace, stack: h.BenchStack, http) -> h.Ratio:
    ratio = h.Ratio("P11 repeated clip: stored/cold TTFT p50 (E|PD)", target=0.3)
    for rep in range(args.reps):
        cold: list[float] = []
        stored: list[float] = []
        for i in range(args.requests):
            clip = clip_bytes(1000 * (rep + 1) + i, args.frames, args.size, args.clip_fps)
            for out in (cold, stored):
                await h.wait_quiet()
                probe = await h.chat(http, stack.url, body(args, stack.model, clip))
                if not probe.ok or probe.ttft_s is None:
                    raise SystemExit(f"request failed: {probe.error}")
                out.append(probe.ttft_s)
        c50, s50 = h.pct(cold, 50), h.pct(stored, 50)
        ratio.add(s50 / c50)
        print(f"  repeat rep {rep}: TTFT p50 cold {c50 * 1e3:.0f} ms, stored {s50 * 1e3:.0f} ms -> {s50 / c50:.2f}")
    return ratio


async def burst(
    args: argparse.Namespace, stacks: dict[str, h.BenchStack], http, plain: PlainVllm | None = None
) -> list[h.Ratio]:
    ratio = h.Ratio(f"P11 burst of {args.burst} video requests: E|PD/agg req/s", target=1.3, at_least=True)
    vs_plain = h.Ratio(f"P11 burst of {args.burst} video requests: E|PD/plain vLLM server req/s")
    equal = total = 0
    urls = {side: (stacks[side].url, stacks[side].model) for side in stacks}
    if plain is not None:
        urls["plain"] = (plain.url, plain.model.name)
    for rep in range(args.reps):
        rates = {}
        tokens: dict[str, list[list[int]]] = {}
        order = list(urls) if rep % 2 == 0 else list(reversed(urls))  # taking turns
        for side in order:
            k = ("epd", "agg").index(side) if side != "plain" else 0  # plain vLLM: the E|PD side's clips
            clips = [
                clip_bytes(500_000 + 10_000 * rep + 1000 * k + i, args.frames, args.size, args.clip_fps)
                for i in range(args.burst)
            ]
            url, model = urls[side]
            await h.wait_quiet()
            started = time.perf_counter()
            probes = await asyncio.gather(*(h.chat(http, url, body(args, model, c)) for c in clips))
            elapsed = time.perf_counter() - started
            failed = [p.error for p in probes if not p.ok]
            if failed:
                raise SystemExit(f"{side}: {len(failed)} requests failed: {failed[:2]}")
            rates[side] = len(probes) / elapsed
            tokens[side] = [p.token_ids for p in probes]
            ttft = h.pct([p.ttft_s for p in probes if p.ttft_s is not None], 50)
            print(f"  burst rep {rep} {side}: {rates[side]:.2f} req/s, TTFT p50 {ttft:.2f} s")
        ratio.add(rates["epd"] / rates["agg"])
        if plain is not None:
            vs_plain.add(rates["epd"] / rates["plain"])
            equal += sum(a == b for a, b in zip(tokens["epd"], tokens["plain"], strict=True))
            total += args.burst
    if plain is None:
        return [ratio]
    print(f"  E|PD outputs equal to plain vLLM's token for token: {equal}/{total}")
    return [ratio, vs_plain]


async def long_video(args: argparse.Namespace, stacks: dict[str, h.BenchStack], http) -> h.Ratio:
    from shared.tools.bench.runner import parse_timeline

    ratio = h.Ratio(f"P11 one {args.long}-frame video: TTFT p50 2 encoders + segments / 1 encoder whole")
    stages: dict[str, dict[str, list[float]]] = {side: {} for side in stacks}
    for rep in range(args.reps):
        ttft: dict[str, list[float]] = {side: [] for side in stacks}
        for k, side in enumerate(("seg", "whole") if rep % 2 == 0 else ("whole", "seg")):
            for i in range(args.requests):
                clip = clip_bytes(900_000 + 10_000 * rep + 1000 * k + i, args.long, args.size, args.clip_fps)
                await h.wait_quiet()
                probe = await h.chat(http, stacks[side].url, body(args, stacks[side].model, clip))
                if not probe.ok or probe.ttft_s is None:
                    raise SystemExit(f"{side}: request failed: {probe.error}")
                ttft[side].append(probe.ttft_s)
                seconds, _ = parse_timeline(await h.timeline(http, stacks[side].url, probe.request_id))
                for name, sec in seconds.items():
                    stages[side].setdefault(name, []).append(sec)
        seg, whole = h.pct(ttft["seg"], 50), h.pct(ttft["whole"], 50)
        ratio.add(seg / whole)
        print(f"  long rep {rep}: TTFT p50 segmented {seg:.2f} s, whole {whole:.2f} s -> {seg / whole:.2f}")
    for side, by_stage in stages.items():
        parts = ", ".join(
            f"{name} {h.pct(v, 50):.2f}" for name, v in sorted(by_stage.items(), key=lambda kv: -max(kv[1]))
        )
        print(f"  where the time goes ({side}, s, medians): {parts}")
    return ratio


async def measure(
    args: argparse.Namespace, stacks: dict[str, h.BenchStack], plain: PlainVllm | None = None
) -> list[h.Ratio]:
    async with h.client() as http:
        for side in stacks:  # warm-up, not counted
            probe = await h.chat(
                http,
                stacks[side].url,
                body(args, stacks[side].model, clip_bytes(7, args.frames, args.size, args.clip_fps)),
            )
            if not probe.ok:
                raise SystemExit(f"warm-up on {side} failed: {probe.error}")
        if args.long:
            return [await long_video(args, stacks, http)]
        figures = [await repeat(args, stacks["epd"], http)]
        if args.burst:
            figures += await burst(args, stacks, http, plain)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(parser, reps=3, requests=4)
    parser.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    parser.add_argument("--frames", type=int, default=16, help="frames of a clip (every one sampled)")
    parser.add_argument("--clip-fps", type=float, default=8.0)
    parser.add_argument("--size", type=int, default=224, help="a clip's side, px")
    parser.add_argument("--burst", type=int, default=16, help="requests of a burst (0: no burst)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--long", type=int, default=0, help="frames of the long-video comparison (0: not run)")
    parser.add_argument("--segment", type=int, default=16, help="--long: frames a segment holds")
    parser.add_argument("--plain-vllm", action="store_true", help="the burst against a plain vLLM server too")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="every engine (EPD_VLLM_MAX_NUM_SEQS)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="every engine (EPD_VLLM_KV_CACHE_GIB)")
    args = parser.parse_args()
    if args.plain_vllm and (args.engine != "vllm" or not args.burst or args.long):
        parser.error("--plain-vllm goes with the vLLM engine's burst (--engine vllm, --burst N, no --long)")
    args.spare_pd = args.vllm_proxy = None  # (P10's server settings PlainVllm reuses)
    env = {
        "EPD_ENGINE": args.engine,
        "EPD_MAX_VIDEO_FRAMES": str(max(64, args.frames, args.long)),
        "EPD_VLLM_MAX_NUM_SEQS": str(args.max_num_seqs),
        "EPD_VLLM_KV_CACHE_GIB": str(args.kv_cache_gib),
    }
    if args.long:
        specs = {
            "seg": ("e-pd", {**env, "EPD_VIDEO_SEGMENT_FRAMES": str(args.segment)}),
            "whole": ("e-pd", {**env, "EPD_VIDEO_SEGMENT_FRAMES": "0"}),
        }
        return h.run_stacks("p11", args, specs, measure, ready_timeout=1200, replicas={"seg": {"encoder": 2}})
    specs = {"epd": ("e-pd", env)}
    if args.burst:
        specs["agg"] = ("agg", env)
    if not args.plain_vllm:
        return h.run_stacks("p11", args, specs, measure, ready_timeout=1200)
    model = h.model_dir(args.model_size)
    print(f"load average at start: {h.load_average()}", flush=True)
    with h.Bench("p11", keep=args.keep) as bench:
        plain = PlainVllm(bench.work / "plain-vllm", model, args)
        try:
            plain.start_servers()  # its engine loads while our stacks' do
            stacks = bench.start(specs, model, timeout=1200.0)
            asyncio.run(plain.wait_ready(1200.0))
            figures = asyncio.run(measure(args, stacks, plain))
        finally:
            plain.close()
    return h.finish(figures)


if __name__ == "__main__":
    h.main_guard(main)
