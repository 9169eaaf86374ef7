"""What crosses a lab host's wire: a packet capture inside the host, and what its TCP streams hold.

No tcpdump here: ``python -m tests.multihost.capture capture FILE`` (run inside a host through its
``ip netns exec``) reads every frame of the host's ``eth0`` with a raw ``AF_PACKET`` socket, both
directions, and writes them to ``FILE`` as a pcap (Ethernet; open it in Wireshark) until SIGTERM;
it prints ``ready`` once it listens. :class:`Capture` runs it. :func:`tcp_streams` reassembles the
capture's TCP streams (one per direction of a connection, in sequence order), :func:`exposed`
says which of some secrets a stream holds in the clear and :func:`tls_coverage` how much of it is
TLS records.

``python -m tests.multihost.capture control NATS_URL SUBJECT S3_ENDPOINT`` is the negative
control's client, run in the same host: a plaintext NATS connection with the identity in
:data:`CONTROL_USER_ENV` / :data:`CONTROL_PASSWORD_ENV` that subscribes to ``SUBJECT`` and
publishes :data:`CONTROL_PROMPT_ENV`'s text there, then :data:`CONTROL_IMAGE_ENV`'s image bytes
(CONNECT, SUB, PUB and MSG on the wire), and an
S3 PUT of the same text over plain HTTP signed with the keys in :data:`CONTROL_S3_KEYS_ENV`
(``ACCESS:SECRET``) - any HTTP server will do: the request is on the wire whatever the answer.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.multihost.lab import Host

ETH_P_ALL = 0x0003
CONTROL_USER_ENV = "MH_CONTROL_USER"
CONTROL_PASSWORD_ENV = "MH_CONTROL_PASSWORD"
CONTROL_PROMPT_ENV = "MH_CONTROL_PROMPT"
CONTROL_S3_KEYS_ENV = "MH_CONTROL_S3_KEYS"
#: (hex) an image file's bytes the control's NATS message carries after the prompt
CONTROL_IMAGE_ENV = "MH_CONTROL_IMAGE"
#: NATS's protocol in the clear: a client's CONNECT, a publish, a delivery, a server's INFO
NATS_VERBS = re.compile(rb"CONNECT \{|INFO \{|\b(?:H?PUB|H?MSG|SUB) [A-Za-z0-9_$.>*-]+ ")


# -- the capture, inside a host ---------------------------------------------------------------------
def _capture(path: Path, interface: str = "eth0") -> None:
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, 33, 64 * 1024 * 1024)  # SO_RCVBUFFORCE (root): no drops in bursts
    sock.bind((interface, 0))
    sock.settimeout(0.1)
    with path.open("wb") as out:
        out.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1))  # pcap, Ethernet
        print("ready", flush=True)
        while not stop:
            try:
                frame = sock.recv(262144)
            except TimeoutError:
                continue
            except InterruptedError:
                continue
            now = time.time()
            out.write(struct.pack("<IIII", int(now), int(now % 1 * 1e6), len(frame), len(frame)) + frame)


@dataclass
class Capture:
    """:func:`_capture` running inside ``host`` into ``path``."""

    host: Host
    path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Capture:
        argv = [*self.host.wrap, sys.executable, "-m", __name__, "capture", str(self.path)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise AssertionError(f"the capture in {self.host.name} did not start ({self.proc.wait()}): {line!r}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# -- what the capture holds -------------------------------------------------------------------------
#: one direction of a TCP connection: (source address, source port, destination address, port)
Flow = tuple[str, int, str, int]


def frames(path: Path) -> list[bytes]:
    data = path.read_bytes()
    out, i = [], 24
    while i + 16 <= len(data):
        incl = struct.unpack_from("<I", data, i + 8)[0]
        out.append(data[i + 16 : i + 16 + incl])
        i += 16 + incl
    return out


def tcp_streams(path: Path) -> dict[Flow, bytes]:
    """Every TCP payload of the capture, per direction of a connection, reassembled in sequence
    order (a retransmission counted once; a gap - bytes the capture missed - left out)."""
    segments: dict[Flow, dict[int, bytes]] = {}
    for frame in frames(path):
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # IPv4 only (the lab's)
            continue
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != 6 or len(ip) < ihl + 20:
            continue
        total = struct.unpack_from("!H", ip, 2)[0] or len(ip)
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack_from("!HHI", tcp, 0)
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if not payload:
            continue
        flow = (socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
        held = segments.setdefault(flow, {})
        if len(payload) > len(held.get(seq, b"")):
            held[seq] = payload
    streams = {}
    for flow, held in segments.items():
        base = min(held, key=lambda s: (s - next(iter(held))) % (1 << 32))  # the earliest, across a wrap
        out, end = bytearray(), 0
        for offset, payload in sorted(((s - base) % (1 << 32), p) for s, p in held.items()):
            if offset + len(payload) <= end:
                continue
            out += payload[max(0, end - offset) :]
            end = offset + len(payload)
        streams[flow] = bytes(out)
    return streams


def exposed(stream: bytes, secrets: dict[str, bytes]) -> list[str]:
    """The labels of ``secrets`` found in ``stream`` as they are, and ``nats protocol`` when it
    holds NATS's protocol in the clear (:data:`NATS_VERBS`)."""
    found = [label for label, secret in secrets.items() if secret and secret in stream]
    if NATS_VERBS.search(stream):
        found.append("nats protocol")
    return found


