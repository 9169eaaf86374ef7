"""P6: ``epd up`` to ready, tiny model: seconds from starting the console script to its ready line.

Runs the venv's ``epd up`` (default topology, e-pd: NATS, S3, api, encoder, prefill) ``--runs`` times, each
on free ports in a new temporary data folder, with the tiny model built beforehand (``--model``: building
it is not part of a start), and stops it with Ctrl-C (SIGINT) once it printed ``epd-serve ready``.
Measured on the wall clock from the process start (so the interpreter start and the CLI's imports are in,
unlike the ``ready in`` figure the line itself prints); the services' logs say when each was up (the API
serving, each worker's engine loaded and consuming). Target: < 15 s.

Run: ``.venv/bin/python bench/p6_epd_up_ready.py [--runs 3] [--topology e-pd]``
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

TARGET_S = 15.0
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


def one_run(model: Path, topology: str) -> tuple[float, float, dict[str, float]]:
    from tests.epdup import READY, EpdUp

    tmp = Path(tempfile.mkdtemp(prefix="bench-p6-", dir=h.ROOT / "var"))
    t0 = time.time()
    up = EpdUp(tmp, "--model", str(model), "--topology", topology)
    try:
        deadline = time.monotonic() + 300  # a hang bound, not a speed requirement
        while not (m := READY.search(up.output())):
            if up.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"epd up did not get ready (exit {up.proc.returncode}):\n{up.output()[-3000:]}")
            time.sleep(0.02)
        wall = time.time() - t0
        printed = float(re.search(r"ready in ([\d.]+)s", m.group(0)).group(1))  # type: ignore[union-attr]  # the line matched READY, which has this group
        return wall, printed, milestones(up.data_dir / "logs", t0)
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
    wall = h.Ratio(
        f"P6 epd up ({args.topology}, {args.model_size} model) to ready, wall clock",
        target=TARGET_S,
        strict=True,
        unit=" s",
        per="runs",
    )
    printed = h.Ratio("P6 'ready in' as printed (from the CLI's start)", unit=" s", per="runs")
    for i in range(args.runs):
        w, p, ms = one_run(model, args.topology)
        wall.add(w)
        printed.add(p)
        print(
            f"  run {i}: ready after {w:.1f} s (printed {p:.1f} s); "
            + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(ms.items(), key=lambda kv: kv[1])),
            flush=True,
        )
    return h.finish([printed, wall])


if __name__ == "__main__":
    h.main_guard(main)
