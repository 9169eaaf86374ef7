"""``epd up --tls`` (issue 45, items 1 and 4 on one host), as real processes: the venv's ``epd``
console script makes its development certificates under the data dir, serves the API over HTTPS
(uvicorn), runs NATS with TLS on its client port and SeaweedFS's S3 over HTTPS only, and gives every
service the CA and the tls:// / https settings. Checked from outside, as a client and as the
servers see it: the printed request is answered over https verified against the generated CA (and
refused without it), every service's NATS connection is TLS and a plaintext NATS client is
refused, the S3 port answers only TLS and the services wrote their objects through it, the keys
are private and their contents appear in no log and not in ``/health``.

One stack for the module (the default topology e-pd on the shipped demo model, transformers engine:
its encoder stores features in S3 and its prefill worker loads them back, both over TLS).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest

from shared.config import StoreSettings
from shared.store.factory import open_stores
from shared.tools.certs import SERVERS, make_certs
from shared.tools.models.shapes import EXAMPLE
from tests.epdup import EPD, REPO, EpdUp
from tests.stackutil import wait_for

pytestmark = pytest.mark.slow

#: The printed request: ``curl -s --cacert CA https://.../v1/chat/completions ... -d 'BODY'``.
CURL = re.compile(
    r"^\s*(?P<line>curl -s --cacert (?P<ca>\S+) (?P<url>https://\S+)/v1/chat/completions "
    r"-H 'Content-Type: application/json' -d '(?P<body>.*)')$",
    re.M,
)
NATS_LINE = re.compile(r"^\s*NATS (?P<nats>\S+)\s+S3 (?P<s3>\S+)\s", re.M)


class TlsUp:
    """The running ``epd up --tls``, its CA and the first printed request's answer."""

    def __init__(self, up: EpdUp, url: str):
        self.up, self.url = up, url
        self.tls_dir = up.data_dir / "tls"
        self.ca = self.tls_dir / "ca.crt"
        self.verified = ssl.create_default_context(cafile=str(self.ca))


@pytest.fixture(scope="module")
def tls_up(tmp_path_factory):
    up = EpdUp(tmp_path_factory.mktemp("epd-up-tls"), "--tls")
    try:
        yield TlsUp(up, up.wait_ready()["url"])
    finally:
        up.close()


def test_the_printed_request_is_answered_over_https_verified_against_the_generated_ca(tls_up, tmp_path):
    up = tls_up.up
    assert tls_up.url == f"https://127.0.0.1:{up.api_port}", tls_up.url
    curl = CURL.search(up.output())
    assert curl, up.output()[-3000:]
    assert (Path(curl["ca"]), curl["url"]) == (tls_up.ca, tls_up.url)
    body = json.loads(curl["body"])
    resp = httpx.post(f"{tls_up.url}/v1/chat/completions", json=body, verify=tls_up.verified, timeout=300)
    assert resp.status_code == 200, resp.text
    assert EXAMPLE.correct(resp.json()["choices"][0]["message"]["content"]), resp.json()
    if shutil.which("curl"):  # the line as printed, pasted into a shell
        pasted = subprocess.run(["bash", "-c", curl["line"]], capture_output=True, text=True, timeout=300)
        assert pasted.returncode == 0, pasted.stderr
        assert EXAMPLE.correct(json.loads(pasted.stdout)["choices"][0]["message"]["content"]), pasted.stdout
    # Negative controls: the system CAs, another CA, plain HTTP - none gets an answer.
    other = ssl.create_default_context(cafile=str(make_certs(tmp_path / "other").ca_cert))
    for verify in (True, other):
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{tls_up.url}/health", verify=verify, timeout=30)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{up.api_port}/health", timeout=30)
    # `epd healthcheck --role api` (a container's probe) with the API's settings: https, verified
    # against EPD_TLS_CA; without the CA it cannot verify the API, so it says unhealthy.
    api_crt, api_key = tls_up.tls_dir / "api.crt", tls_up.tls_dir / "api.key"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EPD_")},
        "PYTHONPATH": str(REPO),
        "EPD_PORT": str(up.api_port),
        "EPD_TLS_CERT": str(api_crt),
        "EPD_TLS_KEY": str(api_key),
    }

    def healthcheck(**more: str) -> subprocess.CompletedProcess[str]:
        argv = [str(EPD), "healthcheck", "--role", "api"]
        return subprocess.run(argv, env={**env, **more}, capture_output=True, text=True, timeout=60)

    healthy = healthcheck(EPD_TLS_CA=str(tls_up.ca))
    assert healthy.returncode == 0 and healthy.stdout.startswith("healthy: api healthy"), healthy
    unverified = healthcheck()
    assert unverified.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in unverified.stderr, unverified


def _ports_file(data_dir: Path) -> dict:
    [path] = (data_dir / "nats").glob("nats-server_*.ports")
    return json.loads(path.read_text())


