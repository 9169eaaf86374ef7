"""Processes run inside a lab host (``ip netns exec``), and the SeaweedFS store spread over hosts.

:class:`HostProc` is one program in one host: started through the host's ``wrap`` (which execs
it, so the pid is the program's), its own process group, output to a log file, killed with this
process (the launcher's ``_spawn``). :class:`WeedStore` is SeaweedFS as a replicated S3 store:
a ``weed master`` (default replication ``001``: a second copy on another server of the rack),
two ``weed volume`` servers on different hosts, and a ``weed filer`` with the S3 gateway - HTTPS
only with ``tls`` (the flags of ``epd up --tls``'s store: ``infra.weed_s3_tls_args``). The links
between the store's own hosts (master, volume servers, filer: HTTP and gRPC) stay plaintext.

The gateway knows an admin and, with ``role_keys``, one identity per role (``shared.store_auth``,
written as ``epd up``'s store writes them: ``infra.write_seaweed_s3_config``); once it is up the
admin creates the bucket and sets its policy (``infra.seaweed_provision``), as ``epd up`` does. The
admin's keys stay with the set-up and the tests' own probes; each service gets its role's.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.nats_auth import Role
from shared.store.objects import S3ObjectStore
from shared.tools.infra import (
    SEAWEED_REGION,
    ServerTLS,
    _spawn,
    find_binary,
    seaweed_provision,
    weed_s3_tls_args,
    write_seaweed_s3_config,
)
from tests.multihost.lab import Host
from tests.stackutil import wait_for


def http_get(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """GET without a proxy; an https ``url`` verified with ``context``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""


