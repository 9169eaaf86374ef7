"""Engine admission of a generating worker: waiting for inputs is not working.

A prefill / PD worker holds each job it takes in one of three states:

* **waiting** for its inputs (image features an encoder is still computing; :meth:`Admission.waiting`);
* **ready**, queued for an engine slot (:meth:`Admission.slot`);
* **running** in the engine, holding one of ``slots`` slots until it ends or hands off.

The runner (``shared.worker.WorkerRunner``) fetches while fewer than ``slots`` jobs are *working*
(ready or running; a job just taken counts as working until it says it waits) and fewer than
``slots + max_waiting`` are held in all. So a burst of image jobs that wait for the encoder never
keeps a text-only job, or a job whose features are stored, out of the engine: waiting jobs take no
slot and do not stop the worker from pulling more (issue 14, item 2).

Ready jobs get a slot in order of their cost, the cheapest prefill first (an estimate of the prompt
tokens: ``shared.engines.prompts.prompt_cost``), with ageing so a long prompt is not starved: each
second a job has waited counts as :data:`AGING_TOKENS_PER_S` tokens off its cost. Why this policy:
a text-only prompt of 30 tokens queued behind an image prompt of 350 waits a whole image prefill for
a few tens of milliseconds of its own work; serving the short one first costs the long one only that
few tens of milliseconds (shortest-job-first minimises the mean wait), and ageing bounds the worst.

Slots are the engine's own capacity (``Engine.max_running_requests``: vLLM's ``max_num_seqs``, the
transformers engine's decode batch), so the engine's continuous batching does the interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

#: Ageing of a queued job's cost: each second it has waited for a slot counts as this many prompt
#: tokens less, so a 350-token image prompt overtakes fresh 30-token prompts after 10 s. Slow on
#: purpose: with 512 (~0.6 s) a loaded machine, where every image prefill of a burst waits longer
#: than that, made the order first-come-first-served again and a text prompt waited for all of them
#: (P4: a text probe 6-14 s behind eight image prefills).
AGING_TOKENS_PER_S = 32.0


@dataclass
class _Ticket:
    cost: float
    seq: int
    queued_at: float
    future: asyncio.Future

    def key(self, now: float) -> tuple[float, int]:
        return (self.cost - AGING_TOKENS_PER_S * (now - self.queued_at), self.seq)


class PrioritySlots:
    """``n`` slots; while all are taken, waiters get them in order of cost, aged by
    :data:`AGING_TOKENS_PER_S` (cheapest first), ties in arrival order. Event-loop only (the
    transformers engine gates its prefills with one slot)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError("slots must be >= 1")
        self.n = n
        self.taken = 0
        self._queue: list[_Ticket] = []
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def slot(self, cost: float) -> AsyncIterator[None]:
        """Hold a slot; queued by ``cost`` while all are taken. Cancelling a queued waiter gives
        up its place (or the slot it was just granted)."""
        if self.taken < self.n and not self._queue:
            self.taken += 1
        else:
            ticket = _Ticket(cost, next(self._seq), time.monotonic(), asyncio.get_running_loop().create_future())
            self._queue.append(ticket)
            try:
                await ticket.future  # the releaser counted us in ``taken``
            except asyncio.CancelledError:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                elif ticket.future.done() and not ticket.future.cancelled():
                    self._release()  # granted as we were cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self.taken -= 1
        while self._queue and self.taken < self.n:
            now = time.monotonic()
            ticket = min(self._queue, key=lambda t: t.key(now))
            self._queue.remove(ticket)
            if ticket.future.done():  # cancelled while queued
                continue
            try:
                ticket.future.set_result(None)
            except RuntimeError:  # its event loop is closed (the waiter is gone with it)
                continue
            self.taken += 1


class Admission:
    """Slots and states of one worker's jobs (see the module docstring). Event-loop only."""

    def __init__(self, slots: int, max_waiting: int):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine_slots = PrioritySlots(slots)
        self.max_waiting = max_waiting
        self.waiting_jobs = 0
        self._changed = asyncio.Event()

    @property
    def slots(self) -> int:
        return self.engine_slots.n

    @property
    def max_held(self) -> int:
        """The most jobs the worker holds at once."""
        return self.slots + self.max_waiting

    def room_to_fetch(self, held: int) -> int:
        """How many more jobs the runner may take while holding ``held``."""
        working = held - self.waiting_jobs
        return max(0, min(self.slots - working, self.max_held - held))

    async def changed(self) -> None:
        """Returns once a job started waiting (room to fetch may have opened)."""
        await self._changed.wait()
        self._changed.clear()

    @contextlib.asynccontextmanager
    async def waiting(self) -> AsyncIterator[None]:
        """Around a job's wait for its inputs: it does not count as working meanwhile."""
        self.waiting_jobs += 1
        self._changed.set()
        try:
            yield
        finally:
            self.waiting_jobs -= 1

    def slot(self, cost: float) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold an engine slot; the cheapest ready job first while all are taken."""
        return self.engine_slots.slot(cost)
