"""Tests for shared.media (decoding, data URLs) and shared.fetch (the SSRF-guarded fetcher, the loaders).

Network tests use real sockets, but only on 127.0.0.1. Every fetcher here is built with
``_LoopbackOnlyBackend`` under the pinning backend: it records each TCP connect and refuses
anything that is not 127.0.0.1, so a guard failure shows up as a test failure instead of a
packet leaving the machine. Host names other than ``localhost`` and numeric forms go through a
fake resolver, never real DNS.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpcore
import numpy as np
import pytest
from PIL import Image

from shared import fetch, media
from shared.errors import (
    FetchFailed,
    FetchTimeout,
    ImageURLUnavailable,
    InvalidImage,
    InvalidRequest,
    PayloadTooLarge,
    UnsupportedContent,
    URLNotAllowed,
)
from shared.fetch import ImageFetcher, check_address, load_image, non_public_reason
from shared.media import LoadedImage, MediaLimits, decode_image, parse_data_url
from tests.stackutil import noise_image, wait_for

LOOPBACK_OK = MediaLimits(allowed_networks=("127.0.0.0/8",))


# ------------------------------------------------------------------------------------------------
# images
# ------------------------------------------------------------------------------------------------
def encode(im: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def expected_hash(im: Image.Image) -> str:
    rgb = im.convert("RGB")
    return hashlib.sha256(b"epd-img-v1|RGB|%dx%d|" % (rgb.width, rgb.height) + rgb.tobytes()).hexdigest()


def bytes_data_url(data: bytes, mime: str = "image/png") -> str:
    """A base64 data URL of arbitrary ``data`` (not necessarily an image)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PATTERN = noise_image(0, (48, 32))
PNG = encode(PATTERN, "PNG")
JPEG = encode(PATTERN, "JPEG", quality=90)


# ------------------------------------------------------------------------------------------------
# local HTTP server (127.0.0.1 only)
# ------------------------------------------------------------------------------------------------
#: How long a stalling endpoint (/slow, /drip, /huge-cl) holds its connection at most; tests
#: expecting a client-side cut-off fail long before (they bound themselves at HANG_S).
STALL_S = 300
HANG_S = 60


@dataclass
class Server:
    port: int
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)
    #: Set at teardown: stalling handlers give up and their threads end.
    release: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


