"""`docker compose up` for real: the production docker-compose.yml, run by Docker Compose v2 on a
real Docker engine, with the images built on this machine (tests/compose/build-images.sh), and
checked from the outside (HTTP, `docker compose` / `docker inspect`, the NATS consumers).

Run by `make test-compose` only: the name of this file keeps the default pytest run (`make test`)
from collecting it. It needs root, a Docker engine with Compose v2 (tests/compose/ensure-docker.sh)
and the images (tests/compose/build-images.sh); the Makefile target does both first.

The stack is docker-compose.yml plus tests/compose/compose.test.yml (stand-in NATS and S3 images
built locally, every port on 127.0.0.1, faster health probes), as its own compose project with a
fresh model folder, secrets and volumes. The steps depend on each other (one stack, started once
per profile) and run in file order; each wait is a condition wait with a hang-only bound.

Last, the cluster deployment (docker-compose.cluster.yml, with compose.cluster.test.yml: the three
NATS nodes as in production, SeaweedFS with replicated volumes standing in for the distributed
MinIO), as a second project once the first is down: clustered, R3, and answering like `epd up`.

TLS is on as Compose ships it: the one-shot `certs` makes the CA and the servers' certificates into
the project's volumes; the test reads the CA from there and verifies the API (https), NATS (TLS from
the first byte) and the S3 stand-in (https) against it, as the services do.

Worker crashes are SIGKILLs of the service's process from the host, as the OOM killer would send
them: `docker compose kill` counts as a deliberate stop for Docker's restart policy (the container
stays down; checked below), so it cannot show the policy bringing a worker back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import ssl
import subprocess
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared import protocol
from shared.config import NatsSettings
from shared.nats_auth import inbox_prefix
from shared.protocol import kv_stream
from shared.store_auth import (
    COMPOSE_BUCKET,
    COMPOSE_NAMESPACE,
    STORE_ROLES,
    access_key_variable,
    seaweed_bucket_policy,
    seaweed_identities,
    secret_key_variable,
)
from shared.tools.certs import SERVERS
from shared.tools.nats_identities import DEPLOYED_ROLES, password_variable
from tests import deploycheck as dc
from tests.epdup import EpdUp, descendants
from tests.stackutil import GREEDY, chat_body, noise_image, parse_sse, read_stream, wait_for, work_consumers
from tests.test_e2e_epd import reference_tokens

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = ROOT / "tests" / "compose" / "compose.test.yml"
SINGLE_FILES = (ROOT / "docker-compose.yml", OVERRIDE)
CLUSTER_FILES = (dc.COMPOSE_PATH, dc.CLUSTER_COMPOSE_PATH, dc.TEST_OVERLAY_PATH, dc.CLUSTER_TEST_OVERLAY_PATH)
NATS_NODES = ("nats-1", "nats-2", "nats-3")
ROUTE_USER, ROUTE_PASSWORD = "epd-route", uuid.uuid4().hex
CLUSTER_UP_TIMEOUT_S = 420  # three NATS nodes electing a meta leader, the store, then the model loads
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NATS_IMAGE = "epd-test/nats:2.15.1"
S3_IMAGE = "epd-test/seaweedfs-s3:4.48"
API_KEY = "sk-compose-" + uuid.uuid4().hex
# One NATS identity per role (deploy/nats-auth.conf): the test reads the streams as the admin.
NATS_PASSWORDS = {role.value: "pw" + uuid.uuid4().hex for role in DEPLOYED_ROLES}  # never read as a number
#: Each store role's (access key, secret key), as a user's .env holds them (S3_<ROLE>_ACCESS_KEY, ...).
S3_KEYS = {role: (f"epd-{role.value}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex) for role in STORE_ROLES}
NATS_USER, NATS_PASSWORD = "admin", NATS_PASSWORDS["admin"]
UP_TIMEOUT_S = 600  # `up --wait`: model loads on a loaded 2-core machine take minutes
REQUEST_TIMEOUT_S = 300
#: The TLS context each API URL of this test is verified with (its project's CA), by URL.
VERIFY: dict[str, ssl.SSLContext] = {}
STATE_TIMEOUT_S = 240  # a container reaching a state (restarted, unhealthy, healthy)

# The requests: one image each, greedy, 12 token ids back (the API's extension). A check that
# needs the encoder to work sends an image the stack has not seen (a seen one is served from the
# EC store without encoding).
BODY = chat_body("Describe the image.", [noise_image(16, (448, 448))], **GREEDY)
# The streamed request killed mid-stream: long enough that tokens are still to come after the first.
LONG_BODY = chat_body("Describe the image in detail.", [noise_image(17, (448, 448))], **{**GREEDY, "max_tokens": 48})
BODIES = {
    "short": BODY,
    "long": LONG_BODY,
    **{
        name: chat_body(f"What is in picture {seed}?", [noise_image(seed, (448, 448))], **GREEDY)
        for seed, name in enumerate(["encoder-fault", "e-p-d"], start=100)
    },
    "cluster-image": chat_body("What is in this picture?", [noise_image(200, (448, 448))], **GREEDY),
    "cluster-text": chat_body("Name three colours.", [], **GREEDY),
}


class Compose:
    """One compose project: docker-compose.yml + the test override (or other files), its own env file."""

    def __init__(self, project: str, env_file: Path, files: tuple[Path, ...] = SINGLE_FILES):
        self.project = project
        self.env_file = env_file
        self.files = files
        # Only the env file speaks: no EPD_* / COMPOSE_* / MINIO_* of this process leaks in.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "COMPOSE_", "MINIO_"))}
        self.profile = "e-pd"
        self.nats_service = "nats-1" if files == CLUSTER_FILES else "nats"

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        argv = [
            "docker",
            "compose",
            "-p",
            self.project,
            *(arg for path in self.files for arg in ("-f", str(path))),
            "--env-file",
            str(self.env_file),
            "--profile",
            self.profile,
            *args,
        ]
        proc = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, (
                f"{' '.join(argv[2:])} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def up(self, *args: str, limit_s: float = UP_TIMEOUT_S) -> float:
        start = time.monotonic()
        self.run("up", "-d", "--wait", "--wait-timeout", str(int(limit_s)), "--no-build", *args, timeout=limit_s + 60)
        took = time.monotonic() - start
        log.info("compose up %s (%s) took %.0f s", self.profile, " ".join(args), took)
        return took

    def port(self, service: str, target: int) -> int:
        """The host port published for ``target`` (the address is checked by the ports test)."""
        out = self.run("port", service, str(target)).stdout.strip()
        return int(out.rpartition(":")[2])

    def containers(self, service: str | None = None, *, all_states: bool = True) -> list[dict[str, Any]]:
        """`docker inspect` of the project's containers (of one service)."""
        argv = ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}"]
        if all_states:
            argv.append("-a")
        if service:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.split()
        if not ids:
            return []
        out = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, timeout=60, check=True)
        return json.loads(out.stdout)

    def container(self, service: str) -> dict[str, Any]:
        [one] = self.containers(service)
        return one

    def left_behind(self) -> dict[str, list[str]]:
        """Containers, volumes and networks that still carry this project's label."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, argv in (
            ("containers", ["docker", "ps", "-aq", "--filter", label]),
            ("volumes", ["docker", "volume", "ls", "-q", "--filter", label]),
            ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
        ):
            found[kind] = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.split()
        return found

    def tls_file(self, path: str, service: str | None = None) -> str:
        """A file of the TLS volumes, as a running service sees it."""
        return self.run("exec", "-T", service or self.nats_service, "cat", path).stdout

    @property
    def ca_pem(self) -> str:
        return self.tls_file("/tls/ca.crt")

    @property
    def tls(self) -> ssl.SSLContext:
        """A client context that trusts this project's CA only (what the services verify against)."""
        return ssl.create_default_context(cadata=self.ca_pem)

    @property
    def api_url(self) -> str:
        url = f"https://127.0.0.1:{self.port('api', 8000)}"
        if url not in VERIFY:
            VERIFY[url] = self.tls
        return url

    @property
    def nats_url(self) -> str:
        return f"tls://{NATS_USER}:{NATS_PASSWORD}@127.0.0.1:{self.port(self.nats_service, 4222)}"


