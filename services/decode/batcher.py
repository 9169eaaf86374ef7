"""The decode worker's batching loop: one engine thread steps a :class:`BatchDecoder`; asyncio
tasks (one per decode job) feed requests in and receive their token events.

Shape:

* :meth:`DecodeBatcher.submit` (event loop) queues a join and returns the request's
  ``asyncio.Queue``; the first join starts the loop in the handler's engine thread.
* The loop (engine thread), between steps: admits queued joins (building each
  ``DecodeState`` from its KV object there, so all torch work stays in the one engine thread),
  drops cancelled requests; then runs one :meth:`BatchDecoder.step` and posts each event to its
  request's queue. It returns when nothing is left, and a later submit starts it again.
* What a queue receives: ``TokenEvent`` s (the last one has ``finish_reason``), or one
  exception (the state could not be built, or the batched step failed) - then nothing more.

Because the engine thread runs this loop for as long as any request is active, every other
model call of the worker must go through the loop too (that is why states are built in it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable

from shared import metrics
from shared.engines.base import SamplingParams
from shared.logs import REQUEST_ID

log = logging.getLogger(__name__)


@dataclass
class _Join:
    key: Hashable
    make_state: Callable[[], Any]  # engine thread: -> DecodeState
    params: SamplingParams
    queue: asyncio.Queue


class DecodeBatcher:
    def __init__(
        self,
        decoder: Any,  # shared.engines.transformers_batch.BatchDecoder (imports torch)
        run_compute: Callable[[Callable[[], None]], Awaitable[None]],
        *,
        step_delay_s: float = 0.0,
    ):
        self.decoder = decoder
        self._run_compute = run_compute
        self.step_delay_s = step_delay_s
        self._lock = threading.Lock()
        self._joins: list[_Join] = []
        self._cancels: set[Hashable] = set()
        self._queues: dict[Hashable, asyncio.Queue] = {}
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future | None = None
        self.steps = 0

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._queues)

    def submit(self, key: Hashable, make_state: Callable[[], Any], params: SamplingParams) -> asyncio.Queue:
        """Queue a request to join the batch before the next step (event loop side)."""
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if key in self._queues:
                raise ValueError(f"{key!r} is already being decoded")
            self._joins.append(_Join(key, make_state, params, queue))
            self._queues[key] = queue
            start = not self._running
            self._running = True
        if start:
            self._task = asyncio.ensure_future(self._run_compute(self._run))
            self._task.add_done_callback(self._loop_ended)
        return queue

    def cancel(self, key: Hashable) -> None:
        """Drop a request (deadline passed, handler cancelled) before the next step. No-op when
        it already finished."""
        with self._lock:
            if self._queues.pop(key, None) is not None:
                self._cancels.add(key)

    # -- engine thread ----------------------------------------------------------------------
    def _post(self, queue: asyncio.Queue, item: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        REQUEST_ID.set("-")  # this thread serves many requests; its lines carry none
        decoder = self.decoder
        while True:
            with self._lock:
                joins, self._joins = self._joins, []
                cancels, self._cancels = self._cancels, set()
                live = dict(self._queues)
            for key in cancels:
                if key in decoder:
                    decoder.remove(key)
            for join in joins:
                if join.key not in live:  # cancelled before it joined
                    continue
                try:
                    decoder.add(join.key, join.make_state(), join.params)
                except Exception as exc:  # bad state or params: this request only
                    self._finish(join.key, exc)
            with self._lock:
                if len(decoder) == 0 and not self._joins:
                    self._running = False
                    return
            members = [k for k in live if k in decoder]
            try:
                events = decoder.step()
            except Exception as exc:  # the whole batch is gone (BatchDecoder cleared itself)
                log.error("batched decode step failed for %d request(s): %s", len(members), exc)
                for key in members:
                    self._finish(key, exc)
                continue
            self.steps += 1
            if decoder.rows:
                metrics.DECODE_BATCH_ROWS.observe(decoder.rows)
            for key, event in events:
                queue = live.get(key)
                if queue is not None:
                    self._post(queue, event)
                if event.finish_reason is not None:
                    with self._lock:
                        self._queues.pop(key, None)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)

    def _finish(self, key: Hashable, exc: BaseException) -> None:
        with self._lock:
            queue = self._queues.pop(key, None)
        if queue is not None:
            self._post(queue, exc)

    def _loop_ended(self, fut: asyncio.Future) -> None:
        # The loop only ends by returning; anything else is a bug. Fail every waiting request
        # rather than leave it hanging.
        exc = None if fut.cancelled() else fut.exception()
        if exc is None and not fut.cancelled():
            return
        log.error("decode loop died: %r", exc)
        with self._lock:
            self._running = False
            queues, self._queues = self._queues, {}
            self._joins.clear()
        self.decoder.clear()
        for queue in queues.values():
            queue.put_nowait(exc or RuntimeError("decode loop cancelled"))
