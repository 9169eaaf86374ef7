"""What the routes check of every request: its API key (:class:`ApiKeys`), its body under the
limit (:func:`read_body`), and the bounds a request is held to (:class:`RequestLimits`)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import Request

from shared.errors import PayloadTooLarge, Unauthorized


class ApiKeys:
    """The Bearer keys a request must carry one of (``EPD_API_KEYS``; none: no authentication)."""

    def __init__(self, keys: Sequence[str]):
        self.keys = tuple(keys)

    def check(self, request: Request) -> None:
        if not self.keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.encode(), key.encode()) for key in self.keys
        ):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer <key>)")


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of a request at the API (the API's ``EPD_*`` request settings)."""

    #: request body bytes (``EPD_MAX_BODY_BYTES``: 413 above)
    max_body_bytes: int
    #: a whole request's deadline (``EPD_REQUEST_TIMEOUT_S``)
    request_timeout_s: float
    #: images / videos one request may carry (``EPD_MAX_IMAGES_PER_REQUEST`` / ``EPD_MAX_VIDEOS_PER_REQUEST``)
    max_images: int
    max_videos: int
    #: ``max_tokens`` of a chat request that sets none (``EPD_DEFAULT_MAX_TOKENS``)
    default_max_tokens: int


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes, declared or read."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)
