"""Fingerprints: the version component of every EC object key and every KV object key.

**Encoder fingerprint** (:func:`encoder_fingerprint`, versions EC objects):

The fingerprint is computed from the model folder itself (no torch needed, so the API service
can compute it too): the full ``config.json``, the raw bytes of every vision-tower and projector
tensor in the safetensors files, the image-processor config, the compute dtype and the engine
kind. Any change to any of those gives a new fingerprint, so a store shared by several model
versions (or engines whose kernels differ numerically) can never serve one's encoder outputs to
another.

**Model fingerprint** (:func:`model_fingerprint`, versions KV objects): the same idea over the
WHOLE model - every tensor in the safetensors files (vision tower and language model), the full
``config.json``, ``generation_config.json``, the processor and tokenizer files and the chat
template, the dtype and the engine. A KV cache is only valid for the exact LM weights that
produced it, and its token ids only for the exact tokenizer, so a decode worker of another
model can never continue a request from it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

FINGERPRINT_SCHEMA = "epd-fp-v1"
FINGERPRINT_HEX_CHARS = 24

#: A tensor is part of the encoder if one of its dotted name components is one of these: every
#: tensor a served family's feature path reads (``tests/test_family_fingerprints.py`` finds them by
#: their gradients), and LLaVA-OneVision / LLaVA-NeXT's top-level ``image_newline`` (a row appended
#: to each tile row of features).
ENCODER_COMPONENTS = frozenset(
    {"visual", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "image_newline"}
)
#: the image and video processors' settings (transformers 5 writes both into processor_config.json;
#: earlier folders have a file each)
PROCESSOR_CONFIG_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024


def is_encoder_tensor(name: str) -> bool:
    return any(part in ENCODER_COMPONENTS for part in name.split("."))


def _canonical_json(path: Path) -> bytes:
    return json.dumps(json.loads(path.read_text()), sort_keys=True, separators=(",", ":")).encode()


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, offset of the data section) without loading tensors."""
    with path.open("rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: not a safetensors file (short header)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header too large ({header_len} bytes)")
        header = json.loads(fh.read(header_len))
    return header, 8 + header_len


def _hash_encoder_tensors(model_dir: Path, digest: hashlib._Hash) -> int:
    return _hash_tensors(model_dir, digest, is_encoder_tensor)


def _hash_tensors(model_dir: Path, digest: hashlib._Hash, select) -> int:
    """Feed name, dtype, shape and bytes of every selected tensor (sorted) into ``digest``."""
    count = 0
    for st_path in sorted(model_dir.glob("*.safetensors")):
        header, data_start = read_safetensors_header(st_path)
        names = sorted(n for n in header if n != "__metadata__" and select(n))
        with st_path.open("rb") as fh:
            for name in names:
                info = header[name]
                start, end = info["data_offsets"]
                digest.update(f"{name}|{info['dtype']}|{info['shape']}|".encode())
                fh.seek(data_start + start)
                remaining = end - start
                while remaining > 0:
                    chunk = fh.read(min(_CHUNK, remaining))
                    if not chunk:
                        raise ValueError(f"{st_path}: truncated tensor {name}")
                    digest.update(chunk)
                    remaining -= len(chunk)
                count += 1
    return count


def _start_digest(model_dir: Path, schema: str, *, dtype: str, engine: str) -> hashlib._Hash:
    """A sha256 seeded with the schema, engine, dtype and the canonical ``config.json``."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model folder {model_dir}")
    digest = hashlib.sha256()
    digest.update(f"{schema}|engine={engine}|dtype={dtype}|".encode())
    digest.update(b"config|" + _canonical_json(config_path))
    return digest


def encoder_fingerprint(model_dir: str | Path, *, dtype: str, engine: str) -> str:
    """Fingerprint of the encoder outputs that ``engine`` produces from ``model_dir`` in ``dtype``."""
    model_dir = Path(model_dir)
    digest = _start_digest(model_dir, FINGERPRINT_SCHEMA, dtype=dtype, engine=engine)
    for name in PROCESSOR_CONFIG_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(f"|{name}|".encode() + _canonical_json(path))
    if _hash_encoder_tensors(model_dir, digest) == 0:
        raise ValueError(f"no vision-encoder tensors found in {model_dir}/*.safetensors")
    return digest.hexdigest()[:FINGERPRINT_HEX_CHARS]


MODEL_FINGERPRINT_SCHEMA = "epd-model-fp-v1"
#: Besides config.json and the weights: files that change what a KV cache or its tokens mean.
MODEL_FILES = (
    "generation_config.json",
    *PROCESSOR_CONFIG_FILES,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
)


def model_fingerprint(model_dir: str | Path, *, dtype: str, engine: str) -> str:
    """Fingerprint of the whole model (all weights, config, tokenizer, template) in ``dtype``
    under ``engine``: the version of KV objects. Reads every weight byte once (about 1-2 GB/s)."""
    model_dir = Path(model_dir)
    digest = _start_digest(model_dir, MODEL_FINGERPRINT_SCHEMA, dtype=dtype, engine=engine)
    for name in MODEL_FILES:
        path = model_dir / name
        if path.is_file():
            data = _canonical_json(path) if name.endswith(".json") else path.read_bytes()
            digest.update(f"|{name}|{len(data)}|".encode() + data)
    if _hash_tensors(model_dir, digest, lambda _name: True) == 0:
        raise ValueError(f"no tensors found in {model_dir}/*.safetensors")
    return digest.hexdigest()[:FINGERPRINT_HEX_CHARS]
