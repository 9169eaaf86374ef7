"""Hosts made of Linux network namespaces on a bridge of their own (root only).

A :class:`Lab` is one switch namespace holding a bridge, and hosts: each host a namespace with
its own loopback and an ``eth0`` (a veth whose other end is a port of the bridge), on a free
``10.X.Y.0/24``. The test process itself sits on the bridge too (a veth in the root namespace,
``.1``), so it reaches every host; the bridge lives in its own namespace so the root namespace's
firewall (Docker's ``FORWARD DROP`` with ``br_netfilter``) never sees the hosts' traffic.

Names carry the owner's pid (``emh<pid>-...``): :func:`sweep_stale` removes what a run that died
without cleaning up left behind (namespaces of a pid that is gone, and the processes still in
them, by pid). :meth:`Lab.cut` / :meth:`Lab.heal` take a host's bridge port down / up: a
partition that keeps the host's own processes running.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PREFIX = "emh"


class LabError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def namespaces() -> list[str]:
    out = ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    proc = ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _kill_all_in(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (by pid), until none is left (bounded)."""
    deadline = time.monotonic() + 10
    while (pids := pids_in(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete our namespaces (``emh<pid>-*``) whose owning pid is gone, killing what runs in them."""
    removed = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if not owner.isdigit() or _owner_alive(int(owner)):
            continue
        _kill_all_in(ns)
        ip("netns", "del", ns, check=False)
        removed.append(ns)
    if removed:
        log.warning("removed stale namespaces of earlier runs: %s", ", ".join(removed))
    return removed


def _taken_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for line in ip("-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1] if len(line.split()) > 1 else ""
        try:
            nets.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            continue
    return nets


def free_subnet() -> ipaddress.IPv4Network:
    """A ``10.X.Y.0/24`` no route of this machine covers or overlaps."""
    taken = _taken_networks()
    rng = random.Random()
    for _ in range(500):
        net = ipaddress.IPv4Network(f"10.{rng.randint(64, 250)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise LabError("no free 10.X.Y.0/24 found")


@dataclass
class Host:
    name: str
    ns: str
    address: str
    #: the bridge port (in the switch namespace) of this host's link
    port: str

    @property
    def wrap(self) -> list[str]:
        """Command prefix that runs a program inside this host (it execs the program)."""
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Lab:
    """A bridge and hosts on it. ``add_host`` makes one; ``close`` removes everything."""

    pid: int = field(default_factory=os.getpid)
    subnet: ipaddress.IPv4Network = field(default_factory=free_subnet)
    hosts: dict[str, Host] = field(default_factory=dict)
    _closed: bool = False

    def __post_init__(self) -> None:
        self.tag = f"{PREFIX}{self.pid}"
        self.switch = f"{self.tag}-sw"
        self.uplink = f"{self.tag}c"  # the root namespace's veth (interface names: 15 chars at most)
        if len(self.uplink) > 15:
            raise LabError(f"interface name {self.uplink!r} too long")
        self._next = 10
        atexit.register(self.close)
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "set", "lo", "up")
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            ip("link", "add", self.uplink, "type", "veth", "peer", "name", "p-test", "netns", self.switch)
            ip("-n", self.switch, "link", "set", "p-test", "master", "br0", "up")
            ip("addr", "add", f"{self.subnet[1]}/{self.subnet.prefixlen}", "dev", self.uplink)
            ip("link", "set", self.uplink, "up")
        except BaseException:
            self.close()
            raise

    @property
    def test_address(self) -> str:
        """The test process's own address on the bridge."""
        return str(self.subnet[1])

    def add_host(self, name: str) -> Host:
        ns = f"{self.tag}-{name}"
        address = str(self.subnet[self._next])
        self._next += 1
        port = f"p-{name}"
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        tmp = f"{self.tag}t"
        ip("link", "add", tmp, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", tmp, "netns", self.switch)
        ip("-n", self.switch, "link", "set", tmp, "name", port)
        ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        host = Host(name, ns, address, port)
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """Take host ``name``'s link down (its bridge port): a partition of that host."""
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL every process running in host ``name`` (a lost machine); returns their pids."""
        pids = pids_in(self.hosts[name].ns)
        _kill_all_in(self.hosts[name].ns)
        return pids

    def close(self) -> None:
        """Kill what runs in the hosts and delete every namespace of this lab (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            _kill_all_in(host.ns)
            ip("netns", "del", host.ns, check=False)
        _kill_all_in(self.switch)
        ip("netns", "del", self.switch, check=False)  # takes the bridge and every veth with it
        ip("link", "del", self.uplink, check=False)
