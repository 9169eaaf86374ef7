"""Start the services as child processes: what ``epd up`` runs and what the tests run.

A :class:`Stack` is NATS + an S3 store (given by URL, or embedded) + the service processes of
one topology (``shared.topology.TOPOLOGIES``), each started with the same
``python -m services.<name>`` entry point and ``EPD_*`` environment that ``docker-compose.yml``
uses. Readiness is the API's ``/health`` counting a heartbeat from every worker service. Where they
can be, the processes are forked from this process's fork server (``shared.tools.forkserver``:
torch and transformers imported once, not per process); otherwise exec'd.

A :class:`Supervisor` keeps a ready stack running the way compose's ``restart: unless-stopped``
does: a service process that exits (crash, SIGKILL, OOM) is started again with the same command,
environment and log file, after a :class:`RestartPolicy` backoff; one stopped on purpose
(:meth:`ServiceProcess.stop`, :meth:`Stack.stop`) is not.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.health import check_worker, tls_client_context
from shared.tools.forkserver import ForkedProcess, ForkServer, default_fork_server, not_forkable
from shared.tools.infra import _describe_exit, _EmbeddedServer, _spawn, stop_servers
from shared.topology import TOPOLOGIES, Service, Topology

log = logging.getLogger(__name__)


class StackError(RuntimeError):
    pass


def topology_env(topology: Topology) -> dict[str, str]:
    """What a topology sets for every service: the API reads ``EPD_TOPOLOGY``, the prefill
    service ``EPD_ROLE`` (the others ignore both)."""
    return {"EPD_TOPOLOGY": topology.value, "EPD_ROLE": TOPOLOGIES[topology].prefill_role.value}


@dataclass
class ServiceProcess:
    """One service process: ``<name>-<index>`` in file names and status lines. A restart
    (:meth:`respawn`) replaces ``popen`` in place, so a stack lists each service process once."""

    name: str
    popen: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    #: Replica number within its service.
    index: int = 0
    #: What :meth:`respawn` runs again: the command line, full environment and folder it started with.
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    cwd: Path | None = None
    #: Where :meth:`respawn` forks it from (None: exec'd, see ``shared.tools.forkserver``).
    fork_server: ForkServer | None = field(default=None, repr=False)
    started_at: float = field(default_factory=time.monotonic)
    #: Times it was started again after exiting.
    restarts: int = 0
    #: Exits in a row without staying up ``RestartPolicy.reset_after_s`` (the backoff exponent).
    crash_streak: int = 0
    #: Set by :meth:`stop`: stopped on purpose, so a supervisor leaves it alone.
    stopped: bool = False
    #: Supervisor state: when the pending restart is due (monotonic), None when none is pending.
    restart_at: float | None = None
    #: Supervisor state: restarted, not seen healthy yet.
    awaiting_health: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}-{self.index}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def reap(self) -> int | None:
        """None while the process runs; once it has exited, kill what it left in its process
        group (e.g. an engine's helper processes) and return its exit code (negative: the signal)."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            res = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (poll)
            return self.popen.poll()
        if res is None or res.si_pid == 0:
            return None
        # Still a zombie, so its pid - the process group id - cannot have been reused yet.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.popen.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def respawn(self) -> None:
        """Start the same command again, same environment, appending to the same log file."""
        with self.log_path.open("ab") as fh:
            fh.write(
                f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} epd: restarting {self.label} "
                f"(restart {self.restarts + 1})\n".encode()
            )
            fh.flush()
        self.popen = _start(self.argv, self.env, self.cwd or Path.cwd(), self.log_path, self.fork_server)
        self.started_at = time.monotonic()
        self.restarts += 1

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Stop it on purpose: ``sig`` to its process group, SIGKILL after ``timeout`` seconds."""
        if self.send_stop(sig):
            self.wait_stopped(timeout)

    def send_stop(self, sig: int = signal.SIGTERM) -> bool:
        """Mark it stopped on purpose (a supervisor leaves it alone) and send ``sig`` to its process
        group, without waiting; False when it was not running."""
        self.stopped = True
        self.restart_at = None
        if self.popen is None or not self.alive():
            return False
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def wait_stopped(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for it to exit (after :meth:`send_stop`), then SIGKILL its group."""
        try:
            self.popen.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(5)


