"""P6: ``epd up`` to ready, and a killed worker back, tiny model; with and without the fork server.

Runs the venv's ``epd up`` (default topology, e-pd: NATS, S3, api, encoder, prefill) ``--runs`` times per
side, sides alternating (``--fork-server``, the default, and ``--no-fork-server``: every service a plain
``python -m services.<name>``; ``shared.tools.forkserver``), each on free ports in a new temporary data
folder, with the tiny model built beforehand (``--model``: building it is not part of a start). Ready:
seconds on the wall clock from the process start (so the interpreter start and the CLI's imports are in,
unlike the ``ready in`` figure the line itself prints) to ``epd-serve ready``. Restart: the prefill worker
SIGKILLed once the stack is ready; seconds from the kill to the supervisor's ``prefill-0 healthy again``
line (its heartbeat back: it consumes again), the supervisor's 1 s backoff included. Then Ctrl-C. The
services' logs say when each was up (the API serving, each worker's engine loaded and consuming).
Targets (issue 28): ready < 15 s in every run, a killed worker serving again within 5 s.

Run: ``.venv/bin/python bench/p6_epd_up_ready.py [--runs 3] [--topology e-pd]``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

TARGET_S = 15.0
TARGET_RESTART_S = 5.0
#: Log lines that mark a service's start-up milestones (services/api/app.py, shared/engines, shared/worker.py).
MILESTONES = {
    "api serving": re.compile(r"Uvicorn running on"),
    "engine loaded": re.compile(r"engine \S+ loaded .* in (?P<s>[\d.]+)s"),
    "consuming": re.compile(r"worker \S+ consuming"),
}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def milestones(log_dir: Path, t0: float) -> dict[str, float]:
    """'<service> <milestone>' -> seconds after ``t0`` (epoch), from the first matching log line."""
    out: dict[str, float] = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            stamp = STAMP.match(line)
            if not stamp:
                continue
            for name, pattern in MILESTONES.items():
                key = f"{path.stem} {name}"
                if key not in out and pattern.search(line):
                    at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    out[key] = at - t0
    return out


def one_run(model: Path, topology: str, fork_server: bool) -> tuple[float, float, float, dict[str, float]]:
    """Ready (wall clock), ready as printed, kill-to-healthy of the prefill worker, milestones."""
    from tests.epdup import HEALTHY, READY, EpdUp

    tmp = Path(tempfile.mkdtemp(prefix="bench-p6-", dir=h.ROOT / "var"))
    t0 = time.time()
    up = EpdUp(tmp, "--model", str(model), "--topology", topology, *([] if fork_server else ["--no-fork-server"]))
    try:
        deadline = time.monotonic() + 300  # a hang bound, not a speed requirement
        while not (m := READY.search(up.output())):
            if up.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"epd up did not get ready (exit {up.proc.returncode}):\n{up.output()[-3000:]}")
            time.sleep(0.02)
        wall = time.time() - t0
        printed = float(re.search(r"ready in ([\d.]+)s", m.group(0)).group(1))  # type: ignore[union-attr]  # the line matched READY, which has this group
        ms = milestones(up.data_dir / "logs", t0)
        mark = len(up.output())
        killed_at = time.monotonic()
        os.kill(up.service_pid("prefill"), signal.SIGKILL)
        healthy = re.compile(HEALTHY.format(label="prefill-0"), re.M)
        while not healthy.search(up.output()[mark:]):
            if up.proc.poll() is not None or time.monotonic() > killed_at + 300:
                raise RuntimeError(f"prefill-0 did not come back:\n{up.output()[-3000:]}")
            time.sleep(0.02)
        return wall, printed, time.monotonic() - killed_at, ms
    finally:
        up.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--topology", default="e-pd", choices=["agg", "e-pd", "e-p-d"])
    parser.add_argument("--model-size", default="tiny", choices=["bench", "tiny"])
    args = parser.parse_args()
    model = h.model_dir(args.model_size)
    figures: list[h.Ratio] = []
    per_side: dict[bool, tuple[h.Ratio, h.Ratio, h.Ratio]] = {}
    for fork_server in (True, False):
        side = "fork server" if fork_server else "no fork server"
        per_side[fork_server] = (
            h.Ratio(f"P6 'ready in' as printed, {side}", unit=" s", per="runs"),
            h.Ratio(
                f"P6 epd up ({args.topology}, {args.model_size} model) to ready, wall clock, {side}",
                target=TARGET_S if fork_server else None,
                strict=True,
                unit=" s",
                per="runs",
            ),
            h.Ratio(
                f"P6 prefill worker SIGKILLed to healthy again, {side}",
                target=TARGET_RESTART_S if fork_server else None,
                unit=" s",
                per="runs",
            ),
        )
        figures.extend(per_side[fork_server])
    for i in range(args.runs):
        for fork_server in (True, False) if i % 2 == 0 else (False, True):
            w, p, r, ms = one_run(model, args.topology, fork_server)
            printed, wall, restart = per_side[fork_server]
            wall.add(w)
            printed.add(p)
            restart.add(r)
            print(
                f"  run {i} ({'fork server' if fork_server else 'no fork server'}): ready after {w:.1f} s "
                f"(printed {p:.1f} s), prefill back {r:.1f} s after its kill; "
                + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(ms.items(), key=lambda kv: kv[1])),
                flush=True,
            )
    return h.finish(figures)


if __name__ == "__main__":
    h.main_guard(main)
