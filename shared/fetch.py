"""Media URLs into validated media: the SSRF-guarded HTTP(S) fetcher and the loaders of ``image_url``
and ``video_url`` parts. The API's side of intake: no worker imports this module (nor httpx), an
import-linter contract in ``pyproject.toml`` (``workers-do-not-fetch``) holds it.

* **Fetching** (:class:`ImageFetcher`): an SSRF-guarded HTTP(S) client. Every hop (the first URL
  and each redirect) is parsed, its host resolved once, and *every* resolved address vetted; the
  TCP connection then goes to one of exactly those vetted addresses (see
  :class:`_PinnedNetworkBackend`), so a DNS answer that changes between the check and the connect
  (DNS rebinding) cannot redirect the request. Redirects are followed by hand, bodies are streamed
  with a byte cap, and one overall deadline bounds DNS + connect + redirects + body.
* **Loading** (:func:`load_image`, :func:`load_video_url`): a ``data:`` URL (:mod:`shared.media`) or
  a fetched one, its header read first, then decoded in a worker thread under the process's
  :class:`~shared.decode_budget.DecodeBudget` (images: :mod:`shared.media`; videos: :mod:`shared.video`).

Errors are the typed ones from :mod:`shared.errors`; messages name the host and what happened,
never the full URL (query strings often carry signed tokens) and never a stack trace.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpcore
import httpx

from shared.decode_budget import DecodeBudget, release_freed_memory
from shared.errors import (
    FetchFailed,
    FetchTimeout,
    ImageURLUnavailable,
    InvalidRequest,
    PayloadTooLarge,
    UnsupportedContent,
    URLNotAllowed,
)
from shared.media import DEFAULT_LIMITS, FETCHED_SCHEMES, LoadedImage, MediaLimits, image_size, parse_data_url
from shared.video import (
    DEFAULT_VIDEO_LIMITS,
    SampledVideo,
    VideoLimits,
    VideoSampler,
    VideoSampling,
    check_sampling,
    frame_indices,
    load_video,
    probe,
)

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``async resolver(host, port) -> addresses`` (IP literals as strings, in preference order).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

MAX_URL_CHARS = 16 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_USER_AGENT = "epd-serve-image-fetcher/1"


# ------------------------------------------------------------------------------------------------
# SSRF guard: address classification
# ------------------------------------------------------------------------------------------------
_SHARED_V4 = ipaddress.IPv4Network("100.64.0.0/10")  # RFC 6598 carrier-grade NAT
_NAT64_WKP = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known NAT64 prefix
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215 local-use NAT64


def _normalize_address(address: str | IPAddress) -> IPAddress:
    """Parse an address; IPv4-mapped IPv6 (``::ffff:a.b.c.d``) becomes the IPv4 address it is."""
    ip = address if not isinstance(address, str) else ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.scope_id:
            # fe80::1%eth0 - the scope does not change the classification.
            ip = ipaddress.IPv6Address(ip.compressed.split("%", 1)[0])
    return ip


def non_public_reason(address: str | IPAddress) -> str | None:
    """Why ``address`` is not a public unicast destination, or ``None`` if it is one.

    Covers loopback, private (RFC 1918, ULA), link-local (incl. cloud metadata 169.254.169.254),
    shared/CGNAT (100.64/10), multicast, reserved, unspecified, documentation/benchmark ranges
    (anything Python does not call global), IPv6 site-local, and IPv4 embedded in IPv6 via the
    mapped, NAT64 and 6to4 forms (classified by the embedded IPv4 address).
    """
    ip = _normalize_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return "local-use NAT64"
        embedded: ipaddress.IPv4Address | None = None
        if ip in _NAT64_WKP:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        elif ip.sixtofour is not None:
            embedded = ip.sixtofour
        if embedded is not None:
            inner = non_public_reason(embedded)
            # The NAT64 prefix itself is inside ::/8, which Python calls reserved; with a public
            # embedded address it is an ordinary route to the public IPv4 internet.
            return f"{inner} (embedded in {ip})" if inner else None
        if ip.is_site_local:
            return "site-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED_V4:
        return "shared address space (100.64.0.0/10)"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    if not ip.is_global:
        return "not globally routable"
    return None


def is_public_address(address: str | IPAddress) -> bool:
    return non_public_reason(address) is None


def check_address(
    address: str | IPAddress, limits: MediaLimits = DEFAULT_LIMITS, *, host: str | None = None
) -> IPAddress:
    """Vet one resolved address for ``host``; return the address to connect to.

    Raises :class:`URLNotAllowed` unless the address is public, inside ``limits.allowed_networks``
    or ``host`` is in ``limits.allowed_hosts``. The unspecified address and multicast are refused
    even then. Pure function: no I/O, safe to call on any address.
    """
    ip = _normalize_address(address)
    shown = host if host is not None else str(ip)
    reason = non_public_reason(ip)
    if reason is None:
        return ip
    if ip.is_unspecified or ip.is_multicast:
        allowed = False
    elif host is not None and limits.allows_host(host):
        allowed = True
    else:
        allowed = any(ip.version == net.version and ip in net for net in limits.networks())
    if allowed:
        return ip
    # Which internal address a name maps to is itself information; it goes to the log only.
    logger.info("refusing image URL host %s: resolves to %s (%s)", shown, ip, reason)
    raise URLNotAllowed(
        f"image URL host {shown!r} is not allowed: it resolves to a private, loopback, "
        "link-local or otherwise non-public address (an operator can allow it: its network in "
        f"{ALLOW_NETWORKS_SETTING}, comma-separated CIDRs, or its host name in {ALLOW_HOSTS_SETTING}; "
        "on a development machine, `epd up --allow-local-urls` allows loopback: 127.0.0.0/8, ::1)"
    )


# ------------------------------------------------------------------------------------------------
# SSRF guard: pinned connections
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pin:
    host: str  # exactly as httpcore will pass it to connect_tcp (the URL's raw host)
    addresses: tuple[str, ...]  # vetted, in the order to try


_PIN: contextvars.ContextVar[_Pin | None] = contextvars.ContextVar("epd_media_pin", default=None)


class _PinnedNetworkBackend(httpcore.AsyncNetworkBackend):
    """Connects only to addresses the current task vetted; never resolves anything itself.

    The URL keeps its host name, so the Host header, TLS SNI, certificate verification and the
    connection-pool key are all the real host's; only the TCP connect is redirected to the
    vetted address set in :data:`_PIN`. (Rewriting the URL to the IP instead would make the pool
    key the IP, letting two HTTPS hosts on one IP share a connection whose TLS session and
    certificate were established for the other name.) httpcore opens connections inside the
    requesting task, so a context variable carries the pin. With no matching pin the connect
    fails closed.
    """

    def __init__(self, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self._inner = inner if inner is not None else httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        pin = _PIN.get()
        if pin is None or pin.host != host:
            raise httpcore.ConnectError(f"refusing to connect to unvetted host {host!r}")
        last: Exception | None = None
        for address in pin.addresses:
            try:
                return await self._inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None  # addresses is never empty
        raise last

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not allowed for image fetches")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with its connection pool rebuilt on :class:`_PinnedNetworkBackend`.

    httpx 0.28 has no public knob for the network backend, so the pool (``_pool``) is replaced
    right after construction; the assertion makes an incompatible httpx upgrade fail loudly at
    start-up instead of silently losing the pinning.
    """

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext,
        limits: httpx.Limits,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        super().__init__(verify=ssl_context, limits=limits, trust_env=False)
        if not isinstance(getattr(self, "_pool", None), httpcore.AsyncConnectionPool):
            raise RuntimeError("unsupported httpx version: cannot install the pinned backend")
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            network_backend=_PinnedNetworkBackend(network_backend),
        )


