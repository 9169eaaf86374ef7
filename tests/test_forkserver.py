"""The fork server (``shared.tools.forkserver``): a forked service gets what ``python -m`` would
have given it, its exit is reported like ``Popen``'s, what it cannot fork is exec'd, and the
supervisor restarts a forked service by forking it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.tools.forkserver import ForkServer
from shared.tools.launcher import Stack, Supervisor, start_service
from tests.stackutil import wait_for

REPO = Path(__file__).resolve().parents[1]
PROBE = [sys.executable, "-m", "tests.forkprobe"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    fs = ForkServer(tmp_path_factory.mktemp("forkserver") / "forkserver.log", cwd=REPO)
    yield fs
    fs.close()


def _said(log: Path) -> dict:
    """The probe's JSON line (waits for it)."""
    line = wait_for(
        lambda: log.exists() and log.read_text().strip().splitlines()[:1], 120, f"the probe's line in {log}"
    )
    return json.loads(line[0])


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_forked_process_gets_its_environment_folder_log_session_and_exit_code(server, tmp_path):
    log = tmp_path / "probe.log"
    proc = server.spawn([*PROBE, "exit", "7"], env={**os.environ, "FORKPROBE": "set"}, cwd=REPO, log_path=log)
    assert proc is not None
    assert proc.wait(120) == 7 and proc.poll() == 7
    said = _said(log)
    assert said["pid"] == proc.pid == said["sid"] == said["pgid"], said  # its own session and group
    assert (said["probe"], said["cwd"], said["argv"]) == ("set", str(REPO), ["exit", "7"]), said
    # The probe never imports torch: forked from the preloaded server, it has it anyway.
    assert said["torch_loaded"] is True, said
    assert "FORKPROBE" not in server.env  # the variable came with the request, not from the server

    raised = server.spawn([*PROBE, "raise"], env=dict(os.environ), cwd=REPO, log_path=tmp_path / "raise.log")
    assert raised is not None and raised.wait(120) == 1  # what `python -m` exits with
    assert "RuntimeError: the probe failed on purpose" in (tmp_path / "raise.log").read_text()


def test_a_forked_process_shows_its_command_line_and_its_group_dies_with_it(server, tmp_path):
    log = tmp_path / "sleep.log"
    proc = server.spawn([*PROBE, "sleep-with-child"], env=dict(os.environ), cwd=REPO, log_path=log)
    assert proc is not None
    said = _said(log)
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_text().replace("\0", " ").strip()
    assert cmdline == f"{sys.executable} -m tests.forkprobe sleep-with-child", cmdline
    assert _ppid(proc.pid) == server.pid
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    # Its own child (same group) is killed when the server reaps it, as the launcher does.
    wait_for(lambda: not Path(f"/proc/{said['child']}").exists(), 30, "the probe's child to be gone")


def test_what_must_be_exec_d_is_refused(server, tmp_path):
    env = dict(os.environ)
    assert server.usable_for(PROBE + ["exit"], env, REPO) == ""  # control: this one is forked
    cases = {
        "OMP_NUM_THREADS": ({**env, "OMP_NUM_THREADS": "3"}, PROBE + ["exit"], REPO),
        "vLLM": ({**env, "EPD_ENGINE": "vllm"}, PROBE + ["exit"], REPO),
        "working folder": (env, PROBE + ["exit"], tmp_path),
        "-m": (env, [sys.executable, "-c", "pass"], REPO),
    }
    for what, (e, argv, cwd) in cases.items():
        why = server.usable_for(argv, e, cwd)
        assert why and what.split()[0].lower() in why.lower(), (what, why)
        assert server.spawn(argv, env=e, cwd=cwd, log_path=tmp_path / "no.log") is None, what


def test_the_supervisor_restarts_a_forked_service_by_forking_it_again(server, tmp_path):
    stack = Stack(env={}, log_dir=tmp_path)
    crasher = start_service("exit", {}, tmp_path / "exit-0.log", cwd=REPO, module="tests.forkprobe", fork_server=server)
    stack.processes.append(crasher)
    first = crasher.popen.pid
    assert _ppid(first) == server.pid  # forked, not exec'd
    assert crasher.popen.wait(120) == 3
    supervisor = Supervisor(stack)
    t = crasher.started_at + 5
    [exited] = supervisor.check(now=t)
    assert exited.kind == "exited" and "exit code 3" in exited.message, exited
    [restarted] = supervisor.check(now=t + 1)
    assert restarted.kind == "restarted" and crasher.popen.pid != first, restarted
    assert crasher.popen.wait(120) == 3
    # Forked again: the second run's line says it had torch without importing it.
    second = [json.loads(x) for x in (tmp_path / "exit-0.log").read_text().splitlines() if x.startswith("{")]
    assert [s["pid"] for s in second] == [first, crasher.popen.pid] and all(s["torch_loaded"] for s in second)
    stack.stop()


def test_a_child_that_fails_to_set_up_exits_127_and_the_server_goes_on(server, tmp_path):
    bad = server.spawn([*PROBE, "exit"], env=dict(os.environ), cwd=REPO, log_path=tmp_path / "no-such-dir" / "x.log")
    assert bad is not None and bad.wait(60) == 127  # its log could not be opened
    assert "FileNotFoundError" in server.log_path.read_text()
    good = server.spawn([*PROBE, "exit", "0"], env=dict(os.environ), cwd=REPO, log_path=tmp_path / "ok.log")
    assert good is not None and good.wait(60) == 0


def test_the_server_exits_at_once_when_closed(tmp_path):
    """``epd up``'s Ctrl-C closes the fork server once the services stopped: it exits as soon as
    it reads the end of its input, without the interpreter's teardown of torch and transformers
    (~3 s: the last part of a stop before)."""
    import time

    fs = ForkServer(tmp_path / "forkserver.log", cwd=REPO)
    try:
        probe = fs.spawn([*PROBE, "exit", "0"], env=dict(os.environ), cwd=REPO, log_path=tmp_path / "probe.log")
        assert probe is not None and probe.wait(120) == 0  # preloaded: torch and transformers imported
    finally:
        t0 = time.monotonic()
        fs.close()
        took = time.monotonic() - t0
    assert fs._popen.returncode == 0
    assert took < 1.5, f"closing the fork server took {took:.2f}s"
