"""The multi-host site: a lab of hosts (network namespaces), a 3-node NATS cluster (one node per
host, ``NatsCluster`` with an ``ip netns exec`` wrap), SeaweedFS over three store hosts, and the
E|PD services spread over four more hosts.

Hosts (``Site.LAYOUT``): ``n1``-``n3`` a NATS node each; ``s1`` the weed master, filer + S3 gateway
and a volume server, ``s2`` and ``s3`` a volume server each; ``a1`` / ``a2`` an API replica each;
``w1`` / ``w2`` an encoder and a prefill (role pd) worker each. Every service gets every NATS
seed (``EPD_NATS_URL``), ``EPD_STREAM_REPLICAS=3`` and the S3 gateway on ``s1``; it runs with
this interpreter through ``ip netns exec``.

NATS runs with one identity per role (``shared.nats_auth``, as ``epd up``'s): every node's
configuration holds the identities' ``authorization`` block (no user without a password), the
routes between the nodes their own credentials (a client ``authorization`` block does not cover
the cluster port), and each service connects as its role (``EPD_NATS_USER`` /
``EPD_NATS_PASSWORD``). The tests' own connections are the viewer (reads: results, consumer
state) or the admin (stream and bucket information): :meth:`Site.login`. :meth:`Site.probe` runs
a client with a given identity inside a host.

Every link between hosts is TLS, verified against one test CA (``shared.tools.certs.make_certs``,
as ``epd certs``; under ``<data dir>/tls``) whose certificates name every host's address: the NATS
client ports (TLS from the first byte: ``handshake_first``), the routes between the nodes (each
peer's certificate verified against the CA), the nodes' monitoring ports (HTTPS), the S3 gateway
(HTTPS only) and the API replicas (HTTPS); services and the tests verify every server against the
CA (``EPD_NATS_TLS_CA``, ``EPD_S3_TLS_CA``, :attr:`Site.client_tls`). ``<data dir>/tls-stranger``
holds certificates of another CA (a stranger's, for the refusals). Not TLS: the store's own links
between ``s1``-``s3`` (weed master, volume servers, filer).

The store runs with one identity per role too (``shared.store_auth``, as ``epd up``'s store: keys
generated under ``<data dir>/s3-roles``, mode 0600; the gateway's identities and the bucket policy
from the same functions, ``procs.WeedStore``): each service gets its role's
``EPD_S3_ACCESS_KEY`` / ``EPD_S3_SECRET_KEY`` (and ``EPD_S3_REGION``: a role may not ask the
bucket's location); the admin's keys make the bucket and its policy and serve the tests' own
probes. :meth:`Site.store_probe` runs S3 calls with given identities inside a host.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import ssl
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, env_var
from shared.nats_auth import SERVICE_ROLES, Role
from shared.protocol import Subjects
from shared.store_auth import load_or_create_keys
from shared.tools.certs import Written, make_certs
from shared.tools.infra import SEAWEED_REGION, NatsCluster, ServerTLS
from shared.tools.nats_identities import PASSWORD_ENV, USER_ENV, NatsIdentities
from shared.topology import TOPOLOGIES, Topology
from tests.faultutil import FAULT_DIR_ENV
from tests.faultutil import MODULE as FAULT_MODULE
from tests.multihost import probe, store_probe
from tests.multihost.lab import Host, Lab
from tests.multihost.load import Login
from tests.multihost.procs import HostProc, WeedStore, http_get
from tests.stackutil import wait_for

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
API_PORT = 8000
NATS_HOSTS = ("n1", "n2", "n3")
STORE_HOSTS = ("s1", "s2", "s3")
#: host -> the services it runs (E|PD)
SERVICE_HOSTS: dict[str, tuple[str, ...]] = {
    "a1": ("api",),
    "a2": ("api",),
    "w1": ("encoder", "prefill"),
    "w2": ("encoder", "prefill"),
}
#: The user the NATS nodes' routes authenticate as (its password is generated per site).
ROUTE_USER = "epd-route"


@dataclass
class Service:
    name: str
    proc: HostProc

    @property
    def label(self) -> str:
        return self.proc.label

    @property
    def host(self) -> Host:
        return self.proc.host

    @property
    def worker_id(self) -> str:
        return f"{self.name}-{self.host.name}"


@dataclass
class Site:
    lab: Lab
    data_dir: Path
    model_dir: Path
    settings: dict[str, str] = field(default_factory=dict)
    nats: NatsCluster | None = None
    store: WeedStore | None = None
    services: list[Service] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    env: dict[str, str] = field(default_factory=dict)
    #: every role's NATS password (``shared.nats_auth``), kept under the data dir
    identities: NatsIdentities | None = None
    route_password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    #: every store role's (access key, secret key) (``shared.store_auth``), kept under the data dir
    store_keys: dict[Role, tuple[str, str]] = field(default_factory=dict, repr=False)
    #: the test CA and the servers' certificates (every host's address); a stranger CA's
    certs: Written | None = None
    stranger: Written | None = None

    # -- start-up
    def start(self) -> Site:
        for name in (*NATS_HOSTS, *STORE_HOSTS, *SERVICE_HOSTS):
            self.lab.add_host(name)
        addresses = tuple(h.address for h in self.lab.hosts.values())
        self.certs = make_certs(self.data_dir / "tls", hosts=addresses)
        self.stranger = make_certs(self.data_dir / "tls-stranger", hosts=addresses)
        nats_hosts = [self.lab.hosts[n] for n in NATS_HOSTS]
        self.identities = NatsIdentities.under(self.data_dir / "nats-identities", Subjects(self.prefix))
        self.nats = NatsCluster(
            self.data_dir / "nats",
            len(nats_hosts),
            hosts=[h.address for h in nats_hosts],
            wraps=[h.wrap for h in nats_hosts],
            server_names=list(NATS_HOSTS),
            extra_config=self.identities.server_config(),
            route_user=ROUTE_USER,
            route_password=self.route_password,
            tls=self.server_tls("nats"),
        )
        store_hosts = [self.lab.hosts[n] for n in STORE_HOSTS]
        self.store_keys = load_or_create_keys(self.data_dir / "s3-roles")
        store = WeedStore(
            store_hosts,
            self.data_dir / "weed",
            tls=self.server_tls("s3"),
            role_keys=self.store_keys,
            bucket=self.bucket,
            namespace=self.namespace,
        )
        with ThreadPoolExecutor(2) as pool:
            nats_started = pool.submit(self.nats.start, timeout=60)
            store_started = pool.submit(store.start)
            nats_started.result()
            self.store = store_started.result()
        self.env = self._service_env()
        # the APIs create the streams (R3); then every worker at once (each imports torch for ~10 s)
        for host, names in SERVICE_HOSTS.items():
            for name in names:
                if name == "api":
                    self.start_service(host, name)
        self.wait_apis()
        for host, names in SERVICE_HOSTS.items():
            for name in names:
                if name != "api":
                    self.start_service(host, name)
        self.wait_workers()
        return self

    def server_tls(self, server: str) -> ServerTLS:
        """The certificate of ``server`` (``nats``, ``s3``, ``api``), its key and the test CA."""
        assert self.certs is not None
        return ServerTLS(*self.certs.servers[server], self.certs.ca_cert)

    @property
    def ca(self) -> Path:
        """The test CA every client verifies every server against."""
        assert self.certs is not None
        return self.certs.ca_cert

    @property
    def client_tls(self) -> ssl.SSLContext:
        """A client's context verifying the site's servers (certificate and address) against the CA."""
        return ssl.create_default_context(cafile=str(self.ca))

    @property
    def prefix(self) -> str:
        """The subject prefix of this site (``EPD_SUBJECT_PREFIX``)."""
        return f"m{self.tag}"

    @property
    def bucket(self) -> str:
        return f"epd-{self.tag}"

    @property
    def namespace(self) -> str:
        return f"ns{self.tag}"

    def _service_env(self) -> dict[str, str]:
        """What every service gets (its NATS and store identities are added per service:
        :meth:`start_service`)."""
        assert self.nats is not None and self.store is not None
        prefix, namespace, bucket = self.prefix, self.namespace, self.bucket
        topology = Topology.E_PD
        env = {
            "EPD_NATS_URL": self.nats.seeds,  # tls://...
            "EPD_NATS_TLS_CA": str(self.ca),
            "EPD_STREAM_REPLICAS": "3",
            "EPD_S3_ENDPOINT": self.store.endpoint,
            "EPD_S3_SECURE": "true",
            "EPD_S3_TLS_CA": str(self.ca),
            env_var("s3_region"): SEAWEED_REGION,  # (a role's key may not ask the bucket's location)
            "EPD_S3_BUCKET": bucket,
            "EPD_NAMESPACE": namespace,
            "EPD_SUBJECT_PREFIX": prefix,
            "EPD_MODEL_PATH": str(self.model_dir),
            "EPD_MODEL_NAME": "qwen2-vl-tiny",
            "EPD_TORCH_THREADS": "1",
            "EPD_LOG_LEVEL": "INFO",
            "EPD_STREAM_MAX_BYTES": str(64 * 1024**2),
            "EPD_TOPOLOGY": topology.value,
            "EPD_ROLE": TOPOLOGIES[topology].prefill_role.value,
            "EPD_PORT": str(API_PORT),
            **self.settings,
        }
        return env

    def start_service(self, host: str, name: str) -> Service:
        h = self.lab.hosts[host]
        label = f"{name}@{host}"
        assert self.identities is not None
        access, secret = self.store_keys[SERVICE_ROLES[name]]
        env = {
            **{k: v for k, v in os.environ.items() if k not in (S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV)},
            **self.env,
            "EPD_WORKER_ID": f"{name}-{host}",
            **self.identities.env(SERVICE_ROLES[name]),  # its role's identity, no other
            S3_ACCESS_KEY_ENV: access,  # its role's store identity, no other
            S3_SECRET_KEY_ENV: secret,
        }
        argv = [sys.executable, "-m", f"services.{name}"]
        if name == "api":
            env["EPD_HOST"] = h.address
            api = self.server_tls("api")  # HTTPS; its own probes verify it against the CA
            env.update(EPD_TLS_CERT=str(api.cert), EPD_TLS_KEY=str(api.key), EPD_TLS_CA=str(api.ca))
        else:
            env["EPD_HEALTH_FILE"] = str(self.data_dir / "logs" / f"{label}.health")
            # workers run through the fault suite's switches (a delay a case turns on per host)
            env[FAULT_DIR_ENV] = str(self.fault_dir(host))
            argv = [sys.executable, "-m", FAULT_MODULE, name]
        existing = [s for s in self.services if s.label == label]
        if existing:
            existing[0].proc.start()
            return existing[0]
        proc = HostProc(label, h, argv, self.data_dir / "logs" / f"{label}.log", env=env, cwd=REPO).start()
        service = Service(name, proc)
        self.services.append(service)
        return service

    def fault_dir(self, host: str) -> Path:
        folder = self.data_dir / "faults" / host
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def switch(self, host: str, service: str, delay: float | None) -> None:
        """Turn a worker-side delay of ``host``'s ``service`` on (seconds) or off (None)."""
        path = self.fault_dir(host) / f"{service}.delay"
        if delay is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(str(delay))

    # -- addresses and state
    @property
    def api_urls(self) -> list[str]:
        return [f"https://{self.lab.hosts[h].address}:{API_PORT}" for h, s in SERVICE_HOSTS.items() if "api" in s]

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.env["EPD_SUBJECT_PREFIX"])

    def health(self, url: str) -> dict[str, Any] | None:
        try:
            status, body = http_get(f"{url}/health", timeout=2, context=self.client_tls)
        except OSError:
            return None
        return json.loads(body) if status == 200 else None

    def _check_alive(self) -> None:
        for s in self.services:
            if s.proc.popen is not None and not s.proc.alive():
                raise AssertionError(f"{s.label} exited ({s.proc.popen.returncode}):\n{s.proc.log_tail()}")

    def wait_apis(self, timeout: float = 120) -> None:
        def up():
            self._check_alive()
            return all(self.health(u) is not None for u in self.api_urls)

        wait_for(up, timeout, "both API replicas", interval=0.25)

    def wait_workers(self, timeout: float = 300) -> None:
        """Both APIs count every worker (two encoders, two prefill workers) by their heartbeats."""
        want: dict[str, int] = {}
        for names in SERVICE_HOSTS.values():
            for n in names:
                if n != "api":
                    want[n] = want.get(n, 0) + 1

        def ready():
            self._check_alive()
            for url in self.api_urls:
                workers = (self.health(url) or {}).get("workers", {})
                if any(workers.get(n, 0) < k for n, k in want.items()):
                    return False
            return True

        wait_for(ready, timeout, f"every worker ({want}) in both APIs' health", interval=0.25)

    def services_on(self, host: str) -> list[Service]:
        return [s for s in self.services if s.host.name == host]

    def connections(self, skip: tuple[int, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
        """Every client connection of the running nodes (less ``skip``): (node name, the
        connection as ``/connz?auth=true`` gives it: ``ip``, ``name``, ``authorized_user``, ...)."""
        assert self.nats is not None
        out = []
        for i in self.nats.running():
            if i in skip:
                continue
            try:
                status, body = http_get(
                    f"{self.nats.monitor_url(i)}/connz?auth=true&limit=1024",
                    timeout=2,
                    context=self.nats.monitor_context(),
                )
            except OSError:
                continue
            if status != 200:
                continue
            out += [(self.nats.nodes[i].server_name, c) for c in json.loads(body).get("connections") or []]
        return out

    def service_of(self, conn: dict[str, Any]) -> Service | None:
        """The service a connection is of (its host's address, a name ending with its worker id)."""
        for s in self.services:
            if conn.get("ip") == s.host.address and (conn.get("name") or "").endswith(s.worker_id):
                return s
        return None

    def nats_clients(self, skip: tuple[int, ...] = ()) -> dict[str, set[str]]:
        """Which NATS nodes each of our services is connected to now: service label -> node names
        (from every running node's ``/connz``; a client's name ends with its worker id)."""
        out: dict[str, set[str]] = {}
        for node, conn in self.connections(skip):
            if (s := self.service_of(conn)) is not None:
                out.setdefault(s.label, set()).add(node)
        return out

    # -- NATS identities
    def login(self, role: Role) -> Login:
        """``role``'s identity for the tests' own connections."""
        assert self.identities is not None
        return Login(role.value, self.identities.passwords[role], ca=self.ca)

    @property
    def secrets(self) -> dict[str, str]:
        """Every secret of this site (NATS passwords, S3 secret keys), by what it is."""
        assert self.identities is not None and self.store is not None
        out = {f"nats password of {r.value}": pw for r, pw in self.identities.passwords.items()}
        out["nats route password"] = self.route_password
        out |= {f"s3 secret key of {r.value}": secret for r, (_, secret) in self.store_keys.items()}
        out["s3 secret key of the admin"] = self.store.secret_key
        return out

    def store_probe(self, host: str, steps: list[tuple[Role | None, str, str]]) -> list[dict[str, Any]]:
        """Run ``tests.multihost.store_probe`` inside ``host``: each step (identity: a role, None for
        the admin; ``put`` / ``get`` / ``stat`` / ``delete``; a key of the site's bucket) in turn,
        over HTTPS verified against the CA, as the services reach the store. The keys go through the
        environment, never the command line."""
        assert self.store is not None
        names = {None: "admin"} | {r: r.value for r in self.store_keys}
        keys = {"admin": [self.store.access_key, self.store.secret_key]}
        keys |= {r.value: list(k) for r, k in self.store_keys.items()}
        spec = {
            "url": self.store.url,
            "ca": str(self.ca),
            "bucket": self.bucket,
            "region": SEAWEED_REGION,
            "steps": [[names[who], op, key] for who, op, key in steps],
        }
        env = {**os.environ, store_probe.KEYS_ENV: json.dumps(keys)}
        return self._run_probe(host, store_probe.__name__, spec, env, what="the store probe")

    def nats_logs(self) -> list[tuple[str, Path]]:
        """Every NATS node's logs, (node name, path): the current one and the one a restart
        rotated to ``*.log.1`` (a second restart of a node drops its oldest)."""
        assert self.nats is not None
        return [
            (node.server_name, path)
            for node in self.nats.nodes
            for path in sorted(node.data_dir.glob(f"{node.log_path.name}*"))
        ]

    def violations(self) -> list[str]:
        """The lines of the NATS nodes' logs where a node refused a client something (``Publish
        Violation``, ``Subscription Violation``, an authentication error), each led by the node's
        name and a colon."""
        out = []
        for node, path in self.nats_logs():
            for line in path.read_text(errors="replace").splitlines():
                if "Violation" in line or "authentication error" in line.lower():
                    out.append(f"{node}: {line}")
        return out

    def written_logs(self) -> list[Path]:
        """Every log the site writes: the services' (and their health files), the NATS nodes', the
        store's (not the configuration files, which hold the passwords they must)."""
        logs = [p for p in (self.data_dir / "logs").glob("*") if p.is_file()]
        logs += [path for _, path in self.nats_logs()]
        logs += [p for p in (self.data_dir / "weed").glob("*.log") if p.is_file()]
        return sorted(logs)

    def probe(
        self,
        host: str,
        role: Role | None,
        *,
        password: str | None = None,
        nodes: list[int] | None = None,
        publish: dict[str, str] | None = None,
        stream_info: list[str] | None = None,
        routes: bool = False,
        plaintext: bool = False,
        ca: Path | None = None,
    ) -> dict[str, Any]:
        """Run ``tests.multihost.probe`` inside ``host`` as ``role`` (None: no identity;
        ``password`` instead of the role's own), against each node of ``nodes`` (default: the
        running ones); over TLS verified against the CA, as the services connect (``plaintext``:
        a ``nats://`` client without TLS; ``ca``: another CA than the site's). ``routes``: also
        knock on every node's cluster port, in plaintext and over TLS presenting the site's NATS
        certificate (``ca``) and a stranger CA's (``stranger``). The password goes through the
        environment, never the command line."""
        assert self.nats is not None and self.identities is not None
        assert self.certs is not None and self.stranger is not None
        indexes = self.nats.running() if nodes is None else nodes
        urls = [self.nats.url(i) for i in indexes]
        spec = {
            "urls": ["nats://" + u.split("://", 1)[1] for u in urls] if plaintext else urls,
            "ca": None if plaintext else str(ca or self.ca),
            "user": None if role is None else role.value,
            "prefix": self.prefix,
            "publish": publish or {},
            "stream_info": stream_info or [],
            "routes": [f"{self.nats.nodes[i].host}:{self.nats.nodes[i].cluster_port}" for i in indexes]
            if routes
            else [],
            "route_certs": {
                "ca": [str(p) for p in self.certs.servers["nats"]],
                "stranger": [str(p) for p in self.stranger.servers["nats"]],
            }
            if routes
            else {},
        }
        env = {k: v for k, v in os.environ.items() if k not in (USER_ENV, PASSWORD_ENV)}
        if role is not None:
            env[probe.PASSWORD_ENV] = self.identities.passwords[role] if password is None else password
        return self._run_probe(host, probe.__name__, spec, env, what="the probe")

    def _run_probe(self, host: str, module: str, spec: dict, env: dict[str, str], *, what: str) -> Any:
        """``python -m module SPEC_JSON`` inside lab host ``host`` (secrets in ``env``, never the
        command line): its JSON answer; AssertionError with its stderr when it fails."""
        done = subprocess.run(
            [*self.lab.hosts[host].wrap, sys.executable, "-m", module, json.dumps(spec)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise AssertionError(f"{what} in {host} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout)

    def client_urls(self, skip: tuple[int, ...] = ()) -> list[str]:
        """NATS URLs the test process may use now (running nodes, less ``skip``)."""
        assert self.nats is not None
        return [self.nats.url(i) for i in self.nats.running() if i not in skip]

    def service(self, label: str) -> Service:
        return next(s for s in self.services if s.label == label)

    def logs(self, *labels: str) -> str:
        return "\n".join(
            f"--- {s.label}\n{s.proc.log_tail(40)}" for s in self.services if not labels or s.label in labels
        )

    # -- teardown
    def stop(self) -> None:
        # every service at once: each may take seconds to drain
        with ThreadPoolExecutor(max(1, len(self.services))) as pool:
            list(pool.map(lambda s: s.proc.stop(timeout=10), self.services))
        if self.store is not None:
            self.store.stop()
        if self.nats is not None:
            self.nats.stop()


def run_async(coro):
    """Run a coroutine to completion from synchronous test code (a thread of its own)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
