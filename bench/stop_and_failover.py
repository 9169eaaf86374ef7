"""Ctrl-C of ``epd up`` and a SIGKILLed worker's request (issue 41, items 1 and 2).

**Stop.** Runs the venv's ``epd up`` (default topology and model) ``--stops`` times in one data folder, always
on the same API / NATS / S3 ports, each started again at once after the previous one exited (the port's
TIME_WAIT connections of the request before must not refuse it). Each time: ready, one request (the one
``epd up`` prints), a quiet second, then SIGINT; the figure is SIGINT to the process's exit on the wall clock
(every service, the fork server, NATS and S3 stopped). Target: <= 3 s (median).

**Failover.** On one more ``epd up``: ``--kills`` times a long streamed greedy request (``max_tokens`` 400,
``ignore_eos``); once its first tokens have arrived, the prefill worker holding it is SIGKILLed (``kill -9``).
The supervisor restarts the worker (after 1 s: the kills are a minute apart, so none counts as a crash loop);
JetStream redelivers the job after ``EPD_ACK_WAIT_S`` (the default, 4 s); the new worker prefills again and
regenerates the tokens already sent (the API drops their repeats).
Figure: the kill to the end of the stream's longest pause after it (tokens sent before the kill
may still arrive after it). Target: <= 5 s (median). The stream's
tokens must equal an unkilled run's.

Run: ``.venv/bin/python bench/stop_and_failover.py [--stops 10] [--kills 5]`` (ports: ``--port``,
``--nats-port``, ``--s3-port``; free ones by default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

TARGET_STOP_S = 3.0
TARGET_RESUME_S = 5.0
EPD = Path(sys.executable).parent / "epd"
READY = re.compile(r"^epd-serve ready in [\d.]+s: (?P<url>http://\S+)", re.M)
BODY = re.compile(r"^\s*curl -s \S+/v1/chat/completions .*-d '(?P<body>.*)'$", re.M)


class Up:
    """One ``epd up`` on fixed ports, its output in a file."""

    def __init__(self, data_dir: Path, ports: tuple[int, int, int], out: Path):
        api, nats, s3 = ports
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
        env.update(PYTHONPATH=str(h.ROOT), PYTHONUNBUFFERED="1")
        self.out = out
        argv = [str(EPD), "up", "--data-dir", str(data_dir), "--port", str(api)]
        argv += ["--nats-port", str(nats), "--s3-port", str(s3)]
        with out.open("wb") as fh:
            self.proc = subprocess.Popen(
                argv, cwd=h.ROOT, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_ready(self, timeout: float = 420) -> tuple[str, dict]:
        deadline = time.monotonic() + timeout  # a hang bound, not a speed requirement
        while not (m := READY.search(self.output())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"epd up not ready (exit {self.proc.returncode}):\n{self.output()[-3000:]}")
            time.sleep(0.05)
        body = BODY.search(self.output())
        assert body is not None, self.output()[-2000:]
        return m["url"], json.loads(body["body"])

    def stop(self) -> float:
        """SIGINT; seconds until it exited."""
        if self.proc.poll() is not None:
            return float("nan")
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(300)
        took = time.monotonic() - t0
        if code != 0:
            raise RuntimeError(f"epd up exited {code}:\n{self.output()[-3000:]}")
        return took

    def pid_of(self, service: str) -> int:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if f"-m services.{service}" in cmdline and _descends(ppid, self.proc.pid):
                return int(entry.name)
        raise RuntimeError(f"no {service} process")


def _descends(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
    return False


def stream(url: str, body: dict, on_first=None) -> tuple[list[int], list[float]]:
    """Token ids of a streamed completion and when each chunk of new tokens arrived (monotonic)."""
    tokens: list[int] = []
    times: list[float] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk)
            new = chunk["choices"][0].get("token_ids") or []
            if new:
                tokens += new
                times.append(time.monotonic())
                if on_first is not None:
                    on_first()
                    on_first = None
    return tokens, times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stops", type=int, default=10)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--port", type=int)
    parser.add_argument("--nats-port", type=int)
    parser.add_argument("--s3-port", type=int)
    args = parser.parse_args()
    from shared.tools.infra import free_ports
    from shared.tools.launcher import RestartPolicy

    picked = iter(free_ports(3))
    ports = (args.port or next(picked), args.nats_port or next(picked), args.s3_port or next(picked))
    tmp = Path(tempfile.mkdtemp(prefix="bench-stop-", dir=h.ROOT / "var"))
    stop = h.Ratio("idle epd up, SIGINT to exit", target=TARGET_STOP_S, unit=" s", per="stops")
    resume = h.Ratio(
        "SIGKILLed prefill worker, kill to the stream going on", target=TARGET_RESUME_S, unit=" s", per="kills"
    )
    print(f"load average before: {h.load_average()}", flush=True)
    try:
        for i in range(args.stops):
            up = Up(tmp / "var", ports, tmp / f"up-{i}.out")
            try:
                url, body = up.wait_ready()
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
                time.sleep(1.0)  # a quiet second: the stop of an idle stack is the figure
            finally:
                took = up.stop()
            stop.add(took)
            print(f"  stop {i}: {took:.2f} s", flush=True)
        if args.kills:
            up = Up(tmp / "var", ports, tmp / "up-kills.out")
            try:
                url, body = up.wait_ready()
                long = {**body, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
                clean, _ = stream(url, long)
                for k in range(args.kills):
                    killed: list[float] = []

                    def kill(killed: list[float] = killed) -> None:
                        os.kill(up.pid_of("prefill"), signal.SIGKILL)
                        killed.append(time.monotonic())

                    got, times = stream(url, long, on_first=kill)
                    if got != clean:
                        raise RuntimeError(f"kill {k}: the stream's tokens differ from an unkilled run's")
                    # Tokens sent before the kill may still arrive after it: the stream resumes where
                    # its longest pause after the kill ends.
                    after = [t for t in times if t > killed[0]]
                    edges = [killed[0], *after]
                    gap, end = max((b - a, b) for a, b in zip(edges, edges[1:]))
                    resume.add(end - killed[0])
                    print(
                        f"  kill {k}: the stream resumed {end - killed[0]:.2f} s after the kill "
                        f"(its longest pause {gap:.2f} s)",
                        flush=True,
                    )
                    # The restarted worker beats again (the supervisor says so) and has been up for the
                    # supervisor's reset time before the next kill: each kill is a first crash, restarted
                    # after 1 s (kills in a row back off 2, 4, 8 ... s: RestartPolicy).
                    deadline = time.monotonic() + 120
                    while up.output().count("prefill-0 healthy again") < k + 1:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"the prefill worker did not come back:\n{up.output()[-2000:]}")
                        time.sleep(0.2)
                    if k + 1 < args.kills:
                        time.sleep(RestartPolicy().reset_after_s)
            finally:
                up.stop()
    finally:
        print(f"load average after: {h.load_average()}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return h.finish([stop] + ([resume] if args.kills else []))


if __name__ == "__main__":
    h.main_guard(main)