def state(container: dict[str, Any]) -> tuple[str, str | None, int]:
    """(status, health status or None, restart count) of a `docker inspect` result."""
    health = container["State"].get("Health") or {}
    return container["State"]["Status"], health.get("Status"), container["RestartCount"]


def service_process(compose: Compose, service: str, module: str) -> int:
    """Host pid of the service's Python process (the child of the container's docker-init)."""
    init_pid = compose.container(service)["State"]["Pid"]
    [pid] = [p.pid for p in descendants(init_pid) if f"-m services.{module}" in p.cmdline]
    return pid


def wait_state(compose: Compose, service: str, what: str, predicate, timeout: float = STATE_TIMEOUT_S):
    return wait_for(lambda: predicate(*state(compose.container(service))), timeout, f"{service}: {what}", interval=0.5)


def headers(key: str | None = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def verify(url: str) -> ssl.SSLContext | bool:
    """How an API URL of this test is verified: its project's CA (:data:`VERIFY`), else the system CAs."""
    return VERIFY.get(url, True)


def chat(url: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=headers(key), timeout=REQUEST_TIMEOUT_S, verify=verify(url)
    )


def tokens_of(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def stream_tokens(url: str, body: dict, on_event=None) -> list[int]:
    """Token ids of a streamed completion (which must end with [DONE] and no error event)."""
    ids: list[int] = []
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers(),
        timeout=REQUEST_TIMEOUT_S,
        verify=verify(url),
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for event in parse_sse(resp.iter_lines()):
            assert "error" not in event, event
            for choice in event.get("choices", []):
                ids.extend(choice.get("token_ids", []))
            if on_event is not None:
                on_event(event, ids)
    return ids


class Background:
    """A call run in a thread; ``result()`` waits for it (bounded) and re-raises its error."""

    def __init__(self, fn, *args):
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn, *args):
        try:
            self._out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._out["error"] = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = REQUEST_TIMEOUT_S + 30):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"no answer within {timeout} s"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def remove_stale_projects() -> None:
    """Remove what an earlier run of this test left behind (a run killed before its teardown):
    compose projects named epdtest<pid> whose pid is gone. Their containers would otherwise be
    started again by the restart policy whenever dockerd starts."""
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=com.docker.compose.project",
            "--format",
            '{{.ID}} {{.Label "com.docker.compose.project"}}',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    stale = {
        project
        for _, project in (line.split() for line in out.splitlines())
        if (m := re.fullmatch(r"epd(?:test|cluster)(\d+)", project)) and not Path(f"/proc/{m.group(1)}").exists()
    }
    for project in sorted(stale):
        log.warning("removing the stale compose project %s", project)
        label = f"label=com.docker.compose.project={project}"
        for ls, rm in (
            (["docker", "ps", "-aq"], ["docker", "rm", "-f"]),
            (["docker", "volume", "ls", "-q"], ["docker", "volume", "rm", "-f"]),
            (["docker", "network", "ls", "-q"], ["docker", "network", "rm"]),
        ):
            ids = subprocess.run([*ls, "--filter", label], capture_output=True, text=True, timeout=60).stdout.split()
            if ids:
                subprocess.run([*rm, *ids], capture_output=True, timeout=300)