def _make_handler(state: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # silence
            pass

        def _send(
            self,
            status: int,
            body: bytes = b"",
            ctype: str = "application/octet-stream",
            headers: dict[str, str] | None = None,
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # http.server API
            state.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            try:
                self._route()
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                self.close_connection = True

        def _route(self) -> None:
            path = self.path
            if path == "/x.png" or path == "/cookie":
                extra = {"Set-Cookie": "session=secret; Path=/"} if path == "/cookie" else None
                self._send(200, PNG, "image/png", extra)
            elif path == "/x.jpg":
                self._send(200, JPEG, "image/jpeg")
            elif path == "/text":
                self._send(200, b"hello, not an image\n", "text/plain")
            elif path == "/404":
                self._send(404, b"nope", "text/plain")
            elif path == "/500":
                self._send(500, b"boom", "text/plain")
            elif path == "/redirect":
                self._send(302, headers={"Location": "/x.png"})
            elif path == "/redirect-abs":
                self._send(301, headers={"Location": state.url("/x.jpg")})
            elif path == "/loop":
                self._send(302, headers={"Location": "/loop"})
            elif path == "/to-metadata":
                self._send(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
            elif path == "/to-file":
                self._send(302, headers={"Location": "file:///etc/passwd"})
            elif path == "/huge":
                # No Content-Length: the client must count while streaming.
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                block = b"\0" * 65536
                for _ in range(64):  # 4 MiB
                    self.wfile.write(block)
            elif path == "/huge-cl":
                # A huge declared length, 1 KiB of body, then nothing: a client that reads the
                # body before judging its size waits here until its fetch deadline.
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(10**9))
                self.end_headers()
                self.close_connection = True
                self.wfile.write(b"\0" * 1024)
                self.wfile.flush()
                state.release.wait(STALL_S)
            elif path == "/slow":
                # Never answers while a test waits: only the client's deadline ends the fetch.
                state.release.wait(STALL_S)
                self._send(200, PNG, "image/png")
            elif path == "/drip":
                # A byte every 0.1 s, for as long as the client reads: every read completes well
                # within a per-read timeout; only an overall deadline stops this.
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(10**6))
                self.end_headers()
                self.close_connection = True
                while not state.release.wait(0.1):
                    self.wfile.write(b"\0")  # raises once the client has gone
                    self.wfile.flush()
            else:
                self._send(404, b"unknown", "text/plain")

    return Handler


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    state = Server(port=0)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    state.release.set()
    httpd.shutdown()
    httpd.server_close()


class _LoopbackOnlyBackend(httpcore.AsyncNetworkBackend):
    """Records every connect; refuses (loudly) anything but 127.0.0.1."""

    def __init__(self) -> None:
        self.inner = httpcore.AnyIOBackend()
        self.connects: list[tuple[str, int]] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        self.connects.append((host, port))
        if host != "127.0.0.1":
            raise AssertionError(f"test tried to connect to non-loopback address {host}")
        return await self.inner.connect_tcp(host, port, timeout=timeout)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def make_fetcher(
    limits: MediaLimits = LOOPBACK_OK, resolver: fetch.Resolver | None = None, verify: ssl.SSLContext | bool = True
) -> tuple[ImageFetcher, _LoopbackOnlyBackend]:
    backend = _LoopbackOnlyBackend()
    return ImageFetcher(limits, resolver=resolver, verify=verify, network_backend=backend), backend


class FakeResolver:
    """Maps host names to address lists (one list per call, the last one repeating)."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        seq = self.answers[host]
        return seq[min(self.calls.count(host) - 1, len(seq) - 1)]


# ------------------------------------------------------------------------------------------------
# SSRF guard: pure address checks
# ------------------------------------------------------------------------------------------------
REFUSED_ADDRESSES = [
    "127.0.0.1",
    "127.255.255.254",
    "10.0.0.1",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",
    "100.64.0.1",
    "0.0.0.0",
    "224.0.0.1",
    "255.255.255.255",
    "240.0.0.1",
    "198.18.0.1",
    "192.0.2.1",
    "::1",
    "::",
    "fe80::1",
    "fe80::1%1",
    "fc00::1",
    "fd12:3456::1",
    "fec0::1",
    "ff02::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b:1::1",  # local-use NAT64
    "2002:7f00:1::",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "::7f00:1",  # deprecated IPv4-compatible ::127.0.0.1
    "2001:db8::1",
]
PUBLIC_ADDRESSES = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "2606:4700:4700::1111",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
]


@pytest.mark.parametrize("address", REFUSED_ADDRESSES)
def test_check_address_refuses_non_public(address: str) -> None:
    assert non_public_reason(address) is not None
    with pytest.raises(URLNotAllowed):
        check_address(address, MediaLimits(), host="example.test")


@pytest.mark.parametrize("address", PUBLIC_ADDRESSES)
def test_check_address_accepts_public(address: str) -> None:
    assert non_public_reason(address) is None
    assert check_address(address, MediaLimits())


def test_check_address_allowlists() -> None:
    assert str(check_address("127.0.0.1", LOOPBACK_OK)) == "127.0.0.1"
    # IPv4-mapped IPv6 is judged (and connected to) as the IPv4 address it is.
    assert str(check_address("::ffff:127.0.0.1", LOOPBACK_OK)) == "127.0.0.1"
    with pytest.raises(URLNotAllowed):
        check_address("10.0.0.1", LOOPBACK_OK)
    with pytest.raises(URLNotAllowed):
        check_address("::1", LOOPBACK_OK)  # a v4 network never matches a v6 address
    hosts = MediaLimits(allowed_hosts=("Images.Internal",))
    assert check_address("10.1.2.3", hosts, host="images.internal.")
    with pytest.raises(URLNotAllowed):
        check_address("10.1.2.3", hosts, host="other.internal")
    # Unspecified and multicast are never destinations, whatever the allowlist says.
    everything = MediaLimits(allowed_networks=("0.0.0.0/0", "::/0"), allowed_hosts=("h",))
    for address in ("0.0.0.0", "::", "224.0.0.1", "ff02::1"):
        with pytest.raises(URLNotAllowed):
            check_address(address, everything, host="h")
    assert check_address("10.0.0.1", everything)


def test_refusal_message_does_not_leak_the_address() -> None:
    with pytest.raises(URLNotAllowed) as info:
        check_address("10.11.12.13", MediaLimits(), host="intranet.example")
    assert "intranet.example" in info.value.message
    assert "10.11.12.13" not in info.value.message


def test_media_limits_validation() -> None:
    with pytest.raises(ValueError):
        MediaLimits(allowed_networks=("not-a-cidr",))
    with pytest.raises(ValueError):
        MediaLimits(allowed_schemes=("http", "file"))
    with pytest.raises(ValueError):
        MediaLimits(max_pixels=0)


# ------------------------------------------------------------------------------------------------
# SSRF guard: the fetcher never connects to a refused address
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "[::1]",
        "10.0.0.1",
        "192.168.1.1",
        "172.16.0.1",
        "169.254.169.254",
        "100.64.0.1",
        "[::ffff:127.0.0.1]",
        "[::ffff:a9fe:a9fe]",
        "[::]",
        "[fe80::1]",
        "[fd00::1]",
        "0.0.0.0",
        "224.0.0.1",
        # Numeric forms that only the system resolver (inet_aton) turns into 127.0.0.1 / 0.0.0.0.
        "0x7f000001",
        "2130706433",
        "127.1",
        "0",
    ],
)
async def test_default_limits_refuse_private_targets(server: Server, host: str) -> None:
    before = len(server.requests)
    fetcher, backend = make_fetcher(MediaLimits())
    async with fetcher:
        with pytest.raises(URLNotAllowed):
            await fetcher.fetch(server.url("/x.png", host=host))
        with pytest.raises(URLNotAllowed):
            await load_image(server.url("/x.png", host=host), fetcher)
    assert backend.connects == []
    assert len(server.requests) == before


async def test_any_private_address_among_many_refuses(server: Server) -> None:
    resolver = FakeResolver({"cdn.example.test": [["93.184.216.34", "10.0.0.7"]]})
    fetcher, backend = make_fetcher(MediaLimits(), resolver=resolver)
    async with fetcher:
        with pytest.raises(URLNotAllowed):
            await fetcher.fetch("http://cdn.example.test/x.png")
    assert backend.connects == []


async def test_connects_to_the_vetted_address_only_and_keeps_host_header(server: Server) -> None:
    resolver = FakeResolver({"img.example.test": [["127.0.0.1"]]})
    fetcher, backend = make_fetcher(LOOPBACK_OK, resolver=resolver)
    async with fetcher:
        data = await fetcher.fetch(server.url("/x.png", host="img.example.test"))
    assert data == PNG
    assert resolver.calls == ["img.example.test"]  # resolved once, then pinned
    assert backend.connects == [("127.0.0.1", server.port)]
    assert server.requests[-1][1]["host"] == f"img.example.test:{server.port}"


async def test_dns_rebinding_is_refused_even_with_a_pooled_connection(server: Server) -> None:
    # First answer is allowed, the second points somewhere forbidden: the second fetch must be
    # refused before anything is sent, although a keep-alive connection to the name exists.
    resolver = FakeResolver({"rebind.example.test": [["127.0.0.1"], ["10.0.0.1"]]})
    fetcher, backend = make_fetcher(LOOPBACK_OK, resolver=resolver)
    before = len(server.requests)
    async with fetcher:
        assert await fetcher.fetch(server.url("/x.png", host="rebind.example.test")) == PNG
        with pytest.raises(URLNotAllowed):
            await fetcher.fetch(server.url("/x.png", host="rebind.example.test"))
    assert len(server.requests) == before + 1
    assert backend.connects == [("127.0.0.1", server.port)]


async def test_pinned_backend_fails_closed_without_a_pin() -> None:
    backend = fetch._PinnedNetworkBackend(_LoopbackOnlyBackend())
    with pytest.raises(httpcore.ConnectError):
        await backend.connect_tcp("127.0.0.1", 9)
    token = fetch._PIN.set(fetch._Pin(host="a.example", addresses=("127.0.0.1",)))
    try:
        with pytest.raises(httpcore.ConnectError):  # pinned for another host
            await backend.connect_tcp("b.example", 9)
    finally:
        fetch._PIN.reset(token)


async def test_allowed_hosts_lets_a_named_private_host_through(server: Server) -> None:
    resolver = FakeResolver({"images.internal": [["127.0.0.1"]]})
    limits = MediaLimits(allowed_hosts=("images.internal",))
    fetcher, _ = make_fetcher(limits, resolver=resolver)
    async with fetcher:
        assert await fetcher.fetch(server.url("/x.png", host="images.internal")) == PNG
        with pytest.raises(URLNotAllowed):  # the literal address is not in the allowlist
            await fetcher.fetch(server.url("/x.png"))


@pytest.mark.parametrize(
    "url,error",
    [
        ("http://user:pw@127.0.0.1/x.png", InvalidRequest),
        ("http://user@127.0.0.1/x.png", InvalidRequest),
        ("ftp://127.0.0.1/x.png", UnsupportedContent),
        ("file:///etc/passwd", UnsupportedContent),
        ("gopher://127.0.0.1:6379/_INFO", UnsupportedContent),
        ("http://[::1/x.png", InvalidRequest),
        ("http:///x.png", InvalidRequest),
        ("http://0177.0.0.1/x.png", InvalidRequest),  # octal dotted quad: httpx refuses to parse
    ],
)
async def test_bad_urls_rejected_before_connecting(url: str, error: type[Exception]) -> None:
    fetcher, backend = make_fetcher(LOOPBACK_OK)
    async with fetcher:
        with pytest.raises(error):
            await fetcher.fetch(url)
        with pytest.raises(error):
            await load_image(url, fetcher)
    assert backend.connects == []


async def test_https_only_limits_refuse_http(server: Server) -> None:
    fetcher, backend = make_fetcher(MediaLimits(allowed_networks=("127.0.0.0/8",), allowed_schemes=("https",)))
    async with fetcher:
        with pytest.raises(UnsupportedContent):
            await fetcher.fetch(server.url("/x.png"))
    assert backend.connects == []


async def test_unresolvable_host_is_a_400_naming_the_url() -> None:
    # issue 23.7: a host that does not exist is the client's mistake, not worth the SDK's retries
    fetcher, backend = make_fetcher(LOOPBACK_OK, resolver=FakeResolver({}))
    async with fetcher:
        with pytest.raises(ImageURLUnavailable) as info:
            await fetcher.fetch("http://nowhere.example.test/x.png?sig=SECRET123")
    assert info.value.http_status == 400
    assert "http://nowhere.example.test/x.png" in info.value.message
    assert "SECRET123" not in info.value.message
    assert backend.connects == []


async def test_a_temporary_dns_failure_stays_fetch_failed() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    fetcher, backend = make_fetcher(LOOPBACK_OK, resolver=resolver)
    async with fetcher:
        with pytest.raises(FetchFailed) as info:
            await fetcher.fetch("http://flaky.example.test/x.png")
    assert info.value.http_status == 502 and "flaky.example.test" in info.value.message
    assert not isinstance(info.value, FetchTimeout)
    assert backend.connects == []


def test_a_private_address_names_the_allow_list_settings() -> None:
    # issue 23.7: the 400 tells the operator which settings open a private network
    with pytest.raises(URLNotAllowed) as info:
        fetch.check_address("10.1.2.3", MediaLimits(), host="intranet.example")
    assert "EPD_URL_ALLOW_NETWORKS" in info.value.message and "EPD_URL_ALLOW_HOSTS" in info.value.message
    assert "epd up --allow-local-urls" in info.value.message
    assert "10.1.2.3" not in info.value.message  # which internal address a name maps to stays in the log


# ------------------------------------------------------------------------------------------------
# fetching from the local server (127.0.0.0/8 allowed)
# ------------------------------------------------------------------------------------------------
async def test_png_and_jpeg_load(server: Server) -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        png = await load_image(server.url("/x.png"), fetcher)
        jpeg = await load_image(server.url("/x.jpg"), fetcher)
    assert (png.width, png.height, png.format) == (48, 32, "PNG")
    assert png.data == PNG
    assert png.content_hash == expected_hash(PATTERN)
    assert (jpeg.width, jpeg.height, jpeg.format) == (48, 32, "JPEG")
    assert jpeg.data == JPEG
    assert jpeg.content_hash != png.content_hash  # lossy: different pixels
    assert png.to_rgb().tobytes() == PATTERN.tobytes()


async def test_http_and_data_url_of_same_bytes_hash_alike(server: Server) -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        a = await load_image(server.url("/x.png"), fetcher)
        b = await load_image(bytes_data_url(PNG), fetcher)
    assert a == b


async def test_non_image_body_is_invalid_image(server: Server) -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        with pytest.raises(InvalidImage):
            await load_image(server.url("/text"), fetcher)


async def test_huge_body_is_cut_off(server: Server) -> None:
    # A fetch deadline well past any load-induced delay: reaching it is a failure (FetchTimeout).
    fetcher, _ = make_fetcher(
        MediaLimits(allowed_networks=("127.0.0.0/8",), max_image_bytes=1024 * 1024, fetch_timeout_s=HANG_S)
    )
    async with fetcher:
        with pytest.raises(PayloadTooLarge, match="over the limit"):
            await fetcher.fetch(server.url("/huge"))
        # Refused on Content-Length alone: /huge-cl stalls after 1 KiB, so reading any further
        # would end in FetchTimeout, not PayloadTooLarge.
        with pytest.raises(PayloadTooLarge, match=f"is {10**9} bytes"):
            await fetcher.fetch(server.url("/huge-cl"))


@pytest.mark.parametrize(
    "path,status,error,http_status",
    [("/404", "404", ImageURLUnavailable, 400), ("/500", "500", FetchFailed, 502)],
)
async def test_http_error_status(server: Server, path: str, status: str, error: type, http_status: int) -> None:
    # 4xx: the URL is wrong, a 400 naming it (issue 23.7); 5xx: upstream trouble, a 502
    fetcher, _ = make_fetcher()
    async with fetcher:
        with pytest.raises(error) as info:
            await fetcher.fetch(server.url(path))
    assert status in info.value.message and "127.0.0.1" in info.value.message
    assert info.value.http_status == http_status
    assert not isinstance(info.value, FetchTimeout)
    if error is ImageURLUnavailable:
        assert server.url(path) in info.value.message


async def test_error_messages_do_not_echo_the_query_string(server: Server) -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        with pytest.raises(ImageURLUnavailable) as info:
            await fetcher.fetch(server.url("/404?X-Amz-Signature=SECRET123"))
    assert "SECRET123" not in info.value.message


async def _timed_fetch(fetcher: ImageFetcher, url: str) -> tuple[FetchTimeout, float]:
    """Fetch ``url`` expecting the fetcher's own deadline to end it: (the FetchTimeout, seconds
    taken). The test's bound (``HANG_S``) only catches a fetch that never ends."""
    started = time.monotonic()
    with pytest.raises(FetchTimeout) as info:
        await asyncio.wait_for(fetcher.fetch(url), HANG_S)
    return info.value, time.monotonic() - started


