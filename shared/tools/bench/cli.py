"""``epd bench``: ``run`` (this module) and the subcommands other bench modules add.

``epd bench run --url URL [workload flags] [--out result.json]`` runs a workload (a YAML file of
``WorkloadSpec`` fields, flags on top) against any OpenAI-compatible endpoint, prints the report
and writes the result JSON (``shared.tools.bench.schema``). Exit codes: 0 done (failed requests
are in the report); 1 every request failed; 2 the benchmark could not run (bad flags or
workload, unreachable endpoint). Heavy imports (httpx, numpy, tqdm) wait until a command runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

#: Modules of this package that add a ``bench`` subcommand with ``add_parser(bench_sub)``.
SUBCOMMANDS = ("compare",)

EXIT_ALL_FAILED = 1
EXIT_ERROR = 2


def add_parser(sub: Any) -> None:
    """Add ``bench`` (``run`` and every module of :data:`SUBCOMMANDS`) to the ``epd`` parser."""
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint (ours or another server)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    run = bench_sub.add_parser(
        "run",
        help="run a multimodal workload, print vLLM-style latency tables, write JSON",
        description="Flags override the --workload file; without --requests, --duration runs for that long.",
    )
    run.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    run.add_argument(
        "--api-key",
        help="sent as 'Authorization: Bearer KEY' (default: OPENAI_API_KEY from the environment, as the openai "
        "client; never printed)",
    )
    run.add_argument(
        "--cacert",
        metavar="FILE",
        help="CA file an https URL's certificate is verified against (curl's flag; `epd up --tls` prints its "
        "CA's path; default: the system CAs)",
    )
    run.add_argument("--workload", metavar="FILE.yaml", help="WorkloadSpec fields (shared/tools/bench/schema.py)")
    run.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    run.add_argument("--requests", type=int, help="requests per run (default 50)")
    run.add_argument("--duration", type=float, dest="duration_s", metavar="S", help="stop sending after S seconds")
    load = run.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="keep N requests in flight (default 1)")
    load.add_argument("--rate", type=float, help="Poisson arrivals at R req/s (open loop)")
    load.add_argument("--sweep", type=parse_rates, metavar="R1,R2,...", help="one Poisson run per rate")
    run.add_argument(
        "--images-per-request",
        type=_parse_counts,
        metavar="N[:W],...",
        help="images per image request with weights, e.g. 1:0.8,2:0.2 (default 1)",
    )
    run.add_argument(
        "--image-sizes",
        type=parse_weights,
        metavar="WxH[:W],...",
        help="image size buckets with weights, e.g. 448x448:0.7,896x896:0.3 (default 448x448)",
    )
    run.add_argument("--text-only-share", type=float, metavar="F", help="share of requests without an image")
    run.add_argument(
        "--repeat-share", type=float, metavar="F", help="share of image requests that reuse earlier images"
    )
    run.add_argument("--repeat-window", type=int, metavar="N", help="repeats pick among the last N images (16)")
    run.add_argument("--prompt-words", type=parse_range, metavar="MIN,MAX", help="prompt length in words (16)")
    run.add_argument("--output-tokens", type=parse_range, metavar="MIN,MAX", help="output length in tokens (32)")
    run.add_argument("--turns", type=int, help="turns per conversation about one image (1)")
    run.add_argument(
        "--video-share", type=float, metavar="F", help="share of requests with media that send a video clip (0)"
    )
    run.add_argument(
        "--video-frames", type=parse_range, metavar="MIN,MAX", help="frames per clip, all sampled (4-32; default 8)"
    )
    run.add_argument(
        "--video-sizes",
        type=parse_weights,
        metavar="WxH[:W],...",
        help="clip frame size buckets with weights, e.g. 224x224:0.5,448x448:0.5 (default 224x224)",
    )
    run.add_argument(
        "--video-repeat-share",
        type=float,
        metavar="F",
        help="share of video requests that send again one of the last --repeat-window clips (0)",
    )
    run.add_argument("--seed", type=int, help="workload seed (0)")
    run.add_argument(
        "--slo", type=parse_slo, metavar="ttft=MS,tpot=MS,e2e=MS", help="report goodput under these bounds"
    )
    run.add_argument("--label", default="", help="a name for this run in reports and comparisons")
    run.add_argument("--out", metavar="FILE.json", help="write the result here")
    run.add_argument("--timeout", type=float, default=None, metavar="S", help="bound on one request (default 600 s)")
    run.add_argument(
        "--no-timelines",
        action="store_true",
        help="epd-serve: skip reading each request's timeline (no stage breakdown)",
    )
    run.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress report (a bar on a terminal, else a plain line every tenth of the run)",
    )
    run.set_defaults(func=cmd_run)

    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"shared.tools.bench.{name}")
        except ImportError as exc:
            if exc.name != f"shared.tools.bench.{name}":
                raise  # the module exists but is broken: say so
            continue
        module.add_parser(bench_sub)


# Flag parsers that import their module (and numpy) only when the flag is given: `epd` starts fast.
def _parse_counts(text: str) -> dict:
    from shared.tools.bench.workload import parse_weights

    return parse_weights(text, int)


def parse_weights(text: str) -> dict:
    from shared.tools.bench import workload

    return workload.parse_weights(text)


def parse_range(text: str) -> tuple[int, int]:
    from shared.tools.bench import workload

    return workload.parse_range(text)


def parse_rates(text: str) -> tuple[float, ...]:
    from shared.tools.bench import workload

    return workload.parse_rates(text)


def parse_slo(text: str) -> dict[str, float]:
    from shared.tools.bench import report

    return report.parse_slo(text)


_SPEC_FLAGS = (
    "requests",
    "duration_s",
    "concurrency",
    "rate",
    "sweep",
    "images_per_request",
    "image_sizes",
    "text_only_share",
    "repeat_share",
    "repeat_window",
    "prompt_words",
    "output_tokens",
    "turns",
    "video_share",
    "video_frames",
    "video_sizes",
    "video_repeat_share",
    "seed",
    "model",
)


def spec_from_args(args: argparse.Namespace):
    """The workload: the --workload file, then the flags given."""
    from shared.tools.bench.workload import load_spec

    overrides = {name: getattr(args, name) for name in _SPEC_FLAGS if getattr(args, name) is not None}
    # A load flag replaces the file's load: --rate or --concurrency drops its sweep.
    if args.sweep is not None:
        overrides["arrival"] = "poisson"
    elif args.rate is not None:
        overrides.update(arrival="poisson", sweep=())
    elif args.concurrency is not None:
        overrides.update(arrival="concurrency", sweep=())
    return load_spec(args.workload, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from shared.tools.bench import runner, schema
    from shared.tools.bench.report import format_result

    try:
        spec = spec_from_args(args)
    except (OSError, ValueError) as exc:
        print(f"epd bench run: {exc}", file=sys.stderr)
        return EXIT_ERROR
    kwargs: dict[str, Any] = {}
    if args.timeout is not None:
        kwargs["request_timeout_s"] = args.timeout
    if args.cacert is not None:
        from shared.health import tls_client_context

        try:
            kwargs["verify"] = tls_client_context(args.cacert)
        except OSError as exc:  # (ssl.SSLError is one) a missing or unreadable CA file
            print(f"epd bench run: cannot read the CA file {args.cacert}: {exc}", file=sys.stderr)
            return EXIT_ERROR
    try:
        result = asyncio.run(
            runner.run(
                args.url,
                spec,
                api_key=args.api_key or os.environ.get(runner.API_KEY_ENV) or None,
                label=args.label,
                progress=not args.no_progress,
                slo_ms=args.slo,
                timelines=not args.no_timelines,
                **kwargs,
            )
        )
    except runner.BenchError as exc:
        print(f"epd bench run: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(format_result(result), flush=True)
    if args.out:
        try:
            Path(args.out).write_bytes(schema.dump(result))
        except OSError as exc:
            print(f"epd bench run: cannot write {args.out}: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print(f"wrote {args.out}", file=sys.stderr)
    if not any(run.summary.completed for run in result.runs):
        return EXIT_ALL_FAILED
    return 0
