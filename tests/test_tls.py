"""TLS (issue 45): ``epd certs``, TLS on the NATS client connection against a real nats-server that
requires TLS (EmbeddedNats' ``tls``), the store over TLS against a real SeaweedFS serving HTTPS only
(EmbeddedS3's ``tls``, ``EPD_S3_TLS_CA`` in the store client and the vLLM connectors' config), the
API's TLS settings and start-up errors, and ``epd up --tls``'s certificates (its whole stack:
tests/test_epd_up_tls.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from pydantic import ValidationError

from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, ApiSettings, NatsSettings, StoreSettings
from shared.connectors.common import ConnectorConfig
from shared.errors import ServiceUnavailable, StoreError
from shared.health import api_health_url
from shared.jetstream import close_connection, connect
from shared.store.factory import open_stores
from shared.tools.certs import SERVERS, Written, ensure_certs, make_certs
from shared.tools.infra import EmbeddedNats, EmbeddedS3, ServerTLS
from tests.epdup import REPO


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
def certs(tmp_path_factory) -> Written:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory, certs):
    """A nats-server whose client port requires TLS (EmbeddedNats' ``tls``), with a certificate of ``epd certs``."""
    crt, key = certs.servers["nats"]
    server = EmbeddedNats(
        tmp_path_factory.mktemp("tls-nats"), tls=ServerTLS(crt, key, certs.ca_cert), max_file_store=2**30
    )
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
    assert server.url.startswith("tls://"), server.url
    assert _try(NatsSettings(nats_url=server.url, nats_tls_ca=certs.ca_cert)) == "ok"
    # Its readiness probe is the monitoring port, plain HTTP on loopback (not for other hosts).
    assert server.monitor_url.startswith("http://127.0.0.1:"), server.monitor_url
    url = server.url.replace("tls://", "nats://")
    assert _try(NatsSettings(nats_url=url, nats_tls_ca=certs.ca_cert)) == "ok"
    # no TLS configured: the server refuses the plaintext client
    assert _try(NatsSettings(nats_url=url)) != "ok"
    # another CA: the server's certificate does not verify
    other = make_certs(tmp_path / "other")
    refused = _try(NatsSettings(nats_url=url, nats_tls_ca=other.ca_cert))
    assert refused != "ok" and "certificate" in refused.lower(), refused


async def _first_bytes_sent(options: dict) -> bytes:
    """What a nats-py client given ``options`` (user "u", password "secret") sends to a server that,
    as a plaintext nats-server or a man in the middle would, greets it with an INFO line that does
    not say ``tls_required``: the first bytes it writes (a real socket, a listener of this test)."""
    import nats

    received = asyncio.get_running_loop().create_future()

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"x","version":"2.15.1","max_payload":1048576,"auth_required":true}\r\n')
        await writer.drain()
        data = b""
        try:
            data = await asyncio.wait_for(reader.read(4096), 3)
        except TimeoutError:
            pass
        if not received.done():
            received.set_result(data)
        writer.close()

    listener = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        try:
            nc = await nats.connect(
                f"nats://127.0.0.1:{port}",
                user="u",
                password="secret",
                connect_timeout=2,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                **options,
            )
        except Exception:  # noqa: BLE001 - nats-py raises several types here; the bytes sent are the point
            pass
        else:
            await nc.close()
        return await asyncio.wait_for(received, 5)
    finally:
        listener.close()


async def test_a_client_with_tls_never_sends_its_credentials_in_the_clear(tls_nats) -> None:
    """``NatsSettings.tls_options``: TLS from the first byte. The negative control is nats-py's
    default, which starts in plaintext and upgrades only when the INFO says ``tls_required``: a
    server (or a man in the middle) that does not say it gets the CONNECT, password included."""
    _, certs = tls_nats
    options = NatsSettings(nats_tls_ca=certs.ca_cert).tls_options()
    assert options["tls_handshake_first"] is True
    sent = await _first_bytes_sent(options)
    assert sent[:1] == b"\x16" and b"secret" not in sent  # a TLS ClientHello
    downgraded = await _first_bytes_sent({"tls": options["tls"]})  # the control: TLS, not first
    assert downgraded.startswith(b"CONNECT") and b"secret" in downgraded
    assert NatsSettings().tls_options() == {}  # plaintext by default


