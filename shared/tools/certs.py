"""``epd certs DIR``: a development CA and the server certificates of a deployment (issue 45, TLS).

For a development or test deployment only - production certificates come from the operator's own
PKI. Writes into ``DIR``:

* ``ca.crt`` / ``ca.key``: a self-signed CA (``--days``, default 365), the file services verify
  servers against (``EPD_NATS_TLS_CA``);
* ``<name>.crt`` / ``<name>.key`` for each server (``nats``, ``s3``, ``api``), signed by the CA, valid
  for ``localhost``, ``127.0.0.1``, ``::1``, the server's name (Compose's and Kubernetes' service
  names: ``nats``, ``minio``, ``api``) and every ``--host`` given.

Keys are EC P-256, written with mode 0600 (the directory 0700); existing files are kept unless
``--force`` (a running deployment's certificates are not replaced under it).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The servers a deployment runs, and the names clients reach them by (Compose / Kubernetes).
SERVERS: dict[str, tuple[str, ...]] = {"nats": ("nats",), "s3": ("minio", "s3"), "api": ("api",)}
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
CA = "ca"


@dataclass(frozen=True)
class Written:
    """The files of one ``epd certs`` run."""

    ca_cert: Path
    ca_key: Path
    servers: dict[str, tuple[Path, Path]]


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # (an existing file keeps its mode through os.open)


def _san(names: tuple[str, ...]) -> Any:
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_certs(out: Path, *, hosts: tuple[str, ...] = (), days: int = 365, force: bool = False) -> Written:
    """Write the CA and one certificate per server into ``out`` (the module docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError("--days must be >= 1")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    files = [out / f"{n}.{ext}" for n in (CA, *SERVERS) for ext in ("crt", "key")]
    existing = [f for f in files if f.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(str(f) for f in existing)} exist (--force replaces them)")
    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=days)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        fmt = serialization.PrivateFormat.PKCS8
        return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "epd-serve development CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # cert and CRL signing
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / f"{CA}.key", pem_key(ca_key), 0o600)
    _write(out / f"{CA}.crt", ca_cert.public_bytes(serialization.Encoding.PEM), 0o600)
    servers = {}
    for name, service_names in SERVERS.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"epd-serve {name}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san((*LOCAL_NAMES, *service_names, *hosts)), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        crt, key_path = out / f"{name}.crt", out / f"{name}.key"
        _write(key_path, pem_key(key), 0o600)
        _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o600)
        servers[name] = (crt, key_path)
    return Written(out / f"{CA}.crt", out / f"{CA}.key", servers)


def _paths(out: Path) -> Written:
    servers = {name: (out / f"{name}.crt", out / f"{name}.key") for name in SERVERS}
    return Written(out / f"{CA}.crt", out / f"{CA}.key", servers)


def ensure_certs(out: Path, *, hosts: tuple[str, ...] = ()) -> tuple[Written, bool]:
    """The certificates under ``out``: made once (:func:`make_certs`), then reused as they are
    (``epd up --tls``: clients that saved the CA keep working across restarts). Returns them and
    whether they were made now. Reused ones must be complete, unexpired and valid for every name
    in ``hosts``; else ``ValueError`` says what is wrong (remove ``out`` to make new ones)."""
    from cryptography import x509

    written = _paths(out)
    files = [written.ca_cert, written.ca_key, *(f for pair in written.servers.values() for f in pair)]
    present = [f for f in files if f.exists()]
    if not present:
        return make_certs(out, hosts=hosts), True
    redo = f"remove {out} to make new ones"
    if len(present) < len(files):
        missing = ", ".join(f.name for f in files if not f.exists())
        raise ValueError(f"the certificates in {out} are incomplete (no {missing}): {redo}")
    now = datetime.datetime.now(datetime.UTC)
    for crt in (written.ca_cert, *(crt for crt, _key in written.servers.values())):
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        if cert.not_valid_after_utc <= now:
            raise ValueError(f"{crt} expired on {cert.not_valid_after_utc:%Y-%m-%d}: {redo}")
        if crt == written.ca_cert:
            continue
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        valid = set(names.get_values_for_type(x509.DNSName))
        valid |= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        lacking = [h for h in hosts if _normal(h) not in valid]
        if lacking:
            raise ValueError(f"{crt} is not valid for {', '.join(lacking)}: {redo}")
    return written, False


def _normal(host: str) -> str:
    """A host name as a certificate's names list it (an address in its canonical form)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _cmd(args: argparse.Namespace) -> int:
    try:
        written = make_certs(Path(args.dir), hosts=tuple(args.host), days=args.days, force=args.force)
    except (FileExistsError, ValueError) as exc:
        print(f"epd certs: {exc}", file=sys.stderr)
        return 2
    print(f"CA: {written.ca_cert} (services: EPD_NATS_TLS_CA={written.ca_cert})")
    for name, (crt, key) in written.servers.items():
        print(f"{name}: {crt} {key}")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``certs`` to the ``epd`` parser."""
    p = sub.add_parser("certs", help="write a development CA and server certificates (TLS; not for production)")
    p.add_argument("dir", help="where to write them (created, mode 0700)")
    p.add_argument("--host", action="append", default=[], help="another name or address of the servers (repeat)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(func=_cmd)
