"""KV objects (E|P|D hand-off): the shared tensor-object format, the model fingerprint, and
KVStore on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
import shutil
import struct
import time

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from shared.fingerprint import encoder_fingerprint, model_fingerprint, read_safetensors_header
from shared.store.format import (
    MissReason,
    ObjectValidationError,
    RawTensor,
    decode_tensor_object,
    encode_tensor_object,
)
from shared.store.kv import KV_SCHEMA, KVStore, decode_kv_object, encode_kv_object, kv_key
from shared.store.objects import ObjectTooLarge

FP = "a" * 24


def raw(arr: np.ndarray, dtype: str) -> RawTensor:
    return RawTensor(arr.tobytes(), dtype, tuple(arr.shape))


@pytest.fixture
def tensors():
    rng = np.random.default_rng(0)
    return {
        "kv.0.k": raw(rng.standard_normal((1, 2, 5, 4)).astype(np.float32), "F32"),
        "kv.0.v": raw(rng.standard_normal((1, 2, 5, 4)).astype(np.float32), "F32"),
        "generator_state": raw(rng.integers(0, 256, 13, dtype=np.uint8), "U8"),  # odd size: alignment
        "ids": raw(np.arange(3, dtype=np.int64), "I64"),
    }


def make(tensors, **kw):
    args = dict(
        schema="test-v1", fingerprint=FP, id_field="request_id", object_id="req-1", producer="w", metadata={"note": "x"}
    )
    args.update(kw)
    return encode_tensor_object(tensors, **args)


def check(blob, **kw):
    args = dict(schema="test-v1", fingerprint=FP, id_field="request_id", object_id="req-1")
    args.update(kw)
    return decode_tensor_object(blob, **args)


def _header(blob):
    (n,) = struct.unpack("<Q", blob[:8])
    return n, json.loads(blob[8 : 8 + n])


def _rebuild(blob, header):
    n, _ = _header(blob)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + blob[8 + n :]


# -- the generic tensor object ------------------------------------------------------------------
def test_round_trip_alignment_and_standard_safetensors(tensors):
    blob = make(tensors)
    obj = check(blob)
    assert obj.tensors == tensors and obj.metadata["note"] == "x" and obj.producer == "w"
    loaded = st_load(blob)  # any safetensors reader opens it
    for name, t in tensors.items():
        assert loaded[name].tobytes() == t.data
    n, header = _header(blob)
    for name, info in header.items():
        if name != "__metadata__":
            start = info["data_offsets"][0]
            assert (8 + n + start) % {"F32": 4, "I64": 8, "U8": 1}[info["dtype"]] == 0, name


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), MissReason.CHECKSUM_MISMATCH),
        (lambda b: b[:-3], MissReason.CORRUPT),
        (lambda b: b + b"\0", MissReason.CORRUPT),
        (lambda b: b[:7], MissReason.CORRUPT),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], MissReason.CORRUPT),
    ],
    ids=["flipped-bit", "truncated", "trailing-byte", "header-cut", "huge-header"],
)
def test_corruption_is_a_typed_miss(tensors, mutate, reason):
    blob = make(tensors)
    check(blob)  # control
    with pytest.raises(ObjectValidationError) as exc:
        check(mutate(blob))
    assert exc.value.reason is reason


def test_header_lies_are_detected(tensors):
    blob = make(tensors)
    _, header = _header(blob)
    header["kv.0.k"]["shape"] = [1, 2, 4, 5]  # same byte count, other shape
    with pytest.raises(ObjectValidationError) as exc:
        check(_rebuild(blob, header))
    assert exc.value.reason is MissReason.SHAPE_MISMATCH
    _, header = _header(blob)
    del header["ids"]
    with pytest.raises(ObjectValidationError) as exc:
        check(_rebuild(blob, header))
    assert exc.value.reason is MissReason.SHAPE_MISMATCH


def test_schema_fingerprint_and_id_are_checked(tensors):
    blob = make(tensors)
    for kw, reason in [
        ({"schema": "test-v2"}, MissReason.SCHEMA_MISMATCH),
        ({"fingerprint": "b" * 24}, MissReason.FINGERPRINT_MISMATCH),
        ({"object_id": "req-2"}, MissReason.ITEM_MISMATCH),
    ]:
        with pytest.raises(ObjectValidationError) as exc:
            check(blob, **kw)
        assert exc.value.reason is reason


def test_writer_rejects_bad_input(tensors):
    with pytest.raises(ValueError):
        make({})
    with pytest.raises(ValueError):
        make({"x": RawTensor(b"123", "F32", (1,))})
    with pytest.raises(ValueError):
        make(tensors, metadata={"sha256": "forged"})
    with pytest.raises(ValueError):
        make(tensors, metadata={"big": "x" * 2_000_000})  # header over the bound


# -- KV objects ---------------------------------------------------------------------------------
STATE_META = {"schema": "epd-decode-state-v1", "state": json.dumps({"past_len": 5, "emitted": 1})}
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": ["x"], "ignore_eos": False}


def test_kv_object_checks_request_attempt_and_model(tensors):
    blob = encode_kv_object(
        tensors,
        state_metadata=STATE_META,
        sampling=SAMPLING,
        fingerprint=FP,
        request_id="req-1",
        attempt=0,
        producer="p",
    )
    obj = decode_kv_object(blob, fingerprint=FP, request_id="req-1", attempt=0)
    assert obj.state == {"past_len": 5, "emitted": 1} and obj.sampling == SAMPLING
    assert obj.state_metadata == STATE_META and obj.nbytes == len(blob)
    for kw, reason in [
        (dict(fingerprint="b" * 24, request_id="req-1", attempt=0), MissReason.FINGERPRINT_MISMATCH),
        (dict(fingerprint=FP, request_id="req-2", attempt=0), MissReason.ITEM_MISMATCH),
        (dict(fingerprint=FP, request_id="req-1", attempt=1), MissReason.ITEM_MISMATCH),
    ]:
        with pytest.raises(ObjectValidationError) as exc:
            decode_kv_object(blob, **kw)
        assert exc.value.reason is reason
    # An EC reader never takes a KV object, and vice versa.
    with pytest.raises(ObjectValidationError) as exc:
        check(blob, schema="epd-ec-v2")
    assert exc.value.reason is MissReason.SCHEMA_MISMATCH
    assert _header(blob)[1]["__metadata__"]["schema"] == KV_SCHEMA


def test_kv_key_scheme():
    assert kv_key("ns", FP, "chatcmpl-1f", 2) == f"ns/kv/{FP}/chatcmpl-1f-2"
    for bad in ("a/b", "", "x" * 300, "sp ace"):
        with pytest.raises(ValueError):
            kv_key("ns", FP, bad, 0)


def test_kv_store_on_s3(s3_store, tensors):
    kv = KVStore(s3_store, namespace="ns", fingerprint=FP, producer="p", max_object_bytes=1 << 20)
    key, blob = kv.encode("req-1", 0, tensors, STATE_META, SAMPLING)
    kv.put(key, blob)
    assert kv.load(key, request_id="req-1", attempt=0).tensors == tensors
    # A corrupted object is a miss with its reason, never data.
    bad = bytearray(blob)
    bad[-2] ^= 0xFF
    s3_store.put(key, bytes(bad))
    with pytest.raises(ObjectValidationError) as exc:
        kv.load(key, request_id="req-1", attempt=0)
    assert exc.value.reason is MissReason.CHECKSUM_MISMATCH
    # Another model's key is refused without reading it; a missing object is NOT_FOUND.
    other = KVStore(s3_store, namespace="ns", fingerprint="c" * 24, producer="p", max_object_bytes=1 << 20)
    with pytest.raises(ObjectValidationError) as exc:
        kv.load(other.key("req-1", 0), request_id="req-1", attempt=0)
    assert exc.value.reason is MissReason.FINGERPRINT_MISMATCH
    kv.delete(key)
    with pytest.raises(ObjectValidationError) as exc:
        kv.load(key, request_id="req-1", attempt=0)
    assert exc.value.reason is MissReason.NOT_FOUND


def test_kv_store_bounds_sizes(s3_store, tensors):
    small = KVStore(s3_store, namespace="ns", fingerprint=FP, producer="p", max_object_bytes=200)
    with pytest.raises(ObjectTooLarge):
        small.encode("req-1", 0, tensors, STATE_META, SAMPLING)
    big = KVStore(s3_store, namespace="ns", fingerprint=FP, producer="p", max_object_bytes=1 << 20)
    key, blob = big.encode("req-1", 0, tensors, STATE_META, SAMPLING)
    big.put(key, blob)
    with pytest.raises(ObjectValidationError) as exc:  # a reader with a smaller bound never reads it
        small.load(small.key("req-1", 0), request_id="req-1", attempt=0)
    assert exc.value.reason is MissReason.TOO_LARGE


def test_sweep_removes_only_old_kv_objects(s3_store, tensors):
    kv = KVStore(s3_store, namespace="ns", fingerprint=FP, producer="p", max_object_bytes=1 << 20)
    other_model = KVStore(s3_store, namespace="ns", fingerprint="d" * 24, producer="p", max_object_bytes=1 << 20)
    keys = []
    for store, rid in ((kv, "old-1"), (other_model, "old-2")):
        key, blob = store.encode(rid, 0, tensors, STATE_META, SAMPLING)
        store.put(key, blob)
        keys.append(key)
    s3_store.put("ns/media/not-a-kv-object", b"image bytes")
    assert kv.sweep(3600) == 0  # fresh objects stay
    assert kv.sweep(3600, now=time.time() + 7200) == 2  # old ones of any model go
    assert all(s3_store.stat(k) is None for k in keys)
    assert s3_store.stat("ns/media/not-a-kv-object") is not None


# -- a real decode state through the store ------------------------------------------------------
async def test_decode_state_round_trip_through_the_store(s3_store, reference_engine, tiny_model_dir):
    from shared.engines.base import SamplingParams
    from shared.engines.transformers_state import kv_object_to_state
    from tests.stackutil import engine_messages, noise_image

    engine = reference_engine
    messages, images = engine_messages("Describe the image.", 1), await engine.encode([noise_image(5, (64, 48))])
    for params in (
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    ):
        want = [e async for e in engine.generate(messages, images, params)]
        prefilled = await engine.prefill(messages, images, params)  # prefill's worker emits the first token
        tensors, state_metadata = await prefilled.export()
        await prefilled.release()
        fp = model_fingerprint(tiny_model_dir, dtype="float32", engine="transformers")
        kv = KVStore(s3_store, namespace="ns", fingerprint=fp, producer="p", max_object_bytes=1 << 26)
        key, blob = kv.encode("req-rt", 0, tensors, state_metadata, SAMPLING)
        kv.put(key, blob)
        obj = kv.load(key, request_id="req-rt", attempt=0)
        restored = kv_object_to_state(obj, engine.config)
        assert restored.rope_delta == json.loads(state_metadata["state"])["rope_delta"] != 0  # M-RoPE offset
        rest = [e async for e in engine.decode(obj, params)]
        assert [prefilled.first, *rest] == want


# -- the model fingerprint ----------------------------------------------------------------------
def _flip_tensor_byte(model_dir, select):
    path = next(model_dir.glob("*.safetensors"))
    header, start = read_safetensors_header(path)
    name = next(n for n in sorted(header) if n != "__metadata__" and select(n))
    data = bytearray(path.read_bytes())
    data[start + header[name]["data_offsets"][0]] ^= 1
    path.write_bytes(bytes(data))
    return name


def test_model_fingerprint_covers_lm_weights_tokenizer_dtype_engine(tiny_model_dir, tmp_path):
    def fps(d, dtype="float32", engine="transformers"):
        return (model_fingerprint(d, dtype=dtype, engine=engine), encoder_fingerprint(d, dtype=dtype, engine=engine))

    base_model, base_enc = fps(tiny_model_dir)
    assert fps(tiny_model_dir) == (base_model, base_enc)  # stable
    assert fps(tiny_model_dir, dtype="bfloat16")[0] != base_model
    assert fps(tiny_model_dir, engine="vllm")[0] != base_model

    lm = tmp_path / "lm"
    shutil.copytree(tiny_model_dir, lm)
    name = _flip_tensor_byte(lm, lambda n: "layers" in n and "visual" not in n)
    assert "visual" not in name
    model_fp, enc_fp = fps(lm)
    assert model_fp != base_model  # an LM weight changes the KV version ...
    assert enc_fp == base_enc  # ... but not the encoder's

    tok = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 12345
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert fps(tok)[0] != base_model


def test_kv_store_exists_and_stat(s3_store, tensors):
    from shared.store.kv import KVRef

    kv = KVStore(s3_store, namespace="ns", fingerprint=FP, producer="p", max_object_bytes=1 << 20)
    ref = KVRef("req-stat", 0)
    assert not kv.exists(ref) and kv.stat(ref) is None
    key, blob = kv.encode(*ref, tensors, STATE_META, SAMPLING)
    kv.put(key, blob)
    assert kv.exists(ref) and kv.stat(ref).size == len(blob) and kv.object_key(ref) == key
    other_model = KVStore(s3_store, namespace="ns", fingerprint="d" * 24, producer="p", max_object_bytes=1 << 20)
    assert not other_model.exists(ref)
    kv.delete(key)
    assert not kv.exists(ref)
