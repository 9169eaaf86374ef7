"""``epd replay``: list, show, run, export and import recorded requests (``shared.history`` reads
them, ``shared.tools.replay`` re-runs, exports and imports them).

Reads NATS and store settings from ``EPD_*`` like the services (``--nats-url`` / ``--prefix``
override). Exit codes: 0 ok; 1 ``run --compare`` found a difference; 2 an error (unknown id,
expired messages, unreachable NATS, ...), printed as one line on stderr. No torch import.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.config import ToolSettings
    from shared.store.objects import ObjectStore

EXIT_DIFFERENT = 1
EXIT_ERROR = 2
CONNECT_TIMEOUT_S = 5.0
#: added to "cannot connect to NATS": where a tool's NATS URL comes from
NATS_HINT = (
    "point the tool at the deployment with --nats-url or EPD_NATS_URL "
    "(`epd up` prints an `export EPD_NATS_URL=...` line to paste)"
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90`` / ``90s`` / ``15m`` / ``2h`` / ``1d`` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 30s, 15m, 2h, 1d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def deployment_options() -> argparse.ArgumentParser:
    """The options every command that reads a deployment's NATS takes (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", help="NATS URL (default: EPD_NATS_URL)")
    common.add_argument("--prefix", help="subject prefix of the deployment (default: EPD_SUBJECT_PREFIX)")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    return common


def add_parser(sub: Any) -> None:
    """Add ``replay`` and its subcommands to the ``epd`` parser."""
    from shared.history import STATUSES

    common = deployment_options()

    replay = sub.add_parser("replay", help="inspect, replay, export and import recorded requests")
    rsub = replay.add_subparsers(dest="replay_command", required=True)

    ls = rsub.add_parser("list", parents=[common], help="recent requests, newest first")
    ls.add_argument(
        "--since", type=parse_duration, default=parse_duration("1h"), help="how far back (30s, 15m, 2h, 1d; default 1h)"
    )
    ls.add_argument("--status", choices=STATUSES, help="only requests that ended so")
    ls.add_argument("--limit", type=int, default=20, help="at most this many requests (default %(default)s)")
    ls.set_defaults(func=_cmd_list)

    show = rsub.add_parser("show", parents=[common], help="a request's summary and stage timeline (and its messages)")
    show.add_argument("request_id", help="the request's id (chatcmpl-..., as epd replay list prints it)")
    show.add_argument("--html", metavar="FILE", help="also write the waterfall page to FILE")
    show.add_argument(
        "--messages",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also print every message of the request, after the timeline (default: summary and timeline only)",
    )
    show.set_defaults(func=_cmd_show)

    run = rsub.add_parser("run", parents=[common], help="re-run a recorded request on the live workers")
    run.add_argument("request_id", help="the recorded request's id")
    run.add_argument(
        "--compare", action="store_true", help="diff the new output with the recorded one; exit 1 when they differ"
    )
    run.add_argument(
        "--new-seed",
        action="store_true",
        help="sample with the replay's own seed instead of the original's derived one",
    )
    run.add_argument("--timeout", type=float, default=None, help="seconds to wait for the result")
    run.add_argument("--wait-workers", type=float, default=10.0, help="seconds to wait for a live prefill worker")
    run.set_defaults(func=_cmd_run)

    export = rsub.add_parser("export", parents=[common], help="write requests to a case file (JSON)")
    export.add_argument("request_ids", nargs="+", metavar="REQUEST_ID", help="the requests to write")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="the case file to write")
    export.add_argument("--no-media", action="store_true", help="leave the images out")
    export.add_argument(
        "--max-media-bytes",
        type=int,
        default=64 * 1024**2,
        help="at most this many image bytes in the file (default 64 MiB)",
    )
    export.set_defaults(func=_cmd_export)

    imp = rsub.add_parser("import", parents=[common], help="load a case file into this NATS (and store)")
    imp.add_argument("file", help="a case file written by epd replay export")
    imp.set_defaults(func=_cmd_import)


