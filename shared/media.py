"""Image intake for ``image_url`` content parts: data URLs, guarded HTTP(S) fetching, decoding.

Three concerns live here, all without torch:

* **Decoding** (:func:`decode_image`): Pillow with a format allowlist, a pixel-count check on the
  header *before* any pixel buffer is allocated (decompression bombs), ``verify()``, then a full
  decode of the first frame and a conversion to RGB (alpha is composited onto white). The content
  hash is taken over the decoded RGB pixels, so the same picture hashes alike in any container.
  Conversion and hashing go a strip of rows at a time (:func:`hash_image` never builds the RGB
  image), and a :class:`DecodeBudget` bounds the pixels a process decodes at once.
* **Data URLs** (:func:`parse_data_url`): ``data:image/...;base64,...`` with the size bound checked
  on the encoded length before anything is decoded.
* **Fetching** (:class:`ImageFetcher`): an SSRF-guarded HTTP(S) client. Every hop (the first URL
  and each redirect) is parsed, its host resolved once, and *every* resolved address vetted; the
  TCP connection then goes to one of exactly those vetted addresses (see
  :class:`_PinnedNetworkBackend`), so a DNS answer that changes between the check and the connect
  (DNS rebinding) cannot redirect the request. Redirects are followed by hand, bodies are streamed
  with a byte cap, and one overall deadline bounds DNS + connect + redirects + body.

Errors are the typed ones from :mod:`shared.errors`; messages name the host and what happened,
never the full URL (query strings often carry signed tokens) and never a stack trace.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import contextvars
import ctypes
import ctypes.util
import functools
import hashlib
import io
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, TypeVar

import httpcore
import httpx
from PIL import Image, UnidentifiedImageError

from shared.errors import (
    EPDError,
    FetchFailed,
    FetchTimeout,
    ImageURLUnavailable,
    InvalidImage,
    InvalidRequest,
    PayloadTooLarge,
    UnsupportedContent,
    URLNotAllowed,
)

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``async resolver(host, port) -> addresses`` (IP literals as strings, in preference order).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
T = TypeVar("T")

HASH_SCHEMA = b"epd-img-v1"
#: Pillow openers that may even try to parse the bytes. Deliberately short: every extra plugin is
#: attack surface (EPS would shell out to Ghostscript, TIFF drags in libtiff). Many phone-camera
#: JPEGs come back with format "MPO": Pillow reaches those through the JPEG opener.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Formats Pillow reports that have no opener of their own, and the opener that produces them.
_OPENER_OF_FORMAT = {"MPO": "JPEG"}
MAX_URL_CHARS = 16 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_KNOWN_SCHEMES = frozenset({"http", "https"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_USER_AGENT = "epd-serve-image-fetcher/1"


# ------------------------------------------------------------------------------------------------
# limits and results
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MediaLimits:
    """Bounds for image intake. Immutable and hashable, so it can key caches.

    ``allowed_networks`` (CIDRs) and ``allowed_hosts`` (exact host names, case-insensitive) punch
    holes in the SSRF guard for deployments that really do serve images from private addresses
    (tests on 127.0.0.1, an in-cluster image store). The unspecified address (``0.0.0.0``, ``::``)
    and multicast stay refused even inside them: neither is a real unicast destination, and
    ``0.0.0.0`` is an alias of the local host on Linux.
    """

    max_image_bytes: int = 20 * 1024 * 1024
    #: Upper bound on width*height, checked from the header before any pixel buffer exists.
    max_pixels: int = 40_000_000
    min_side: int = 1
    #: One deadline for the whole fetch: DNS, connects, every redirect hop and the body.
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    allowed_networks: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    allowed_schemes: tuple[str, ...] = ("http", "https")
    allowed_formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    #: the model family's limit on width:height either way (strictly below; None: none), and the
    #: family, for the message (``shared.families.max_aspect_ratio``)
    max_aspect_ratio: float | None = None
    family: str = ""

    def __post_init__(self) -> None:
        # Fail at configuration time, not on the first request.
        if self.max_image_bytes <= 0 or self.max_pixels <= 0 or self.min_side < 1:
            raise ValueError("max_image_bytes and max_pixels must be > 0 and min_side >= 1")
        if self.fetch_timeout_s <= 0 or self.max_redirects < 0:
            raise ValueError("fetch_timeout_s must be > 0 and max_redirects >= 0")
        bad = {s.lower() for s in self.allowed_schemes} - _KNOWN_SCHEMES
        if bad:
            raise ValueError(f"allowed_schemes may only contain http/https, got {sorted(bad)}")
        _parse_networks(self.allowed_networks)  # raises ValueError on a bad CIDR
        Image.init()
        unknown = [f for f in self.allowed_formats if f not in Image.OPEN]
        if unknown or not self.allowed_formats:
            raise ValueError(f"allowed_formats must be Pillow opener names; unknown: {unknown}")


@functools.lru_cache(maxsize=64)
def _parse_networks(
    cidrs: tuple[str, ...],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(c.strip(), strict=False) for c in cidrs)


@functools.lru_cache(maxsize=64)
def _normalized_hosts(hosts: tuple[str, ...]) -> frozenset[str]:
    return frozenset(_normalize_host_name(h) for h in hosts)


def _normalize_host_name(host: str) -> str:
    return host.strip().lower().rstrip(".")


DEFAULT_LIMITS = MediaLimits()


@dataclass(frozen=True)
class LoadedImage:
    """A validated image: its original encoded bytes plus what decoding them established.

    The decoded pixels are deliberately *not* kept: an in-flight request holds only the encoded
    bytes (typically 10-50x smaller); :meth:`to_rgb` decodes again when pixels are needed.
    """

    data: bytes
    #: sha256 hex of ``b"epd-img-v1|RGB|{w}x{h}|" + rgb_bytes`` (see :func:`decode_image`).
    content_hash: str
    width: int
    height: int
    #: Pillow format name, e.g. "PNG", "JPEG", "MPO", "WEBP", "GIF".
    format: str

    @classmethod
    def from_bytes(cls, data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> LoadedImage:
        """Validate and hash encoded bytes (synchronous; CPU work — use a thread in async code).

        Memory: the decoded image in its own mode plus one strip; no full-size RGB copy is made
        (see :func:`hash_image`)."""
        content_hash, width, height, fmt = hash_image(data, limits)
        return cls(data=bytes(data), content_hash=content_hash, width=width, height=height, format=fmt)

    def to_rgb(self) -> Image.Image:
        """Decode ``data`` again into an RGB image (first frame, alpha composited onto white)."""
        # The bytes were validated when this object was built; bounding the pixel count by the
        # recorded size keeps a tampered-with ``data`` from becoming a bomb.
        limits = MediaLimits(
            max_image_bytes=max(len(self.data), 1),
            max_pixels=max(self.width * self.height, 1),
            allowed_formats=(_OPENER_OF_FORMAT.get(self.format, self.format),),
        )
        rgb, _, _ = decode_image(self.data, limits)
        return rgb


# ------------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------------
#: Pixels per strip when converting and hashing: the RGB bytes of an image exist a strip at a time
#: (~4 MB), never all at once.
_STRIP_PIXELS = 1 << 20


def _check_dimensions(size: tuple[int, int], limits: MediaLimits) -> None:
    width, height = size
    if width < limits.min_side or height < limits.min_side:
        raise InvalidImage(f"image is {width}x{height}; each side must be at least {limits.min_side} pixel(s)")
    if width * height > limits.max_pixels:
        raise InvalidImage(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels} pixels"
        )
    ratio = max(width, height) / min(width, height)
    if limits.max_aspect_ratio is not None and ratio >= limits.max_aspect_ratio:
        raise InvalidImage(
            f"image is {width}x{height}, an aspect ratio of {ratio:.0f}:1; the model's family ({limits.family}) takes"
            f" images below {limits.max_aspect_ratio:.0f}:1"
        )


def _check_size(data: bytes, limits: MediaLimits) -> None:
    if not data:
        raise InvalidImage("image data is empty")
    if len(data) > limits.max_image_bytes:
        raise PayloadTooLarge(f"image is {len(data)} bytes, over the limit of {limits.max_image_bytes} bytes")


def _open(data: bytes, limits: MediaLimits) -> Image.Image:
    """``Image.open`` restricted to the allowed formats; reads the header only."""
    return Image.open(io.BytesIO(data), formats=list(limits.allowed_formats))


@contextlib.contextmanager
def _image_errors(limits: MediaLimits) -> Iterator[None]:
    """Turn whatever Pillow raises for bad input into an :class:`InvalidImage`."""
    try:
        yield
    except EPDError:
        raise
    except MemoryError:
        raise
    except Image.DecompressionBombError as exc:
        # Pillow's own guard (2x Image.MAX_IMAGE_PIXELS) fired while reading the header.
        raise InvalidImage(f"image dimensions are too large (limit {limits.max_pixels} pixels): {exc}") from None
    except UnidentifiedImageError:
        raise InvalidImage(
            f"data is not a recognised image (supported formats: {', '.join(limits.allowed_formats)})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError,
        # struct.error, EOFError, ... for corrupt input; all of them mean "bad image".
        raise InvalidImage(f"image is corrupt or truncated ({type(exc).__name__}: {exc})") from None


def image_size(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """``(width, height)`` from the header alone, after the byte and pixel bounds: cheap, no pixel
    buffer. An image declaring more than ``limits.max_pixels`` is refused here, before any decode."""
    _check_size(data, limits)
    with _image_errors(limits), _open(data, limits) as probe:
        _check_dimensions(probe.size, limits)
        return probe.size


def _decode(data: bytes, limits: MediaLimits) -> tuple[Image.Image, str]:
    """The checks of :func:`decode_image` and the decoded first frame in its own mode."""
    _check_size(data, limits)
    with _image_errors(limits):
        with _open(data, limits) as probe:
            fmt = probe.format or "unknown"
            _check_dimensions(probe.size, limits)
            probe.verify()
        # verify() leaves the image unusable; decode from a fresh parser. No ``with``: the
        # image outlives this block, and its file is a BytesIO that needs no closing.
        im = _open(data, limits)
        _check_dimensions(im.size, limits)
        im.seek(0)  # animated GIF/PNG/WebP: the first frame
        im.load()
    return im, fmt


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert any decoded mode to RGB; transparent pixels become white, not their hidden RGB."""
    mode = im.mode
    if mode.startswith("I;16"):
        # 16-bit grayscale: a plain convert("RGB") clips at 255 (nearly all white), so scale.
        im = im.convert("I").point(lambda v: v * (1 / 257)).convert("L")
        mode = "L"
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
    if has_alpha:
        rgba = im.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return im if mode == "RGB" else im.convert("RGB")