# -- fixtures ---------------------------------------------------------------------------------------
def write_s3_roles(path: Path) -> Path:
    """The S3 stand-in's per-role identities and bucket policy (tests/compose/epd-test-s3.py), from
    shared/store_auth.py's table as deploy/minio-policies is, with the env file's keys (S3_KEYS)."""
    roles = {
        "identities": seaweed_identities(S3_KEYS, COMPOSE_BUCKET, COMPOSE_NAMESPACE),
        "bucket_policy": seaweed_bucket_policy(COMPOSE_BUCKET, COMPOSE_NAMESPACE),
        "namespace": COMPOSE_NAMESPACE,
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(roles, f)
    return path


def write_env_file(path: Path, model_dir: Path, **extra: str) -> Path:
    """What a user's .env holds: fresh secrets (one S3 account per role), the model, the stand-in
    images; and the S3 stand-in's identities of those accounts (EPD_TEST_S3_ROLES)."""
    values = {
        "EPD_API_KEYS": API_KEY,
        # more names the certificates are valid for (the host's, for clients elsewhere)
        "TLS_CERT_HOSTS": "epd.example.internal,10.11.12.13",
        **{password_variable(role): password for role, password in NATS_PASSWORDS.items()},
        "MINIO_ROOT_USER": "epd-admin",
        "MINIO_ROOT_PASSWORD": uuid.uuid4().hex,
        **{access_key_variable(role): access for role, (access, _) in S3_KEYS.items()},
        **{secret_key_variable(role): secret for role, (_, secret) in S3_KEYS.items()},
        # SeaweedFS refuses a role's GetBucketLocation (MinIO's policies allow it): the region given
        "EPD_S3_REGION": "us-east-1",
        "EPD_TEST_S3_ROLES": str(write_s3_roles(path.parent / "s3-roles.json")),
        "EPD_MODEL_DIR": str(model_dir),
        # the tiny model served under the name the bodies ask for (Compose's default is the demo model's)
        "EPD_MODEL_NAME": "qwen2-vl-tiny",
        "EPD_NATS_IMAGE": NATS_IMAGE,
        "EPD_MINIO_IMAGE": S3_IMAGE,
        **extra,
    }
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    """The tiny model, readable by the containers' uid 10001 (mounted read-only)."""
    for path in [tiny_model_dir, *tiny_model_dir.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return tiny_model_dir


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory) -> dict[str, list[int]]:
    """The same model's answers from `epd up` (E|PD, on this host): what the containers must say."""
    up = EpdUp(tmp_path_factory.mktemp("epd-up"), "--model", str(model_dir))
    try:
        up.wait_ready()
        out = {name: tokens_of(chat(up.url, body, key=None)) for name, body in BODIES.items()}
    finally:
        up.close()
    assert len(out["short"]) == GREEDY["max_tokens"] and len(out["long"]) == 48, out
    assert len({tuple(t) for t in out.values()}) > 1, f"every request gives the same tokens: {out}"
    return out


@pytest.fixture(scope="module")
def compose(model_dir, tmp_path_factory):
    images = subprocess.run(
        ["docker", "image", "inspect", f"epd-serve:{VERSION}-cpu", NATS_IMAGE, S3_IMAGE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert images.returncode == 0, f"images missing (run tests/compose/build-images.sh): {images.stderr}"
    remove_stale_projects()
    env_file = write_env_file(tmp_path_factory.mktemp("compose") / "test.env", model_dir)
    c = Compose(f"epdtest{os.getpid()}", env_file)
    try:
        yield c
    finally:
        logs = c.run("logs", "--no-color", "--tail", "60", check=False, timeout=120)
        log.info("compose logs (tail):\n%s", logs.stdout[-20000:])
        c.run("down", "-v", "--remove-orphans", "--timeout", "10", check=False, timeout=300)


# -- the checks, in order -------------------------------------------------------------------------
def test_e_pd_comes_up_healthy(compose, expected):
    compose.up()
    running = {c["Config"]["Labels"]["com.docker.compose.service"]: state(c) for c in compose.containers()}
    assert running == {
        "certs": ("exited", None, 0),
        "nats": ("running", "healthy", 0),
        "minio": ("running", "healthy", 0),
        "minio-init": ("exited", None, 0),
        "api": ("running", "healthy", 0),
        "encoder": ("running", "healthy", 0),
        "prefill": ("running", "healthy", 0),
    }, running
    assert compose.container("minio-init")["State"]["ExitCode"] == 0
    assert compose.container("certs")["State"]["ExitCode"] == 0
    url = compose.api_url
    health = httpx.get(f"{url}/health", timeout=30, verify=verify(url)).json()
    assert health["workers"] == {"encoder": 1, "prefill": 1}, health


def test_e_pd_answers_like_epd_up(compose, expected):
    url = compose.api_url
    assert chat(url, BODY, key=None).status_code == 401
    assert chat(url, BODY, key="sk-wrong").status_code == 401
    assert tokens_of(chat(url, BODY)) == expected["short"]
    assert stream_tokens(url, BODY) == expected["short"]
    assert tokens_of(chat(url, LONG_BODY)) == expected["long"]


def test_published_ports_bind_loopback_only(compose):
    published = [
        (c["Config"]["Labels"]["com.docker.compose.service"], binding["HostIp"], port)
        for c in compose.containers(all_states=False)
        for port, bindings in (c["NetworkSettings"]["Ports"] or {}).items()
        for binding in bindings or []
    ]
    assert {service for service, _, _ in published} == {"nats", "minio", "api"}, published
    assert all(ip == "127.0.0.1" for _, ip, _ in published), published


def connz(compose: Compose, node: str | None = None) -> list[dict[str, Any]]:
    """The NATS server's own view of its client connections (with the authorized user of each)."""
    out = compose.run(
        "exec",
        "-T",
        node or compose.nats_service,
        "wget",
        "-q",
        "-O",
        "-",
        "http://127.0.0.1:8222/connz?auth=1&limit=1024",
    ).stdout
    return json.loads(out)["connections"]


def test_each_service_connects_as_its_own_role(compose):
    """The server's own view (/connz with the authorized user of each connection): the services
    connect as their roles. Each role's password from .env opens its identity and no other; the
    single services' account of before is gone."""
    users = {c.get("authorized_user") for c in connz(compose)}
    assert {"api", "encoder", "prefill"} <= users <= {"api", "encoder", "prefill", "admin"}, users
    port, tls = compose.port("nats", 4222), compose.tls
    for role, password in NATS_PASSWORDS.items():
        assert asyncio.run(nats_connects(port, role, password, tls)), role
    assert not asyncio.run(nats_connects(port, "encoder", NATS_PASSWORDS["api"], tls))
    assert not asyncio.run(nats_connects(port, "epd", NATS_PASSWORDS["api"], tls))


def _cert_names(pem: str) -> set[str]:
    from cryptography import x509

    names = x509.load_pem_x509_certificate(pem.encode()).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return {*names.value.get_values_for_type(x509.DNSName), *map(str, names.value.get_values_for_type(x509.IPAddress))}


def _stat(compose: Compose, service: str, *paths: str) -> dict[str, str]:
    out = compose.run("exec", "-T", service, "stat", "-c", "%n %a %u", *paths).stdout
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines()}


def test_certificates_are_made_once_with_private_keys(compose):
    """The one-shot `certs` wrote a CA and a certificate per server into the volumes: keys 0600,
    owned by the user the server runs as (NATS and the S3 store: root; the API: 10001), the CA's
    key nowhere; each certificate signed by the CA and valid for the names the services and the
    cluster file reach the server by, plus TLS_CERT_HOSTS from .env. A worker sees no key: not
    the API's (not mounted), not NATS's (root's, 0600: permission denied)."""
    from cryptography import x509

    assert _stat(compose, "nats", "/tls", "/tls/ca.crt", "/tls/nats.key", "/tls/minio/private.key") == {
        "/tls": "755 0",
        "/tls/ca.crt": "644 0",
        "/tls/nats.key": "600 0",
        "/tls/minio/private.key": "600 0",
    }
    assert _stat(compose, "api", "/api-tls", "/api-tls/api.key", "/api-tls/api.crt") == {
        "/api-tls": "755 0",
        "/api-tls/api.key": "600 10001",
        "/api-tls/api.crt": "644 10001",
    }
    listed = compose.run("exec", "-T", "nats", "find", "/tls", "-name", "*.key").stdout.split()
    assert sorted(listed) == ["/tls/minio/private.key", "/tls/nats.key"], listed  # no ca.key
    denied = compose.run("exec", "-T", "encoder", "cat", "/tls/nats.key", check=False)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    assert not compose.run("exec", "-T", "encoder", "test", "-e", "/api-tls", check=False).returncode == 0
    ca = x509.load_pem_x509_certificate(compose.ca_pem.encode())
    extra = {"epd.example.internal", "10.11.12.13", "localhost", "127.0.0.1"}
    expected = {
        "nats": {*SERVERS["nats"], "nats-1", "nats-2", "nats-3"},
        "minio": {*SERVERS["s3"], "minio-1", "minio-2", "minio-3", "minio-4"},
        "api": {*SERVERS["api"], "api-gpu"},
    }
    for server, path, service in (
        ("nats", "/tls/nats.crt", "nats"),
        ("minio", "/tls/minio/public.crt", "nats"),
        ("api", "/api-tls/api.crt", "api"),
    ):
        pem = compose.tls_file(path, service)
        x509.load_pem_x509_certificate(pem.encode()).verify_directly_issued_by(ca)
        assert expected[server] | extra <= _cert_names(pem), (server, _cert_names(pem))
    log = compose.run("logs", "--no-color", "certs").stdout
    assert "made a CA" in log and "BEGIN" not in log, log


def test_every_link_is_tls_and_plaintext_is_refused(compose):
    """Every NATS connection of the services is TLS (the server's /connz), the API answers over
    https verified against the CA; negative controls: a plaintext NATS client with the right
    password is refused (the server waits for a TLS handshake), and so is one with TLS that
    trusts only the system CAs; a plaintext S3 client and one without the CA are refused by the
    store, whose https verified against the CA works; the API refuses plain http and a client
    without the CA."""
    import urllib3
    from minio import Minio

    conns = connz(compose)
    assert conns and all(c.get("tls_version") for c in conns), [
        (c.get("authorized_user"), c.get("tls_version")) for c in conns
    ]
    port, password = compose.port("nats", 4222), NATS_PASSWORDS["admin"]
    assert asyncio.run(nats_connects(port, "admin", password, compose.tls))
    assert not asyncio.run(nats_connects(port, "admin", password))  # plaintext
    assert not asyncio.run(nats_connects(port, "admin", password, ssl.create_default_context()))  # no CA
    # S3: the API's account, over https with the CA (positive control), then without it / plain.
    env = dict(line.split("=", 1) for line in compose.env_file.read_text().splitlines() if "=" in line)
    endpoint = f"127.0.0.1:{compose.port('minio', 9000)}"

    def s3(secure: bool, ca: str | None) -> bool:
        pool = urllib3.PoolManager(
            cert_reqs="CERT_REQUIRED", retries=urllib3.Retry(total=0), timeout=10, **({"ca_certs": ca} if ca else {})
        )
        access, secret = env[access_key_variable("api")], env[secret_key_variable("api")]
        # (a role may not ask the bucket's region either: the services' EPD_S3_REGION)
        client = Minio(endpoint, access, secret, secure=secure, http_client=pool, region=env["EPD_S3_REGION"])
        try:  # (a role may not look the bucket up: the API lists its namespace)
            list(client.list_objects("epd", prefix=f"{COMPOSE_NAMESPACE}/"))
            return True
        except Exception as exc:  # noqa: BLE001 - refused, whatever the error
            log.info("S3 client (secure=%s, CA %s) refused: %s", secure, bool(ca), exc)
            return False

    ca_file = compose.env_file.parent / "ca.crt"
    ca_file.write_text(compose.ca_pem)
    assert s3(True, str(ca_file))
    assert not s3(False, None)
    assert not s3(True, None)
    # The API: https with the CA (the other checks), not http, not without the CA.
    url = compose.api_url
    assert httpx.get(f"{url}/health", timeout=30, verify=verify(url)).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=30)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", timeout=30)


def test_encoder_hung_then_killed_mid_request(compose, expected):
    """The encoder hangs (SIGSTOP) while the request's encode job waits for it: Docker marks it
    unhealthy; then it dies (SIGKILL): the restart policy brings it back, it turns healthy, and
    the request completes with the same tokens - whether the job was redelivered to the restarted
    encoder or the prefill worker computed the features itself after EPD_EC_WAIT_S (30 s)."""
    url, before = compose.api_url, state(compose.container("encoder"))[2]
    pid = service_process(compose, "encoder", "encoder")
    os.kill(pid, signal.SIGSTOP)
    try:
        request = Background(lambda: tokens_of(chat(url, BODIES["encoder-fault"])))

        def job_waits():
            info = work_consumers(compose.nats_url, protocol.Subjects(), compose.tls).get(protocol.CONSUMER_ENCODER)
            return info is not None and (info.num_pending + info.num_ack_pending) >= 1

        wait_for(job_waits, 60, "the request's encode job on the encoder consumer", interval=0.2)
        wait_state(compose, "encoder", "unhealthy while hung", lambda status, health, n: health == "unhealthy")
        log.info("encoder unhealthy; the request %s", "has ended" if request.done() else "is still waiting")
    finally:
        os.kill(pid, signal.SIGKILL)
    wait_state(
        compose, "encoder", "restarted by the restart policy", lambda s, h, n: n == before + 1 and s == "running"
    )
    wait_state(compose, "encoder", "healthy again", lambda s, h, n: h == "healthy")
    assert request.result() == expected["encoder-fault"]


def test_prefill_killed_mid_stream(compose, expected):
    """The E|PD worker dies after the first streamed tokens: it comes back and the stream
    completes with exactly the tokens of an undisturbed run."""
    url, before = compose.api_url, state(compose.container("prefill"))[2]
    pid = service_process(compose, "prefill", "prefill")
    killed: list[int] = []

    def kill_after_first_tokens(event, ids):
        if ids and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(len(ids))

    ids = stream_tokens(url, LONG_BODY, on_event=kill_after_first_tokens)
    assert killed and killed[0] < len(expected["long"]), f"the kill did not land mid-stream: {killed}"
    assert ids == expected["long"]
    wait_state(
        compose, "prefill", "restarted by the restart policy", lambda s, h, n: n == before + 1 and s == "running"
    )
    wait_state(compose, "prefill", "healthy again", lambda s, h, n: h == "healthy")
    assert tokens_of(chat(url, BODY)) == expected["short"]


def test_compose_kill_is_a_deliberate_stop(compose, expected):
    """What `docker compose kill` does to the restart policy (why the checks above kill from the
    host): the container stays down until `up` starts it again."""
    compose.run("kill", "encoder")
    wait_state(compose, "encoder", "exited", lambda s, h, n: s == "exited", timeout=60)
    compose.up("encoder")
    assert state(compose.container("encoder"))[:2] == ("running", "healthy")


class Load:
    """A steady load through the API: ``workers`` threads, each sending one request after another
    (one in four text-only, the others a fresh image, so the encoders have work) until
    :meth:`stop`; every request's outcome is kept (time sent and answered, status, tokens, id)."""

    TEXT = "Describe the image."

    def __init__(self, url: str, workers: int = 2, pause_s: float = 0.5):
        self.url = url
        self.pause_s = pause_s
        self.results: list[dict[str, Any]] = []
        self._seeds = iter(range(10_000, 1_000_000))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                seed = next(self._seeds)
            image = None if seed % 4 == 0 else noise_image(seed, (64, 48))
            body = chat_body(self.TEXT, [image] if image is not None else [], **GREEDY)
            out: dict[str, Any] = {"seed": seed, "image": image, "sent": time.monotonic()}
            try:
                resp = chat(self.url, body)
                out["status"] = resp.status_code
                if resp.status_code == 200:
                    out["tokens"] = resp.json()["choices"][0]["token_ids"]
                    out["id"] = resp.json()["id"]
                else:
                    out["error"] = resp.text[:500]
            except Exception as exc:  # noqa: BLE001 - recorded: a hung or lost request fails the check
                out["status"], out["error"] = None, f"{type(exc).__name__}: {exc}"
            out["answered"] = time.monotonic()
            with self._lock:
                self.results.append(out)
            self._stop.wait(self.pause_s)

    def answered_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for r in self.results if r["answered"] >= t and r.get("status") == 200)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 30)
            assert not t.is_alive(), "a load request hung"
        return self.results


