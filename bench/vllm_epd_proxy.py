"""vLLM's disaggregated-encoder proxy (E + PD), reimplemented for P10 (``bench/p10_vllm_proxy_burst.py``).

vLLM ships its E|PD proxy as an example in its repository
(``examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py``), not in the ``vllm`` wheel, and
nothing can be downloaded on the bench machines; this file is a reimplementation of that example's routing,
written from its source (read at vLLM commit 7e4cd77), with the same libraries (FastAPI served by uvicorn on
uvloop, one aiohttp session with an unlimited connection pool) and the same command line
(``--encode-servers-urls``, ``--prefill-servers-urls disable``, ``--decode-servers-urls``). Per
``POST /v1/chat/completions``:

1. every multimodal item of the request (``image_url``, ``audio_url``, ``input_audio`` parts of any message)
   becomes its own encoder request: the model, one user message holding only that item (all text removed),
   ``max_tokens: 1``, not streamed, header ``x-request-id: <parent>:<index>:<random>``; the items go
   round-robin over the encoder servers, all at once;
2. the proxy waits for all of them; any failure fails the request (502, or the encoder's status);
3. the original request, unchanged, goes to a PD server (chosen at random), and its response is streamed
   back in 1 KiB chunks (or returned whole when not streamed). The PD server therefore processes the images
   again (vLLM's image processor) and takes the features its ``ECExampleConnector`` finds in the shared
   folder under each image's content hash.

Differences, none of them on the request path's work: the encoder responses are read and released (the
example leaves them to the garbage collector); the PD server's chunks are passed on as bytes (the example
decodes each to str first); the E -> P -> D branch (``--prefill-servers-urls`` with
URLs) and the profiler routes are left out; ``GET /bench/timings`` (an addition) returns and clears, per
request id, when the proxy received the request, when all its encoder requests had answered, when the PD
server's first chunk and last chunk arrived (``time.perf_counter`` seconds), so the bench can say where
a burst's time went. Logging as the example's: one line per request in, per encoder round, per answer.

Run: ``python bench/vllm_epd_proxy.py --port 8000 --encode-servers-urls http://127.0.0.1:8001
--prefill-servers-urls disable --decode-servers-urls http://127.0.0.1:8002``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

log = logging.getLogger("proxy")

MM_TYPES = {"image_url", "audio_url", "input_audio"}

app = FastAPI()
state: dict[str, Any] = {"session": None, "e_urls": [], "d_urls": [], "timings": {}}


def mm_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every image / audio part of every message, in order."""
    return [
        part
        for msg in body.get("messages", [])
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if isinstance(part, dict) and part.get("type") in MM_TYPES
    ]


async def encode_items(body: dict[str, Any], req_id: str) -> None:
    """Step 1-2: one text-free ``max_tokens: 1`` request per item to the encoders, all at once; raise
    an HTTPException when any of them fails."""
    items = mm_items(body)
    if not items:
        return
    session: aiohttp.ClientSession = state["session"]
    e_urls: list[str] = state["e_urls"]
    log.info("[%s] %d multimodal items to encode", req_id, len(items))

    async def one(i: int, item: dict[str, Any]) -> tuple[int, str]:
        sub = {
            "model": body.get("model"),
            "messages": [{"role": "user", "content": [item]}],
            "max_tokens": 1,
            "stream": False,
        }
        headers = {"x-request-id": f"{req_id}:{i}:{uuid.uuid4().hex[:6]}"}
        async with session.post(f"{e_urls[i % len(e_urls)]}/v1/chat/completions", json=sub, headers=headers) as r:
            return r.status, (await r.text() if r.status != 200 else "")

    results = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)), return_exceptions=True)
    for i, res in enumerate(results):
        if isinstance(res, BaseException):
            log.error("[%s] encoder request %d raised %r", req_id, i, res)
            raise HTTPException(status_code=502, detail=f"Encoder request failed: {res}")
        status, text = res
        if status != 200:
            log.error("[%s] encoder request %d answered %d: %s", req_id, i, status, text[:200])
            raise HTTPException(status_code=status, detail=f"Encoder request failed: {text}")
    log.info("[%s] all %d encoder requests done", req_id, len(items))


def _mark(req_id: str, key: str) -> None:
    state["timings"].setdefault(req_id, {})[key] = time.perf_counter()


async def forward_stream(body: dict[str, Any], req_id: str, d_url: str) -> AsyncIterator[bytes]:
    await encode_items(body, req_id)
    _mark(req_id, "encoded")
    session: aiohttp.ClientSession = state["session"]
    log.info("[%s] streaming from PD %s", req_id, d_url)
    first = True
    async with session.post(f"{d_url}/v1/chat/completions", json=body, headers={"x-request-id": req_id}) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_chunked(1024):
            if chunk:
                if first:
                    _mark(req_id, "first_chunk")
                    first = False
                yield chunk
    _mark(req_id, "done")
    log.info("[%s] stream done", req_id)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    body = await request.json()
    req_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    _mark(req_id, "received")
    log.info(">>> [%s] POST /v1/chat/completions", req_id)
    d_url = random.choice(state["d_urls"])
    if body.get("stream", False):
        return StreamingResponse(forward_stream(body, req_id, d_url), media_type="text/event-stream")
    await encode_items(body, req_id)
    _mark(req_id, "encoded")
    session: aiohttp.ClientSession = state["session"]
    async with session.post(f"{d_url}/v1/chat/completions", json=body, headers={"x-request-id": req_id}) as resp:
        resp.raise_for_status()
        out = await resp.json()
    _mark(req_id, "done")
    return JSONResponse(content=out)


@app.get("/v1/models")
async def models() -> Any:
    async with state["session"].get(f"{state['d_urls'][0]}/v1/models") as resp:
        resp.raise_for_status()
        return await resp.json()


@app.get("/health")
async def health() -> JSONResponse:
    async def healthy(urls: list[str]) -> bool:
        for u in urls:
            try:
                async with state["session"].get(f"{u}/health") as resp:
                    resp.raise_for_status()
            except (aiohttp.ClientError, TimeoutError):
                return False
        return True

    e_ok, d_ok = await asyncio.gather(healthy(state["e_urls"]), healthy(state["d_urls"]))
    return JSONResponse({"encode": e_ok, "decode": d_ok}, status_code=200 if e_ok and d_ok else 503)


@app.get("/bench/timings")
async def timings() -> dict[str, Any]:
    out, state["timings"] = state["timings"], {}
    return out


@app.on_event("startup")
async def _startup() -> None:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    state["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=100_000), connector=connector)


@app.on_event("shutdown")
async def _shutdown() -> None:
    if state["session"] is not None:
        await state["session"].close()


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--encode-servers-urls", required=True, help="comma-separated encoder base URLs")
    parser.add_argument("--prefill-servers-urls", default="disable", help="only 'disable' (E + PD) here")
    parser.add_argument("--decode-servers-urls", required=True, help="comma-separated PD base URLs")
    args = parser.parse_args()
    if args.prefill_servers_urls.lower() not in ("disable", "none", ""):
        parser.error("this reimplementation routes E + PD only: --prefill-servers-urls disable")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s: %(message)s")
    state["e_urls"] = _urls(args.encode_servers_urls)
    state["d_urls"] = _urls(args.decode_servers_urls)
    log.info("proxy on %s:%s; encoders %s; PD %s", args.host, args.port, state["e_urls"], state["d_urls"])
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", loop="uvloop", access_log=True)


if __name__ == "__main__":
    main()