def test_the_ec_connector_s_nats_link_is_tls_too(tls_nats, tmp_path) -> None:
    """The vLLM EC connector's own NATS connection (invalidations, use records) gets the
    deployment's NATS TLS settings through its extra config (absolute paths) and connects."""
    from shared.config import WorkerSettings
    from shared.ec_lifecycle.invalidation import ConnectorLifecycle
    from shared.engines.vllm_engine import connector_extra_config

    server, certs = tls_nats
    worker = WorkerSettings.model_validate({"nats": {"nats_url": server.url, "nats_tls_ca": certs.ca_cert}})
    extra = connector_extra_config(worker)
    assert extra["nats_tls_ca"] == str(certs.ca_cert.resolve())
    config = ConnectorConfig.from_extra(extra)
    store = ConnectorConfig.from_extra({"store_backend": "fs", "store_fs_root": str(tmp_path)}).ec_store("f" * 16)

    def connected(options: dict) -> bool:
        lifecycle = ConnectorLifecycle.launch(store, nats_url=server.url, prefix="tlsconn", tls_options=options)
        assert lifecycle is not None
        try:
            return lifecycle.ready.wait(15)
        finally:
            lifecycle.close()

    assert connected(config.nats_tls_options())
    # the control: without them the connector's client cannot talk to the TLS-only server
    assert not connected(ConnectorConfig.from_extra({**extra, "nats_tls_ca": None}).nats_tls_options())


def test_tls_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="go together"):
        NatsSettings(nats_tls_cert="/x.crt")
    assert NatsSettings().tls_context() is None  # plaintext by default
    unreadable = NatsSettings(nats_tls_ca="/nonexistent/ca.crt")
    with pytest.raises(FileNotFoundError):
        unreadable.tls_context()


# -- the store over TLS: EmbeddedS3's tls, EPD_S3_TLS_CA in every S3 client --------------------------
@pytest.fixture(scope="module")
def tls_s3(tmp_path_factory, certs):
    """SeaweedFS whose S3 port serves HTTPS only, with a certificate of ``epd certs``."""
    crt, key = certs.servers["s3"]
    server = EmbeddedS3(tmp_path_factory.mktemp("tls-s3"), tls=ServerTLS(crt, key, certs.ca_cert))
    server.start()  # (ready: its /healthz answered over https, verified against the CA)
    try:
        yield server
    finally:
        server.stop()


def _objects(server: EmbeddedS3, **settings: object):
    store = StoreSettings(
        s3_endpoint=server.endpoint,
        s3_access_key=server.access_key,
        s3_secret_key=server.secret_key,
        s3_bucket="tls",
        **settings,
    )
    return open_stores(store).objects