def _health_count(compose: Compose, role: str) -> int:
    url = compose.api_url
    return httpx.get(f"{url}/health", timeout=30, verify=verify(url)).json()["workers"].get(role, 0)


def test_scale_every_role_under_load_loses_nothing(compose, reference_engine):
    """Issue 44 item 4: under a steady load of image and text requests, encoders 1 -> 3 -> 1 -> 0
    -> 1 and PD workers 1 -> 2 -> 1 with `docker compose up -d --scale` (a scale-down is a SIGTERM
    and the drain, EPD_DRAIN_S, within stop_grace_period). Every request completes with the
    single-run tokens: 0 lost, 0 wrong, 0 hung, 0 run twice (one FinalResult each); the time each
    change took to show (the command, then the API's /health count) is logged."""
    steps = [("encoder", 3), ("encoder", 1), ("encoder", 0), ("encoder", 1), ("prefill", 2), ("prefill", 1)]
    counts = {"encoder": 1, "prefill": 1}
    load = Load(compose.api_url)
    timings = []
    try:
        wait_for(lambda: load.answered_since(0) >= 4, 300, "the load's first answers", interval=0.5)
        for role, n in steps:
            counts[role] = n
            started = time.monotonic()
            compose.up(*(arg for r, c in counts.items() for arg in ("--scale", f"{r}={c}")))
            command_s = time.monotonic() - started
            wait_for(lambda r=role, n=n: _health_count(compose, r) == n, 120, f"/health: {n} {role}", interval=0.5)
            shown_s = time.monotonic() - started
            wait_for(lambda t=started: load.answered_since(t) >= 2, 300, f"answers after {role}={n}", interval=0.5)
            timings.append((f"{role}={n}", round(command_s, 1), round(shown_s, 1)))
            log.info("scaled %s to %d: command %.1f s, /health %.1f s", role, n, command_s, shown_s)
    finally:
        results = load.stop()
    log.info("scaling steps (step, command s, shown in /health s): %s", timings)
    failed = [r for r in results if r.get("status") != 200]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    wrong = [
        r["seed"]
        for r in results
        if r["tokens"] != reference_tokens(reference_engine, Load.TEXT, [r["image"]] if r["image"] else [])
    ]
    assert not wrong, f"{len(wrong)} of {len(results)} requests answered wrong: seeds {wrong[:10]}"
    finals: dict[str, int] = {}
    stream = protocol.Subjects(NatsSettings.model_fields["subject_prefix"].default).stream_results
    for _, _, msg in read_stream(compose.nats_url, stream, compose.tls):
        if isinstance(msg, protocol.FinalResult):
            finals[msg.request_id] = finals.get(msg.request_id, 0) + 1
    twice = {r["id"]: finals.get(r["id"], 0) for r in results if finals.get(r["id"], 0) != 1}
    assert not twice, f"requests with other than one FinalResult: {twice}"
    images = sum(1 for r in results if r["image"] is not None)
    log.info("under scaling: %d requests (%d with an image), 0 lost / wrong / hung / run twice", len(results), images)