async def test_slow_server_times_out(server: Server) -> None:
    timeout = 1.0
    fetcher, _ = make_fetcher(MediaLimits(allowed_networks=("127.0.0.0/8",), fetch_timeout_s=timeout))
    before = len(server.requests)
    async with fetcher:
        error, elapsed = await _timed_fetch(fetcher, server.url("/slow"))
    # The overall deadline ended it (its message names the limit), not before it passed (the
    # 10 ms allow for the event loop's clock resolution), and the server had the request: the
    # wait was for the answer.
    assert f"timed out after {timeout:g}s" in error.message, error.message
    assert elapsed >= timeout - 0.01, elapsed
    wait_for(lambda: "/slow" in server.paths()[before:], HANG_S, "the server to see /slow")


async def test_drip_feed_hits_the_overall_deadline(server: Server) -> None:
    timeout = 1.0
    fetcher, _ = make_fetcher(MediaLimits(allowed_networks=("127.0.0.0/8",), fetch_timeout_s=timeout))
    async with fetcher:
        error, elapsed = await _timed_fetch(fetcher, server.url("/drip"))
    # Bytes keep coming, so no per-read timeout fires (those say "timed out" without the
    # limit): only the overall deadline ends this fetch.
    assert f"timed out after {timeout:g}s" in error.message, error.message
    assert elapsed >= timeout - 0.01, elapsed