def test_the_store_talks_tls_verified_against_the_configured_ca(tls_s3, certs, tmp_path, monkeypatch) -> None:
    assert tls_s3.url == f"https://{tls_s3.endpoint}"
    objects = _objects(tls_s3, s3_secure=True, s3_tls_ca=certs.ca_cert)
    objects.ensure_bucket()
    objects.put("k", b"over tls")
    assert objects.get("k", 100) == b"over tls"
    # The S3 port speaks TLS only: a plain HTTP request is answered 400 (Go's "HTTP request to an
    # HTTPS server"), never served.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as plain:
        opener.open(f"http://{tls_s3.endpoint}/healthz", timeout=10)
    assert plain.value.code == 400
    # Negative controls: plaintext, the system CAs, another CA - none reads the object.
    other = make_certs(tmp_path / "other")
    for settings in ({}, {"s3_secure": True}, {"s3_secure": True, "s3_tls_ca": other.ca_cert}):
        with pytest.raises(StoreError):
            _objects(tls_s3, **settings).get("k", 100)
    # The vLLM connectors build their store from their extra config, the store group's dump: the CA
    # travels in it (absolute) and their client verifies against it too.
    monkeypatch.setenv(S3_ACCESS_KEY_ENV, tls_s3.access_key)
    monkeypatch.setenv(S3_SECRET_KEY_ENV, tls_s3.secret_key)
    dump = StoreSettings(s3_endpoint=tls_s3.endpoint, s3_bucket="tls", s3_secure=True, s3_tls_ca=certs.ca_cert)
    extra = json.loads(json.dumps(dump.connector_dump()))  # (as vLLM passes it on)
    connector_store = ConnectorConfig.from_extra(extra).ec_store("f" * 16).store
    assert connector_store.get("k", 100) == b"over tls"
    without_ca = ConnectorConfig.from_extra({**extra, "s3_tls_ca": None}).ec_store("f" * 16).store
    with pytest.raises(StoreError):
        without_ca.get("k", 100)


def test_the_store_ca_needs_tls_and_travels_to_the_connectors_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError, match="EPD_S3_TLS_CA is set but the store is reached in plaintext"):
        StoreSettings(s3_tls_ca=tmp_path / "ca.crt")
    assert StoreSettings(s3_endpoint="https://s3.example", s3_tls_ca="ca.crt").s3_tls_ca == Path("ca.crt")
    dump = StoreSettings(s3_secure=True, s3_tls_ca="rel/ca.crt").connector_dump()
    assert dump["s3_tls_ca"] == str(tmp_path / "rel" / "ca.crt")
    assert StoreSettings().connector_dump()["s3_tls_ca"] is None
    with pytest.raises(ValueError, match="reached in plaintext"):  # a connector's config is checked alike
        ConnectorConfig.from_extra({"s3_tls_ca": "/ca.crt"})
    with pytest.raises(ValueError, match="is not a file"):  # said when the store is opened, not at a request
        _objects_at("127.0.0.1:9", s3_secure=True, s3_tls_ca=tmp_path / "missing.crt")


def _objects_at(endpoint: str, **settings: object):
    return open_stores(StoreSettings(s3_endpoint=endpoint, s3_bucket="tls", **settings)).objects


# -- the API over HTTPS: EPD_TLS_CERT / EPD_TLS_KEY / EPD_TLS_CA -------------------------------------
def test_api_tls_settings_go_together(tmp_path) -> None:
    crt, key, ca = tmp_path / "api.crt", tmp_path / "api.key", tmp_path / "ca.crt"
    for half in ({"tls_cert": crt}, {"tls_key": key}):
        with pytest.raises(ValidationError, match="EPD_TLS_CERT and EPD_TLS_KEY go together"):
            ApiSettings(**half)
    with pytest.raises(ValidationError, match="EPD_TLS_CA is the CA of the API's HTTPS certificate"):
        ApiSettings(tls_ca=ca)
    settings = ApiSettings(tls_cert=crt, tls_key=key, tls_ca=ca, port=8443)
    assert (settings.tls_cert, settings.tls_key, settings.tls_ca) == (crt, key, ca)
    assert ApiSettings().tls_cert is None  # plain HTTP by default
    assert api_health_url("0.0.0.0", 8443, tls=True) == "https://127.0.0.1:8443/health"
    assert api_health_url("::", 8000) == "http://[::1]:8000/health"