def tls_coverage(stream: bytes) -> tuple[int, int]:
    """(TLS records, bytes outside any) of ``stream``: it is walked record by record (content type
    20-23, version 3.1-3.4, a length of at most 2^14 + 2048), skipping a byte where no record
    starts; the last record may be cut off by the capture's end. A stream captured from its
    middle has a head before its first whole record (less than one record)."""
    records = outside = i = 0
    while i < len(stream):
        head = stream[i : i + 5]
        if (
            len(head) == 5
            and head[0] in (20, 21, 22, 23)
            and head[1] == 3
            and 1 <= head[2] <= 4
            and (length := struct.unpack_from("!H", head, 3)[0]) <= (1 << 14) + 2048
        ):
            records += 1
            i += 5 + length
        else:
            outside += 1
            i += 1
    return records, outside


# -- the negative control's client --------------------------------------------------------------------
async def _control_nats(url: str, subject: str, prompt: bytes) -> None:
    import asyncio

    import nats

    nc = await nats.connect(
        servers=[url],
        user=os.environ[CONTROL_USER_ENV],
        password=os.environ[CONTROL_PASSWORD_ENV],
        connect_timeout=5,
        allow_reconnect=False,
    )
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_msg(msg) -> None:
        if not got.done():
            got.set_result(msg.data)

    await nc.subscribe(subject, cb=on_msg)
    await nc.publish(subject, prompt)
    assert await asyncio.wait_for(got, 5) == prompt
    await nc.close()


def _control_s3(endpoint: str, prompt: bytes) -> str:
    import io

    import urllib3
    from minio import Minio

    access, secret = os.environ[CONTROL_S3_KEYS_ENV].split(":", 1)
    http = urllib3.PoolManager(retries=False, timeout=5)  # one try: it is on the wire
    client = Minio(endpoint, access_key=access, secret_key=secret, secure=False, region="us-east-1", http_client=http)
    try:
        client.put_object("mh-control", "prompt.txt", io.BytesIO(prompt), len(prompt))
        return "stored"
    except Exception as exc:  # noqa: BLE001 - any answer: the request crossed the wire
        return type(exc).__name__


if __name__ == "__main__":
    if sys.argv[1] == "capture":
        _capture(Path(sys.argv[2]))
    elif sys.argv[1] == "control":
        import asyncio

        prompt = os.environ[CONTROL_PROMPT_ENV].encode()
        image = bytes.fromhex(os.environ.get(CONTROL_IMAGE_ENV, ""))
        asyncio.run(_control_nats(sys.argv[2], sys.argv[3], prompt + image))
        print(_control_s3(sys.argv[4], prompt))
    else:
        raise SystemExit(f"usage: python -m {__name__} capture FILE | control NATS_URL SUBJECT S3_ENDPOINT")