async def test_redirects(server: Server) -> None:
    fetcher, backend = make_fetcher()
    async with fetcher:
        before = len(server.requests)
        assert await fetcher.fetch(server.url("/redirect")) == PNG
        assert server.paths()[before:] == ["/redirect", "/x.png"]
        assert await fetcher.fetch(server.url("/redirect-abs")) == JPEG
        with pytest.raises(FetchFailed, match="redirects"):
            await fetcher.fetch(server.url("/loop"))
        with pytest.raises(UnsupportedContent):
            await fetcher.fetch(server.url("/to-file"))
    assert {host for host, _ in backend.connects} == {"127.0.0.1"}
    assert server.paths().count("/loop") == LOOPBACK_OK.max_redirects + 1

    strict, _ = make_fetcher(MediaLimits(allowed_networks=("127.0.0.0/8",), max_redirects=0))
    async with strict:
        with pytest.raises(FetchFailed, match="redirects"):
            await strict.fetch(server.url("/redirect"))


async def test_redirect_to_link_local_is_refused_without_connecting(server: Server) -> None:
    fetcher, backend = make_fetcher()
    async with fetcher:
        with pytest.raises(URLNotAllowed):
            await fetcher.fetch(server.url("/to-metadata"))
    assert backend.connects and all(host == "127.0.0.1" for host, _ in backend.connects)