async def _system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]


@dataclass(frozen=True)
class _Target:
    url: httpx.URL
    host: str  # raw (ASCII / punycode) host, as httpcore sees it
    port: int
    addresses: tuple[str, ...]


#: getaddrinfo's "no such host" answers (others, like EAI_AGAIN, are upstream trouble: a 502)
_NO_SUCH_HOST = frozenset(
    code for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None)) if code is not None
)
#: the settings that allow image URLs on non-public addresses (``ApiSettings.url_allow_*``)
ALLOW_NETWORKS_SETTING = "EPD_URL_ALLOW_NETWORKS"
ALLOW_HOSTS_SETTING = "EPD_URL_ALLOW_HOSTS"


def shown_url(url: httpx.URL) -> str:
    """An image URL for an error message: without credentials, query and fragment (signatures,
    tokens), at most 200 characters."""
    text = str(url.copy_with(userinfo=b"", query=None, fragment=None))
    return text if len(text) <= 200 else text[:197] + "..."


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class ImageFetcher:
    """SSRF-guarded image downloader sharing one ``httpx.AsyncClient`` (connection reuse).

    Guarantees, per hop (the URL itself and every redirect target):

    * scheme in ``limits.allowed_schemes``; no credentials in the URL;
    * the host is resolved once (``resolver``, default ``loop.getaddrinfo``) and every address
      is vetted with :func:`check_address` *before* any connection is made — one bad address
      refuses the URL;
    * the connection goes to a vetted address (no second resolution, so no DNS rebinding);
    * redirects are followed by hand, at most ``limits.max_redirects``;
    * the body is streamed and abandoned past ``limits.max_image_bytes``;
    * ``limits.fetch_timeout_s`` bounds the whole fetch.

    No environment proxies, no ``.netrc``, no cookies are used or kept (a shared client must not
    carry state from one user's fetch into another's). Use as ``async with ImageFetcher() as f``
    or call :meth:`aclose`.
    """

    def __init__(
        self,
        limits: MediaLimits = DEFAULT_LIMITS,
        *,
        resolver: Resolver | None = None,
        verify: ssl.SSLContext | bool = True,
        max_connections: int = 64,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
        noun: str = "image",
    ) -> None:
        """``resolver``/``network_backend`` exist for tests and unusual deployments; the
        backend is always wrapped by the pinning one, so it only ever sees vetted addresses.
        ``noun``: what it fetches, in its errors ("video": a fetcher for videos, whose
        ``limits.max_image_bytes`` is then the video byte limit)."""
        self.limits = limits
        self.noun = noun
        self._resolver: Resolver = resolver if resolver is not None else _system_resolver
        if isinstance(verify, ssl.SSLContext):
            ssl_context = verify
        else:
            ssl_context = httpx.create_ssl_context(verify=verify, trust_env=False)
        pool_limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(16, max_connections))
        self._client = httpx.AsyncClient(
            transport=_PinnedTransport(ssl_context=ssl_context, limits=pool_limits, network_backend=network_backend),
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(limits.fetch_timeout_s),
            # An empty allowed_domains list blocks every cookie, both storing and sending.
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            headers={
                "User-Agent": _USER_AGENT,
                "Accept": f"{noun}/*,*/*;q=0.5",
                # Images are already compressed; refusing gzip also avoids decompression bombs
                # in the transfer encoding.
                "Accept-Encoding": "identity",
            },
        )

    async def __aenter__(self) -> ImageFetcher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str) -> bytes:
        """Download ``url`` (http/https) under the SSRF guard; return the body bytes.

        Raises :class:`InvalidRequest` / :class:`UnsupportedContent` (bad URL or scheme),
        :class:`URLNotAllowed` (non-public target), :class:`PayloadTooLarge`,
        :class:`FetchFailed` (DNS, connect, HTTP error status, too many redirects) or
        :class:`FetchTimeout` (the overall deadline passed).
        """
        host = "?"
        try:
            host = httpx.URL(url).host or "?"
        except Exception:  # noqa: BLE001 - reported properly by _vet below
            pass
        try:
            async with asyncio.timeout(self.limits.fetch_timeout_s):
                return await self._fetch(url)
        except TimeoutError:
            raise FetchTimeout(
                f"fetching {self.noun} from {host} timed out after {self.limits.fetch_timeout_s:g}s"
            ) from None

    async def _vet(self, url: str) -> _Target:
        """Parse and check one hop; resolve its host and vet every address. No connections."""
        if len(url) > MAX_URL_CHARS:
            raise InvalidRequest(f"{self.noun} URL is longer than {MAX_URL_CHARS} characters")
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError) as exc:
            raise InvalidRequest(f"invalid {self.noun} URL: {_short(exc)}") from None
        scheme = parsed.scheme.lower()
        if scheme not in {s.lower() for s in self.limits.allowed_schemes}:
            raise UnsupportedContent(
                f"unsupported {self.noun} URL scheme {scheme or '(none)'!r}; "
                f"use {' or '.join(self.limits.allowed_schemes)} or a data: URL"
            )
        if parsed.userinfo:
            raise InvalidRequest(f"{self.noun} URLs must not contain credentials (user:password@)")
        host = parsed.raw_host.decode("ascii")
        if not host:
            raise InvalidRequest(f"{self.noun} URL has no host")
        port = parsed.port or _DEFAULT_PORTS[scheme]

        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            resolved: Sequence[str] = [host]
        else:
            try:
                resolved = await self._resolver(host, port)
            except socket.gaierror as exc:
                if exc.errno in _NO_SUCH_HOST:  # the name does not exist: the client's URL is wrong
                    raise ImageURLUnavailable(
                        f"{self.noun} URL {shown_url(parsed)}: host {host!r} does not resolve ({_short(exc)})"
                    ) from None
                raise FetchFailed(f"could not resolve {self.noun} URL host {host!r}: {_short(exc)}") from None
            except (OSError, UnicodeError) as exc:
                raise FetchFailed(f"could not resolve {self.noun} URL host {host!r}: {_short(exc)}") from None
        if not resolved:
            raise ImageURLUnavailable(f"{self.noun} URL {shown_url(parsed)}: host {host!r} resolves to no address")

        vetted: list[str] = []
        for address in resolved:
            try:
                ip = check_address(address, self.limits, host=host)
            except ValueError:
                raise FetchFailed(f"resolver returned a malformed address for {host!r}") from None
            text = str(ip)
            if text not in vetted:
                vetted.append(text)
        return _Target(url=parsed, host=host, port=port, addresses=tuple(vetted))

    async def _fetch(self, url: str) -> bytes:
        current = url
        for hop in range(self.limits.max_redirects + 1):
            target = await self._vet(current)
            outcome = await self._request(target)
            if isinstance(outcome, bytes):
                return outcome
            logger.debug("image fetch: %s redirected (hop %d)", target.host, hop + 1)
            current = outcome
        raise FetchFailed(
            f"fetching {self.noun} failed: more than {self.limits.max_redirects} redirects "
            f"(last host {httpx.URL(current).host!r})"
        )

    async def _request(self, target: _Target) -> bytes | str:
        """One GET to a vetted target. Returns the body, or the next URL for a redirect."""
        host = target.host
        token = _PIN.set(_Pin(host=host, addresses=target.addresses))
        try:
            request = self._client.build_request("GET", target.url)
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TimeoutException:
                raise FetchTimeout(f"fetching {self.noun} from {host} timed out") from None
            except httpx.InvalidURL as exc:  # (not an HTTPError) httpx parses a redirect's Location eagerly
                raise UnsupportedContent(
                    f"{self.noun} URL host {host} redirected to a URL that is not fetched (only http(s) redirects are "
                    f"followed): {_short(exc)}"
                ) from None
            except httpx.HTTPError as exc:
                raise FetchFailed(
                    f"fetching {self.noun} from {host} failed: {type(exc).__name__}: {_short(exc)}"
                ) from None
            try:
                status = response.status_code
                if status in _REDIRECT_STATUSES:
                    location = response.headers.get("location")
                    if not location:
                        raise FetchFailed(f"fetching {self.noun} from {host} failed: HTTP {status} without Location")
                    try:
                        return str(target.url.join(location))
                    except (httpx.InvalidURL, ValueError) as exc:
                        raise FetchFailed(
                            f"{self.noun} URL host {host} redirected to an invalid URL: {_short(exc)}"
                        ) from None
                if not 200 <= status < 300:
                    reason = response.reason_phrase or ""
                    if 400 <= status < 500:  # the URL is wrong (or not the client's to read): not worth a retry
                        raise ImageURLUnavailable(
                            f"{self.noun} URL {shown_url(target.url)} answered HTTP {status} {reason}".rstrip()
                        )
                    raise FetchFailed(f"fetching {self.noun} from {host} failed: HTTP {status} {reason}".rstrip())
                body = await self._read_body(response, host)
                logger.debug("image fetch: %d bytes from %s", len(body), host)
                return body
            finally:
                await response.aclose()
        finally:
            _PIN.reset(token)

    async def _read_body(self, response: httpx.Response, host: str) -> bytes:
        cap = self.limits.max_image_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise PayloadTooLarge(f"{self.noun} at {host} is {int(declared)} bytes, over the limit of {cap} bytes")
        body = bytearray()
        try:
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > cap:
                    raise PayloadTooLarge(f"{self.noun} at {host} is over the limit of {cap} bytes")
        except httpx.TimeoutException:
            raise FetchTimeout(f"fetching {self.noun} from {host} timed out reading the body") from None
        except httpx.HTTPError as exc:
            raise FetchFailed(
                f"fetching {self.noun} from {host} failed while reading the body: {type(exc).__name__}: {_short(exc)}"
            ) from None
        return bytes(body)


