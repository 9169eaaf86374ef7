"""``epd up`` as the tests run it: the venv's console script on free ports in a temporary data
folder, its output, and the processes it started (found through /proc, so a test can signal one
and can kill what is left behind, by pid and start time, never by name)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.tools.infra import free_port
from tests.stackutil import require_vllm_tier, wait_for

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
EPD = Path(sys.executable).parent / "epd"  # the console script `make run` calls
READY = re.compile(
    r"^epd-serve ready in [\d.]+s: (?P<url>https?://\S+)\s+"
    r"\(model (?P<model>\S+), engine (?P<engine>\S+), "
    r"topology (?P<topology>\S+)\)$",
    re.M,
)
#: The supervisor's lines about a service (``.format(label="encoder-0")``, then ``re.M``).
EXITED = r"^{label} \(pid (?P<pid>\d+)\) exited \((?P<how>[^)]*)\) after [\d.]+s up; restarting in (?P<delay>[\d.]+)s"
RESTARTED = r"^{label} restarted \(pid (?P<pid>\d+), restart (?P<n>\d+)\)$"
HEALTHY = r"^{label} healthy again \(pid (?P<pid>\d+), (?P<after>[\d.]+)s after its restart\)$"
#: How many times :class:`EpdUp` starts ``epd up`` when a port it picked was taken meanwhile.
PORT_RACE_LAUNCHES = 3


@dataclass(frozen=True)
class Proc:
    pid: int
    start_time: str  # /proc/<pid>/stat field 22: tells a pid from a later reuse of it
    cmdline: str

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[19] == self.start_time and stat[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state first), or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if stat is None or stat[0] == "Z":
            continue
        out.append(Proc(pid, stat[19], cmdline))
        todo.extend(children.get(pid, []))
    return out


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


class EpdUp:
    """A running ``epd up`` (the console script), its output and its processes."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
        """``args``: more ``epd up`` options; ``env``: ``EPD_*`` settings for every service (nothing
        else of this process's ``EPD_*`` leaks in)."""
        if (env or {}).get("EPD_ENGINE") == "vllm" or any(
            a == "--engine=vllm" or (a == "--engine" and b == "vllm") for a, b in zip(args, args[1:])
        ):
            require_vllm_tier("epd up with the vLLM engine")
        self.data_dir = tmp_path / "var"
        self.args = args
        # PYTHONPATH: the tree under test (the editable install points at the main checkout).
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EPD_")},
            **(env or {}),
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }
        self.tmp_path = tmp_path
        self.launches = 0
        self.seen: set[Proc] = set()
        self._launch()

    def _launch(self) -> None:
        """Start ``epd up`` on ports that were free a moment ago (each launch its own output file)."""
        self.launches += 1
        self.api_port, self.nats_port, self.s3_port = distinct_free_ports(3)
        argv = [
            str(EPD),
            "up",
            "--data-dir",
            str(self.data_dir),
            "--port",
            str(self.api_port),
            "--nats-port",
            str(self.nats_port),
            "--s3-port",
            str(self.s3_port),
            *self.args,
        ]
        self.out_path = self.tmp_path / ("epd-up.out" if self.launches == 1 else f"epd-up-{self.launches}.out")
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 420) -> re.Match:
        def ready():
            if self.proc.poll() is not None:
                # One of the ports picked free was taken before epd up bound it (a busy machine):
                # start again on others, a bounded number of times.
                if "already in use" in self.output() and self.launches < PORT_RACE_LAUNCHES:
                    log.warning("epd up: a port was taken, starting again: %s", self.output()[-300:])
                    self._kill_leftovers()
                    self._launch()
                    return None
                raise AssertionError(f"epd up exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            return READY.search(self.output())

        # A loaded 2-core machine: building the model plus starting four processes can take minutes.
        return wait_for(ready, timeout, "epd up to print that it is ready", interval=0.5)

    def children(self) -> list[Proc]:
        found = descendants(self.proc.pid)
        self.seen.update(found)
        return found

    def service_pid(self, service: str) -> int:
        [pid] = [p.pid for p in self.children() if f"-m services.{service}" in p.cmdline]
        return pid

    def health_files(self) -> dict[str, tuple[Path, str]]:
        """Worker label (``encoder-0``) -> (its heartbeat file, its role)."""
        return {p.stem: (p, p.stem.rsplit("-", 1)[0]) for p in sorted((self.data_dir / "logs").glob("*.health"))}

    def wait_line(self, pattern: str, what: str, timeout: float = 240, after: int = 0) -> re.Match:
        """The first output line at or after offset ``after`` matching ``pattern`` (epd up must keep running)."""

        def line():
            assert self.proc.poll() is None, f"epd up exited ({self.proc.returncode}):\n{self.output()[-4000:]}"
            return re.search(pattern, self.output()[after:], re.M)

        return wait_for(line, timeout, what, interval=0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        self.children()
        for p in self.seen:  # only what this test started, by pid
            if p.alive():
                log.warning("killing leftover %s (%d)", p.cmdline, p.pid)
                os.kill(p.pid, signal.SIGKILL)