def _is_plain_rgb(im: Image.Image) -> bool:
    """``_to_rgb(im)`` is ``im`` itself."""
    return im.mode == "RGB" and "transparency" not in im.info


def _strips(im: Image.Image) -> Iterator[tuple[int, Image.Image]]:
    """``(top, strip)`` for consecutive full-width strips of ``im`` (crops, ~4 MB as RGB)."""
    width, height = im.size
    rows = max(1, _STRIP_PIXELS // width)
    for top in range(0, height, rows):
        yield top, im.crop((0, top, width, min(height, top + rows)))


def _rgb_strips(im: Image.Image) -> Iterator[tuple[int, Image.Image]]:
    """The strips of ``im`` converted by :func:`_to_rgb`. Every step of that conversion works
    pixel by pixel, so they are exactly the rows of ``_to_rgb(im)``, without its intermediates
    (an RGBA image would need three more full-size images)."""
    for top, strip in _strips(im):
        yield top, _to_rgb(strip)


def _hash_strips(size: tuple[int, int], strips: Iterable[tuple[int, Image.Image]]) -> str:
    digest = hashlib.sha256()
    digest.update(b"%s|RGB|%dx%d|" % (HASH_SCHEMA, size[0], size[1]))
    for _, strip in strips:
        digest.update(strip.tobytes())
    return digest.hexdigest()


def content_hash_of(rgb: Image.Image) -> str:
    """The content hash of an RGB image: same pixels -> same hash, whatever the container.

    ``sha256(b"epd-img-v1|RGB|{w}x{h}|" + rgb.tobytes())``, fed a strip of rows at a time."""
    if rgb.mode != "RGB":
        raise ValueError(f"content_hash_of needs an RGB image, got mode {rgb.mode}")
    return _hash_strips(rgb.size, _strips(rgb))


def hash_image(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[str, int, int, str]:
    """Validate encoded bytes as :func:`decode_image` does; return ``(content_hash, width, height,
    format)`` without building the RGB image: the decoded frame is converted and hashed a strip
    at a time, so memory peaks at the decoded frame (its own mode) plus one strip."""
    im, fmt = _decode(data, limits)
    with _image_errors(limits):
        return _hash_strips(im.size, _rgb_strips(im)), im.width, im.height, fmt


def decode_image(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[Image.Image, str, str]:
    """Validate and decode encoded image bytes.

    Returns ``(rgb_image, content_hash, format)``. Steps: size bound on the bytes; ``Image.open``
    restricted to ``limits.allowed_formats`` (header only); width/height checked against
    ``min_side``/``max_pixels`` before anything is decoded; ``verify()`` (PNG chunk CRCs etc.);
    reopen, decode the first frame of animated images, convert to RGB compositing alpha onto
    white (a strip at a time: no full-size intermediates, and an RGB frame is returned as is). Raises
    :class:`InvalidImage` (or :class:`PayloadTooLarge`) with a readable message.
    """
    im, fmt = _decode(data, limits)
    with _image_errors(limits):
        if _is_plain_rgb(im):
            rgb = im
        else:
            rgb = Image.new("RGB", im.size)
            for top, strip in _rgb_strips(im):
                rgb.paste(strip, (0, top))
            del im
    return rgb, content_hash_of(rgb), fmt


# ------------------------------------------------------------------------------------------------
# decode budget
# ------------------------------------------------------------------------------------------------
class DecodeBudget:
    """A bound on the pixels being decoded at once in one process, shared by all its requests.

    A decoded image costs memory in proportion to its pixels (4 bytes each for an RGB frame),
    so bounding the pixels in flight bounds the memory that decoding can take, however many
    images arrive at once. Claims are served in arrival order (a large image is not starved by a
    stream of small ones). A claim larger than the whole budget is cut down to the whole budget:
    such an image decodes alone once everything before it is done, instead of waiting forever.

    Use from one event loop. :meth:`run` holds the claim until the decode *thread* finishes, also
    when the awaiting task is cancelled (a thread cannot be stopped; its memory is still in use).
    """

    def __init__(self, pixels: int) -> None:
        if pixels < 1:
            raise ValueError("the decode budget must be at least 1 pixel")
        self.capacity = pixels
        self._free = pixels
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def in_use(self) -> int:
        """Pixels claimed now."""
        return self.capacity - self._free

    async def acquire(self, pixels: int) -> int:
        """Wait for ``pixels`` (at most the whole budget) to be free and claim them; returns the
        amount claimed, to be given to :meth:`release`."""
        claim = min(max(pixels, 1), self.capacity)
        if not self._waiters and self._free >= claim:
            self._free -= claim
            return claim
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (claim, granted)
        self._waiters.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(claim)  # granted, then cancelled before it could run
            else:
                self._waiters.remove(entry)
                self._grant()  # it may have been the head blocking smaller claims
            raise
        return claim

    def release(self, claim: int) -> None:
        self._free += claim
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._free >= self._waiters[0][0]:
            claim, granted = self._waiters.popleft()
            self._free -= claim
            granted.set_result(None)

    async def run(self, pixels: int, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` in a worker thread (with this context's variables) once ``pixels`` are
        claimed; the claim is released when the thread finishes."""
        claim = await self.acquire(pixels)
        loop = asyncio.get_running_loop()
        try:
            done = loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, fn, *args))
        except BaseException:
            self.release(claim)
            raise
        done.add_done_callback(lambda _: self.release(claim))
        # shield: cancelling the caller must not mark the decode done while its thread still runs.
        return await asyncio.shield(done)


def _release_freed_memory() -> None:
    """Hand memory freed by a large decode back to the OS (glibc only; a no-op elsewhere).

    Pillow allocates a large image in 16 MB blocks; once glibc's dynamic mmap threshold has grown
    past that, the blocks come from malloc arenas, and freeing them leaves the pages in the
    process (measured: ~770 MB kept after eight 36-Mpx decodes). ``malloc_trim(0)`` returns the
    free pages of every arena."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()
#: Images of at least this many pixels trim the allocator after they are hashed.
_TRIM_AFTER_PIXELS = 4_000_000


def _load_decoded(data: bytes, limits: MediaLimits, pixels: int) -> LoadedImage:
    try:
        return LoadedImage.from_bytes(data, limits)
    finally:
        if pixels >= _TRIM_AFTER_PIXELS:
            _release_freed_memory()


# ------------------------------------------------------------------------------------------------
# data URLs
# ------------------------------------------------------------------------------------------------
_B64_WHITESPACE = str.maketrans("", "", " \t\r\n\f\v")
_B64_URLSAFE = str.maketrans("-_", "+/")


def parse_data_url(url: str, limits: MediaLimits = DEFAULT_LIMITS, *, kind: str = "image") -> bytes:
    """Decode ``data:image/<subtype>[;param=value]*;base64,<payload>`` into bytes.

    Only base64 image payloads are accepted. Whitespace inside the payload, missing ``=``
    padding and the URL-safe alphabet are tolerated (clients differ); anything else that is not
    base64 is an :class:`InvalidRequest`. The size bound is checked on the encoded length before
    decoding, so an oversized payload costs no decode work (:class:`PayloadTooLarge`).
    """
    if not url[:5].lower() == "data:":
        raise InvalidRequest("not a data: URL")
    # Cheap bound before any copy of the string: base64 is 4/3 of the bytes; allow 10% for
    # line breaks plus a generous header. The exact check on the payload follows.
    if len(url) > limits.max_image_bytes * 4 // 3 * 11 // 10 + 4096:
        raise PayloadTooLarge(
            f"data URL is {len(url)} characters, too long for the {kind} limit of {limits.max_image_bytes} bytes"
        )
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise InvalidRequest("malformed data URL: missing ',' between the media type and data")
    params = [p.strip() for p in header.split(";")]
    mime = params[0].lower()
    if not mime.startswith(f"{kind}/") or len(mime) <= len(kind) + 1:
        # RFC 2397: an empty media type means text/plain.
        raise UnsupportedContent(f"data URL media type must be {kind}/*, got {mime or 'text/plain'!r}")
    if "base64" not in (p.lower() for p in params[1:]):
        raise InvalidRequest(f"data URL {kind}s must be base64-encoded (';base64,' is missing)")

    payload = payload.translate(_B64_WHITESPACE)
    if not payload:
        raise InvalidRequest("data URL contains no data")
    padding = len(payload) - len(payload.rstrip("="))
    decoded_len = len(payload) * 3 // 4 - min(padding, 2)
    if decoded_len > limits.max_image_bytes:
        raise PayloadTooLarge(
            f"data URL {kind} is about {decoded_len} bytes, over the limit of {limits.max_image_bytes} bytes"
        )
    if "-" in payload or "_" in payload:
        payload = payload.translate(_B64_URLSAFE)
    if padding == 0 and len(payload) % 4:
        payload += "=" * (-len(payload) % 4)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"invalid base64 in data URL: {exc}") from None
    if not data:
        raise InvalidRequest("data URL contains no data")
    return data


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
    elif host is not None and _normalize_host_name(host) in _normalized_hosts(limits.allowed_hosts):
        allowed = True
    else:
        allowed = any(ip.version == net.version and ip in net for net in _parse_networks(limits.allowed_networks))
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
# entry point
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
    elif scheme in _KNOWN_SCHEMES:
        data = await fetcher.fetch(url)
    else:
        raise UnsupportedContent(f"unsupported image URL scheme {scheme or '(none)'!r}; use http(s) or a data: URL")
    width, height = await asyncio.to_thread(image_size, data, limits)
    if budget is None:
        return await asyncio.to_thread(_load_decoded, data, limits, width * height)
    return await budget.run(width * height, _load_decoded, data, limits, width * height)