async def test_connection_refused_is_fetch_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fetcher, _ = make_fetcher()
    async with fetcher:
        with pytest.raises(FetchFailed) as info:
            await fetcher.fetch(f"http://127.0.0.1:{port}/x.png")
    assert not isinstance(info.value, FetchTimeout)
    assert "127.0.0.1" in info.value.message


async def test_no_cookies_are_kept_between_fetches(server: Server) -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        await fetcher.fetch(server.url("/cookie"))
        await fetcher.fetch(server.url("/cookie"))
    assert "cookie" not in server.requests[-1][1]
    assert server.requests[-1][1]["accept-encoding"] == "identity"


async def test_concurrent_fetches(server: Server) -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        results = await asyncio.gather(*(fetcher.fetch(server.url("/x.png")) for _ in range(8)))
    assert all(r == PNG for r in results)


# ------------------------------------------------------------------------------------------------
# HTTPS: the connection goes to the pinned IP, TLS still uses and verifies the host name
# ------------------------------------------------------------------------------------------------
def self_signed_certificate(folder: Path, host: str) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for ``host`` (its own CA; SAN ``DNS:host``), valid for
    two days, made in Python (the ``cryptography`` package, pinned in the test extra): (cert
    PEM, key PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A real TLS server (127.0.0.1) with a certificate for ``img.example.test`` only."""
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"), "img.example.test")
    state = Server(port=0)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: state.sni.append(name)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    httpd.daemon_threads = True
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state, cert
    state.release.set()
    httpd.shutdown()
    httpd.server_close()


async def test_https_uses_sni_and_verifies_the_host_name(tls_server: tuple[Server, Path]) -> None:
    state, cert = tls_server
    trust = ssl.create_default_context(cafile=str(cert))
    resolver = FakeResolver({"img.example.test": [["127.0.0.1"]], "other.example.test": [["127.0.0.1"]]})
    fetcher, backend = make_fetcher(LOOPBACK_OK, resolver=resolver, verify=trust)
    async with fetcher:
        url = state.url("/x.png", host="img.example.test", scheme="https")
        assert await fetcher.fetch(url) == PNG
        assert state.sni[-1] == "img.example.test"
        assert state.requests[-1][1]["host"] == f"img.example.test:{state.port}"
        # Same IP, a name the certificate does not cover: verification must fail.
        with pytest.raises(FetchFailed, match="CERTIFICATE_VERIFY_FAILED"):
            await fetcher.fetch(state.url("/x.png", host="other.example.test", scheme="https"))
        assert state.sni[-1] == "other.example.test"
    assert {host for host, _ in backend.connects} == {"127.0.0.1"}


# ------------------------------------------------------------------------------------------------
# data URLs
# ------------------------------------------------------------------------------------------------
async def test_data_url_png_loads() -> None:
    fetcher, backend = make_fetcher()
    async with fetcher:
        loaded = await load_image(bytes_data_url(PNG), fetcher)
    assert (loaded.width, loaded.height, loaded.format, loaded.data) == (48, 32, "PNG", PNG)
    assert loaded.content_hash == expected_hash(PATTERN)
    assert backend.connects == []


def test_data_url_tolerated_variations() -> None:
    b64 = base64.b64encode(PNG).decode()
    assert parse_data_url(f"DATA:Image/PNG;base64,{b64}") == PNG
    assert parse_data_url(f"data:image/png;name=x.png;base64,{b64}") == PNG
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert parse_data_url(f"data:image/png;base64,{wrapped}") == PNG
    assert parse_data_url(f"data:image/png;base64,{b64.rstrip('=')}") == PNG
    urlsafe = base64.urlsafe_b64encode(PNG).decode()
    assert parse_data_url(f"data:image/png;base64,{urlsafe}") == PNG


@pytest.mark.parametrize(
    "url,needle",
    [
        ("data:image/png;base64,@@@@not-base64@@@@", "invalid base64"),
        ("data:image/png;base64,QUJD=QUJD", "invalid base64"),
        ("data:image/png;base64,A", "invalid base64"),
        ("data:text/plain;base64,aGVsbG8=", "image/*"),
        ("data:;base64,aGVsbG8=", "image/*"),
        ("data:application/octet-stream;base64,aGVsbG8=", "image/*"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "malformed"),
        ("data:image/png;base64,", "no data"),
    ],
)
def test_bad_data_urls(url: str, needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_data_url(url)
    assert needle in info.value.message
    assert not isinstance(info.value, (InvalidImage, PayloadTooLarge))


def test_data_url_size_is_checked_before_decoding() -> None:
    limits = MediaLimits(max_image_bytes=1000)
    assert len(parse_data_url(bytes_data_url(b"\x01" * 1000), limits)) == 1000
    with pytest.raises(PayloadTooLarge):
        parse_data_url(bytes_data_url(b"\x01" * 1001), limits)
    # Invalid base64 that is also too long: the size check must come first.
    with pytest.raises(PayloadTooLarge):
        parse_data_url("data:image/png;base64," + "!" * 4000, limits)
    with pytest.raises(PayloadTooLarge):  # far too long: refused before any parsing
        parse_data_url("data:image/png;base64," + "A" * 100_000, limits)


async def test_data_url_garbage_image_is_invalid_image() -> None:
    fetcher, _ = make_fetcher()
    async with fetcher:
        with pytest.raises(InvalidImage):
            await load_image(bytes_data_url(b"definitely not an image"), fetcher)
        with pytest.raises(UnsupportedContent):
            await load_image("blob:https://example.test/123", fetcher)
        with pytest.raises(InvalidRequest):
            await load_image("", fetcher)


# ------------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------------
def test_same_pixels_in_any_container_hash_alike() -> None:
    expected = expected_hash(PATTERN)
    variants = {
        "png-optimized": encode(PATTERN, "PNG", optimize=True),
        "png-rgba-opaque": encode(PATTERN.convert("RGBA"), "PNG"),
        "webp-lossless": encode(PATTERN, "WEBP", lossless=True),
        "bmp": encode(PATTERN, "BMP"),
    }
    for name, data in variants.items():
        _, content_hash, _ = decode_image(data, MediaLimits())
        assert content_hash == expected, name


def test_different_images_hash_differently() -> None:
    hashes = {
        decode_image(encode(noise_image(0, (48, 32)), "PNG"))[1],
        decode_image(encode(noise_image(1, (48, 32)), "PNG"))[1],
        # Same bytes, other shape: the dimensions are part of the hash.
        decode_image(encode(Image.frombytes("RGB", (32, 48), PATTERN.tobytes()), "PNG"))[1],
    }
    assert len(hashes) == 3


def test_content_hash_value_is_pinned() -> None:
    """The content hash is part of every EC key already stored: a picture's hash never changes."""
    pinned = "c5f49602b68568fec77693f0d58e875e3bf0816525832344879a0d24732fea7a"
    assert LoadedImage.from_bytes(PNG).content_hash == pinned
    assert decode_image(PNG)[1] == pinned
    assert media.content_hash_of(PATTERN) == pinned


def _mode_variants() -> dict[str, bytes]:
    """Small images in every mode the decoders produce, 23 rows high (strips leave a remainder)."""
    base = noise_image(7, (37, 23))
    rgba = base.copy()
    rgba.putalpha(noise_image(8, (37, 23)).convert("L"))
    wide = Image.fromarray(np.random.default_rng(9).integers(0, 65536, (23, 37), dtype=np.uint16))
    return {
        "rgb-png": encode(base, "PNG"),
        "rgba-png": encode(rgba, "PNG"),
        "l-png": encode(base.convert("L"), "PNG"),
        "la-png": encode(rgba.convert("LA"), "PNG"),
        "p-png": encode(base.quantize(64), "PNG"),
        "p-transparent-gif": encode(base.quantize(64), "GIF", transparency=3),
        "rgb-trns-png": encode(base, "PNG", transparency=base.getpixel((0, 0))),
        "i16-png": encode(wide, "PNG"),
        "1-bmp": encode(base.convert("1"), "BMP"),
        "cmyk-jpeg": encode(base.convert("CMYK"), "JPEG"),
        "rgba-webp": encode(rgba, "WEBP", lossless=True),
    }


@pytest.mark.parametrize("strip_pixels", [1, 37 * 3 + 5, 1 << 20])
def test_strips_convert_and_hash_like_the_whole_frame(monkeypatch: pytest.MonkeyPatch, strip_pixels: int) -> None:
    """Conversion and hashing go a strip of rows at a time; the pixels and the hash must be exactly
    those of the whole frame converted at once (how the hash was defined, and EC keys made)."""
    monkeypatch.setattr(media, "_STRIP_PIXELS", strip_pixels)
    for name, data in _mode_variants().items():
        im = Image.open(io.BytesIO(data))
        im.seek(0)
        im.load()
        whole = media._to_rgb(im)
        rgb, content_hash, _ = decode_image(data)
        assert rgb.tobytes() == whole.tobytes(), name
        assert content_hash == expected_hash(whole), name
        assert LoadedImage.from_bytes(data).content_hash == content_hash, name
        assert media.content_hash_of(whole) == content_hash, name


_BOMB_SCRIPT = """
import json, resource, struct, zlib
from shared.errors import InvalidImage
from shared.media import MediaLimits, decode_image

def png(width, height, rows):
    # An RGB PNG of ``width x height`` whose first ``rows`` rows are black (compressed row by
    # row: building it never holds the raw pixels).
    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    z = zlib.compressobj(9)
    row = bytes(width * 3 + 1)
    idat = b"".join(z.compress(row) for _ in range(rows)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")

bombs = {"pillow_guard": png(20000, 20000, 2), "our_check": png(8000, 8000, 8000)}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
errors = {}
for name, data in bombs.items():
    try:
        decode_image(data, MediaLimits())
        errors[name] = None
    except InvalidImage as exc:
        errors[name] = exc.message
grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"errors": errors, "grown_kib": grown_kib, "sizes": {k: len(v) for k, v in bombs.items()}}))
"""


def test_decompression_bomb_is_refused_without_allocating() -> None:
    """Two small PNGs declaring huge images: 20000x20000 (past Pillow's own guard) and a complete,
    valid 8000x8000 (192 MB of pixels, under Pillow's guard: only our header check stops it).
    Decoded in a fresh process, whose peak RSS (which can only grow) is read before and after:
    in this process an earlier test may already have set a higher peak, hiding any growth."""
    proc = subprocess.run(
        [sys.executable, "-c", _BOMB_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert max(out["sizes"].values()) < 1024 * 1024, out["sizes"]  # small files ...
    errors = out["errors"]
    assert errors["pillow_guard"] and "too large" in errors["pillow_guard"], errors
    assert errors["our_check"] and "pixels" in errors["our_check"], errors  # ... refused by their headers
    assert out["grown_kib"] / 1024 < 100, out  # ... without decoding (that would take 256 MB)


def test_pixel_and_side_limits() -> None:
    with pytest.raises(InvalidImage, match="pixels"):
        decode_image(PNG, MediaLimits(max_pixels=48 * 32 - 1))
    decode_image(PNG, MediaLimits(max_pixels=48 * 32))
    with pytest.raises(InvalidImage, match="at least"):
        decode_image(PNG, MediaLimits(min_side=33))
    with pytest.raises(PayloadTooLarge):
        decode_image(PNG, MediaLimits(max_image_bytes=len(PNG) - 1))


@pytest.mark.parametrize(
    "data",
    [
        PNG[: len(PNG) // 2],
        PNG[:40],
        JPEG[: len(JPEG) // 2],
        PNG[:-20] + b"\0" * 20,  # IEND / IDAT CRC damaged
        b"",
        b"GIF89a",
    ],
)
def test_truncated_or_corrupt_images_are_invalid(data: bytes) -> None:
    with pytest.raises(InvalidImage):
        decode_image(data)


def test_disallowed_formats_are_not_parsed() -> None:
    tiff = encode(PATTERN, "TIFF")
    with pytest.raises(InvalidImage, match="not a recognised image"):
        decode_image(tiff)
    assert decode_image(tiff, MediaLimits(allowed_formats=("TIFF",)))[2] == "TIFF"


def test_modes_become_rgb() -> None:
    # RGBA: transparent pixels become white, opaque ones keep their colour.
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (200, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 200, 128))
    rgb, content_hash, fmt = decode_image(encode(rgba, "PNG"))
    assert (rgb.mode, fmt) == ("RGB", "PNG")
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((2, 0)) == (10, 20, 30)
    assert rgb.getpixel((1, 0))[2] > rgb.getpixel((1, 0))[0]  # blended towards white
    assert content_hash == expected_hash(rgb)

    # Palette: same pixels as the RGB it was made from.
    palette = PATTERN.quantize(64)
    rgb, _, _ = decode_image(encode(palette, "PNG"))
    assert rgb.tobytes() == palette.convert("RGB").tobytes()

    # Grayscale, grayscale+alpha, 16-bit grayscale (scaled, not clipped), CMYK JPEG.
    grey = PATTERN.convert("L")
    rgb, _, _ = decode_image(encode(grey, "PNG"))
    assert rgb.tobytes() == grey.convert("RGB").tobytes()
    rgb, _, _ = decode_image(encode(grey.convert("LA"), "PNG"))
    assert rgb.tobytes() == grey.convert("RGB").tobytes()
    wide = Image.new("I;16", (3, 1))
    for x, value in enumerate((0, 32896, 65535)):
        wide.putpixel((x, 0), value)
    rgb, _, _ = decode_image(encode(wide, "PNG"))
    assert [rgb.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    rgb, _, fmt = decode_image(encode(PATTERN.convert("CMYK"), "JPEG"))
    assert (rgb.mode, rgb.size, fmt) == ("RGB", (48, 32), "JPEG")


def test_palette_gif_with_transparency_and_animation_first_frame() -> None:
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    blue = Image.new("RGB", (8, 8), (0, 0, 255))
    buf = io.BytesIO()
    red.save(buf, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    rgb, _, fmt = decode_image(buf.getvalue())
    assert fmt == "GIF"
    assert rgb.getpixel((3, 3)) == (255, 0, 0)

    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 0, 255, 0] + [0] * (256 * 3 - 6))
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    rgb, _, _ = decode_image(encode(p, "GIF", transparency=0))
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((1, 0)) == (0, 255, 0)


def test_mpo_camera_jpeg_is_accepted() -> None:
    buf = io.BytesIO()
    PATTERN.save(buf, "MPO", save_all=True, append_images=[noise_image(1, (48, 32))], quality=95)
    loaded = LoadedImage.from_bytes(buf.getvalue())
    assert loaded.format == "MPO"
    assert loaded.to_rgb().size == (48, 32)
    assert media.content_hash_of(loaded.to_rgb()) == loaded.content_hash


def test_import_does_not_pull_in_torch() -> None:
    code = "import sys, shared.media; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_loaded_image_round_trip() -> None:
    loaded = LoadedImage.from_bytes(PNG)
    assert loaded.content_hash == expected_hash(PATTERN)
    again = loaded.to_rgb()
    assert again.mode == "RGB" and again.tobytes() == PATTERN.tobytes()
    assert media.content_hash_of(again) == loaded.content_hash