def _plaintext_nats(port: int, user: str, password: str) -> tuple[bytes, bytes]:
    """A plaintext NATS client with a valid identity: what the server says before the client
    speaks (its INFO on a plaintext port; nothing where the TLS handshake comes first), then what it
    answers a plain CONNECT + PING (a PONG would mean it serves plaintext clients)."""
    connect = json.dumps({"verbose": False, "pedantic": False, "user": user, "pass": password})

    def read(sock: socket.socket, until: bytes | None) -> bytes:
        got = b""
        try:
            while chunk := sock.recv(4096):  # (b"": the server closed)
                got += chunk
                if until is not None and got.endswith(until):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return got

    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        greeting = read(sock, b"\r\n")
        try:
            sock.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            return greeting, b""
        return greeting, read(sock, None)


def test_every_nats_and_s3_link_is_tls(tls_up):
    up = tls_up.up
    printed = NATS_LINE.search(up.output())
    assert printed and printed["nats"] == f"tls://127.0.0.1:{up.nats_port}", up.output()[-3000:]
    assert printed["s3"] == f"https://127.0.0.1:{up.s3_port}", printed["s3"]
    # NATS: the server requires TLS of every client; a plaintext one never gets a PONG.
    admin = (up.data_dir / "nats" / "identities" / "admin").read_text().strip()
    greeting, answer = _plaintext_nats(up.nats_port, "admin", admin)
    # the TLS handshake first (handshake_first): not a plaintext byte from the server, no INFO
    assert b"INFO" not in greeting, greeting
    assert b"PONG" not in answer, answer
    # ... and each service's connection is TLS, as the server sees it (monitoring: loopback HTTP).
    monitor = _ports_file(up.data_dir)["monitoring"][0]
    assert monitor.startswith("http://127.0.0.1:"), monitor

    def services_connected():
        with urllib.request.urlopen(f"{monitor}/connz?auth=true", timeout=10) as resp:
            conns = json.loads(resp.read())["connections"]
        users = {c.get("authorized_user") for c in conns}
        return conns if {"api", "encoder", "prefill"} <= users else None

    conns = wait_for(services_connected, 60, "the services' NATS connections")
    assert all(c.get("tls_version") for c in conns), [(c.get("name"), c.get("tls_version")) for c in conns]
    # S3: the port answers only TLS (plain HTTP: 400 from the TLS server); https verified against the CA works.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as plain:
        opener.open(f"http://127.0.0.1:{up.s3_port}/healthz", timeout=10)
    assert plain.value.code == 400
    verified = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls_up.verified)
    )
    with verified.open(f"https://127.0.0.1:{up.s3_port}/healthz", timeout=10) as resp:
        assert resp.status == 200
    # The services wrote through it (the only way in): the image and its features of a request.
    body = json.loads(CURL.search(up.output())["body"])
    resp = httpx.post(f"{tls_up.url}/v1/chat/completions", json=body, verify=tls_up.verified, timeout=300)
    assert resp.status_code == 200, resp.text
    store = StoreSettings(
        s3_endpoint=f"127.0.0.1:{up.s3_port}", s3_secure=True, s3_tls_ca=tls_up.ca, s3_bucket="epd", namespace="epd"
    )
    keys = [o.key for o in open_stores(store).objects.list("epd/")]
    assert keys, "no object in the store"


def test_the_keys_are_private_and_their_contents_are_in_no_log_and_not_in_health(tls_up):
    up = tls_up.up
    assert stat.S_IMODE(tls_up.tls_dir.stat().st_mode) == 0o700
    keys = sorted(tls_up.tls_dir.glob("*.key"))
    assert [k.stem for k in keys] == sorted(["ca", *SERVERS])
    assert {k.name: stat.S_IMODE(k.stat().st_mode) for k in keys} == {k.name: 0o600 for k in keys}
    secrets = [line for k in keys for line in k.read_text().splitlines() if line and not line.startswith("-----")]
    assert secrets
    health = httpx.get(f"{tls_up.url}/health", verify=tls_up.verified, timeout=30)
    assert health.status_code == 200, health.text
    logs = [p for p in up.data_dir.rglob("*.log*") if p.is_file()]
    assert {p.name for p in logs} >= {"api-0.log", "encoder-0.log", "prefill-0.log", "nats-server.log", "weed.log"}
    texts = {str(p): p.read_text(errors="replace") for p in logs}
    texts.update({"epd up's output": up.output(), "/health": health.text})
    leaked = {where: "PRIVATE KEY" in text or any(s in text for s in secrets) for where, text in texts.items()}
    assert not any(leaked.values()), [where for where, bad in leaked.items() if bad]


def test_epd_bench_runs_against_the_https_api_with_its_ca(tls_up, tmp_path):
    """``epd bench run --cacert``: the workload runs against ``epd up --tls``'s API verified against
    its CA; without it (the system CAs) the benchmark cannot run: exit 2 naming the certificate
    (the negative control)."""
    argv = [str(EPD), "bench", "run", "--url", tls_up.url, "--requests", "2", "--no-progress"]
    argv += ["--text-only-share", "1", "--output-tokens", "2,2", "--out", str(tmp_path / "bench.json")]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}  # (epd up sets no API key)
    ran = subprocess.run([*argv, "--cacert", str(tls_up.ca)], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads((tmp_path / "bench.json").read_text())["runs"][0]["summary"]["completed"] == 2
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr[-3000:]