def http_ok(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> bool:
    try:
        return http_get(url, timeout, context)[0] == 200
    except OSError:
        return False


@dataclass
class HostProc:
    """One program running in a lab host."""

    label: str
    host: Host
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = field(default=None, repr=False)  # (it holds secrets)
    cwd: Path | None = None
    popen: subprocess.Popen | None = None
    starts: int = 0

    def start(self) -> HostProc:
        if self.popen is not None:
            if self.alive():
                raise RuntimeError(f"{self.label} is already running (pid {self.popen.pid})")
            self.popen.wait()  # reap the previous run
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as fh:
            fh.write(f"=== {time.strftime('%H:%M:%S')} start {self.label} in {self.host.name}\n".encode())
            fh.flush()
            self.popen = _spawn(
                [*self.host.wrap, *self.argv], log_fh=fh, cwd=self.cwd or self.log_path.parent, env=self.env
            )
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.popen is None:
            return
        self.send(signal.SIGCONT)
        self.send(sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.popen.wait(10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# -- SeaweedFS ------------------------------------------------------------------------------------
MASTER_PORT, VOLUME_PORT, FILER_PORT, S3_PORT = 9333, 8081, 8888, 8333


@dataclass
class WeedStore:
    """SeaweedFS over hosts: master + filer/S3 on ``hosts[0]``, a volume server on each host."""

    hosts: list[Host]
    data_dir: Path
    replication: str = "001"
    #: the S3 gateway's certificate (None: plain HTTP)
    tls: ServerTLS | None = None
    access_key: str = field(default_factory=lambda: "epdmh" + secrets.token_hex(4))
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    #: one identity per role (``shared.store_auth``) on ``bucket`` / ``namespace``; None: the admin only
    role_keys: Mapping[Role, tuple[str, str]] | None = field(default=None, repr=False)
    bucket: str = "epd"
    namespace: str = "epd"
    master: HostProc | None = None
    volumes: list[HostProc] = field(default_factory=list)
    filer: HostProc | None = None

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def endpoint(self) -> str:
        """``host:port`` of the S3 gateway (what EPD_S3_ENDPOINT takes)."""
        return f"{self.head.address}:{S3_PORT}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.endpoint}"

    def _weed(self, label: str, host: Host, args: list[str]) -> HostProc:
        folder = self.data_dir / label
        folder.mkdir(parents=True, exist_ok=True)
        # weed puts unix sockets named by port into TMPDIR: one per process, the hosts share /tmp
        env = {**os.environ, "TMPDIR": str(folder)}
        argv = [find_binary("weed"), "-logtostderr=true", f"-config_dir={folder}", *args]
        return HostProc(label, host, argv, self.data_dir / f"{label}.log", env=env, cwd=folder)

    def volume_proc(self, i: int) -> HostProc:
        host = self.hosts[i]
        port = VOLUME_PORT + i  # distinct ports: weed names its unix sockets after them
        return self._weed(
            f"weed-volume-{i}",
            host,
            [
                "volume",
                f"-dir={self.data_dir / f'weed-volume-{i}'}",
                f"-ip={host.address}",
                f"-ip.bind={host.address}",
                f"-port={port}",
                f"-port.grpc={port + 10000}",
                f"-mserver={self.head.address}:{MASTER_PORT}",
                "-dataCenter=dc1",
                "-rack=rack1",
                "-max=200",
                "-preStopSeconds=0",
            ],
        )

    def start(self) -> WeedStore:
        head = self.head
        self.master = self._weed(
            "weed-master",
            head,
            [
                "master",
                f"-mdir={self.data_dir / 'weed-master'}",
                f"-ip={head.address}",
                f"-ip.bind={head.address}",
                f"-port={MASTER_PORT}",
                f"-port.grpc={MASTER_PORT + 10000}",
                f"-defaultReplication={self.replication}",
                "-volumeSizeLimitMB=64",
                "-telemetry=false",
            ],
        ).start()
        master_url = f"http://{head.address}:{MASTER_PORT}"
        wait_for(lambda: http_ok(f"{master_url}/cluster/status"), 30, "the weed master")
        self.volumes = [self.volume_proc(i).start() for i in range(len(self.hosts))]
        wait_for(lambda: self.data_nodes() >= len(self.hosts), 60, "every volume server to join the master")
        ident = self.data_dir / "s3-identities.json"
        write_seaweed_s3_config(ident, self.access_key, self.secret_key, self.role_keys, self.bucket, self.namespace)
        self.filer = self._weed(
            "weed-filer",
            head,
            [
                "filer",
                f"-defaultStoreDir={self.data_dir / 'weed-filer'}",
                f"-ip={head.address}",
                f"-ip.bind={head.address}",
                f"-port={FILER_PORT}",
                f"-port.grpc={FILER_PORT + 10000}",
                f"-master={head.address}:{MASTER_PORT}",
                f"-defaultReplicaPlacement={self.replication}",
                "-webdav=false",
                "-s3",
                f"-s3.port={S3_PORT}",
                f"-s3.port.grpc={S3_PORT + 10000}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-s3.allowDeleteBucketNotEmpty=false",  # the default deletes non-empty buckets!
                "-s3.autoCreateBucket=false",
                f"-s3.config={ident}",
                *weed_s3_tls_args(self.tls),
            ],
        ).start()
        context = self.tls.client_context() if self.tls is not None else None
        wait_for(lambda: http_ok(f"{self.url}/healthz", context=context), 60, "the weed S3 gateway")
        if self.role_keys is not None:
            seaweed_provision(self.admin_store(), self.namespace, tuple(self.role_keys))
        return self

    def admin_store(self) -> S3ObjectStore:
        """The bucket as the admin (the set-up's and the tests' own probes' identity)."""
        ca = self.tls.ca if self.tls is not None else None
        return S3ObjectStore(
            self.url, self.access_key, self.secret_key, self.bucket, region=SEAWEED_REGION, ca_file=ca, max_retries=0
        )

    def data_nodes(self) -> int:
        """Volume servers the master counts as alive."""
        try:
            status, body = http_get(f"http://{self.head.address}:{MASTER_PORT}/dir/status", timeout=2)
        except OSError:
            return 0
        if status != 200:
            return 0
        topo = json.loads(body).get("Topology", {})
        return sum(
            len(rack.get("DataNodes") or []) for dc in topo.get("DataCenters") or [] for rack in dc.get("Racks") or []
        )

    def procs(self) -> list[HostProc]:
        return [p for p in (self.filer, *self.volumes, self.master) if p is not None]

    def stop(self) -> None:
        for proc in self.procs():
            proc.stop(timeout=10)
