"""Bounded image intake in the API process (issue 12): a request with many large images must not
decode them all at once, nor keep full-size copies of their pixels, nor keep the memory afterwards.

The :class:`~shared.decode_budget.DecodeBudget` tests are pure logic on one event loop. The end-to-end
test sends eight 6000x6000 PNGs (~120 KB each: solid colours compress well, so the whole body is
~1.3 MB) to a real API process with no workers and reads that process's memory from ``/proc``:
the peak while the images are taken in (the kernel's high-water mark, reset just before the
request) and the resident size once they are in.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import select
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from shared.decode_budget import DecodeBudget
from shared.errors import InvalidImage
from shared.fetch import ImageFetcher, load_image
from shared.media import MediaLimits
from shared.protocol import EncodeJob
from tests.stackutil import data_url, start_stack, user_message

MiB = 1024 * 1024
BIG_SIDE = 6000  # 36 Mpx: 144 MB as a decoded Pillow RGB image, 108 MB as raw RGB bytes
N_BIG = 8
#: All eight decoded at once, each with a copy and its raw bytes, grew the process by 2.1-2.6 GB;
#: two 36-Mpx images decoding at once (the default budget) need ~2 x 144 MB plus strips (~300 MB).
PEAK_GROWTH_LIMIT = 600 * MiB
#: What the process may keep once the request's images are in (allocator slack, lazy imports).
#: Without handing freed pages back (malloc_trim) it kept ~340 MB; before the budget, ~770 MB.
SETTLED_MARGIN = 300 * MiB
HANG_S = 300  # bounds a hang, not a speed requirement


# ------------------------------------------------------------------------------------------------
# the decode budget
# ------------------------------------------------------------------------------------------------
async def _settle() -> None:
    """Let every task that can run, run (the budget grants from callbacks, never from a timer)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_budget_bounds_concurrent_decodes() -> None:
    budget = DecodeBudget(10)
    running: set[int] = set()
    most = 0
    finish = {i: asyncio.Event() for i in range(6)}

    async def decode(i: int) -> None:
        nonlocal most
        claim = await budget.acquire(4)
        running.add(i)
        most = max(most, len(running))
        await finish[i].wait()
        running.discard(i)
        budget.release(claim)

    tasks = [asyncio.create_task(decode(i)) for i in range(6)]
    await _settle()
    assert running == {0, 1} and budget.in_use == 8  # 3 x 4 > 10: the third waits
    for i in range(6):
        finish[i].set()
        await _settle()
        assert len(running) <= 2 and budget.in_use <= 10
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert most == 2 and budget.in_use == 0


async def test_an_image_over_the_budget_proceeds_alone_in_arrival_order() -> None:
    budget = DecodeBudget(10)
    small = await budget.acquire(4)
    big = asyncio.create_task(budget.acquire(25))  # more than the whole budget
    later = asyncio.create_task(budget.acquire(1))  # would fit now, but arrived after `big`
    await _settle()
    assert not big.done() and not later.done()
    budget.release(small)
    assert await asyncio.wait_for(big, 60) == 10  # the whole budget, not 25: no deadlock
    await _settle()
    assert not later.done()  # `big` decodes alone
    budget.release(10)
    assert await asyncio.wait_for(later, 60) == 1
    budget.release(1)
    assert budget.in_use == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    budget = DecodeBudget(10)
    held = await budget.acquire(8)
    blocked = asyncio.create_task(budget.acquire(5))
    behind = asyncio.create_task(budget.acquire(2))  # fits, but queued behind `blocked`
    await _settle()
    assert not behind.done()
    blocked.cancel()  # e.g. the request passed its deadline
    assert await asyncio.wait_for(behind, 60) == 2
    budget.release(2)
    budget.release(held)
    assert budget.in_use == 0


async def test_run_holds_the_claim_until_the_thread_finishes_even_if_cancelled() -> None:
    budget = DecodeBudget(10)
    started, go = threading.Event(), threading.Event()

    def decode() -> str:
        started.set()
        assert go.wait(60)
        return "done"

    task = asyncio.create_task(budget.run(10, decode))
    try:
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()
        await _settle()
        assert task.cancelled()
        assert budget.in_use == 10  # the thread still decodes: its memory is still in use
    finally:
        go.set()
    deadline = time.monotonic() + 60
    while budget.in_use and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert budget.in_use == 0
    assert await budget.run(3, str.upper, "ok") == "OK"


