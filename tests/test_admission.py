"""Engine admission (``shared.admission``): waiting for image features is not working.

* unit: slots go to the cheapest waiter (ageing, ties in arrival order, cancellation); long
  prompts go in two at a time, short ones do not wait for them; how many jobs the runner may fetch
  while some wait for their inputs;
* end to end (real NATS, S3 and worker processes, tiny model, E|PD with the encoder not started
  yet so image jobs wait for it): a text-only request is served while image jobs of the same
  prefill worker wait for their features, with one engine slot. Negative control: with
  ``EPD_MAX_WAITING_JOBS=0`` (a waiting job holds its place, as before) the text job is not
  even fetched until the encoder comes and the images are served first.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from shared.admission import (
    AGING_TOKENS_PER_S,
    LONG_PROMPTS_AT_ONCE,
    Admission,
    PrioritySlots,
    Slot,
    long_prompt_tokens,
)
from shared.protocol import CONSUMER_PREFILL, GenerationJob
from tests.stackutil import GREEDY, chat_body, noise_image, start_stack, wait_for, work_consumers


# -- unit --------------------------------------------------------------------------------------
class _Queue:
    """One holder of the only slot of ``slots`` and a waiter per cost queued behind it, in order;
    ``order`` gets each waiter's index as it gets the slot."""

    def __init__(self, slots: PrioritySlots, costs: list[float]):
        self.slots, self.costs = slots, costs
        self.order: list[int] = []
        self.hold = asyncio.Event()

    async def __aenter__(self) -> _Queue:
        self.holder = asyncio.create_task(self._hold())
        await asyncio.sleep(0)
        self.waiters = [asyncio.create_task(self._wait(i, c)) for i, c in enumerate(self.costs)]
        while self.slots.queued < len(self.costs):
            await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.hold.set()
        await asyncio.gather(self.holder, *self.waiters, return_exceptions=True)

    async def _hold(self) -> None:
        async with self.slots.slot(0):
            await self.hold.wait()

    async def _wait(self, i: int, cost: float) -> None:
        async with self.slots.slot(cost):
            self.order.append(i)


async def _grant_order(costs: list[float], *, age: dict[int, float] | None = None) -> list[int]:
    """The order the waiters got the slot; ``age``: waiter index -> seconds it waited already."""
    async with _Queue(PrioritySlots(1), costs) as q:
        for ticket in q.slots._queue:  # waiter i has ticket seq i
            ticket.queued_at -= (age or {}).get(ticket.seq, 0.0)
    return q.order


async def test_cheapest_waiter_first_ties_in_arrival_order():
    assert await _grant_order([300, 10, 50, 10]) == [1, 3, 2, 0]
    assert await _grant_order([5, 5, 5]) == [0, 1, 2]  # control: equal costs are FIFO


async def test_a_long_wait_overtakes_a_cheaper_newcomer():
    # 600 tokens that waited 20 s count as 600 - 20 * 32 = -40 < 100: the old one goes first.
    assert await _grant_order([100, 600], age={1: 20.0}) == [1, 0]
    assert 600 - 20 * AGING_TOKENS_PER_S < 100
    assert await _grant_order([100, 600], age={1: 1.0}) == [0, 1]  # a short wait does not: cheapest first
    assert await _grant_order([100, 600]) == [0, 1]  # control: without the wait


async def test_a_cancelled_waiter_gives_up_its_place_and_no_slot_leaks():
    slots = PrioritySlots(1)
    async with _Queue(slots, [1, 100]) as q:
        q.waiters[0].cancel()  # the cheap one
    assert q.waiters[0].cancelled() and q.order == [1]
    assert slots.taken == 0 and slots.queued == 0
    async with slots.slot(5):  # the slot is free again
        assert slots.taken == 1


class _Holder:
    """A task holding a slot of ``slots`` for a prompt of ``cost`` until :meth:`end`; ``slot`` is
    set once it got it."""

    def __init__(self, slots: PrioritySlots, cost: float):
        self.slot: Slot | None = None
        self._end = asyncio.Event()
        self.task = asyncio.create_task(self._run(slots, cost))

    async def _run(self, slots: PrioritySlots, cost: float) -> None:
        async with slots.slot(cost) as slot:
            self.slot = slot
            await self._end.wait()

    def end(self) -> None:
        self._end.set()


async def _settle() -> None:
    for _ in range(5):  # grants resolve futures; their waiters run a few loop turns later
        await asyncio.sleep(0)


async def _long_ones_in(slots: PrioritySlots) -> list[_Holder]:
    """Long prompts (300) let in until the limit: LONG_PROMPTS_AT_ONCE of them, each holding a slot."""
    held = [_Holder(slots, 300) for _ in range(LONG_PROMPTS_AT_ONCE)]
    await _settle()
    assert all(h.slot is not None for h in held) and slots.long_prefilling == LONG_PROMPTS_AT_ONCE
    return held