# -- plumbing ---------------------------------------------------------------------------------
def _settings(args: argparse.Namespace) -> ToolSettings:
    from shared.config import ToolSettings

    overrides = {}
    if args.nats_url:
        overrides["nats_url"] = args.nats_url
    if args.prefix:
        overrides["subject_prefix"] = args.prefix
    return ToolSettings(**overrides)


async def _quiet(_exc: Exception) -> None:
    """nats-py prints every failed connect attempt; the one error we raise says it all."""


async def _connect(settings: ToolSettings):
    from shared.jetstream import connect

    # Fail fast: one attempt per server, no reconnect loop (services reconnect forever; a CLI must not hang).
    return await asyncio.wait_for(
        connect(
            settings.nats,
            name="epd-replay",
            connect_timeout=CONNECT_TIMEOUT_S,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            error_cb=_quiet,
        ),
        timeout=CONNECT_TIMEOUT_S * 3,
    )


def _store(settings: ToolSettings) -> ObjectStore:
    from shared.store.factory import open_stores

    return open_stores(settings.store).objects


def _run(args: argparse.Namespace, body, *, prog: str = "epd replay") -> int:
    """Connect to the deployment's NATS, run ``body(nc, subjects, settings)``, close. Errors are
    printed as one line on stderr, prefixed with ``prog``; exit :data:`EXIT_ERROR`."""
    from shared.errors import EPDError, ServiceUnavailable
    from shared.jetstream import redact_url
    from shared.protocol import Subjects

    async def main() -> int:
        settings = _settings(args)
        try:
            nc = await _connect(settings)
        except TimeoutError as exc:
            raise ServiceUnavailable(
                f"cannot connect to NATS at {redact_url(settings.nats.nats_url)}: timed out; {NATS_HINT}"
            ) from exc
        except ServiceUnavailable as exc:
            raise ServiceUnavailable(f"{exc.message}; {NATS_HINT}") from exc
        try:
            return await body(nc, Subjects(settings.nats.subject_prefix), settings)
        finally:
            await nc.close()

    try:
        return asyncio.run(main())
    except EPDError as exc:
        print(f"{prog}: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as exc:  # settings validation (e.g. a bad --prefix)
        print(f"{prog}: invalid settings: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _printable(text: str) -> str:
    """Model output can hold control characters: escape them so the terminal shows them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


# -- commands ---------------------------------------------------------------------------------
def _cmd_list(args: argparse.Namespace) -> int:
    from shared import history
    from shared.timeline import render_summary

    async def body(nc, subjects, _settings) -> int:
        rows = await history.list_requests(nc, subjects, since_s=args.since, status=args.status, limit=args.limit)
        if args.json:
            _print_json([r.to_json() for r in rows])
        elif not rows:
            status = f" with status {args.status}" if args.status else ""
            print(f"no requests in the last {args.since:.0f} s{status}")
        else:
            for r in rows:
                print(render_summary(r))
        return 0

    return _run(args, body)


def _cmd_show(args: argparse.Namespace) -> int:
    from shared import history, timeline

    async def body(nc, subjects, _settings) -> int:
        case = await history.find_case(nc, subjects, args.request_id)
        tl = timeline.build_timeline(case)
        if args.html:
            Path(args.html).write_text(timeline.render_html(case, tl), encoding="utf-8")
        if args.json:
            _print_json({"case": case.to_json(), "timeline": tl.to_json()})
            return 0
        print(timeline.render_summary(tl.summary) + f"  ({case.source})")
        for note in tl.notes:
            print(f"note: {note}")
        print()
        print(timeline.render_text(tl))
        if args.messages:
            print()
            print(timeline.render_messages(case))
        if args.html:
            print(f"\nwrote {args.html}")
        return 0

    return _run(args, body)


def _cmd_run(args: argparse.Namespace) -> int:
    from shared.tools import replay

    async def body(nc, subjects, settings: ToolSettings) -> int:
        out = await replay.replay_request(
            nc,
            subjects,
            args.request_id,
            namespace=settings.store.namespace,
            store=_store(settings),
            keep_seed=not args.new_seed,
            timeout_s=args.timeout,
            worker_wait_s=args.wait_workers,
            stream_replicas=settings.nats.stream_replicas,
        )
        if args.json:
            _print_json(out.to_json())
        else:
            _print_outcome(out, compare=args.compare)
        if args.compare and out.identical is False:
            return EXIT_DIFFERENT
        return 0

    return _run(args, body)


def _describe(result) -> str:
    from shared.protocol import FinalResult

    if isinstance(result, FinalResult):
        return f"{result.completion_tokens} tokens, finish={result.finish_reason}, text {result.text!r}"
    return f"error {result.code} (HTTP {result.http_status}): {result.message}"


def _print_outcome(out, *, compare: bool) -> None:
    mode = "greedy" if out.greedy else f"sampled, seed {out.seed}"
    print(f"replayed {out.original_id} as {out.replay_id} in {out.elapsed_s:.2f}s ({mode})")
    for note in out.notes:
        print(f"note: {note}")
    print(f"replay:   {_describe(out.result)}")
    if not compare:
        return
    if out.recorded is None:
        recorded = _describe(out.recorded_error) if out.recorded_error else "no result"
        print(f"recorded: {recorded} - nothing to compare")
        return
    print(f"recorded: {_describe(out.recorded)}")
    if out.identical:
        print(f"identical: yes ({len(out.recorded.token_ids)} token ids and the text)")
    else:
        where = out.first_difference
        print("identical: NO" + (f" - first difference at token {where}" if where is not None else ""))
        if out.diff():
            print(f"diff ([-recorded-] {{+replay+}}):\n  {_printable(out.diff())}")


def _cmd_export(args: argparse.Namespace) -> int:
    from shared.tools import replay

    async def body(nc, subjects, settings: ToolSettings) -> int:
        doc = await replay.export_cases(
            nc,
            subjects,
            args.request_ids,
            store=None if args.no_media else _store(settings),
            include_media=not args.no_media,
            max_media_bytes=args.max_media_bytes,
        )
        size = replay.write_case_file(doc, args.output)
        cases = doc["cases"]
        if args.json:
            _print_json(
                {
                    "file": args.output,
                    "bytes": size,
                    "cases": [
                        {
                            "request_id": c["request_id"],
                            "messages": len(c["messages"]),
                            "images": len(c["media"]),
                            "notes": c["notes"],
                        }
                        for c in cases
                    ],
                }
            )
            return 0
        for c in cases:
            print(f"{c['request_id']}: {len(c['messages'])} messages, {len(c['media'])} image(s)")
            for note in c["notes"]:
                print(f"  note: {note}")
        print(f"wrote {args.output} ({size} bytes)")
        return 0

    return _run(args, body)


def _cmd_import(args: argparse.Namespace) -> int:
    from shared.history import HistoryError
    from shared.tools import replay

    doc: dict[str, Any] = {}

    async def body(nc, subjects, settings: ToolSettings) -> int:
        report = await replay.import_cases(nc, subjects, settings, doc, store=_store(settings))
        if args.json:
            _print_json(report.__dict__)
            return 0
        for rid in report.imported:
            print(f"imported {rid}")
        for rid in report.skipped:
            print(f"skipped {rid}: already imported here")
        for note in report.notes:
            print(f"note: {note}")
        print(f"{report.messages} messages into {subjects.stream_imported}, {report.media} image(s) into the store")
        return 0

    try:
        doc = replay.read_case_file(args.file)
    except HistoryError as exc:
        print(f"epd replay: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    return _run(args, body)
