"""Start the services as child processes: what ``epd up`` runs and what the tests run.

A :class:`Stack` is NATS + an S3 store (given by URL, or embedded) + the service processes of
one topology (``shared.topology.TOPOLOGIES``), each started with the same
``python -m services.<name>`` entry point and ``EPD_*`` environment that ``docker-compose.yml``
uses. Readiness is the API's ``/health`` counting a heartbeat from every worker service.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.tools.infra import _spawn
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
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


def service_command(module_name: str, python: str = sys.executable, *, module: str | None = None) -> list[str]:
    """A service's command line, ``python -m services.<module_name>``: docker-compose.yml runs the same.
    ``module``: run ``python -m <module> <module_name>`` instead (tests: ``tests.fault_workers``)."""
    if module is not None:
        return [python, "-m", module, module_name]
    return [python, "-m", f"services.{module_name}"]


def start_service(module_name: str, env: dict[str, str], log_path: Path, cwd: Path | None = None, *,
                  module: str | None = None) -> ServiceProcess:
    """Launch ``python -m services.<module_name>`` with ``env`` added to this process's environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    with log_path.open("ab") as fh:
        popen = _spawn(service_command(module_name, module=module), log_fh=fh, cwd=cwd or Path.cwd(), env=full_env)
    return ServiceProcess(module_name, popen, log_path)


def http_json(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@dataclass
class Stack:
    """The service processes of one deployment, sharing one environment."""

    env: dict[str, str]
    log_dir: Path
    #: A :class:`Topology` or its value (``epd up --topology``).
    topology: Topology | str = Topology.E_PD
    api_port: int = 8000
    replicas: dict[str, int] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Service -> module that runs it instead of ``services.<service>`` (``service_command``).
    service_modules: dict[str, str] = field(default_factory=dict)
    processes: list[ServiceProcess] = field(default_factory=list)
    #: Workers serve Prometheus ``/metrics`` on base + 1, + 2, ... in start order (None: not at all).
    metrics_port_base: int | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def __post_init__(self) -> None:
        try:
            self.topology = Topology(self.topology)
        except ValueError:
            raise StackError(f"unknown topology {self.topology!r}; available: {', '.join(Topology)}") from None

    def start(self) -> "Stack":
        for service in TOPOLOGIES[self.topology].services:
            for i in range(self.replicas.get(service, 1)):
                self.add(service, index=i)
        return self

    def add(self, name: str, *, index: int = 0, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        """Start one more process of service ``name`` (``service_env`` / ``extra_env`` override the
        topology's environment)."""
        name = Service(name).value
        env = {**self.env, **topology_env(self.topology), **self.service_env.get(name, {}), **(extra_env or {})}
        if name == "api":
            env["EPD_PORT"] = str(self.api_port)
        env.setdefault("EPD_WORKER_ID", f"{name}-{index}-{os.getpid()}")
        if name != "api":  # the heartbeat file `epd healthcheck` reads, as in docker-compose.yml
            env.setdefault("EPD_HEALTH_FILE", str(self.log_dir / f"{name}-{index}.health"))
        if name != "api" and self.metrics_port_base:
            env.setdefault("EPD_METRICS_PORT", str(self.metrics_port_base + 1 + len(self.metrics_ports)))
            self.metrics_ports[f"{name}-{index}"] = int(env["EPD_METRICS_PORT"])
        proc = start_service(name, env, self.log_dir / f"{name}-{index}.log", module=self.service_modules.get(name))
        self.processes.append(proc)
        return proc

    def health(self) -> dict | None:
        try:
            status, body = http_json(f"{self.base_url}/health")
        except (OSError, ValueError):
            return None
        return body if status == 200 else None

    def wait_ready(self, timeout: float = 120.0, *, roles: dict[str, int] | None = None) -> dict:
        """Wait until the API answers and at least the given number of workers beat per heartbeat
        role (a worker's service name; default: every worker service of the topology, replicas each)."""
        if roles is None:
            roles = {s.value: self.replicas.get(s, 1) for s in TOPOLOGIES[self.topology].worker_services}
        deadline = time.monotonic() + timeout
        health = None
        while time.monotonic() < deadline:
            for proc in self.processes:
                if not proc.alive():
                    raise StackError(
                        f"service {proc.name} exited with code {proc.popen.returncode}; log {proc.log_path}:\n"
                        f"{proc.log_tail()}"
                    )
            health = self.health()
            if health and all(health.get("workers", {}).get(r, 0) >= n for r, n in roles.items()):
                return health
            time.sleep(0.25)
        tails = "\n".join(f"--- {p.name} ({p.log_path})\n{p.log_tail(10)}" for p in self.processes)
        raise StackError(f"stack not ready after {timeout:.0f}s (last health: {health})\n{tails}")

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
