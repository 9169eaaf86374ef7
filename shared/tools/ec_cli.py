"""``epd ec``: what the EC store holds per model version, and purges (``shared.ec_lifecycle.janitor``).

* ``epd ec ls`` - per fingerprint and kind (``ec`` encoder outputs, ``kv`` E|P|D hand-offs):
  objects, bytes, last use (EC: the index; KV: modification time), the model it belongs to when
  known (served name and folder, from the fingerprint registry the API keeps from heartbeats)
  and whether it is ``current`` (a worker served it within ``EPD_EC_RETIRED_AFTER_S``),
  ``retired``, or ``unknown`` (no heartbeat named it; ``--retired`` takes it once unused for
  ``EPD_EC_RETIRED_AFTER_S``).
* ``epd ec purge --fingerprint F | --retired | --older-than D [--kind ec|kv|all] [--dry-run]`` -
  delete the matching objects (every given selector must match) and announce the EC ones
  (``ECInvalidated``), so no worker serves a purged object from a local copy. A fingerprint
  that no stored object and no heartbeat has is refused, listing the known ones (a typo, most
  likely; ``--allow-unknown-fingerprint`` purges it anyway).

Reads NATS and store settings from ``EPD_*`` like the services (``--nats-url`` / ``--prefix``
override). Exit codes: 0 ok; 2 an error, printed as one line on stderr. No torch import.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from shared.tools.replay_cli import EXIT_ERROR, _run, deployment_options, parse_duration

if TYPE_CHECKING:
    from shared.config import ToolSettings


def add_parser(sub: Any) -> None:
    """Add ``ec`` and its subcommands to the ``epd`` parser."""
    common = deployment_options()

    ec = sub.add_parser("ec", help="EC store: objects per model version, purges")
    esub = ec.add_subparsers(dest="ec_command", required=True)
    ls = esub.add_parser("ls", parents=[common], help="objects, bytes and last use per fingerprint")
    ls.set_defaults(func=_cmd_ls)
    purge = esub.add_parser("purge", parents=[common], help="delete the objects of a model version (or old ones)")
    purge.add_argument("--fingerprint", help="only this fingerprint's objects")
    purge.add_argument("--retired", action="store_true", help="only fingerprints no worker serves any more")
    purge.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="D",
        help="only objects last used more than D ago (30s, 15m, 2h, 1d)",
    )
    purge.add_argument("--kind", choices=("ec", "kv", "all"), default="all", help="object kind (default: all)")
    purge.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    purge.add_argument(
        "--allow-unknown-fingerprint",
        action="store_true",
        help="purge a --fingerprint that no stored object and no worker heartbeat named "
        "(refused by default: most likely a typo)",
    )
    purge.set_defaults(func=_cmd_purge)


async def _open(nc: Any, subjects: Any, settings: ToolSettings):
    import asyncio

    from shared.ec_lifecycle.index import ECIndex
    from shared.store.factory import open_stores

    index = await ECIndex.open(nc.jetstream(), subjects.ec_index_bucket, replicas=settings.nats.stream_replicas)
    store = (await asyncio.to_thread(open_stores, settings.store)).objects
    return index, store


def _cmd_ls(args: argparse.Namespace) -> int:
    async def body(nc, subjects, settings: ToolSettings) -> int:
        import asyncio

        from shared.ec_lifecycle.index import entry_key
        from shared.ec_lifecycle.janitor import is_current, list_objects

        index, store = await _open(nc, subjects, settings)
        listed = await asyncio.to_thread(list_objects, store, settings.store.namespace)
        snap = await index.snapshot("ec.>")
        fps = await index.fingerprints()
        now = time.time()
        rows: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {"objects": 0, "bytes": 0, "last_use": 0.0})
        for obj in listed:
            row = rows[(obj.kind, obj.fingerprint)]
            row["objects"] += 1
            row["bytes"] += obj.info.size
            indexed = snap.get(entry_key(obj.fingerprint, obj.name)) if obj.kind == "ec" else None
            used = indexed[0].last_use if indexed else (obj.info.last_modified or 0.0)
            row["last_use"] = max(row["last_use"], used)
        out = []
        for (kind, fp), row in sorted(rows.items(), key=lambda kv: (kv[0][0], -kv[1]["last_use"])):
            reg = fps.get(fp)
            out.append(
                {
                    "kind": kind,
                    "fingerprint": fp,
                    **row,
                    "model": reg.model if reg else "",
                    "model_path": reg.model_path if reg else "",
                    # (no heartbeat named it: KV objects' model fingerprints, plain vLLM servers' versions)
                    "status": ("current" if is_current(reg, now, settings.janitor.ec_retired_after_s) else "retired")
                    if reg is not None
                    else "unknown",
                }
            )
        if args.json:
            print(
                json.dumps(
                    {
                        "namespace": settings.store.namespace,
                        "max_bytes": settings.janitor.ec_max_bytes,
                        "fingerprints": out,
                    },
                    indent=2,
                )
            )
            return 0
        total = sum(r["bytes"] for r in out if r["kind"] == "ec")
        bound = f" (bound {settings.janitor.ec_max_bytes})" if settings.janitor.ec_max_bytes else ""
        print(f"namespace {settings.store.namespace}: {total} bytes of EC objects{bound}")
        print(f"{'kind':4} {'fingerprint':26} {'objects':>8} {'bytes':>12} {'last use':>10}  {'status':8} model")
        for r in out:
            ago = _ago(now - r["last_use"]) if r["last_use"] else "-"
            model = " ".join(x for x in (r["model"], f"({r['model_path']})" if r["model_path"] else "") if x) or "?"
            print(
                f"{r['kind']:4} {r['fingerprint']:26} {r['objects']:>8} {r['bytes']:>12} {ago:>10}  "
                f"{r['status']:8} {model}"
            )
        return 0

    return _run(args, body, prog="epd ec")


def _cmd_purge(args: argparse.Namespace) -> int:
    if not (args.fingerprint or args.retired or args.older_than is not None):
        print("epd ec purge: give --fingerprint, --retired or --older-than", file=sys.stderr)
        return EXIT_ERROR

    async def body(nc, subjects, settings: ToolSettings) -> int:
        from shared.ec_lifecycle.janitor import UnknownFingerprint, is_current, purge

        index, store = await _open(nc, subjects, settings)
        kinds = ("ec", "kv") if args.kind == "all" else (args.kind,)
        try:
            result = await purge(
                nc=nc,
                subjects=subjects,
                index=index,
                store=store,
                namespace=settings.store.namespace,
                by=f"epd-ec-purge-{settings.worker_id}",
                fingerprint=args.fingerprint,
                retired=args.retired,
                older_than_s=args.older_than,
                retired_after_s=settings.janitor.ec_retired_after_s,
                kinds=kinds,
                dry_run=args.dry_run,
                allow_unknown=args.allow_unknown_fingerprint,
            )
        except UnknownFingerprint as exc:
            now = time.time()
            known = (
                "; ".join(
                    f"{fp} ({'current' if is_current(reg, now, settings.janitor.ec_retired_after_s) else 'retired'}"
                    f"{', model ' + reg.model if reg.model else ''})"
                    if reg is not None
                    else f"{fp} (unknown model)"
                    for fp, reg in sorted(exc.known.items())
                )
                or "none"
            )
            print(
                f"epd ec purge: unknown fingerprint {exc.fingerprint!r} in namespace {settings.store.namespace}: no "
                f"stored object and no worker heartbeat has it; nothing removed. Known: {known}. "
                "(--allow-unknown-fingerprint purges it anyway)",
                file=sys.stderr,
            )
            return EXIT_ERROR
        rows = [
            {"kind": k, "fingerprint": fp, "objects": v[0], "bytes": v[1]}
            for (k, fp), v in sorted(result.removed.items())
        ]
        if args.json:
            print(json.dumps({"dry_run": args.dry_run, "removed": rows}, indent=2))
            return 0
        if args.fingerprint and result.objects:
            reg = await index.fingerprint(args.fingerprint)
            if is_current(reg, time.time(), settings.janitor.ec_retired_after_s):
                print(
                    f"note: {args.fingerprint} is a current fingerprint (a worker served it within "
                    f"{settings.janitor.ec_retired_after_s:.0f} s): purging it makes the encoders encode its images "
                    "again on their next use"
                )
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {result.objects} object(s), {result.nbytes} bytes")
        for r in rows:
            print(f"  {r['kind']:4} {r['fingerprint']:26} {r['objects']:>8} {r['bytes']:>12}")
        return 0

    return _run(args, body, prog="epd ec")


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