# ------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------
async def load_image(
    url: str,
    fetcher: ImageFetcher,
    limits: MediaLimits | None = None,
    *,
    budget: DecodeBudget | None = None,
) -> LoadedImage:
    """Load an ``image_url`` (``data:`` or ``http(s):``) into a validated :class:`LoadedImage`.

    ``limits`` (default: the fetcher's) bounds data URLs and decoding; the network side always
    uses ``fetcher.limits``. The header is read first, so an image declaring too many pixels is
    refused before any decode. Decoding runs in a worker thread (CPU work that would otherwise
    stall the event loop), after ``budget`` (if given) grants the image's pixels.
    """
    limits = limits if limits is not None else fetcher.limits
    if not isinstance(url, str) or not url:
        raise InvalidRequest("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = parse_data_url(url, limits)
    elif scheme in FETCHED_SCHEMES:
        data = await fetcher.fetch(url)
    else:
        raise UnsupportedContent(f"unsupported image URL scheme {scheme or '(none)'!r}; use http(s) or a data: URL")
    width, height = await asyncio.to_thread(image_size, data, limits)
    if budget is None:
        return await asyncio.to_thread(_load_decoded, data, limits, width * height)
    return await budget.run(width * height, _load_decoded, data, limits, width * height)


def _load_decoded(data: bytes, limits: MediaLimits, pixels: int) -> LoadedImage:
    try:
        return LoadedImage.from_bytes(data, limits)
    finally:
        release_freed_memory(pixels)


async def load_video_url(
    url: str,
    fetcher: ImageFetcher,
    *,
    sampler: VideoSampler,
    sampling: VideoSampling,
    limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    budget: DecodeBudget | None = None,
) -> SampledVideo:
    """Load a ``video_url`` (``data:video/...`` or ``http(s):``, fetched by ``fetcher``: an
    :class:`ImageFetcher` built for videos, its byte limit the video's) and sample it
    (:func:`shared.video.load_video`), in a worker thread after ``budget`` (if given) grants the
    frames' pixels (the header is read first: the claim is what decoding will hold)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("video_url.url must be a non-empty string", param="messages")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = parse_data_url(url, MediaLimits(max_image_bytes=limits.max_video_bytes), kind="video")
    elif scheme in FETCHED_SCHEMES:
        data = await fetcher.fetch(url)
    else:
        raise UnsupportedContent(f"unsupported video URL scheme {scheme or '(none)'!r}; use http(s) or a data: URL")
    info = await asyncio.to_thread(probe, data, limits)
    check_sampling(sampler, sampling)
    pixels = min(len(frame_indices(info, sampler, sampling)), limits.max_sampled_frames) * info.width * info.height
    if budget is None:
        return await asyncio.to_thread(load_video, data, sampler, sampling, limits)
    return await budget.run(pixels, load_video, data, sampler, sampling, limits)