async def _end(*holders: _Holder) -> None:
    for h in holders:
        h.end()
    await asyncio.gather(*(h.task for h in holders))


async def test_long_prompts_go_in_two_at_a_time_and_short_ones_do_not_wait_for_them():
    assert LONG_PROMPTS_AT_ONCE == 2  # one prefilling, the next queued behind it in the engine
    slots = PrioritySlots(16, long_prompt=128)
    first, second = await _long_ones_in(slots)
    third = _Holder(slots, 300)
    await _settle()
    assert third.slot is None  # waits for one of them to be prefilled
    text = _Holder(slots, 30)
    mid = _Holder(slots, 128)  # at the bound: not long
    await _settle()
    assert text.slot is not None and mid.slot is not None  # past the long one queued
    assert first.slot is not None
    first.slot.prefilled()
    await _settle()
    assert third.slot is not None  # the first one's first token is out: the third goes in
    assert slots.taken == 5 and slots.long_prefilling == 2
    first.slot.prefilled()  # idempotent
    assert slots.long_prefilling == 2
    await _end(first, second, third, text, mid)
    assert slots.taken == 0 and slots.long_prefilling == 0 and slots.queued == 0


async def test_control_without_the_rule_long_prompts_go_in_side_by_side():
    slots = PrioritySlots(16)  # long_prompt None: as before
    holders = [_Holder(slots, 300) for _ in range(LONG_PROMPTS_AT_ONCE + 2)]
    await _settle()
    assert all(h.slot is not None for h in holders)
    await _end(*holders)


async def test_a_long_prompt_ending_before_its_first_token_lets_the_next_in():
    slots = PrioritySlots(16, long_prompt=128)
    failing, *others = await _long_ones_in(slots)
    nxt = _Holder(slots, 300)
    await _settle()
    assert nxt.slot is None
    failing.end()  # e.g. the request failed or was cancelled in the engine: no first token
    await _settle()
    assert nxt.slot is not None and slots.long_prefilling == LONG_PROMPTS_AT_ONCE
    assert failing.slot is not None
    failing.slot.prefilled()  # after its end: counted once only
    assert slots.long_prefilling == LONG_PROMPTS_AT_ONCE
    await _end(failing, nxt, *others)
    assert slots.long_prefilling == 0


async def test_an_aged_long_prompt_queued_does_not_hold_a_short_one_back():
    slots = PrioritySlots(16, long_prompt=128)
    held = await _long_ones_in(slots)
    waiting = _Holder(slots, 300)
    await _settle()
    for ticket in slots._queue:
        ticket.queued_at -= 100.0  # aged far past any short prompt's cost: first in cost order
    text = _Holder(slots, 30)
    await _settle()
    assert waiting.slot is None and text.slot is not None  # it does not fit; the short one does
    held[0].end()
    await _settle()
    assert waiting.slot is not None
    await _end(*held, waiting, text)


async def test_a_cancelled_long_waiter_and_a_cancelled_grant_leak_nothing():
    slots = PrioritySlots(16, long_prompt=128)
    held = await _long_ones_in(slots)
    queued = _Holder(slots, 300)
    await _settle()
    queued.task.cancel()
    await asyncio.gather(queued.task, return_exceptions=True)
    assert slots.queued == 0 and slots.taken == LONG_PROMPTS_AT_ONCE
    granted = _Holder(slots, 300)
    await _settle()
    assert held[0].slot is not None
    held[0].slot.prefilled()  # grants the waiter at once, counted in; cancelled before it resumes:
    assert slots.long_prefilling == LONG_PROMPTS_AT_ONCE and slots.queued == 0
    granted.task.cancel()
    await asyncio.gather(granted.task, return_exceptions=True)
    assert granted.slot is None and slots.long_prefilling == LONG_PROMPTS_AT_ONCE - 1
    await _end(*held)
    assert slots.taken == 0 and slots.long_prefilling == 0


def test_a_long_prompt_is_more_than_half_the_engine_s_step_unless_configured():
    assert long_prompt_tokens(None, 256) == 128  # vLLM's CPU step budget
    assert long_prompt_tokens(None, None) is None  # transformers: it orders its prefills itself
    assert long_prompt_tokens(300, 256) == 300  # EPD_LONG_PROMPT_TOKENS
    assert long_prompt_tokens(0, 256) is None  # 0: no such rule
    assert not PrioritySlots(1, 128).is_long(128) and PrioritySlots(1, 128).is_long(129)
    assert not PrioritySlots(1).is_long(10**6)


