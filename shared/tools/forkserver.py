"""Start service processes from a fork server that imported the heavy libraries once.

**Why.** A service process spends most of its start importing: torch, transformers and the
model's modeling module take ~6 s of CPU on an idle 2-core machine and 15-20 s while other work
runs, against ~1 s to load a tiny model and connect. ``epd up`` starting five processes paid that
five times at once, and a killed worker served again only after 10-25 s. The fork server
(``python -m shared.tools.forkserver``) imports :data:`PRELOAD` once and forks every service
process from that state: a start (and a restart) costs the fork, our own modules and the model
load, and the imported pages are shared copy-on-write between the services.

**What a forked service gets** is what ``python -m <module> <args>`` would have: its own session
and process group (``os.killpg`` reaches what it starts), stdout and stderr appended to its log
file, stdin from /dev/null, ``SIGTERM`` when the fork server dies (``PR_SET_PDEATHSIG``, and the
server dies with the launcher the same way), the requested environment and folder, and
``/proc/<pid>/cmdline`` showing its command line (``setproctitle``). Its exit status is reported
by the server, which reaps it, kills what it left in its process group and tells the launcher.

**When it is not used** (:meth:`ForkServer.spawn` returns None and the launcher execs as before):
a command other than ``<this python> -m <module>``, another working folder, a service on the vLLM
engine (vLLM sets up its own environment and threads before it imports torch), or an environment
that differs from the server's in a variable a preloaded library reads when it is imported
(:data:`IMPORT_TIME_ENV`: OpenMP, torch, Hugging Face, the Python path, ...).

**Fork safety.** The server runs one thread (numpy's BLAS pool is shut down and restarted around
``fork`` by OpenBLAS itself), creates no event loop and runs no torch operation, so no OpenMP pool
or lock is inherited; it imports none of our own modules (their state - metrics, settings - is
built in each service as before).

Protocol (the server is the launcher's child; JSON lines on its stdin / stdout):
``{"id": n, "argv": [...], "env": {...}, "cwd": "...", "log": "..."}`` ->
``{"id": n, "pid": p}`` or ``{"id": n, "error": "..."}``; when a service exits,
``{"exit": p, "code": c}`` (``c`` as ``Popen.returncode``: negative = the signal).
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

#: What the server imports before it forks anything: what the services import that costs (torch,
#: transformers and the modeling modules of the architectures we ship), and the service libraries.
PRELOAD: tuple[str, ...] = (
    "numpy",
    "torch",
    "PIL.Image",
    "transformers",
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "transformers.models.qwen2_vl.processing_qwen2_vl",
    "transformers.models.qwen2_vl.image_processing_qwen2_vl",
    "transformers.models.llava.modeling_llava",
    "nats",
    "msgspec",
    "fastapi",
    "uvicorn",
    "httpx",
    "pydantic_settings",
    "prometheus_client",
    "minio",
    "setproctitle",
)

#: Environment variables read when a preloaded library is imported (by name prefix): a service
#: whose value differs from the server's is exec'd instead, so it never runs with a library set
#: up for another environment.
IMPORT_TIME_ENV: tuple[str, ...] = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "CUDA",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "VLLM_",
)

#: Seconds a spawn request waits for the server's answer (it answers after its preload).
SPAWN_TIMEOUT_S = 180.0


# -- the server (``python -m shared.tools.forkserver``) ------------------------------------------
def _set_pdeathsig(sig: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG


def _become(spec: dict[str, Any], server_fds: list[int], server_pid: int, started_fd: int) -> None:
    """In the forked child: turn into ``spec['argv']`` and run it; never returns (it exits with the
    status ``python -m`` would, without the interpreter's teardown).
    Writes to ``started_fd`` once it has its session, output, folder, environment and title (what
    ``subprocess.Popen`` guarantees on return), then closes it. A failure before that exits the
    child at once (127, the traceback in the server's log), never back into the server's loop."""
    import runpy

    argv: list[str] = spec["argv"]
    try:
        os.setsid()
        _set_pdeathsig(signal.SIGTERM)
        if os.getppid() != server_pid:  # the server died between the fork and prctl
            os._exit(1)
        for fd in server_fds:
            os.close(fd)
        out = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))  # before the environment changes: it moves environ's memory
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        os.write(started_fd, b"1")
        os.close(started_fd)
    except BaseException:  # noqa: BLE001 - whatever it was, this child must not return into the server's loop
        import traceback

        traceback.print_exc()
        os._exit(127)
    sys.argv = [argv[2], *argv[3:]]
    code: int = 0
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what `python -m` does with an uncaught exception: print it, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    # What `python -m` does at exit, without the interpreter's teardown: a service forked from
    # here holds torch, transformers and a frozen start-up heap (shared.heap), whose teardown took
    # ~1 s after the service had stopped - every Ctrl-C of `epd up` waited for it.
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives a process (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _reap(pid: int) -> int:
    """Wait for ``pid`` (it has exited), kill what it left in its process group, return its code."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        # Still a zombie, so its pid - the process group id - cannot have been reused yet.
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, ChildProcessError):
        pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def serve(preload: list[str]) -> None:
    """The server's loop: preload, then fork on request and report exits, until stdin closes."""
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a library's stray print goes to the server's log, not into the protocol
    os.close(devnull)
    loaded = []
    for name in preload:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # noqa: BLE001 - a missing optional library only costs its import later
            print(f"forkserver: preloading {name} failed: {exc!r}", file=sys.stderr, flush=True)

    def send(msg: dict[str, Any]) -> None:
        os.write(ctl_out, json.dumps(msg).encode() + b"\n")

    send({"ready": os.getpid(), "preloaded": loaded})
    server_pid = os.getpid()
    sel = selectors.DefaultSelector()
    sel.register(ctl_in, selectors.EVENT_READ, None)
    pidfds: dict[int, int] = {}  # pidfd -> pid
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.data is not None:  # a child's pidfd: it exited
                pid = pidfds.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                send({"exit": pid, "code": _reap(pid)})
                continue
            chunk = os.read(ctl_in, 1 << 16)
            if not chunk:  # closed, or the launcher is gone: exit; our children get SIGTERM (PDEATHSIG)
                # At once, without the interpreter's teardown: with torch and transformers imported
                # it took ~3 s, and `epd up`'s Ctrl-C waited for it. Nothing of ours is left to flush.
                sys.stderr.flush()
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                spec = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                started_r, started_w = os.pipe()
                try:
                    pid = os.fork()
                except OSError as exc:
                    os.close(started_r)
                    os.close(started_w)
                    send({"id": spec["id"], "error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    _become(spec, [ctl_in, ctl_out, sel.fileno(), started_r, *pidfds], server_pid, started_w)
                os.close(started_w)
                os.read(started_r, 1)  # b"": it died setting up (its exit is reported as usual)
                os.close(started_r)
                pidfd = os.pidfd_open(pid)
                pidfds[pidfd] = pid
                sel.register(pidfd, selectors.EVENT_READ, pid)
                send({"id": spec["id"], "pid": pid})


# -- the launcher's side -------------------------------------------------------------------------
def not_forkable(env: Mapping[str, str]) -> str:
    """Why a service with this environment is never forked ("" = it may be): the vLLM engine sets
    up its own environment, threads and CPU binding before it imports torch, and imports none of
    what the server preloads but torch."""
    return "a vLLM engine" if env.get("EPD_ENGINE") == "vllm" else ""


class ForkedProcess:
    """The part of ``subprocess.Popen`` the launcher and the tests use, for a process the fork
    server started: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``. Signals go through a pidfd, so they never reach a later process that
    reused the pid."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already exited and reaped: its exit message is on its way
            self._pidfd = None

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pidfd = self._pidfd
        if self.returncode is not None or pidfd is None:
            return
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except (ProcessLookupError, OSError):  # exited meanwhile (or the fd was closed by its exit)
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"


class ForkServer:
    """A running fork server and the processes it started (see the module docstring).

    Thread-safe; :meth:`spawn` blocks until the server has preloaded (the first time) and forked.
    """

    def __init__(self, log_path: Path, *, cwd: Path | None = None, env: Mapping[str, str] | None = None):
        from shared.tools.infra import _spawn

        self.cwd = (cwd or Path.cwd()).resolve()
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as fh:
            self._popen = _spawn(
                [sys.executable, "-m", __name__, *PRELOAD], log_fh=fh, cwd=self.cwd, env=self.env, pipes=True
            )
        assert self._popen.stdin is not None and self._popen.stdout is not None
        self._stdin: IO[bytes] = self._popen.stdin
        self._lock = threading.Lock()
        self._next_id = 0
        self._replies: dict[int, Future[int]] = {}
        self._procs: dict[int, ForkedProcess] = {}
        self._exits: dict[int, int] = {}  # exits reported before the spawn's reply was handled
        self._closed = False
        threading.Thread(target=self._read, args=(self._popen.stdout,), name="epd-forkserver", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def usable_for(self, argv: list[str], env: Mapping[str, str], cwd: Path) -> str:
        """Why a service with this command, environment and folder must be exec'd instead ("" = it
        can be forked from this server)."""
        if self._closed or self._popen.poll() is not None:
            return "the fork server is not running"
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            return "not `<this python> -m <module>`"
        if cwd.resolve() != self.cwd:
            return f"another working folder ({cwd})"
        if why := not_forkable(env):
            return why
        for key in sorted(set(env) | set(self.env)):
            if key.startswith(IMPORT_TIME_ENV) and env.get(key) != self.env.get(key):
                return f"{key} differs from the fork server's"
        return ""

    def spawn(self, argv: list[str], *, env: Mapping[str, str], cwd: Path, log_path: Path) -> ForkedProcess | None:
        """Fork ``argv`` (``<python> -m <module> ...``) with ``env`` in ``cwd``, output appended to
        ``log_path``; None when it must be exec'd instead (:meth:`usable_for`)."""
        if why := self.usable_for(argv, env, cwd):
            log.debug("not forking %s: %s", argv, why)
            return None
        fut: Future[int] = Future()
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._replies[rid] = fut
            line = json.dumps({"id": rid, "argv": argv, "env": dict(env), "cwd": str(cwd), "log": str(log_path)})
            try:
                self._stdin.write(line.encode() + b"\n")
                self._stdin.flush()
            except OSError:
                self._replies.pop(rid, None)
                return None
        try:
            pid = fut.result(SPAWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the server failed or died: exec instead
            log.warning("fork server could not start %s (%s); starting it the plain way", argv, exc)
            return None
        with self._lock:
            proc = ForkedProcess(pid, argv)
            self._procs[pid] = proc
            if (code := self._exits.pop(pid, None)) is not None:
                self._procs.pop(pid)
                proc._set_exit(code)
        return proc

    def _read(self, stdout: IO[bytes]) -> None:
        for raw in stdout:
            msg = json.loads(raw)
            with self._lock:
                if "exit" in msg:
                    proc = self._procs.pop(msg["exit"], None)
                    if proc is None:
                        self._exits[msg["exit"]] = msg["code"]
                    else:
                        proc._set_exit(msg["code"])
                elif "id" in msg:
                    fut = self._replies.pop(msg["id"], None)
                    if fut is not None:
                        if "pid" in msg:
                            fut.set_result(msg["pid"])
                        else:
                            fut.set_exception(RuntimeError(msg.get("error", "no pid")))
        # The server is gone: its children got SIGTERM (PDEATHSIG) and init reaps them, so their
        # exit codes are lost; report SIGTERM once each has gone.
        with self._lock:
            self._closed = True
            for fut in self._replies.values():
                fut.set_exception(RuntimeError("the fork server exited"))
            self._replies.clear()
            orphans = list(self._procs.values())
            self._procs.clear()
        for proc in orphans:
            if proc._pidfd is not None:
                select.select([proc._pidfd], [], [], 30)
            proc._set_exit(-signal.SIGTERM)

    def close(self) -> None:
        """Stop the server (its remaining children get SIGTERM): it exits as soon as it reads the
        end of its input (milliseconds); ``epd up`` closes it once its services have stopped."""
        self._closed = True
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self._popen.wait(10)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait(5)


_default: ForkServer | None = None
_default_lock = threading.Lock()


def default_fork_server(log_dir: Path) -> ForkServer:
    """This process's fork server (started on first use, its log in ``log_dir``; stopped at exit)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = ForkServer(log_dir / "forkserver.log")
            atexit.register(_default.close)
        return _default


if __name__ == "__main__":
    serve(sys.argv[1:])
