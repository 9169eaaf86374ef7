"""Batched decode for the transformers engine: many requests, one LM forward per step.

A :class:`BatchDecoder` owns the KV caches of its members as ONE padded cache
(``[batch, kv_heads, columns, head_dim]`` per layer, every row right-aligned: a row's real
positions are its last ``past_len`` columns, the columns before them are zero padding). Each
:meth:`BatchDecoder.step` feeds every member's ``last_token`` in one forward with

* a 2-D ``attention_mask`` that masks each row's padding columns,
* explicit per-row ``position_ids`` (``past_len``, and for Qwen2-VL M-RoPE ``past_len +
  rope_delta`` on the t/h/w rows), so padding never shifts a position,

then samples each row with its own :class:`SamplingParams` and generator and turns the token
into a :class:`TokenEvent` through the same :class:`DecodeStream` the single-request loop uses.

Members join (:meth:`add`) and leave (:meth:`remove`, or by finishing) between steps only. A
join left-pads the smaller side to a common column count and concatenates rows; a leave drops
the row and trims the padding columns no remaining row needs. A batch of one row has no
padding, and then the step is the single-request call (:meth:`TransformersEngine.decode_logits`)
bit for bit, so a request alone in a decode worker decodes exactly like the aggregated engine.

Numerics: with two or more rows the matmuls run with M = rows instead of 1 and attention runs
over the padded column count, so logits can differ from the single-request run in the last bits
(measured on the tiny models: see README, "Batching"). Greedy tokens are equal unless two logits
tie within that difference.

Not thread-safe: call it from the engine thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable

import torch

from shared.engines.base import SamplingParams, TokenEvent
from shared.engines.transformers_engine import DecodeState, DecodeStream, TransformersEngine, sample_next
from shared.errors import EngineError

log = logging.getLogger(__name__)


@dataclass
class _Member:
    state: DecodeState
    params: SamplingParams
    stream: DecodeStream


class BatchDecoder:
    """Decode steps for several :class:`DecodeState` s at once (see the module docstring)."""

    def __init__(self, engine: TransformersEngine, *, max_batch: int = 16, record_logits: bool = False):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine = engine
        self.max_batch = max_batch
        self.record_logits = record_logits
        #: key -> logits ``[vocab]`` of the rows of the last step (only with ``record_logits``).
        self.last_logits: dict[Hashable, torch.Tensor] = {}
        #: largest number of rows seen in one forward (for metrics and tests).
        self.max_rows_seen = 0
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
            member.state.advance(sample_next(row_logits, member.params, member.state.generator))

    def _batch_inputs(self, members: list[_Member]) -> tuple[torch.Tensor, torch.Tensor]:
        """The padding mask including the new column, and per-row position ids."""
        n = len(members)
        assert self._mask is not None
        mask = torch.cat([self._mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        text_pos = torch.tensor([[m.state.past_len] for m in members], dtype=torch.long)  # [n, 1]
        if not self.engine.is_mrope:
            return mask, text_pos
        rope = torch.tensor([[m.state.past_len + m.state.rope_delta] for m in members], dtype=torch.long)
        # [4, n, 1]: text positions (used for the mask), then the t/h/w M-RoPE positions.
        return mask, torch.stack([text_pos, rope, rope, rope])

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask  # a seam for tests (a negative control that ignores padding)

    def _cache(self):
        from transformers import DynamicCache

        return DynamicCache([(k, v) for k, v in self._kv], config=self.engine.config)

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
            kv.append((torch.cat([_left_pad(k, grow), _left_pad(nk, pad_new)], dim=0),
                       torch.cat([_left_pad(v, grow), _left_pad(nv, pad_new)], dim=0)))
        mask_old = torch.cat([torch.zeros((len(self._rows), grow), dtype=torch.long), self._mask], dim=1)
        mask_new = torch.cat([torch.zeros((1, pad_new), dtype=torch.long), torch.ones((1, length), dtype=torch.long)],
                             dim=1)
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
        member.state.cache = DynamicCache(kv, config=self.engine.config)


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Zero columns before ``t``'s positions (dim 2)."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[2] = n
    return torch.cat([t.new_zeros(shape), t], dim=2)

