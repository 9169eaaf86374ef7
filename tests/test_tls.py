"""TLS between hosts, first part (issue 45 item 1): ``epd certs`` and TLS on the NATS client
connection, against a real nats-server that requires TLS."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys

import pytest
from cryptography import x509

from shared.config import NatsSettings
from shared.errors import ServiceUnavailable
from shared.jetstream import close_connection, connect
from shared.tools.certs import SERVERS, make_certs
from shared.tools.infra import EmbeddedNats


def test_epd_certs_writes_a_ca_and_server_certificates_it_signed(tmp_path) -> None:
    out = tmp_path / "certs"
    written = make_certs(out, hosts=("epd.example", "10.0.0.7"))
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate(written.ca_cert.read_bytes())
    assert set(written.servers) == set(SERVERS)
    for name, (crt, key) in written.servers.items():
        for path in (crt, key, written.ca_cert, written.ca_key):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        cert.verify_directly_issued_by(ca)  # raises when another key signed it
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = set(names.get_values_for_type(x509.DNSName))
        ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        assert {"localhost", "epd.example", *SERVERS[name]} <= dns and {"127.0.0.1", "10.0.0.7"} <= ips
    # negative control: another run's CA did not sign these
    other = make_certs(tmp_path / "other")
    other_ca = x509.load_pem_x509_certificate(other.ca_cert.read_bytes())
    with pytest.raises(Exception):  # noqa: B017 - cryptography raises ValueError or InvalidSignature by version
        x509.load_pem_x509_certificate(written.servers["nats"][0].read_bytes()).verify_directly_issued_by(other_ca)
    # a second run keeps the files unless --force
    with pytest.raises(FileExistsError):
        make_certs(out)
    cli = [sys.executable, "-m", "shared.tools.cli", "certs", str(out)]
    assert subprocess.run(cli, capture_output=True, text=True, timeout=120).returncode == 2
    again = subprocess.run([*cli, "--force"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert x509.load_pem_x509_certificate(written.ca_cert.read_bytes()) != ca  # replaced


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory):
    """A nats-server whose client port requires TLS, with a certificate of ``epd certs``."""
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    crt, key = certs.servers["nats"]
    conf = f'tls {{\n  cert_file: "{crt}"\n  key_file: "{key}"\n  timeout: 5\n}}\n'
    server = EmbeddedNats(tmp_path_factory.mktemp("tls-nats"), extra_config=conf, max_file_store=2**30)
    server.start()
    try:
        yield server, certs
    finally:
        server.stop()


def _try(settings: NatsSettings) -> str:
    """Connect, make a JetStream round trip, close: 'ok' or the error's text."""

    async def main() -> str:
        try:
            # (a service retries for ever; here the first failure is the answer)
            nc = await connect(settings, name="tls-test", connect_timeout=3, allow_reconnect=False)
        except ServiceUnavailable as exc:
            return str(exc)
        try:
            await nc.jetstream().account_info()
            return "ok"
        finally:
            await close_connection(nc)

    return asyncio.run(main())


def test_a_client_verifies_the_nats_server_against_the_configured_ca(tls_nats, tmp_path) -> None:
    server, certs = tls_nats
    url = server.url.replace("tls://", "nats://")
    assert _try(NatsSettings(nats_url=url, nats_tls_ca=certs.ca_cert)) == "ok"
    # no TLS configured: the server refuses the plaintext client
    assert _try(NatsSettings(nats_url=url)) != "ok"
    # another CA: the server's certificate does not verify
    other = make_certs(tmp_path / "other")
    refused = _try(NatsSettings(nats_url=url, nats_tls_ca=other.ca_cert))
    assert refused != "ok" and "certificate" in refused.lower(), refused


def test_tls_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="go together"):
        NatsSettings(nats_tls_cert="/x.crt")
    assert NatsSettings().tls_context() is None  # plaintext by default
    unreadable = NatsSettings(nats_tls_ca="/nonexistent/ca.crt")
    with pytest.raises(FileNotFoundError):
        unreadable.tls_context()