async def test_an_oversized_header_is_refused_without_waiting_for_the_budget() -> None:
    """A PNG declaring 20 Mpx (a few hundred bytes) against a 10-Mpx limit: refused from its header
    while the whole budget is taken, so it neither waited for the budget nor was decoded."""
    buf = io.BytesIO()
    Image.new("L", (5000, 4000)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    budget = DecodeBudget(1)
    held = await budget.acquire(1)
    async with ImageFetcher() as fetcher:
        with pytest.raises(InvalidImage, match="over the limit of 10000000 pixels"):
            await asyncio.wait_for(load_image(url, fetcher, MediaLimits(max_pixels=10_000_000), budget=budget), 60)
    budget.release(held)


# ------------------------------------------------------------------------------------------------
# a real API process
# ------------------------------------------------------------------------------------------------
def _status_bytes(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of process ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) of ``pid`` to its current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _send(url: str, body: bytes) -> socket.socket:
    """POST ``body`` to the chat endpoint on a raw connection the test closes when it is done:
    with no workers the API would hold the request until its deadline."""
    u = httpx.URL(url)
    sock = socket.create_connection((u.host, u.port), timeout=HANG_S)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.host}:{u.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _answered_early(sock: socket.socket) -> str | None:
    """The API's answer if it already sent one (it must not: that would be an error)."""
    if select.select([sock], [], [], 0)[0]:
        return sock.recv(65536).decode(errors="replace") or "(connection closed)"
    return None


@pytest.fixture(scope="module")
def intake_stack(nats_server, s3_server, tiny_model_dir, tmp_path_factory):
    """Just the API process (no workers), default decode budget, a deadline far past the intake."""
    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("intake-logs"),
        services=["api"],
        roles={},
        EPD_REQUEST_TIMEOUT_S=str(HANG_S * 2),
        EPD_MAX_IMAGES_PER_REQUEST=str(N_BIG),
        EPD_MAX_IMAGE_PIXELS=str(40_000_000),
    )
    try:
        yield running
    finally:
        running.stack.stop()


def test_many_large_images_are_taken_in_with_bounded_memory(intake_stack) -> None:
    stack = intake_stack
    pid = next(p for p in stack.stack.processes if p.name == "api").popen.pid
    urls = [data_url(Image.new("RGB", (BIG_SIDE, BIG_SIDE), (30 * i, 100, 200))) for i in range(N_BIG)]
    body = json.dumps(
        {"model": "qwen2-vl-tiny", "max_tokens": 4, "messages": [user_message("describe", urls)]}
    ).encode()
    seen = {m.request_id for _, _, m in stack.stream_messages("stream_encode") if isinstance(m, EncodeJob)}

    baseline = _status_bytes(pid, "VmRSS")
    _reset_peak(pid)
    started = time.monotonic()
    sock = _send(stack.url, body)
    try:
        # Intake is over when the request's encode jobs are queued: prepare_images' last step.
        deadline = started + HANG_S
        while True:
            early = _answered_early(sock)
            assert early is None, f"the API answered before queueing encode jobs:\n{early[:2000]}"
            jobs: dict[str, int] = {}
            for _, _, m in stack.stream_messages("stream_encode"):
                if isinstance(m, EncodeJob) and m.request_id not in seen:
                    jobs[m.request_id] = jobs.get(m.request_id, 0) + 1
            if N_BIG in jobs.values():
                break
            assert time.monotonic() < deadline, f"no {N_BIG} encode jobs after {HANG_S}s: {jobs}"
            time.sleep(0.25)
        intake_s = time.monotonic() - started
        peak_growth = _status_bytes(pid, "VmHWM") - baseline
        right_after = _status_bytes(pid, "VmRSS") - baseline
        # Memory the request no longer needs must go back; poll (a hang bound, not a speed claim).
        settle_deadline = time.monotonic() + 60
        while (
            settled := _status_bytes(pid, "VmRSS")
        ) - baseline >= SETTLED_MARGIN and time.monotonic() < settle_deadline:
            time.sleep(0.5)
    finally:
        sock.close()
    figures = (
        f"baseline {baseline / MiB:.0f} MiB, peak growth {peak_growth / MiB:.0f} MiB, right after "
        f"{right_after / MiB:+.0f} MiB, settled {(settled - baseline) / MiB:+.0f} MiB, intake {intake_s:.1f}s"
    )
    print(f"\nintake of {N_BIG} x {BIG_SIDE}x{BIG_SIDE} PNG: {figures}")
    assert peak_growth < PEAK_GROWTH_LIMIT, figures
    assert settled - baseline < SETTLED_MARGIN, figures