def service_command(module_name: str, python: str = sys.executable, *, module: str | None = None) -> list[str]:
    """A service's command line, ``python -m services.<module_name>``: docker-compose.yml runs the same.
    ``module``: run ``python -m <module> <module_name>`` instead (tests: ``tests.fault_workers``)."""
    if module is not None:
        return [python, "-m", module, module_name]
    return [python, "-m", f"services.{module_name}"]


def _start(
    argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, fork_server: ForkServer | None
) -> subprocess.Popen[bytes] | ForkedProcess:
    """Fork ``argv`` from ``fork_server`` where it can (``ForkServer.spawn``), else exec it."""
    if fork_server is not None and (forked := fork_server.spawn(argv, env=env, cwd=cwd, log_path=log_path)):
        return forked
    with log_path.open("ab") as fh:
        return _spawn(argv, log_fh=fh, cwd=cwd, env=env)


def start_service(
    module_name: str,
    env: dict[str, str],
    log_path: Path,
    cwd: Path | None = None,
    *,
    module: str | None = None,
    fork_server: ForkServer | None = None,
) -> ServiceProcess:
    """Launch ``python -m services.<module_name>`` with ``env`` added to this process's environment;
    forked from ``fork_server`` when given and usable for it (``shared.tools.forkserver``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    argv = service_command(module_name, module=module)
    cwd = cwd or Path.cwd()
    popen = _start(argv, full_env, cwd, log_path, fork_server)
    return ServiceProcess(module_name, popen, log_path, argv=argv, env=full_env, cwd=cwd, fork_server=fork_server)


def http_json(url: str, timeout: float = 2.0, *, cafile: str | os.PathLike[str] | None = None) -> tuple[int, dict]:
    """GET ``url``'s JSON: (status, body). An https ``url`` is verified against ``cafile`` (None:
    the system CAs)."""
    context = tls_client_context(cafile) if url.lower().startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def worker_metrics_port(base: int, nth: int) -> int:
    """The ``/metrics`` port of the ``nth`` worker a :class:`Stack` starts (0-based) from ``base``
    (``epd up --metrics-port``; the API gets none of these)."""
    return base + 1 + nth


@dataclass
class Stack:
    """The service processes of one deployment, sharing one environment."""

    env: dict[str, str]
    log_dir: Path
    #: A :class:`Topology` or its value (``epd up --topology``).
    topology: Topology | str = Topology.E_PD
    api_port: int = 8000
    replicas: dict[Service, int] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Service -> module that runs it instead of ``services.<service>`` (``service_command``).
    service_modules: dict[str, str] = field(default_factory=dict)
    processes: list[ServiceProcess] = field(default_factory=list)
    #: Workers serve Prometheus ``/metrics`` on base + 1, + 2, ... in start order (None: not at all).
    metrics_port_base: int | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)
    #: Start (and restart) the services from this process's fork server
    #: (``shared.tools.forkserver``): their heavy imports are paid once, not per process.
    fork_server: bool = True
    #: Set by :meth:`stop`; a supervisor restarts nothing from then on.
    stopping: bool = False
    #: Random, per stack: the last part of its workers' ids (``encoder-0-<tag>``).
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    #: Held by :meth:`stop` while it marks the processes stopped and by ``Supervisor.check``.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def api_env(self) -> dict[str, str]:
        """The settings the API process gets (this process's environment, the stack's, the API's own;
        :meth:`add` adds the port): whether it serves HTTPS and the CA of its certificate are read here."""
        return {**os.environ, **self.env, **self.service_env.get(Service.API.value, {})}

    @property
    def base_url(self) -> str:
        """The API's URL from this host: https when it serves TLS (``EPD_TLS_CERT``)."""
        return f"{'https' if self.api_env().get('EPD_TLS_CERT') else 'http'}://127.0.0.1:{self.api_port}"

    @property
    def api_ca(self) -> str | None:
        """The CA the API's certificate is verified against (``EPD_TLS_CA``; None: the system CAs)."""
        return self.api_env().get("EPD_TLS_CA") or None

    def __post_init__(self) -> None:
        try:
            self.topology = Topology(self.topology)
        except ValueError:
            raise StackError(f"unknown topology {self.topology!r}; available: {', '.join(Topology)}") from None

    def start(
        self, *, staggered: bool = False, timeout: float = 600.0, progress: Callable[[str], None] | None = None
    ) -> Stack:
        """Start every service of the topology. ``staggered``: the API, then one worker service at a
        time, each once the previous one is ready (:meth:`wait_ready`), so engines that each take
        all the cores to start (vLLM on a small CPU host) do not slow each other down."""
        services = TOPOLOGIES[Topology(self.topology)].services
        if not staggered:
            for service in services:
                for i in range(self.replicas.get(service, 1)):
                    self.add(service, index=i)
            return self
        workers = TOPOLOGIES[Topology(self.topology)].worker_services
        for service in services:
            if service in workers:
                continue
            for i in range(self.replicas.get(service, 1)):
                self.add(service, index=i)
        done: dict[str, int] = {}
        for service in workers:
            for i in range(self.replicas.get(service, 1)):
                self.add(service, index=i)
            done[service.value] = self.replicas.get(service, 1)
            self.wait_ready(timeout=timeout, roles=dict(done), progress=progress)
        return self

    def worker_id(self, name: str, index: int) -> str:
        """``EPD_WORKER_ID`` of the ``index``-th process of service ``name``: ``<service>-<index>-<tag>``,
        unique per stack (not a pid: this process's would read as the worker's own) and kept when
        the supervisor restarts the process."""
        return f"{name}-{index}-{self.tag}"

    def add(self, name: str, *, index: int = 0, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        """Start one more process of service ``name`` (``service_env`` / ``extra_env`` override the
        topology's environment)."""
        name = Service(name).value
        env = {
            **self.env,
            **topology_env(Topology(self.topology)),
            **self.service_env.get(name, {}),
            **(extra_env or {}),
        }
        if name == "api":
            env["EPD_PORT"] = str(self.api_port)
        env.setdefault("EPD_WORKER_ID", self.worker_id(name, index))
        if name != "api":  # the heartbeat file `epd healthcheck` reads, as in docker-compose.yml
            env.setdefault("EPD_HEALTH_FILE", str(self.log_dir / f"{name}-{index}.health"))
        if name != "api" and self.metrics_port_base:
            port = worker_metrics_port(self.metrics_port_base, len(self.metrics_ports))
            env.setdefault("EPD_METRICS_PORT", str(port))
            self.metrics_ports[f"{name}-{index}"] = int(env["EPD_METRICS_PORT"])
        proc = start_service(
            name,
            env,
            self.log_dir / f"{name}-{index}.log",
            module=self.service_modules.get(name),
            fork_server=default_fork_server(self.log_dir) if self.fork_server and not not_forkable(env) else None,
        )
        proc.index = index
        self.processes.append(proc)
        return proc

    def health(self) -> dict | None:
        try:
            status, body = http_json(f"{self.base_url}/health", cafile=self.api_ca)
        except (OSError, ValueError):
            return None
        return body if status == 200 else None

    def wait_ready(
        self,
        timeout: float = 120.0,
        *,
        roles: dict[str, int] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> dict:
        """Wait until the API answers and at least the given number of workers beat per heartbeat
        role (a worker's service name; default: every worker service of the topology, replicas each).
        ``progress`` gets a line whenever what is ready changes (``epd up`` prints it)."""
        if roles is None:
            roles = {s.value: self.replicas.get(s, 1) for s in TOPOLOGIES[Topology(self.topology)].worker_services}
        started = time.monotonic()
        deadline = started + timeout
        health = None
        said = ""
        while time.monotonic() < deadline:
            if progress is not None:
                line = _readiness(health, roles)
                if line != said:
                    progress(f"  {time.monotonic() - started:5.1f}s  {line}")
                    said = line
            for proc in self.processes:
                if not proc.alive():
                    raise StackError(
                        f"service {proc.name} exited with code {proc.popen.returncode}; log {proc.log_path}:\n"
                        f"{proc.log_tail()}"
                    )
            health = self.health()
            if health and all(health.get("workers", {}).get(r, 0) >= n for r, n in roles.items()):
                if progress is not None:
                    progress(f"  {time.monotonic() - started:5.1f}s  {_readiness(health, roles)}")
                return health
            time.sleep(0.25)
        tails = "\n".join(f"--- {p.name} ({p.log_path})\n{p.log_tail(10)}" for p in self.processes)
        raise StackError(f"stack not ready after {timeout:.0f}s (last health: {health})\n{tails}")

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every service process together: SIGTERM to all at once, then one wait for all (each
        SIGKILLed ``timeout`` seconds after the SIGTERM), so the stack stops in its slowest process's
        time, not in the sum of them. Each drains what it runs (a worker finishes its jobs and
        returns those it fetched and had not started; the API answers its open requests)."""
        with self.lock:  # first mark all, so a supervisor restarts none of them meanwhile
            self.stopping = True
            for proc in self.processes:
                proc.stopped = True
        deadline = time.monotonic() + timeout
        signalled = [proc for proc in self.processes if proc.send_stop()]
        for proc in signalled:
            proc.wait_stopped(deadline - time.monotonic())
        self.processes.clear()


def shut_down(
    stack: Stack | None, servers: Sequence[_EmbeddedServer | None] = (), fork_server: ForkServer | None = None
) -> None:
    """Stop what ``epd up`` started (its Ctrl-C): the services together (:meth:`Stack.stop`), then
    its ``fork_server`` (the one it asked for: never another caller's - closing a fork server ends
    every process forked from it, other stacks' too) together with the embedded servers (NATS, S3;
    ``shared.tools.infra.stop_servers``). The services go first: draining, they still talk to NATS
    and the store. The fork server only once they have exited: its children get SIGTERM when it
    exits (``PR_SET_PDEATHSIG``), and a second SIGTERM makes the API's server skip its graceful
    shutdown. An idle stack stops in ~1.5-2.5 s (bench/stop_and_failover.py; docs/operations.md)."""
    try:
        if stack is not None:
            stack.stop()
    finally:
        for server in servers:  # SIGTERM first, so they stop while the fork server closes
            if server is not None:
                server.begin_stop()
        try:
            if fork_server is not None:
                fork_server.close()
        finally:
            stop_servers(servers)


def _readiness(health: dict | None, roles: dict[str, int]) -> str:
    """What is ready and what is still starting, in one line."""
    if health is None:
        return "waiting for the API"
    workers = health.get("workers", {})
    ready = [f"{r} {min(workers.get(r, 0), n)}/{n}" for r, n in roles.items()]
    waiting = [r for r, n in roles.items() if workers.get(r, 0) < n]
    return "api ready; workers " + ", ".join(ready) + (f" (starting: {', '.join(waiting)})" if waiting else "")


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff between restarts of a process that keeps exiting: ``initial_s``,
    doubling (``factor``) up to ``max_s``. A process that stayed up ``reset_after_s`` before it
    exited starts over at ``initial_s``, so one crash a day never waits long, while a worker that
    dies at start-up (a bad model path) is retried every ``max_s`` at most, not in a hot loop."""

    initial_s: float = 1.0
    max_s: float = 30.0
    factor: float = 2.0
    reset_after_s: float = 60.0

    def streak_after_exit(self, streak: int, uptime_s: float) -> int:
        """The exits-in-a-row count after an exit following ``uptime_s`` seconds up."""
        return 1 if uptime_s >= self.reset_after_s else streak + 1

    def delay(self, streak: int) -> float:
        """Seconds to wait before restarting after the ``streak``-th exit in a row (1-based)."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, streak - 1))


@dataclass(frozen=True)
class SupervisorEvent:
    """Something the supervisor saw or did, for a status line (:meth:`line`)."""

    #: "exited" (a restart is scheduled), "restarted", "restart_failed" or "healthy".
    kind: str
    process: str
    message: str
    #: "exited": the last lines of the process's log.
    log_tail: str = ""

    def line(self) -> str:
        if not self.log_tail:
            return self.message
        return self.message + "\n" + "\n".join(f"    | {line}" for line in self.log_tail.splitlines())


class Supervisor:
    """Restarts the processes of ``stack`` that exit, with ``policy``'s backoff, unless they or
    the stack were stopped on purpose. Call :meth:`check` periodically (``epd up`` does, about
    twice a second); it never blocks on a restart's backoff and returns what happened.

    A restarted process keeps its name, index, command, environment (so its worker id and
    heartbeat file) and log file (appended). Work it held is not lost: its unacknowledged
    JetStream jobs are redelivered after the ack wait, to it or to another worker."""

    def __init__(self, stack: Stack, policy: RestartPolicy | None = None, *, log_tail_lines: int = 5):
        self.stack = stack
        self.policy = policy or RestartPolicy()
        self.log_tail_lines = log_tail_lines

    def check(self, now: float | None = None) -> list[SupervisorEvent]:
        events: list[SupervisorEvent] = []
        with self.stack.lock:
            if self.stack.stopping:
                return events
            for proc in self.stack.processes:
                if proc.stopped or proc.popen is None:
                    continue
                event = self._check_one(proc, time.monotonic() if now is None else now)
                if event is not None:
                    log.info("%s", event.message)
                    events.append(event)
        return events

    def _check_one(self, proc: ServiceProcess, now: float) -> SupervisorEvent | None:
        if proc.restart_at is None:
            code = proc.reap()
            if code is None:
                if proc.awaiting_health and self._healthy(proc):
                    proc.awaiting_health = False
                    return SupervisorEvent(
                        "healthy",
                        proc.label,
                        f"{proc.label} healthy again (pid {proc.popen.pid}, "
                        f"{now - proc.started_at:.1f}s after its restart)",
                    )
                return None
            uptime = now - proc.started_at
            proc.crash_streak = self.policy.streak_after_exit(proc.crash_streak, uptime)
            delay = self.policy.delay(proc.crash_streak)
            proc.restart_at = now + delay
            proc.awaiting_health = False
            return SupervisorEvent(
                "exited",
                proc.label,
                f"{proc.label} (pid {proc.popen.pid}) exited ({_describe_exit(code)}) after {uptime:.1f}s up; "
                f"restarting in {delay:.1f}s (restart {proc.restarts + 1}); log {proc.log_path}:",
                proc.log_tail(self.log_tail_lines),
            )
        if now < proc.restart_at:
            return None
        try:
            self._respawn(proc)
        except OSError as exc:
            proc.crash_streak += 1
            delay = self.policy.delay(proc.crash_streak)
            proc.restart_at = now + delay
            return SupervisorEvent(
                "restart_failed", proc.label, f"{proc.label} could not be restarted ({exc}); retrying in {delay:.1f}s"
            )
        proc.restart_at = None
        proc.awaiting_health = True
        return SupervisorEvent(
            "restarted", proc.label, f"{proc.label} restarted (pid {proc.popen.pid}, restart {proc.restarts})"
        )

    @staticmethod
    def _respawn(proc: ServiceProcess) -> None:
        # In the main thread a Ctrl-C between the fork and the assignment would leave an orphan
        # behind that Stack.stop cannot see: hold SIGINT/SIGTERM until the new popen is in place.
        if threading.current_thread() is not threading.main_thread():
            proc.respawn()
            return
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            proc.respawn()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _healthy(self, proc: ServiceProcess) -> bool:
        """The restarted process serves again: the API answers /health, a worker's own heartbeat
        file (written by this pid) is fresh."""
        if proc.name == Service.API:
            return self.stack.health() is not None
        path = proc.env.get("EPD_HEALTH_FILE")
        if not path:
            return True  # nothing to watch: running is all we can tell
        try:
            pid = json.loads(Path(path).read_bytes())["pid"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return pid == proc.popen.pid and check_worker(Path(path), role=proc.name)[0]