def test_room_to_fetch_does_not_count_waiting_jobs():
    a = Admission(slots=2, max_waiting=3)
    assert a.room_to_fetch(0) == 2
    assert a.room_to_fetch(2) == 0  # two working jobs fill the engine
    a.waiting_jobs = 2
    assert a.room_to_fetch(2) == 2  # both wait for features: room for two that can work
    assert a.room_to_fetch(5) == 0  # 2 slots + 3 waiting held
    a.waiting_jobs = 5
    assert a.room_to_fetch(5) == 0  # the waiting bound holds too
    assert Admission(slots=2, max_waiting=0).room_to_fetch(1) == 1
    b = Admission(slots=2, max_waiting=0)
    b.waiting_jobs = 2
    assert b.room_to_fetch(2) == 0  # no room for waiting jobs: they hold their places


# -- end to end --------------------------------------------------------------------------------
class _Post(threading.Thread):
    """A chat request in the background: its response and when it came."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None
        self.done_at = 0.0
        self.start()

    def run(self) -> None:
        self.response = httpx.post(f"{self.url}/v1/chat/completions", json=self.body, timeout=400)
        self.done_at = time.monotonic()


def _gen_consumer(stack) -> tuple[int, int]:
    info = work_consumers(stack.nats_url, stack.subjects)[CONSUMER_PREFILL]
    return info.num_pending, info.num_ack_pending


def _text_body(i: int) -> dict:
    return chat_body(f"just text {i}", [], **{**GREEDY, "max_tokens": 4})


def _image_body(seed: int) -> dict:
    return chat_body("describe", [noise_image(seed, (40, 40))], **{**GREEDY, "max_tokens": 4})


def _jobs_recorded(stack, n: int) -> bool:
    return len([m for _, _, m in stack.stream_messages("stream_generate") if isinstance(m, GenerationJob)]) >= n


def _pd_without_encoder(nats_server, s3_server, model_dir, log_dir, **env):
    # No encoder yet: image jobs wait for their features (EPD_EC_WAIT_S) on the prefill worker.
    return start_stack(
        nats_server,
        s3_server,
        model_dir,
        log_dir,
        services=["api", "prefill"],
        roles={"prefill": 1},
        EPD_MAX_CONCURRENT_JOBS="1",
        EPD_EC_WAIT_S="300",
        EPD_ENCODE_STEALS="0",  # image jobs wait for the encoder the test starts later, not encode themselves
        EPD_NO_ENCODER_AFTER_S="300",  # ... also while no encoder runs at all
        EPD_REQUEST_TIMEOUT_S="400",
        **env,
    )


def _serve_images_then_check(stack, images: list[_Post]) -> None:
    stack.stack.add("encoder")
    for post in images:
        post.join(300)
        assert post.response is not None and post.response.status_code == 200, post.response
        assert post.response.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.slow
def test_text_is_served_while_image_jobs_wait_for_the_encoder(nats_server, s3_server, tiny_model_dir, tmp_path):
    stack = _pd_without_encoder(nats_server, s3_server, tiny_model_dir, tmp_path / "admit")
    try:
        images = [_Post(stack.url, _image_body(seed)) for seed in (1, 2)]
        # Both image jobs taken with one engine slot: they wait for features, holding none.
        wait_for(lambda: _gen_consumer(stack) == (0, 2), 120, "the prefill worker to hold both image jobs")
        resp = httpx.post(f"{stack.url}/v1/chat/completions", json=_text_body(0), timeout=120)
        assert resp.status_code == 200, resp.text
        assert not any(p.done_at for p in images)  # still waiting for an encoder
        assert "admission: 1 job(s) in the engine at once (EPD_MAX_CONCURRENT_JOBS" in stack.log_of("prefill")
        _serve_images_then_check(stack, images)
        # Defaults from the engine, printed: the encoder holds as many jobs as its engine batches.
        assert "encoder: up to 16 jobs at once (from the engine)" in stack.log_of("encoder")
    finally:
        stack.stack.stop()


@pytest.mark.slow
def test_control_a_waiting_job_holding_its_place_blocks_text(nats_server, s3_server, tiny_model_dir, tmp_path):
    stack = _pd_without_encoder(nats_server, s3_server, tiny_model_dir, tmp_path / "hold", EPD_MAX_WAITING_JOBS="0")
    try:
        images = [_Post(stack.url, _image_body(seed)) for seed in (3, 4)]
        wait_for(lambda: _gen_consumer(stack) == (1, 1), 120, "the prefill worker to hold one image job")
        text = _Post(stack.url, _text_body(1))
        wait_for(lambda: _jobs_recorded(stack, 3), 120, "the text job on the stream")
        # Not fetched: the one place is held by an image job waiting for the encoder.
        wait_for(lambda: _gen_consumer(stack) == (2, 1), 120, "the text job to be pending behind it")
        assert not text.done_at
        _serve_images_then_check(stack, images)
        text.join(300)
        assert text.response is not None and text.response.status_code == 200
        assert text.done_at > min(p.done_at for p in images)  # served after an image, not before
    finally:
        stack.stack.stop()