def test_e_p_d_answers_too(compose, expected):
    """After `down` (the volumes kept) and `up` with the other topology: `certs` keeps the
    certificates it made (clients that saved the CA keep working), and E|P|D answers."""
    ca_before = compose.ca_pem
    compose.run("down", "--timeout", "30", timeout=300)
    compose.profile = "e-p-d"
    compose.up()
    assert compose.ca_pem == ca_before
    assert compose.run("logs", "--no-color", "certs").stdout.count("kept the certificates") == 1
    services = {
        c["Config"]["Labels"]["com.docker.compose.service"]: state(c)[:2] for c in compose.containers(all_states=False)
    }
    assert services == {
        "nats": ("running", "healthy"),
        "minio": ("running", "healthy"),
        "api": ("running", "healthy"),
        "encoder": ("running", "healthy"),
        "prefill-only": ("running", "healthy"),
        "decode": ("running", "healthy"),
    }, services
    url = compose.api_url
    assert tokens_of(chat(url, BODIES["e-p-d"])) == expected["e-p-d"]
    assert stream_tokens(url, LONG_BODY) == expected["long"]


def test_down_v_leaves_nothing(compose):
    compose.run("down", "-v", "--timeout", "30", timeout=300)
    assert compose.left_behind() == {"containers": [], "volumes": [], "networks": []}


