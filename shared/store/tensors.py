"""torch <-> EC object conversion (imports torch; only model workers use this module)."""

from __future__ import annotations

from typing import cast

import torch

from shared.store.format import ECObject, RawTensor
from shared.store.kv import KVObject
from shared.engines.base import EncodedImage

_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"F32"`` (KeyError for dtypes the format does not carry)."""
    return _TO_ST[dtype]


def tensor_to_raw(t: torch.Tensor) -> tuple[bytes, str, tuple[int, ...]]:
    """Raw little-endian bytes, safetensors dtype name and shape of a CPU copy of ``t``."""
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return raw, _TO_ST[t.dtype], tuple(t.shape)


def raw_to_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(_FROM_ST[dtype]).reshape(shape)


def encoded_to_extra(item: EncodedImage) -> dict:
    return {"grid_thw": list(item.grid_thw)} if item.grid_thw is not None else {}


def ec_object_to_encoded(obj: ECObject) -> EncodedImage:
    grid = obj.extra.get("grid_thw")
    return EncodedImage(
        features=raw_to_tensor(obj.data, obj.dtype, obj.shape),
        grid_thw=cast("tuple[int, int, int]", tuple(int(x) for x in grid)) if grid else None,
    )


# -- KV objects (E|P|D hand-off) ----------------------------------------------------------------
def decode_state_to_raw(state) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """A ``DecodeState`` as raw tensors + its metadata, for :class:`shared.store.kv.KVStore`."""
    tensors, meta = state.to_tensors()
    return {name: RawTensor(*tensor_to_raw(t)) for name, t in tensors.items()}, meta


def kv_object_to_state(obj: KVObject, config):
    """Rebuild the ``DecodeState`` of a validated KV object (``config``: the model config).
    Raises EngineError when the state does not fit the model (layers, heads, shapes)."""
    from shared.engines.transformers_engine import DecodeState

    tensors = {name: raw_to_tensor(t.data, t.dtype, t.shape) for name, t in obj.tensors.items()}
    return DecodeState.from_tensors(tensors, obj.state_metadata, config)
