"""``LeanClient`` over HTTPS (the benchmarks' ``--tls``, issue 45): its URL and context handling, and
a streamed response from a TLS server verified against the bench's throwaway CA (``make_certs``);
with the system CAs instead the same server is refused (the negative control)."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from shared.tools.bench.lean_http import LeanClient
from shared.tools.certs import make_certs


def test_the_url_picks_plaintext_or_tls_and_a_context_goes_with_https_only():
    assert LeanClient("http://127.0.0.1:8000").ssl is None
    default = LeanClient("https://127.0.0.1:8000").ssl
    assert isinstance(default, ssl.SSLContext) and default.verify_mode == ssl.CERT_REQUIRED
    own = ssl.create_default_context()
    assert LeanClient("https://localhost:8443", ssl_context=own).ssl is own
    with pytest.raises(ValueError, match="for an https:// URL"):
        LeanClient("http://127.0.0.1:8000", ssl_context=own)
    for bad in ("ftp://127.0.0.1:21", "https://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ValueError, match="needs an http://host:port or https://host:port URL"):
            LeanClient(bad)


def test_a_streamed_response_over_tls_verified_against_the_ca_and_refused_without_it(tmp_path):
    certs = make_certs(tmp_path / "tls", days=1)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(*(str(f) for f in certs.servers["api"]))
    chunk = b"data: one\n\ndata: [DONE]\n\n"
    response = b"HTTP/1.1 200 OK\r\nx-request-id: r1\r\nTransfer-Encoding: chunked\r\n\r\n"
    response += b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one response per request
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))[15:])
                await reader.readexactly(length)
                writer.write(response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()

    async def main() -> tuple[list[str], bool, BaseException | None]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        lean = LeanClient(url, ssl_context=ssl.create_default_context(cafile=str(certs.ca_cert)))
        lines: list[str] = []
        first = await lean.post("/v1/chat/completions", {"n": 1}, lines.append)
        connection = lean._writer
        await lean.post("/v1/chat/completions", {"n": 2}, lines.append)
        reused = first.status == 200 and lean._writer is connection
        await lean.aclose()
        refused: BaseException | None = None
        try:
            await LeanClient(url).post("/v1/chat/completions", {"n": 3}, lines.append)  # the system CAs
        except ssl.SSLCertVerificationError as exc:
            refused = exc
        server.close()
        await server.wait_closed()
        return lines, reused, refused

    lines, reused, refused = asyncio.run(main())
    assert [x for x in lines if x] == ["data: one", "data: [DONE]"] * 2
    assert reused
    assert refused is not None and "certificate verify failed" in str(refused)