# -- the cluster deployment (docker-compose.cluster.yml), once the single-node project is down ------
@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    env_file = write_env_file(
        tmp_path_factory.mktemp("cluster") / "cluster.env",
        model_dir,
        NATS_ROUTE_USER=ROUTE_USER,
        NATS_ROUTE_PASSWORD=ROUTE_PASSWORD,
    )
    c = Compose(f"epdcluster{os.getpid()}", env_file, files=CLUSTER_FILES)
    try:
        yield c
    finally:
        logs = c.run("logs", "--no-color", "--tail", "40", check=False, timeout=120)
        log.info("cluster compose logs (tail):\n%s", logs.stdout[-20000:])
        c.run("down", "-v", "--remove-orphans", "--timeout", "10", check=False, timeout=300)


def monitor(c: Compose, node: str, endpoint: str) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{c.port(node, 8222)}/{endpoint}", timeout=10).json()


async def nats_connects(port: int, user: str, password: str, tls: ssl.SSLContext | None = None) -> bool:
    """Whether ``user`` gets in: with ``tls``, TLS from the first byte (as the services); without,
    a plaintext client."""
    import nats

    options: dict[str, Any] = {"tls": tls, "tls_handshake_first": True} if tls is not None else {}
    try:
        nc = await nats.connect(
            f"nats://127.0.0.1:{port}",
            user=user,
            password=password,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            **options,
        )
    except Exception:  # noqa: BLE001 - any failure means: refused
        return False
    await nc.close()
    return True