def test_the_api_refuses_to_start_with_half_a_tls_pair_or_a_key_of_another_certificate(certs) -> None:
    """Said at start-up in one line naming the settings (never the key's contents), before anything starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}

    def start(**tls: Path) -> subprocess.CompletedProcess[str]:
        run_env = {**env, "PYTHONPATH": str(REPO), "EPD_NATS_URL": "nats://127.0.0.1:9", "EPD_PORT": "9"}
        run_env.update({k: str(v) for k, v in tls.items()})
        argv = [sys.executable, "-m", "services.api"]
        return subprocess.run(argv, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=120)

    api_crt, api_key = certs.servers["api"]
    half = start(EPD_TLS_CERT=api_crt)
    assert half.returncode != 0 and "EPD_TLS_CERT and EPD_TLS_KEY go together" in half.stderr, half.stderr[-2000:]
    wrong = start(EPD_TLS_CERT=api_crt, EPD_TLS_KEY=certs.servers["nats"][1])
    assert wrong.returncode == 1, wrong.stderr[-2000:]
    assert f"epd api: cannot serve HTTPS with EPD_TLS_CERT={api_crt}" in wrong.stderr, wrong.stderr[-2000:]
    assert "Traceback" not in wrong.stderr and "PRIVATE KEY" not in wrong.stderr


# -- epd up --tls: its certificates -------------------------------------------------------------------
def test_epd_up_makes_its_certificates_once_and_reuses_them(tmp_path, capsys) -> None:
    from shared.tools.cli import _tls_certs
    from shared.tools.infra import InfraError

    folder = tmp_path / "tls"
    first = _tls_certs(folder, "127.0.0.1")
    assert "made development certificates in" in capsys.readouterr().out
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    made = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert sorted(made) == sorted(f"{n}.{ext}" for n in ("ca", *SERVERS) for ext in ("crt", "key"))
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == dict.fromkeys(made, 0o600)
    # the next start reuses them as they are (a client keeps the CA it saved)
    assert _tls_certs(folder, "localhost") == first
    assert "reusing the certificates in" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == made
    # another --host they do not name is said, not served with a certificate a client refuses
    with pytest.raises(InfraError, match="not valid for 10.1.2.3"):
        _tls_certs(folder, "10.1.2.3")
    named = _tls_certs(tmp_path / "named", "10.1.2.3")
    sans = x509.load_pem_x509_certificate(named.servers["api"][0].read_bytes()).extensions
    ips = sans.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)
    assert "10.1.2.3" in {str(ip) for ip in ips}
    # a folder with some of them lost: said, not half replaced
    (folder / "s3.key").unlink()
    with pytest.raises(InfraError, match="incomplete"):
        _tls_certs(folder, "127.0.0.1")
    with pytest.raises(ValueError, match="incomplete"):
        ensure_certs(folder)


def test_a_tls_cluster_s_routes_verify_their_peers_and_monitoring_is_https(certs, tmp_path) -> None:
    """``NatsCluster(tls=...)``: the nodes form a cluster over TLS routes (a JetStream meta leader),
    a client reaches them by ``tls://`` URLs verified against the CA, monitoring is HTTPS only.
    Each cluster port starts with the TLS handshake and refuses a certificate another CA signed
    (the site's own passes the handshake and is refused the wrong route password: the control)."""
    import socket
    import ssl

    from shared.tools.infra import NatsCluster

    crt, key = certs.servers["nats"]
    stranger = make_certs(tmp_path / "stranger")
    cluster = NatsCluster(
        tmp_path / "nats", 3, tls=ServerTLS(crt, key, certs.ca_cert), route_user="r", route_password="route-secret"
    )
    with cluster:
        assert cluster.meta_leader() is not None  # the routes are up
        assert all(u.startswith("tls://") for u in cluster.urls)
        assert _try(NatsSettings(nats_url=cluster.seeds, nats_tls_ca=certs.ca_cert)) == "ok"
        assert cluster.monitor_url(0).startswith("https://")
        with pytest.raises(urllib.error.URLError):  # plain HTTP to the monitoring port
            urllib.request.urlopen("http://" + cluster.monitor_url(0).split("://", 1)[1] + "/varz", timeout=3)
        port = cluster.nodes[0].cluster_port
        assert port is not None

        def knock(pair: tuple[Path, Path]) -> str:
            ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
            ctx.load_cert_chain(*pair)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                try:
                    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                        reader = sock.makefile("rb")
                        assert reader.readline().startswith(b"INFO ")
                        sock.sendall(b'CONNECT {"user":"r","pass":"wrong","tls_required":true}\r\nPING\r\n')
                        return reader.readline().decode()
                except ssl.SSLError as exc:
                    return str(exc)

        assert "Authorization Violation" in knock((crt, key))
        assert "unknown ca" in knock(stranger.servers["nats"]).lower()


def test_a_client_leaves_a_stalled_tls_server_for_another_at_once(certs, tmp_path) -> None:
    """A client on a TLS cluster whose server stops answering (SIGSTOP: its connections stay open,
    as behind a partition) is on another node within a few ping intervals. nats-py's reconnect
    waited for the old connection's TLS shutdown - asyncio's 30 s for the peer's close_notify -
    before trying the next server (the multi-host test's minority partition: an API replica off
    NATS for 27 s); ``shared.natsclient.Client`` drops it (mutation: its ``_attempt_reconnect``
    removed -> the client is still off NATS after the bound)."""
    from shared.tools.infra import NatsCluster

    crt, key = certs.servers["nats"]
    cluster = NatsCluster(tmp_path / "nats", 3, tls=ServerTLS(crt, key, certs.ca_cert))
    with cluster:
        settings = NatsSettings(nats_url=cluster.seeds, nats_tls_ca=certs.ca_cert)

        async def main() -> tuple[str, str | None, float]:
            nc = await connect(settings, name="stall-probe")
            try:
                before = nc.connected_url.netloc if nc.connected_url else ""
                (stalled,) = [i for i, url in enumerate(cluster.urls) if url.endswith(before)]
                cluster.pause(stalled)
                try:
                    t0 = asyncio.get_running_loop().time()
                    # pings every 1 s, 2 unanswered: gone after ~3 s; then another node at once
                    while asyncio.get_running_loop().time() - t0 < 15:
                        url = nc.connected_url.netloc if nc.connected_url else None
                        if nc.is_connected and url != before:
                            return before, url, asyncio.get_running_loop().time() - t0
                        await asyncio.sleep(0.1)
                    return before, None, asyncio.get_running_loop().time() - t0
                finally:
                    cluster.resume(stalled)
            finally:
                await close_connection(nc)

        before, after, took = asyncio.run(main())
        assert after is not None, f"still off NATS {took:.1f}s after {before} stalled"
        assert after != before and any(u.endswith(after) for u in cluster.urls)


def test_epd_up_tls_on_every_interface_prints_a_url_its_certificate_names(tmp_path) -> None:
    """``epd up --tls --host 0.0.0.0``: the printed URL is the loopback address (0.0.0.0 is no
    address to connect to, nor a name a certificate can hold) and the certificates name it and this
    machine's host name (what other machines reach it by); a given address is named as it is."""
    import socket

    from cryptography.x509 import DNSName, IPAddress, SubjectAlternativeName, load_pem_x509_certificate

    from shared.tools.cli import api_url, cert_hosts

    assert api_url("0.0.0.0", 8000, https=True) == "https://127.0.0.1:8000"
    assert api_url("::", 8000, https=False) == "http://[::1]:8000"
    assert api_url("10.1.2.3", 8443, https=True) == "https://10.1.2.3:8443"
    assert cert_hosts("0.0.0.0") == (socket.gethostname(),)
    assert cert_hosts("10.1.2.3") == ("10.1.2.3",) and cert_hosts("127.0.0.1") == ()
    crt, _key = make_certs(tmp_path / "wild", hosts=cert_hosts("0.0.0.0")).servers["api"]
    names = load_pem_x509_certificate(crt.read_bytes()).extensions.get_extension_for_class(SubjectAlternativeName)
    valid = set(names.value.get_values_for_type(DNSName)) | {str(a) for a in names.value.get_values_for_type(IPAddress)}
    assert {"127.0.0.1", socket.gethostname()} <= valid
    assert api_url("0.0.0.0", 8000, https=True).split("//")[1].split(":")[0] in valid
