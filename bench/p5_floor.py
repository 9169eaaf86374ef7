"""P5's floor: the fabric's path with nothing of ours on it, timed like P5 on the same machine.

P5 (``bench/p5_fabric_overhead.py``) times a one-token text request through the stack minus the engine's
compute. This script times the same path built from the same parts and nothing else - what no Python
implementation of our design can go under on this machine:

* client: ``shared.tools.bench.lean_http.LeanClient`` (P5's), one streamed POST at a time;
* API: uvicorn (as ``services/api`` runs it: uvloop, httptools) with a bare ASGI app: read the body,
  subscribe to the request's result subject (core NATS), publish the job to a JetStream stream (file
  storage) and await its ack, then write the SSE response (one data line and ``[DONE]``) in one write
  once the result arrives;
* worker: a durable pull consumer, ``fetch(1)`` as ``shared.worker`` does; a no-op call on a
  one-thread executor (the engine's compute-thread hand-off there and back); the token chunk and the
  result published to a JetStream stream the API's core subscription also hears, the job acked once
  both are stored;
* NATS: ``EmbeddedNats``, as the benches start it.

``--job core`` sends the job as a core NATS message instead (no stream, no at-least-once delivery: what
the job stream costs); ``--no-thread`` leaves out the executor hand-off. Each variant runs in turn
(``--reps`` times, ``--requests`` each after a warm-up) and prints its E2E p50 with the spread over reps.

Run: ``.venv/bin/python bench/p5_floor.py [--reps 3] [--requests 300]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats

from shared.tools.bench.lean_http import LeanClient
from shared.tools.infra import EmbeddedNats, free_port

JOBS, RESULTS = "FLOOR_JOBS", "FLOOR_RESULTS"
DONE = b"data: [DONE]\n\n"


async def api(nats_url: str, port: int, job_via: str) -> None:
    import uvicorn

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    counter = iter(range(1 << 62))

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        rid = f"r{next(counter)}"
        result: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_result(msg) -> None:
            result.put_nowait(msg.data)

        sub = await nc.subscribe(f"floor.out.{rid}", cb=on_result)
        job = json.dumps({"id": rid, "body": json.loads(body)}).encode()
        if job_via == "core":
            await nc.publish(f"floor.core.{rid}", job)
        else:
            await js.publish(f"floor.job.{rid}", job, stream=JOBS)
        token = await result.get()
        final = await result.get()
        await sub.unsubscribe()
        headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", rid.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: " + token + b"\n\ndata: " + final + b"\n\n" + DONE})

    await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).serve()


async def worker(nats_url: str, job_via: str, thread: bool) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    executor = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()

    async def handle(data: bytes) -> None:
        job = json.loads(data)
        if thread:
            await loop.run_in_executor(executor, int)
        out = f"floor.out.{job['id']}"
        chunk = await js.publish_async(out, json.dumps({"token_ids": [1], "text": "a"}).encode())
        final = await js.publish_async(out, json.dumps({"finish_reason": "length"}).encode())
        await chunk
        await final

    if job_via == "core":

        async def on_job(msg) -> None:
            await handle(msg.data)

        await nc.subscribe("floor.core.*", cb=on_job)
        await asyncio.Event().wait()
    psub = await js.pull_subscribe_bind(durable="floor", stream=JOBS)
    while True:
        try:
            msgs = await psub.fetch(1, timeout=1.0)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle(msg.data)
            await msg.ack()


async def setup(nats_url: str) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=JOBS, subjects=["floor.job.>"], storage=StorageType.FILE))
    await js.add_stream(StreamConfig(name=RESULTS, subjects=["floor.out.>"], storage=StorageType.FILE))
    await js.add_consumer(JOBS, ConsumerConfig(durable_name="floor", ack_policy=AckPolicy.EXPLICIT))
    await nc.close()


async def measure(url: str, n: int) -> float:
    client = LeanClient(url)
    try:
        e2e = []
        for i in range(n):
            lines: list[str] = []
            sent = time.perf_counter()
            response = await client.post(
                "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}]}, lines.append
            )
            e2e.append(time.perf_counter() - sent)
            if response.status != 200 or "data: [DONE]" not in lines:
                raise RuntimeError(f"bad response: {response.status} {lines}")
        return statistics.median(e2e) * 1e3
    finally:
        await client.aclose()


async def wait_up(url: str, deadline_s: float = 30.0) -> None:
    until = time.monotonic() + deadline_s
    while True:
        try:
            await measure(url, 1)
            return
        except (OSError, ValueError, asyncio.IncompleteReadError):
            if time.monotonic() > until:
                raise
            await asyncio.sleep(0.1)


VARIANTS = {
    "job stream + thread (P5's path)": ("jetstream", True),
    "job stream, no thread hand-off": ("jetstream", False),
    "core job (no at-least-once) + thread": ("core", True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--role", choices=["api", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--job", default="jetstream", help=argparse.SUPPRESS)
    parser.add_argument("--thread", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "api":
        asyncio.run(api(args.nats, args.port, args.job))
        return
    if args.role == "worker":
        asyncio.run(worker(args.nats, args.job, bool(args.thread)))
        return
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="p5-floor-") as tmp, EmbeddedNats(Path(tmp) / "nats") as server:
        asyncio.run(setup(server.url))
        for rep in range(args.reps):
            for name, (job_via, thread) in VARIANTS.items():
                port = free_port()
                me = [sys.executable, __file__, "--nats", server.url, "--job", job_via]
                procs = [
                    subprocess.Popen([*me, "--role", "api", "--port", str(port)]),
                    subprocess.Popen([*me, "--role", "worker", "--thread", str(int(thread))]),
                ]
                try:
                    url = f"http://127.0.0.1:{port}"
                    asyncio.run(wait_up(url))
                    asyncio.run(measure(url, 20))  # warm-up
                    p50 = asyncio.run(measure(url, args.requests))
                finally:
                    for proc in procs:
                        proc.terminate()
                    for proc in procs:
                        proc.wait(10)
                results[name].append(p50)
                print(f"  rep {rep}: {name}: E2E p50 {p50:.2f} ms", flush=True)
    for name, p50s in results.items():
        spread = f"[{min(p50s):.2f}-{max(p50s):.2f}]"
        print(f"P5 floor, {name}: E2E p50 {statistics.median(p50s):.2f} {spread} ms, {len(p50s)} reps")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