def test_cluster_config_is_what_the_static_checks_read(cluster):
    """`docker compose config` of the cluster files (Compose's own merge of the four files) agrees
    with tests/deploycheck.py's merge, which `make test` checks: the same services start, with the
    same command lines, seeds, replicas, dependencies and aliases."""
    out = cluster.run("config", "--format", "json")
    real = json.loads(out.stdout)["services"]
    dotenv = {
        line.split("=", 1)[0]: line.split("=", 1)[1] for line in cluster.env_file.read_text().splitlines() if line
    }
    static = dc.cluster_compose(test=True)
    assert set(real) == set(dc.active_services(static, [cluster.profile]))
    for name, svc in real.items():
        mine = dc.resolve(static["services"][name], dotenv)
        for key in ("command", "entrypoint"):
            if mine.get(key) is not None:
                assert svc[key] == [a.replace("$", "$$") for a in mine[key]], (name, key)
        assert {d: v["condition"] for d, v in (svc.get("depends_on") or {}).items()} == {
            d: v["condition"] for d, v in (mine.get("depends_on") or {}).items()
        }, name
        real_aliases = {a for n in (svc.get("networks") or {}).values() for a in ((n or {}).get("aliases") or [])}
        assert real_aliases == dc.aliases(mine), name
        env = dc.environment(mine)
        for var in ("EPD_NATS_URL", "EPD_STREAM_REPLICAS", "EPD_S3_ENDPOINT"):
            if var in env:
                assert svc["environment"][var] == env[var], (name, var)


