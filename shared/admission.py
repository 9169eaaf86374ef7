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
But an engine that chunks prefills (vLLM) serves the requests it runs before the ones that came
since, so a short prompt admitted behind eight image prompts ready at once waited for all of their
chunks. So *long* prompts - more than half the engine's step budget
(``Engine.prefill_tokens_per_step``; ``EPD_LONG_PROMPT_TOKENS`` overrides) - go into the engine
:data:`LONG_PROMPTS_AT_ONCE` at a time, the next once one's first token is out, and the short ones
do not wait for them (:class:`PrioritySlots`).
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


#: Long prompts in the engine not yet prefilled (``PrioritySlots``): one prefilling and the next
#: queued behind it, so the engine goes on with it in the next step. Measured on vLLM
#: (``bench/admission_long_prompts_vllm.py``: 8 prompts of 357 tokens ready at once, one core, text
#: probes meanwhile), against no limit: with 2 the slowest probe 0.33x, the burst 1.06x as long;
#: with 1 the engine waits for each first token's round trip before the next one (0.23x, 1.14x).
LONG_PROMPTS_AT_ONCE = 2


@dataclass
class _Ticket:
    cost: float
    seq: int
    queued_at: float
    future: asyncio.Future

    def key(self, now: float) -> tuple[float, int]:
        return (self.cost - AGING_TOKENS_PER_S * (now - self.queued_at), self.seq)


class Slot:
    """A granted slot (what :meth:`PrioritySlots.slot` yields). A long prompt's slot counts among
    the long ones in the engine until :meth:`prefilled` (or the slot's end)."""

    def __init__(self, owner: PrioritySlots, long: bool):
        self._owner = owner
        self.long_prefilling = long

    def prefilled(self) -> None:
        """The prompt is prefilled (its first token is out): another long prompt may go in.
        Idempotent."""
        if self.long_prefilling:
            self.long_prefilling = False
            self._owner._long_prefilled()


class PrioritySlots:
    """``n`` slots; while none is free, waiters get them in order of cost, aged by
    :data:`AGING_TOKENS_PER_S` (cheapest first), ties in arrival order. Event-loop only (the
    transformers engine gates its prefills with one slot).

    ``long_prompt`` (``None``: no such rule): a prompt costing more than that is *long*, and at
    most ``long_at_once`` (:data:`LONG_PROMPTS_AT_ONCE`) long prompts are let in and not yet :meth:`Slot.prefilled`,
    while shorter ones do not wait for them. Why: an engine that chunks prefills (vLLM) serves the
    requests it already runs before the ones that came since, so a short prompt let in behind eight
    long ones waited for all of their chunks; now it waits for at most two. Short prompts never
    queue behind long ones (a long one that waited seconds for its turn would otherwise have aged
    past them).
    """

    def __init__(self, n: int, long_prompt: float | None = None, long_at_once: int = LONG_PROMPTS_AT_ONCE):
        if n < 1:
            raise ValueError("slots must be >= 1")
        if long_prompt is not None and long_prompt < 0:
            raise ValueError("long_prompt must be >= 0 (None: no such rule)")
        if long_at_once < 1:
            raise ValueError("long_at_once must be >= 1")
        self.n = n
        self.long_prompt = long_prompt
        self.long_at_once = long_at_once
        self.taken = 0
        #: long prompts let in and not yet prefilled (at most ``long_at_once``)
        self.long_prefilling = 0
        self._queue: list[_Ticket] = []
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def is_long(self, cost: float) -> bool:
        return self.long_prompt is not None and cost > self.long_prompt

    def _fits(self, cost: float) -> bool:
        return self.taken < self.n and not (self.long_prefilling >= self.long_at_once and self.is_long(cost))

    @contextlib.asynccontextmanager
    async def slot(self, cost: float) -> AsyncIterator[Slot]:
        """Hold a slot; queued by ``cost`` while none is free (or, for a long prompt, while
        ``long_at_once`` long ones are prefilling). Cancelling a queued waiter gives up
        its place (or the slot it was just granted)."""
        if not self._queue and self._fits(cost):
            self._take(cost)
        else:
            ticket = _Ticket(cost, next(self._seq), time.monotonic(), asyncio.get_running_loop().create_future())
            self._queue.append(ticket)
            self._grant()  # a short prompt does not wait for the long ones queued
            try:
                await ticket.future  # the granter counted us in
            except asyncio.CancelledError:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                elif ticket.future.done() and not ticket.future.cancelled():
                    self._release(self.is_long(cost))  # granted as we were cancelled: pass it on
                raise
        held = Slot(self, self.is_long(cost))
        try:
            yield held
        finally:
            prefilling, held.long_prefilling = held.long_prefilling, False
            self._release(prefilling)

    def _take(self, cost: float) -> None:
        self.taken += 1
        self.long_prefilling += self.is_long(cost)

    def _long_prefilled(self) -> None:
        self.long_prefilling -= 1
        self._grant()

    def _release(self, long_prefilling: bool) -> None:
        """A slot ends (``long_prefilling``: it still counted among the long prompts prefilling)."""
        self.taken -= 1
        self.long_prefilling -= long_prefilling
        self._grant()

    def _grant(self) -> None:
        """Grant the waiters that fit, in order of their aged cost (a long one that does not fit
        holds back no short one; nor another long one: none of those fits either)."""
        now = time.monotonic()
        for ticket in sorted(self._queue, key=lambda t: t.key(now)):
            if self.taken >= self.n:
                return
            if ticket.future.done():  # cancelled while queued
                self._queue.remove(ticket)
                continue
            if not self._fits(ticket.cost):
                continue
            self._queue.remove(ticket)
            try:
                ticket.future.set_result(None)
            except RuntimeError:  # its event loop is closed (the waiter is gone with it)
                continue
            self._take(ticket.cost)


def long_prompt_tokens(configured: int | None, step_tokens: int | None) -> int | None:
    """The size of a long prompt (:class:`PrioritySlots`): ``EPD_LONG_PROMPT_TOKENS`` when set (0:
    no such rule), else half the engine's step budget - such a prompt takes more than half a step,
    two of them do not fit one - or no such rule for an engine without one (``None``)."""
    if configured is not None:
        return configured or None
    return None if step_tokens is None else step_tokens // 2


class Admission:
    """Slots and states of one worker's jobs (see the module docstring). Event-loop only."""

    def __init__(self, slots: int, max_waiting: int, long_prompt: float | None = None):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine_slots = PrioritySlots(slots, long_prompt)
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

    def slot(self, cost: float) -> contextlib.AbstractAsyncContextManager[Slot]:
        """Hold an engine slot; the cheapest ready job first while all are taken (a long prompt
        also waits while :data:`LONG_PROMPTS_AT_ONCE` long ones prefill: call :meth:`Slot.prefilled`
        at the first token)."""
        return self.engine_slots.slot(cost)
