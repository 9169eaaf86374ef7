"""Batched decode for the transformers engine: many requests, one LM forward per step.

A :class:`BatchDecoder` owns the KV caches of its members as ONE padded cache
(``[batch, kv_heads, columns, head_dim]`` per layer, every row right-aligned: a row's real
positions are its last ``past_len`` columns, the columns before them are zero padding). Each
:meth:`BatchDecoder.step` feeds every member's ``last_token`` in one forward with

* a 2-D ``attention_mask`` that masks each row's padding columns,
* explicit per-row ``position_ids`` (``past_len``, and for Qwen2-VL M-RoPE ``past_len +
  rope_delta`` on the t/h/w rows), so padding never shifts a position,

then samples each row with its own :class:`SamplingParams`, generator, prompt and output tokens
(penalties, ``min_tokens``, logit bias, logprobs: ``DecodeStream.sample``) and turns the token
into a :class:`TokenEvent` through the same :class:`DecodeStream` the single-request loop uses.

Members join (:meth:`add`) and leave (:meth:`remove`, or by finishing) between steps only. A
join left-pads the smaller side to a common column count and concatenates rows; a leave drops
the row and trims the padding columns no remaining row needs. A batch of one row has no
padding, and then the step is the single-request call (:meth:`TransformersEngine.decode_logits`)
bit for bit, so a request alone in a decode worker decodes exactly like the aggregated engine.

Numerics: with two or more rows the matmuls run with M = rows instead of 1 and attention runs
over the padded column count, so logits can differ from the single-request run in the last bits
(measured on the tiny models: see docs/operations.md, "Batching and bit-identity"). Greedy tokens are
equal unless two logits tie within that difference.

Not thread-safe: call it from the engine's compute thread only.

:class:`EncodeBatcher` does the same for the vision tower: encode calls that arrive while a forward
runs wait and go together into the compute thread's next turn (up to :data:`ENCODE_BATCH_PIXELS`).
Batch-invariant (``EPD_ENCODE_BATCH_INVARIANT``, the default) each image then gets a forward of its
own, so its features are its one-image forward's bit for bit on any CPU; otherwise they share
forwards, and the matmuls' row blocking (which differs by batch shape and CPU) can change features in
the last bits (tests/test_engine_transformers.py; docs/operations.md, "Batching and bit-identity").

:class:`DecodeLoop` drives a :class:`BatchDecoder` for :meth:`TransformersEngine.decode`: requests
join and leave from any thread (an event loop), the steps run in the compute thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Hashable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shared import metrics
from shared.engines.base import KVStateMismatch, SamplingParams, TokenEvent
from shared.engines.transformers_state import DecodeState, DecodeStream, Vocabulary
from shared.errors import EngineError, InvalidRequest
from shared.logs import REQUEST_ID

if TYPE_CHECKING:
    from shared.engines.families.base import VisionFamily

log = logging.getLogger(__name__)


class DecodeModel(Vocabulary, Protocol):
    """What :class:`BatchDecoder` uses of its engine (a ``TransformersEngine``; the engine builds
    its batch decoder, so this module does not import it)."""

    @property
    def model(self) -> Any: ...

    @property
    def config(self) -> Any: ...

    @property
    def text_config(self) -> Any: ...

    @property
    def family(self) -> VisionFamily: ...

    def decode_logits(self, state: DecodeState) -> torch.Tensor: ...


@dataclass
class _Member:
    state: DecodeState
    params: SamplingParams
    stream: DecodeStream


class BatchDecoder:
    """Decode steps for several :class:`DecodeState` s at once (see the module docstring)."""

    def __init__(self, engine: DecodeModel, *, max_batch: int = 16, record_logits: bool = False):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine = engine
        self.max_batch = max_batch
        self.record_logits = record_logits
        #: key -> logits ``[vocab]`` of the rows of the last step (only with ``record_logits``).
        self.last_logits: dict[Hashable, torch.Tensor] = {}
        #: largest number of rows seen in one forward (for metrics and tests).
        self.max_rows_seen = 0
        #: keys of the rows of the last step's forward (empty when it ran none).
        self.last_forward: tuple[Hashable, ...] = ()
        self._members: dict[Hashable, _Member] = {}
        # Members whose KV is not in the batch cache yet (they still have tokens to emit).
        self._waiting: list[Hashable] = []
        # Rows of the batch cache, in order, with each row's left padding.
        self._rows: list[Hashable] = []
        self._pad: list[int] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask: torch.Tensor | None = None  # [rows, columns], 1 = real position

    # -- membership -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._members

    @property
    def rows(self) -> int:
        return len(self._rows)

    def add(self, key: Hashable, state: DecodeState, params: SamplingParams) -> None:
        """Join the batch before the next step. Raises InvalidRequest for bad params, ValueError
        for a duplicate key or a full batch, EngineError for a state without a usable cache."""
        if key in self._members:
            raise ValueError(f"{key!r} is already in the batch")
        if len(self._members) >= self.max_batch:
            raise ValueError(f"batch is full ({self.max_batch})")
        stream = DecodeStream(self.engine, state, params)  # validates params, replays emitted text
        kv = state.kv_tensors()
        if len(kv) != self.engine.text_config.num_hidden_layers:
            raise EngineError(f"state has {len(kv)} KV layers, model has {self.engine.text_config.num_hidden_layers}")
        if any(k.shape[0] != 1 or k.shape[2] != state.past_len for k, _ in kv):
            raise EngineError(f"state KV shape {tuple(kv[0][0].shape)} does not match past_len {state.past_len}")
        self._members[key] = _Member(state, params, stream)
        self._waiting.append(key)

    def remove(self, key: Hashable) -> DecodeState:
        """Leave the batch (between steps). The returned state owns its KV cache again."""
        member = self._members.get(key)
        if member is None:
            raise KeyError(key)
        if key in self._rows:
            i = self._rows.index(key)
            self._restore_row_cache(i)
            self._drop_rows({key})
        else:
            self._waiting.remove(key)
        del self._members[key]
        self.last_logits.pop(key, None)
        return member.state

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[tuple[Hashable, TokenEvent]]:
        """One event per member: a pending token of a waiting member, or one decoded by a single
        forward over all rows. Finished members leave the batch; their event carries
        ``finish_reason``. Engine failures raise EngineError and leave the batch empty (the
        caches are in an unknown state)."""
        events: list[tuple[Hashable, TokenEvent]] = []
        finished: list[Hashable] = []
        self.last_logits.clear()
        self.last_forward = ()
        try:
            for key in list(self._waiting):
                member = self._members[key]
                if member.stream.needs_step:
                    self._waiting.remove(key)
                    self._join(key, member)
                else:  # e.g. a state straight from prefill: its first token is not emitted yet
                    event = member.stream.emit()
                    events.append((key, event))
                    if event.finish_reason is not None:
                        finished.append(key)
            if self._rows:
                self._forward()
                for key in self._rows:
                    event = self._members[key].stream.emit()
                    events.append((key, event))
                    if event.finish_reason is not None:
                        finished.append(key)
        except (RuntimeError, ValueError, IndexError) as exc:
            self.clear()
            raise EngineError(f"batched decode failed: {exc}") from exc
        except BaseException:
            self.clear()
            raise
        leaving = set(finished)
        self._waiting = [k for k in self._waiting if k not in leaving]
        if leaving & set(self._rows):
            self._drop_rows(leaving)
        for key in finished:
            del self._members[key]
        return events

    def clear(self) -> None:
        self.last_forward = ()
        self._members.clear()
        self._waiting.clear()
        self._rows.clear()
        self._pad.clear()
        self._kv = []
        self._mask = None
        self.last_logits.clear()

    # -- internals ------------------------------------------------------------------------------
    def _forward(self) -> None:
        engine = self.engine
        members = [self._members[k] for k in self._rows]
        self.max_rows_seen = max(self.max_rows_seen, len(members))
        self.last_forward = tuple(self._rows)
        if len(members) == 1:
            # No padding in a single row: exactly the single-request call, bit for bit.
            state = members[0].state
            state.cache = self._cache()
            logits = engine.decode_logits(state)[None]
            self._kv = [(layer.keys, layer.values) for layer in state.cache.layers]
            state.cache = None
            self._mask = torch.ones((1, self._kv[0][0].shape[2]), dtype=torch.long)
        else:
            mask, position_ids = self._batch_inputs(members)
            with torch.inference_mode():
                out = engine.model(
                    input_ids=torch.tensor([[m.state.last_token] for m in members], dtype=torch.long),
                    attention_mask=self._attention_mask(mask),
                    position_ids=position_ids,
                    past_key_values=self._cache(),
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits = out.logits[:, -1]
            self._kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            self._mask = mask
        for key, member, row_logits in zip(self._rows, members, logits):
            if self.record_logits:
                self.last_logits[key] = row_logits.detach().clone()
            member.state.advance(member.stream.sample(row_logits))

    def _batch_inputs(self, members: list[_Member]) -> tuple[torch.Tensor, torch.Tensor]:
        """The padding mask including the new column, and per-row position ids."""
        n = len(members)
        assert self._mask is not None
        mask = torch.cat([self._mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        positions = self.engine.family.decode_positions(
            [m.state.past_len for m in members], [m.state.rope_delta for m in members]
        )
        return mask, positions

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask  # a seam for tests (a negative control that ignores padding)

    def _cache(self):
        from transformers import DynamicCache

        return DynamicCache([(k, v) for k, v in self._kv])  # full layers (see TransformersEngine._prefill)

    def _join(self, key: Hashable, member: _Member) -> None:
        new_kv = member.state.kv_tensors()
        member.state.cache = None  # the batch cache holds it now
        length = member.state.past_len
        if not self._rows:
            self._kv = [(k, v) for k, v in new_kv]
            self._mask = torch.ones((1, length), dtype=torch.long)
            self._rows, self._pad = [key], [0]
            return
        assert self._mask is not None
        cols = self._mask.shape[1]
        width = max(cols, length)
        grow, pad_new = width - cols, width - length
        kv = []
        for (k, v), (nk, nv) in zip(self._kv, new_kv):
            kv.append(
                (
                    torch.cat([_left_pad(k, grow), _left_pad(nk, pad_new)], dim=0),
                    torch.cat([_left_pad(v, grow), _left_pad(nv, pad_new)], dim=0),
                )
            )
        mask_old = torch.cat([torch.zeros((len(self._rows), grow), dtype=torch.long), self._mask], dim=1)
        mask_new = torch.cat(
            [torch.zeros((1, pad_new), dtype=torch.long), torch.ones((1, length), dtype=torch.long)], dim=1
        )
        self._kv = kv
        self._mask = torch.cat([mask_old, mask_new], dim=0)
        self._pad = [p + grow for p in self._pad] + [pad_new]
        self._rows.append(key)

    def _drop_rows(self, keys: set) -> None:
        keep = [i for i, k in enumerate(self._rows) if k not in keys]
        if not keep:
            self._rows, self._pad, self._kv, self._mask = [], [], [], None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        trim = min(self._pad[i] for i in keep)  # padding columns no remaining row needs
        assert self._mask is not None
        self._kv = [
            (k.index_select(0, idx)[:, :, trim:].contiguous(), v.index_select(0, idx)[:, :, trim:].contiguous())
            for k, v in self._kv
        ]
        self._mask = self._mask.index_select(0, idx)[:, trim:].contiguous()
        self._rows = [self._rows[i] for i in keep]
        self._pad = [self._pad[i] - trim for i in keep]

    def _restore_row_cache(self, i: int) -> None:
        from transformers import DynamicCache

        pad = self._pad[i]
        kv = [(k[i : i + 1, :, pad:].clone(), v[i : i + 1, :, pad:].clone()) for k, v in self._kv]
        member = self._members[self._rows[i]]
        member.state.cache = DynamicCache(kv)


# -- the decode loop ----------------------------------------------------------------------------
class _Sink:
    """Where one request's items go: an ``asyncio.Queue`` on the event loop of the coroutine that
    reads them, fed from the compute thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop = loop
        self.queue = queue

    def post(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # that event loop is closed: nobody reads any more
            pass


@dataclass
class _Join:
    key: Hashable
    state: DecodeState
    params: SamplingParams
    sink: _Sink


class DecodeLoop:
    """The batched decode loop behind :meth:`TransformersEngine.decode`.

    * :meth:`join` (any thread; the engine calls it on the event loop) queues a request - its
      ``DecodeState``, already built in the compute thread - with the queue its items go to;
      the first join starts the loop. :meth:`leave` drops a request before the next step (a
      no-op once it finished).
    * The loop is a chain of compute-thread tasks, one step each, each submitting the next while
      any request is left; other compute calls queued meanwhile (encode, prefill, building a
      state) run between two steps. It ends when nothing is left; a later join starts it again.
    * A step (tick): drops requests that left, admits queued joins while rows are free
      (``max_batch``; the rest wait), runs one :meth:`BatchDecoder.step`, posts each event.
    * What a queue receives: ``(TokenEvent, rows)`` items - ``rows``: the rows of the forward
      that produced the token, 0 for a token that needed none - the last event with
      ``finish_reason``; or one exception (the state does not fit: :class:`KVStateMismatch`;
      the batched step failed; the engine closed), then nothing more.
    """

    def __init__(self, decoder: BatchDecoder, executor: Executor):
        self.decoder = decoder
        self._executor = executor
        self._lock = threading.Lock()
        self._joins: list[_Join] = []
        self._cancels: set[Hashable] = set()
        self._sinks: dict[Hashable, _Sink] = {}
        self._running = False
        self._closed = False
        self.steps = 0

    @property
    def active(self) -> int:
        """Requests joined and not finished (decoding or waiting for a row)."""
        with self._lock:
            return len(self._sinks)

    def join(
        self,
        key: Hashable,
        state: DecodeState,
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue,
    ) -> None:
        with self._lock:
            if self._closed:
                raise EngineError("the engine is closed")
            if key in self._sinks:
                raise ValueError(f"{key!r} is already being decoded")
            sink = _Sink(loop, queue)
            self._joins.append(_Join(key, state, params, sink))
            self._sinks[key] = sink
            start = not self._running
            self._running = True
        if start:
            self._schedule()

    def leave(self, key: Hashable) -> None:
        with self._lock:
            if self._sinks.pop(key, None) is not None:
                self._cancels.add(key)

    def close(self) -> None:
        """Fail every request still joined; the loop stops at its next tick."""
        with self._lock:
            self._closed = True
            sinks, self._sinks = self._sinks, {}
            self._joins.clear()
        for sink in sinks.values():
            sink.post(EngineError("the engine was closed"))

    def _schedule(self) -> None:
        try:
            self._executor.submit(self._tick)
        except RuntimeError as exc:  # the compute thread is shut down
            self._fail_all(EngineError(f"the decode loop cannot run: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._running = False
            sinks, self._sinks = self._sinks, {}
            self._joins.clear()
            self._cancels.clear()
        for sink in sinks.values():
            sink.post(exc)

    def _finish(self, key: Hashable, exc: BaseException) -> None:
        with self._lock:
            sink = self._sinks.pop(key, None)
        if sink is not None:
            sink.post(exc)

    # -- compute thread ---------------------------------------------------------------------
    def _tick(self) -> None:
        REQUEST_ID.set("-")  # this thread serves many requests; loop lines carry none
        try:
            more = self._step()
        except BaseException as exc:  # a bug: fail every request rather than leave it hanging
            log.exception("decode loop died")
            self.decoder.clear()
            self._fail_all(EngineError(f"decode loop died: {exc!r}"))
            return
        if more:
            self._schedule()

    def _step(self) -> bool:
        """One tick; False when the loop ends (nothing left)."""
        decoder = self.decoder
        with self._lock:
            if self._closed:
                self._running = False
                decoder.clear()
                return False
            cancels, self._cancels = self._cancels, set()
        for key in cancels:
            if key in decoder:
                decoder.remove(key)
        with self._lock:
            room = max(0, decoder.max_batch - len(decoder))
            joins, self._joins = self._joins[:room], self._joins[room:]
            live = dict(self._sinks)
        for join in joins:
            if join.key not in live:  # left before it joined
                continue
            try:
                decoder.add(join.key, join.state, join.params)
            except InvalidRequest as exc:
                self._finish(join.key, exc)
            except EngineError as exc:  # the state's cache does not fit the model
                self._finish(join.key, KVStateMismatch(str(exc)))
        with self._lock:
            if len(decoder) == 0 and not self._joins:
                self._running = False
                return False
        members = [k for k in live if k in decoder]
        try:
            events = decoder.step()
        except Exception as exc:  # noqa: BLE001 - the whole batch is gone (BatchDecoder cleared itself)
            log.error("batched decode step failed for %d request(s): %s", len(members), exc)
            for key in members:
                self._finish(key, exc)
            return True
        self.steps += 1
        forward = decoder.last_forward
        if forward:
            metrics.DECODE_BATCH_ROWS.observe(len(forward))
        for key, event in events:
            sink = live.get(key)
            if sink is not None:
                sink.post((event, len(forward) if key in forward else 0))
            if event.finish_reason is not None:
                with self._lock:
                    self._sinks.pop(key, None)
        return True


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Zero columns before ``t``'s positions (dim 2)."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[2] = n
    return torch.cat([t.new_zeros(shape), t], dim=2)


#: Most image pixels (width x height, before preprocessing) one encode forward takes: bounds the
#: vision tower's activations (~40 images of 448 x 448); a larger single image still goes alone.
ENCODE_BATCH_PIXELS = 8_000_000


class EncodeBatcher:
    """Concurrent :meth:`TransformersEngine.encode` calls share forwards. A call's preprocessed
    images (``engine._preprocess``) are queued; one drain task at a time takes the queue up to
    :data:`ENCODE_BATCH_PIXELS` and runs ``engine._encode_pixels`` on all of them in the compute
    thread, then hands each call its own features. A failed forward fails every call in it."""

    def __init__(self, engine: Any, max_pixels: int = ENCODE_BATCH_PIXELS):
        self.engine = engine
        self.max_pixels = max_pixels
        self._queue: list[tuple[list[Any], int, asyncio.Future]] = []
        self._draining = False
        self._drain_task: asyncio.Future[None] | None = None  # held: the loop keeps only a weak reference

    async def submit(self, pixels: list[Any], n_pixels: int) -> list[Any]:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((pixels, n_pixels, future))
        if not self._draining:
            self._draining = True
            self._drain_task = asyncio.ensure_future(self._drain())
        return await future

    def _take(self) -> list[tuple[list[Any], int, asyncio.Future]]:
        batch: list[tuple[list[Any], int, asyncio.Future]] = []
        total = 0
        while self._queue and (not batch or total + self._queue[0][1] <= self.max_pixels):
            item = self._queue.pop(0)
            if item[2].done():  # its caller gave up
                continue
            batch.append(item)
            total += item[1]
        return batch

    async def _drain(self) -> None:
        try:
            while batch := self._take():
                flat = [px for pixels, _, _ in batch for px in pixels]
                try:
                    out = await self.engine._call(self.engine._encode_pixels, flat)
                except Exception as exc:  # noqa: BLE001 - handed to every caller in the batch
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                start = 0
                for pixels, _, future in batch:
                    if not future.done():
                        future.set_result(out[start : start + len(pixels)])
                    start += len(pixels)
        finally:
            self._draining = False
            if self._queue:  # arrived after the last take, while this task was finishing
                self._draining = True
                self._drain_task = asyncio.ensure_future(self._drain())
