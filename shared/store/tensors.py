"""torch <-> raw tensor conversion for the tensor-object format (imports torch; only model
workers and the vLLM connectors use this module). What the tensors mean belongs to their owners:
an encoder output <-> ``EncodedImage`` in :mod:`shared.engines.ec_objects`, a transformers decode
state <-> KV object in :mod:`shared.engines.transformers_state`."""

from __future__ import annotations

import torch

_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
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
