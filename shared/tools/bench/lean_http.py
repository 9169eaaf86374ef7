"""A minimal HTTP/1.1 client for latency measurements (``bench/p5_fabric_overhead.py``).

One keep-alive connection, the request in one write, a chunked (streamed) response read line by
line as it arrives, nothing else: no redirects, proxies, compression or pooling. httpx, the other
benches' client, spends ~1.3 ms of Python on each streamed request on a 2-core machine of ours (its
request building and response parsing; a ``GET /v1/models`` through it takes ~0.7 ms); this one
~0.1 ms, so what a benchmark times is the server's work, not the client's. An ``https://`` URL is
TLS, the server verified against ``ssl_context`` (default: the system CAs; the benchmarks' ``--tls``
give their throwaway CA's).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Bounds on what the server may send: a status or header line, the headers, a body.
MAX_LINE = 64 * 1024
MAX_HEADERS = 100
MAX_BODY = 16 * 1024 * 1024


@dataclass
class LeanResponse:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    #: the body of a response that was not streamed (chunked responses go to ``on_line``)
    body: bytes = b""


class LeanClient:
    """POSTs JSON to one ``http://host:port`` (or ``https://host:port``) server over one connection
    (opened on first use, again after a failure). Not for concurrent use: one request at a time.

    ``ssl_context``: what an ``https://`` server is verified with (default: the system CAs); it
    is refused with an ``http://`` URL (a plaintext connection would not use it)."""

    def __init__(self, url: str, timeout: float = 60.0, *, ssl_context: ssl.SSLContext | None = None):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or parsed.hostname is None or parsed.port is None:
            raise ValueError(f"LeanClient needs an http://host:port or https://host:port URL, got {url!r}")
        if ssl_context is not None and parsed.scheme != "https":
            raise ValueError(f"an ssl_context is for an https:// URL, got {url!r}")
        self.host, self.port, self.timeout = parsed.hostname, parsed.port, timeout
        #: None: plaintext
        self.ssl: ssl.SSLContext | None = (
            (ssl_context or ssl.create_default_context()) if parsed.scheme == "https" else None
        )
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any], on_line: Callable[[str], None]) -> LeanResponse:
        """POST ``body`` as JSON to ``path``. A streamed (chunked) response's body goes to
        ``on_line`` one line at a time (without its line end) as it arrives; any other response's
        body is returned. Raises OSError, TimeoutError, ValueError (a malformed or oversized
        response) or ``asyncio.IncompleteReadError`` (the server closed the connection); the
        connection is dropped then."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._exchange(path, json.dumps(body).encode(), on_line)
        except asyncio.LimitOverrunError as exc:
            await self.aclose()
            raise ValueError(f"a line of the response is over {MAX_LINE} bytes") from exc
        except BaseException:
            await self.aclose()  # (its state is unknown: a new one next time)
            raise

    async def _exchange(self, path: str, data: bytes, on_line: Callable[[str], None]) -> LeanResponse:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, limit=MAX_LINE, ssl=self.ssl
            )
        reader = self._reader
        assert reader is not None
        self._writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.port, len(data), data)
        )
        status_line = (await reader.readuntil(b"\r\n")).decode("latin-1").split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {status_line!r}")
        response = LeanResponse(status=int(status_line[1]))
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            if len(response.headers) >= MAX_HEADERS:
                raise ValueError(f"over {MAX_HEADERS} response headers")
            key, _, value = line.decode("latin-1").partition(":")
            response.headers[key.strip().lower()] = value.strip()
        if response.headers.get("transfer-encoding") == "chunked":
            pending = b""
            while size := int(await reader.readuntil(b"\r\n"), 16):
                if size > MAX_BODY:
                    raise ValueError(f"a chunk of {size} bytes is over {MAX_BODY}")
                pending += (await reader.readexactly(size + 2))[:-2]
                *lines, pending = pending.split(b"\n")
                if len(pending) > MAX_LINE:
                    raise ValueError(f"a line of the streamed body is over {MAX_LINE} bytes")
                for line in lines:
                    on_line(line.decode().removesuffix("\r"))
            await reader.readuntil(b"\r\n")  # the end of the last chunk: ready for the next request
            if pending:
                on_line(pending.decode())
        else:
            length = int(response.headers.get("content-length", "0"))
            if length > MAX_BODY:
                raise ValueError(f"a response body of {length} bytes is over {MAX_BODY}")
            response.body = await reader.readexactly(length)
        if response.headers.get("connection", "").lower() == "close":
            await self.aclose()
        return response

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = self._reader = None
