"""Images: the intake types and limits, data URLs, bounded decoding and content hashing.

All without torch and without an HTTP client (a worker that decodes imports this and nothing that
fetches: fetching is :mod:`shared.fetch`, the process-wide decode budget :mod:`shared.decode_budget`):

* **Decoding** (:func:`decode_image`): Pillow with a format allowlist, a pixel-count check on the
  header *before* any pixel buffer is allocated (decompression bombs), ``verify()``, then a full
  decode of the first frame and a conversion to RGB (alpha is composited onto white). The content
  hash is taken over the decoded RGB pixels, so the same picture hashes alike in any container.
  Conversion and hashing go a strip of rows at a time (:func:`hash_image` never builds the RGB
  image).
* **Data URLs** (:func:`parse_data_url`): ``data:image/...;base64,...`` (and ``data:video/...``)
  with the size bound checked on the encoded length before anything is decoded.
* **Limits** (:class:`MediaLimits`): the bounds of image intake, the fetcher's included.

Errors are the typed ones from :mod:`shared.errors`, with a readable message and never a stack trace.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import io
import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from shared.errors import (
    EPDError,
    InvalidImage,
    InvalidRequest,
    PayloadTooLarge,
    UnsupportedContent,
)

HASH_SCHEMA = b"epd-img-v1"
#: Pillow openers that may even try to parse the bytes. Deliberately short: every extra plugin is
#: attack surface (EPS would shell out to Ghostscript, TIFF drags in libtiff). Many phone-camera
#: JPEGs come back with format "MPO": Pillow reaches those through the JPEG opener.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Formats Pillow reports that have no opener of their own, and the opener that produces them.
_OPENER_OF_FORMAT = {"MPO": "JPEG"}
#: The URL schemes a fetcher knows (``MediaLimits.allowed_schemes`` is a subset).
FETCHED_SCHEMES = frozenset({"http", "https"})


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
        bad = {s.lower() for s in self.allowed_schemes} - FETCHED_SCHEMES
        if bad:
            raise ValueError(f"allowed_schemes may only contain http/https, got {sorted(bad)}")
        _parse_networks(self.allowed_networks)  # raises ValueError on a bad CIDR
        Image.init()
        unknown = [f for f in self.allowed_formats if f not in Image.OPEN]
        if unknown or not self.allowed_formats:
            raise ValueError(f"allowed_formats must be Pillow opener names; unknown: {unknown}")

    def networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """``allowed_networks``, parsed."""
        return _parse_networks(self.allowed_networks)

    def allows_host(self, host: str) -> bool:
        """``host`` is one of ``allowed_hosts`` (case-insensitive, a trailing dot aside)."""
        return _normalize_host_name(host) in _normalized_hosts(self.allowed_hosts)


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
