"""Health signals that a container runtime can probe: ``epd healthcheck``.

Workers have no HTTP API, so each worker refreshes a small *heartbeat file*
(``EPD_HEALTH_FILE``) on every heartbeat tick (every 2 s, :mod:`shared.worker`). It is written
only

* after the worker has loaded its model, set up its streams and bound its pull consumer
  (the heartbeat task starts then), and
* right after a JetStream round trip to its consumer succeeded (``shared.worker``: liveness), so
  a worker that cannot pull stops refreshing it (and removes it at the first failed round trip);

and it is removed when the worker stops consuming (SIGTERM drain, crash). A worker is healthy
while the file names its role, its process is alive and it is younger than ``--max-age``. The
same tick publishes the NATS heartbeat that the API's ``/health`` counts, so "healthy" here and
"listed by the API" mean the same thing.

The API's check is its ``/health`` endpoint (200 once connected to NATS); over https, verified
against ``EPD_TLS_CA``, when the API serves TLS (``EPD_TLS_CERT`` / ``EPD_TLS_KEY``).

``epd healthcheck --role api|encoder|prefill|decode`` (or ``python -m shared.health``) exits 0
when healthy, 1 otherwise, printing one line either way. It reads the same ``EPD_*`` variables
as the service it checks, so a compose ``healthcheck`` needs no arguments beyond the role, and
it needs nothing beyond the Python standard library and the settings classes (no curl).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.topology import Service

HEALTH_SCHEMA = 1
#: Stale after this long without a refresh: 5 heartbeat intervals (2 s each).
DEFAULT_MAX_AGE_S = 10.0


@dataclass(frozen=True)
class HealthFile:
    """The heartbeat file one worker process refreshes."""

    path: Path

    def write(self, *, role: str, worker_id: str, in_flight: int = 0, now: float | None = None) -> None:
        """Atomically replace the file (a reader never sees a partial write)."""
        body = json.dumps(
            {
                "schema": HEALTH_SCHEMA,
                "role": role,
                "worker_id": worker_id,
                "pid": os.getpid(),
                "in_flight": in_flight,
                "written_at": time.time() if now is None else now,
            }
        ).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(body)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def check_worker(
    path: Path, *, role: str | None, max_age_s: float = DEFAULT_MAX_AGE_S, now: float | None = None
) -> tuple[bool, str]:
    """(healthy, reason) for the worker whose heartbeat file is ``path``."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return False, f"no heartbeat file {path} (worker starting, not connected to NATS, or stopped)"
    except OSError as exc:
        return False, f"cannot read heartbeat file {path}: {exc}"
    try:
        info = json.loads(raw)
        written_at = float(info["written_at"])
        file_role = str(info["role"])
        pid = int(info["pid"])
        if info.get("schema") != HEALTH_SCHEMA:
            return False, f"heartbeat file {path} has schema {info.get('schema')!r}, expected {HEALTH_SCHEMA}"
    except (ValueError, KeyError, TypeError):
        return False, f"heartbeat file {path} is not a valid heartbeat"
    if role is not None and file_role != role:
        return False, f"heartbeat file {path} is a {file_role} worker's, expected {role}"
    age = (time.time() if now is None else now) - written_at
    if age > max_age_s:
        return False, f"{file_role} worker heartbeat is stale ({age:.1f}s old, limit {max_age_s:g}s)"
    if not _pid_alive(pid):
        return False, f"{file_role} worker process {pid} is gone"
    return True, f"{file_role} worker {info.get('worker_id', '?')} healthy (heartbeat {max(age, 0):.1f}s ago)"


def tls_client_context(cafile: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """A client's TLS context: the server's certificate and name verified against ``cafile``
    (None: the system CAs)."""
    return ssl.create_default_context(cafile=os.fspath(cafile) if cafile is not None else None)


def check_api(url: str, *, timeout: float = 3.0, cafile: str | os.PathLike[str] | None = None) -> tuple[bool, str]:
    """(healthy, reason) from the API's ``/health``: 200 means up and connected to NATS. An https
    ``url`` is verified against ``cafile`` (None: the system CAs)."""
    try:
        context = tls_client_context(cafile) if url.lower().startswith("https://") else None
    except OSError as exc:  # (ssl.SSLError is one) a missing or unreadable CA file
        return False, f"cannot read the CA file {cafile}: {exc}"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            body = json.loads(resp.read() or b"{}")
            status = resp.status
    except urllib.error.HTTPError as exc:
        return False, f"{url} answered {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{url} unreachable: {exc}"
    if status != 200:
        return False, f"{url} answered {status}"
    return True, f"api healthy: workers {body.get('workers', {})}"


def api_health_url(host: str, port: int, *, tls: bool = False) -> str:
    """Where to probe an API bound to ``host:port`` from the same machine / container (``tls``:
    it serves https)."""
    probe = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    if ":" in probe:
        probe = f"[{probe}]"
    return f"{'https' if tls else 'http'}://{probe}:{port}/health"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role",
        required=True,
        choices=[s.value for s in Service],
        help="api, or the worker service to expect in the heartbeat file (a worker beats as its "
        "service: an EPD_ROLE=pd worker is a prefill worker)",
    )
    parser.add_argument("--file", help="worker heartbeat file (default: EPD_HEALTH_FILE)")
    parser.add_argument(
        "--max-age",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help=f"seconds a worker heartbeat stays fresh (default {DEFAULT_MAX_AGE_S:g})",
    )
    parser.add_argument("--url", help="API health URL (default: from EPD_HOST / EPD_PORT; https with EPD_TLS_CERT)")
    parser.add_argument("--cacert", help="CA file an https URL is verified against (default: EPD_TLS_CA)")
    parser.add_argument("--timeout", type=float, default=3.0, help="API request timeout, seconds")


def run(args: argparse.Namespace) -> int:
    if args.role == Service.API:
        url, cafile = args.url, args.cacert
        if url is None or (cafile is None and url.lower().startswith("https://")):
            from shared.config import ApiSettings

            settings = ApiSettings()
            url = url or api_health_url(settings.host, settings.port, tls=settings.tls_cert is not None)
            cafile = cafile or settings.tls_ca
        ok, reason = check_api(url, timeout=args.timeout, cafile=cafile)
    else:
        path = args.file
        if path is None:
            from shared.config import WorkerSettings

            path = WorkerSettings().health_file
        if path is None:
            ok, reason = False, "no heartbeat file configured (set EPD_HEALTH_FILE for the worker and the check)"
        else:
            ok, reason = check_worker(Path(path), role=args.role, max_age_s=args.max_age)
    print(("healthy: " if ok else "unhealthy: ") + reason, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd healthcheck", description="exit 0 if the service is healthy")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
