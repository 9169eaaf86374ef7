"""P8: what JetStream's ``sync_interval: always`` costs on a 3-node R3 cluster (issue 26, durability).

Starts a 3-node NATS cluster on localhost (``shared.tools.infra.NatsCluster``) once per setting -
the server's default (fsync every 2 minutes) and ``always`` (fsync every write) - creates the
deployment's streams with 3 replicas (``ensure_topology``) and publishes real, encoded
``GenerationJob`` s (a job-sized message, with a ``Nats-Msg-Id`` like the API's) to the job stream:

* ``sequential``: one publish at a time, each awaiting its ack - what one request's submission
  waits for (reported as the publish-ack p50 in ms and as publishes/s);
* ``pipelined``: ``--window`` publishes in flight at once - the stream's throughput under load.

Each setting runs ``--reps`` times (a fresh cluster each); printed: median and spread (min..max).

Run: ``.venv/bin/python bench/p8_sync_interval.py [--reps 3] [--messages 2000] [--window 64]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from shared import protocol
from shared.config import NatsSettings
from shared.jetstream import connect, ensure_topology
from shared.protocol import GenerationJob, SamplingSpec, Subjects
from shared.tools.infra import NatsCluster


def _job(i: int) -> GenerationJob:
    return GenerationJob(
        request_id=f"bench-{uuid.uuid4().hex}",
        model="qwen2-vl-tiny",
        messages=[{"role": "user", "content": "Describe the picture in one short sentence, please. " * 4}],
        images=(),
        fingerprint="f" * 24,
        sampling=SamplingSpec(temperature=0, max_tokens=64),
        stream=True,
        deadline=time.time() + 300,
        created_at=time.time(),
    )


async def _run(seeds: str, messages: int, window: int) -> dict[str, float]:
    prefix = "b" + uuid.uuid4().hex[:8]
    settings = NatsSettings(nats_url=seeds, subject_prefix=prefix, stream_replicas=3, stream_max_bytes=256 * 1024**2)
    subjects = Subjects(prefix)
    nc = await connect(settings, name="bench-sync")
    try:
        js = nc.jetstream(timeout=10)
        await ensure_topology(js, settings, subjects, nc=nc)
        jobs = [_job(i) for i in range(messages)]
        payloads = [(protocol.encode(j), protocol.headers_for(j, j.request_id, msg_id=j.request_id)) for j in jobs]
        # warm-up
        for data, headers in payloads[:50]:
            await js.publish(
                subjects.generate_jobs, data, headers={**headers, protocol.HDR_MSG_ID: "w" + uuid.uuid4().hex}
            )
        half = messages // 2
        lat: list[float] = []
        t0 = time.perf_counter()
        for data, headers in payloads[:half]:
            t = time.perf_counter()
            await js.publish(subjects.generate_jobs, data, headers=headers)
            lat.append(time.perf_counter() - t)
        seq_s = time.perf_counter() - t0
        sem = asyncio.Semaphore(window)

        async def one(data: bytes, headers: dict[str, str]) -> None:
            async with sem:
                await js.publish(subjects.generate_jobs, data, headers=headers)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(d, h) for d, h in payloads[half:]))
        pipe_s = time.perf_counter() - t0
        return {
            "bytes": float(len(payloads[0][0])),
            "seq_per_s": half / seq_s,
            "seq_p50_ms": statistics.median(lat) * 1000,
            "pipe_per_s": (messages - half) / pipe_s,
        }
    finally:
        await nc.close()


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for sync in ("default", "always"):
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="epd-p8-", dir=Path.cwd()) as tmp:
                cluster = NatsCluster(tmp, 3, sync_interval=None if sync == "default" else "always")
                with cluster:
                    r = asyncio.run(_run(cluster.seeds, args.messages, args.window))
            results.setdefault(sync, []).append(r)
            print(f"{sync:8s} rep {rep + 1}: {r}", flush=True)
    size = results["default"][0]["bytes"]
    print(
        f"\nP8 JetStream publish of a {size:.0f}-byte GenerationJob, 3-node R3 cluster on localhost, "
        f"median (min..max) of {args.reps}:"
    )
    print(f"{'sync_interval':14s} {'sequential/s':>22s} {'ack p50 ms':>22s} {'pipelined/s':>22s}")
    for sync, runs in results.items():
        print(
            f"{sync:14s} {_summary([r['seq_per_s'] for r in runs]):>22s} "
            f"{_summary([r['seq_p50_ms'] for r in runs]):>22s} {_summary([r['pipe_per_s'] for r in runs]):>22s}"
        )


if __name__ == "__main__":
    main()
