"""The layout of a vLLM paged-KV object (a KV object of :mod:`shared.store.kv`), written by the
KV connector's worker side and checked by its scheduler side.

Tensors: ``kv.<layer name>`` (``[blocks, *per-block shape]`` of vLLM's paged cache: every block
holding a prompt token; the last one may be partly filled) and ``token_ids`` (I64, the prompt).
State (``state_metadata``, schema :data:`STATE_SCHEMA`): engine, block size, token count,
per-layer block shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from shared.connectors.common import ENGINE_NAME
from shared.store.format import MissReason, ObjectValidationError, RawTensor
from shared.store.kv import KVObject
from shared.store.tensors import raw_to_tensor, tensor_to_raw

#: ``state_metadata["schema"]`` of a vLLM paged-KV object (the transformers engine writes others)
STATE_SCHEMA = "vllm-paged-kv-v1"
LAYER_PREFIX = "kv."


def blocks_for(start: int, end: int, block_size: int) -> range:
    """Indexes (within a request) of the blocks holding tokens ``start .. end-1``."""
    return range(start // block_size, -(-end // block_size))


def paged_kv_tensors(
    token_ids: tuple[int, ...], block_ids: tuple[int, ...], layers: Mapping[str, torch.Tensor], block_size: int
) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """The tensors and state metadata of a request's KV object: every block holding its prompt,
    per layer. The last block may be partly filled; its other slots are never read (decode
    overwrites them). Raises ValueError."""
    if not layers:
        raise ValueError("no attention layer was saved in this step")
    n = len(token_ids)
    index = list(blocks_for(0, n, block_size))
    if index[-1] >= len(block_ids):
        raise ValueError(f"request has {len(block_ids)} blocks for {n} tokens")
    tensors: dict[str, RawTensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, kv_layer in sorted(layers.items()):
        blocks = torch.tensor([block_ids[i] for i in index], dtype=torch.long, device=kv_layer.device)
        tensors[LAYER_PREFIX + name] = RawTensor(*tensor_to_raw(kv_layer[blocks]))
        shapes[name] = list(kv_layer.shape[1:])
    tensors["token_ids"] = RawTensor(*tensor_to_raw(torch.tensor(token_ids, dtype=torch.int64)))
    state = {"engine": ENGINE_NAME, "num_tokens": n, "block_size": block_size, "block_shapes": shapes}
    return tensors, {"schema": STATE_SCHEMA, "state": json.dumps(state, sort_keys=True)}


def check_kv_object(
    obj: KVObject, prompt: tuple[int, ...], block_size: int, layout: dict[str, tuple[int, str]] | None
) -> tuple[dict[str, RawTensor], int]:
    """Check a validated KV object against the request and this engine: its schema and block
    size, that its token ids are (a prefix of) the request's prompt, and its layers' block sizes
    and dtypes (``layout``: layer name -> (values per block, safetensors dtype), None: unknown).
    Returns (layer tensors, number of tokens). Raises ObjectValidationError."""
    if obj.state_metadata.get("schema") != STATE_SCHEMA:
        raise ObjectValidationError(
            MissReason.SCHEMA_MISMATCH, f"decode state schema {obj.state_metadata.get('schema')!r} != {STATE_SCHEMA}"
        )
    state = obj.state
    n = state.get("num_tokens")
    ids = obj.tensors.get("token_ids")
    if not isinstance(n, int) or n < 1 or ids is None or ids.dtype != "I64" or ids.shape != (n,):
        raise ObjectValidationError(MissReason.CORRUPT, "KV object token ids / count are malformed")
    if state.get("block_size") != block_size:
        raise ObjectValidationError(
            MissReason.SHAPE_MISMATCH, f"KV object block size {state.get('block_size')} != this engine's {block_size}"
        )
    stored = raw_to_tensor(ids.data, ids.dtype, ids.shape).tolist()
    if n > len(prompt) or tuple(stored) != prompt[:n]:
        raise ObjectValidationError(MissReason.ITEM_MISMATCH, "KV object was computed for another prompt")
    n_blocks = -(-n // block_size)
    tensors = {name: t for name, t in obj.tensors.items() if name.startswith(LAYER_PREFIX)}
    for name, t in tensors.items():
        if not t.shape or t.shape[0] != n_blocks:
            raise ObjectValidationError(MissReason.SHAPE_MISMATCH, f"{name} holds {t.shape} for {n_blocks} blocks")
    if layout is not None:
        have = {name[len(LAYER_PREFIX) :]: (math.prod(t.shape[1:]), t.dtype) for name, t in tensors.items()}
        if set(have) != set(layout):
            raise ObjectValidationError(
                MissReason.SHAPE_MISMATCH, f"layers {sorted(have)[:3]}... != this engine's {sorted(layout)[:3]}..."
            )
        for name, expected in layout.items():
            if have[name] != expected:
                raise ObjectValidationError(
                    MissReason.SHAPE_MISMATCH, f"layer {name}: (values per block, dtype) {have[name]} != {expected}"
                )
    return tensors, n