def test_cluster_comes_up_clustered(cluster):
    """Every container healthy; the three NATS nodes route to each other, agree on one meta leader
    and a cluster of three; every stream and the EC index are R3 with both followers current."""
    cluster.run("down", "-v", "--timeout", "10", timeout=300)  # nothing of an earlier run
    took = cluster.up(limit_s=CLUSTER_UP_TIMEOUT_S)
    running = {c["Config"]["Labels"]["com.docker.compose.service"]: state(c)[:2] for c in cluster.containers()}
    assert running == {
        "certs": ("exited", None),
        **{node: ("running", "healthy") for node in NATS_NODES},
        **{s: ("running", "healthy") for s in ("seaweed-master", "seaweed-volume-1", "seaweed-volume-2", "seaweed-s3")},
        "minio-init": ("exited", None),
        "api": ("running", "healthy"),
        "encoder": ("running", "healthy"),
        "prefill": ("running", "healthy"),
    }, running
    for node in NATS_NODES:
        routes = {r["remote_name"] for r in monitor(cluster, node, "routez")["routes"]}
        assert routes == set(NATS_NODES) - {node}, (node, routes)
    metas = {node: monitor(cluster, node, "jsz")["meta_cluster"] for node in NATS_NODES}
    leaders = {m.get("leader") for m in metas.values()}
    assert len(leaders) == 1 and leaders <= set(NATS_NODES), metas
    assert {m["cluster_size"] for m in metas.values()} == {3}, metas
    log.info("cluster up in %.0f s; meta leader %s", took, leaders.pop())
    tls = cluster.tls

    async def streams() -> list:
        import nats

        seeds = [f"nats://{NATS_USER}:{NATS_PASSWORD}@127.0.0.1:{cluster.port(n, 4222)}" for n in NATS_NODES]
        nc = await nats.connect(seeds, inbox_prefix=inbox_prefix(NATS_USER), tls=tls, tls_handshake_first=True)
        s = protocol.Subjects()
        names = [*s.streams(), *(kv_stream(b) for b in (s.ec_index_bucket, s.routing_bucket, s.ec_claims_bucket))]
        try:  # (the admin identity may ask for each stream's information, not list them)
            return [await nc.jetstream().stream_info(name) for name in names]
        finally:
            await nc.close()

    def all_r3() -> bool:
        infos = asyncio.run(streams())
        return bool(infos) and all(
            s.config.num_replicas == 3
            and s.cluster is not None
            and s.cluster.leader in NATS_NODES
            and sorted(r.name for r in s.cluster.replicas or [] if r.current)
            == sorted(set(NATS_NODES) - {s.cluster.leader})
            for s in infos
        )

    wait_for(all_r3, 60, "every stream R3 with a leader and two current followers", interval=0.5)
    # The route account is no client account (and the role identities work on every node).
    for node in NATS_NODES:
        port = cluster.port(node, 4222)
        for role, password in NATS_PASSWORDS.items():
            assert asyncio.run(nats_connects(port, role, password, tls)), (node, role)
        assert not asyncio.run(nats_connects(port, ROUTE_USER, ROUTE_PASSWORD, tls)), node
        assert not asyncio.run(nats_connects(port, "admin", NATS_PASSWORD)), node  # plaintext
        assert all(c.get("tls_version") for c in connz(cluster, node)), node
    names = {s.config.name for s in asyncio.run(streams())}
    subjects = protocol.Subjects()
    assert {subjects.stream_encode, subjects.stream_generate} <= names, names
    assert any(name.startswith("KV_") for name in names), names  # the EC index bucket


def test_cluster_answers_like_epd_up(cluster, expected):
    """One image request and one text-only request through the API on the cluster: the tokens of
    `epd up` on this host."""
    url = cluster.api_url
    start = time.monotonic()
    assert tokens_of(chat(url, BODIES["cluster-image"])) == expected["cluster-image"]
    assert tokens_of(chat(url, BODIES["cluster-text"])) == expected["cluster-text"]
    log.info("two requests on the cluster took %.1f s", time.monotonic() - start)


def test_cluster_store_keeps_two_copies(cluster):
    """What the requests wrote (the image's encoder output) is in volumes of the bucket, each on
    both volume servers of the S3 stand-in (-defaultReplication=001)."""
    master = f"http://127.0.0.1:{cluster.port('seaweed-master', 9333)}"
    status = httpx.get(f"{master}/vol/status", timeout=10).json()["Volumes"]["DataCenters"]
    where: dict[int, set[str]] = {}
    for racks in status.values():
        for nodes in racks.values():
            for node, volumes in nodes.items():
                for v in volumes or []:
                    if v["Collection"] == "epd":
                        where.setdefault(v["Id"], set()).add(node.split(":")[0])
    assert where and all(servers == {"seaweed-volume-1", "seaweed-volume-2"} for servers in where.values()), where


def test_cluster_down_v_leaves_nothing(cluster):
    cluster.run("down", "-v", "--timeout", "30", timeout=300)
    assert cluster.left_behind() == {"containers": [], "volumes": [], "networks": []}
