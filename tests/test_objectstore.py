"""The object-store contract, against a real S3 server (SeaweedFS) and the fs backend."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from shared.errors import EPDError, StoreError, error_from_code
from shared.store.objects import (
    STORE_BACKENDS,
    InvalidObjectKey,
    LocalDirObjectStore,
    ObjectInfo,
    ObjectStore,
    ObjectTooLarge,
    S3ObjectStore,
    make_object_store,
)
from shared.tools.infra import EmbeddedS3, free_port


@pytest.fixture(params=["s3", "fs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    fs = LocalDirObjectStore(tmp_path / "bucket")
    fs.ensure_bucket()
    return fs


# -- the contract on both backends -------------------------------------------------------------
def test_put_get_stat_roundtrip(store: ObjectStore) -> None:
    data = os.urandom(1000)
    before = time.time()
    store.put("ec/abc/features.safetensors", data, metadata={"Model-Id": "tiny-llava", "x-amz-meta-shape": "256x768"})
    assert store.get("ec/abc/features.safetensors", max_bytes=10_000) == data
    info = store.stat("ec/abc/features.safetensors")
    assert isinstance(info, ObjectInfo)
    assert info.key == "ec/abc/features.safetensors"
    assert info.size == 1000
    assert info.etag == hashlib.md5(data).hexdigest()
    assert info.metadata == {"model-id": "tiny-llava", "shape": "256x768"}
    assert info.last_modified is not None and abs(info.last_modified - before) < 120
    assert store.exists("ec/abc/features.safetensors")


def test_overwrite_replaces_data_and_metadata(store: ObjectStore) -> None:
    store.put("k", b"one", metadata={"a": "1"})
    store.put("k", b"second", metadata={"b": "2"})
    assert store.get("k", max_bytes=100) == b"second"
    info = store.stat("k")
    assert info is not None and info.size == 6 and info.metadata == {"b": "2"}


def test_empty_object_and_no_metadata(store: ObjectStore) -> None:
    store.put("empty", b"")
    assert store.get("empty", max_bytes=0) == b""
    info = store.stat("empty")
    assert info is not None and info.size == 0 and info.metadata == {}


def test_missing_key_is_none(store: ObjectStore) -> None:
    assert store.get("nope/missing", max_bytes=10) is None
    assert store.stat("nope/missing") is None
    assert not store.exists("nope/missing")


def test_max_bytes_enforced(store: ObjectStore) -> None:
    store.put("big", b"x" * 1000)
    with pytest.raises(ObjectTooLarge) as excinfo:
        store.get("big", max_bytes=999)
    err = excinfo.value
    assert isinstance(err, EPDError) and err.code == "object_too_large"
    assert err.key == "big" and err.size == 1000 and err.max_bytes == 999
    assert "1000" in str(err) and "999" in str(err)
    assert store.get("big", max_bytes=1000) == b"x" * 1000
    # the store still works after an aborted read (connection dropped, not drained)
    assert store.get("big", max_bytes=5000) == b"x" * 1000
    with pytest.raises(ValueError):
        store.get("big", max_bytes=-1)


def test_multi_megabyte_object(store: ObjectStore) -> None:
    data = os.urandom(9 * 1024 * 1024 + 17)  # over SeaweedFS' 4 MB chunk and minio's 5 MB part
    store.put("large/obj", data)
    assert store.get("large/obj", max_bytes=len(data)) == data
    info = store.stat("large/obj")
    assert info is not None and info.size == len(data)
    assert info.etag == hashlib.md5(data).hexdigest()  # single PUT, not multipart
    with pytest.raises(ObjectTooLarge):
        store.get("large/obj", max_bytes=len(data) - 1)


def test_delete_is_idempotent(store: ObjectStore) -> None:
    store.put("d/x", b"1")
    store.delete("d/x")
    assert store.get("d/x", max_bytes=10) is None
    store.delete("d/x")
    store.delete("never/existed")


def test_list_by_prefix(store: ObjectStore) -> None:
    keys = ["p/a", "p/b/c", "p/b/d", "pz", "q/x", "p-dash"]
    for i, k in enumerate(keys):
        store.put(k, b"v" * (i + 1), metadata={"i": str(i)})

    def names(prefix: str) -> list[str]:
        # S3 itself lists in byte order, SeaweedFS directory-wise: the contract leaves it open
        return sorted(o.key for o in store.list(prefix))

    assert names("p/") == ["p/a", "p/b/c", "p/b/d"]
    assert names("p/b") == ["p/b/c", "p/b/d"]
    assert names("p") == ["p-dash", "p/a", "p/b/c", "p/b/d", "pz"]
    assert names("") == sorted(keys)
    assert names("nothing/") == []
    infos = {o.key: o for o in store.list("q/")}
    assert infos["q/x"].size == 5
    assert infos["q/x"].etag == hashlib.md5(b"v" * 5).hexdigest()
    assert infos["q/x"].last_modified is not None
    assert infos["q/x"].metadata == {}  # listings carry no user metadata: use stat()


def test_key_and_file_prefix_do_not_collide(store: ObjectStore) -> None:
    store.put("a", b"file")
    store.put("a/b", b"nested")
    assert store.get("a", max_bytes=10) == b"file"
    assert store.get("a/b", max_bytes=10) == b"nested"
    store.delete("a/b")
    assert store.get("a", max_bytes=10) == b"file"


def test_ensure_bucket_idempotent(store: ObjectStore) -> None:
    store.put("keep", b"1")
    store.ensure_bucket()
    store.ensure_bucket()
    assert store.get("keep", max_bytes=10) == b"1"


@pytest.mark.parametrize(
    "key",
    [
        "../escape",
        "a/../../b",
        "/abs/path",
        "",
        "a//b",
        "trailing/",
        "./x",
        "a/./b",
        "nul\x00",
        "x" * 1025,
    ],
)
def test_invalid_keys_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidObjectKey):
        store.put(key, b"x")
    with pytest.raises(ValueError):  # InvalidObjectKey is a ValueError
        store.get(key, max_bytes=10)
    with pytest.raises(InvalidObjectKey):
        store.delete(key)


@pytest.mark.parametrize(
    "metadata",
    [
        {"bad key": "v"},
        {"under_score": "v"},
        {"k": "non-ascii é"},
        {"k": " padded"},
        {"k": "line\nbreak"},
        {"k": "v" * 3000},
        {"A": "1", "a": "2"},
    ],
)
def test_invalid_metadata_rejected(store: ObjectStore, metadata: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        store.put("m", b"x", metadata=metadata)
    assert store.stat("m") is None


# -- S3 specifics ------------------------------------------------------------------------------
def test_s3_wrong_credentials_raise_store_error_without_secret(s3_server: EmbeddedS3, s3_store: S3ObjectStore) -> None:
    secret = "Wr0ngSecretThatMustNotLeak-" + uuid.uuid4().hex
    bad = S3ObjectStore(s3_server.endpoint, s3_server.access_key, secret, s3_store.bucket, region="us-east-1")
    for call in (
        lambda: bad.get("k", max_bytes=10),
        lambda: bad.put("k", b"v"),
        bad.ensure_bucket,
        lambda: list(bad.list("")),
    ):
        with pytest.raises(StoreError) as excinfo:
            call()
        err = excinfo.value
        text = f"{err} {err!r} {err.message} {err.__cause__!r}"
        assert secret not in text
        assert err.code == "store_error"
        # GET/PUT carry S3's SignatureDoesNotMatch; a HEAD (bucket_exists) only a bare 403
        assert "SignatureDoesNotMatch" in str(err) or "AccessDenied" in str(err)
        assert "check the S3 access key" in str(err)
        assert s3_store.bucket in str(err) and s3_server.endpoint in str(err)
    assert secret not in repr(bad)
    unknown = S3ObjectStore(s3_server.endpoint, "nosuchaccesskey", secret, s3_store.bucket)
    with pytest.raises(StoreError) as excinfo:
        unknown.stat("k")  # region discovery (GetBucketLocation) fails first
    assert secret not in str(excinfo.value)
    assert "nosuchaccesskey" in str(excinfo.value)


def test_s3_unreachable_server_raises_store_error() -> None:
    secret = "unreachable-secret-" + uuid.uuid4().hex
    store = S3ObjectStore(
        f"127.0.0.1:{free_port()}", "ak", secret, "some-bucket", region="us-east-1", connect_timeout=1, max_retries=1
    )
    t0 = time.monotonic()
    with pytest.raises(StoreError) as excinfo:
        store.get("k", max_bytes=10)
    assert time.monotonic() - t0 < 60  # a refused connect fails at once; the bound only catches a hang
    assert "cannot reach" in str(excinfo.value) and secret not in str(excinfo.value)


def test_s3_missing_bucket_is_store_error(s3_server: EmbeddedS3) -> None:
    store = S3ObjectStore(
        s3_server.endpoint,
        s3_server.access_key,
        s3_server.secret_key,
        f"epd-missing-{uuid.uuid4().hex[:8]}",
        region="us-east-1",
    )
    with pytest.raises(StoreError, match="NoSuchBucket"):
        store.get("k", max_bytes=10)
    with pytest.raises(StoreError):
        store.put("k", b"v")
    with pytest.raises(StoreError):
        list(store.list(""))
    assert store.stat("k") is None  # HEAD cannot tell a missing bucket from a missing key


def test_s3_ensure_bucket_race_safe(s3_server: EmbeddedS3) -> None:
    bucket = f"epd-race-{uuid.uuid4().hex[:8]}"
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def create() -> None:
        s = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)
        barrier.wait()
        try:
            s.ensure_bucket()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on by the test
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = S3ObjectStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)
    s.put("x", b"1")
    assert s.get("x", max_bytes=1) == b"1"


def test_s3_endpoint_forms_and_bad_bucket_names() -> None:
    s = S3ObjectStore("http://127.0.0.1:9000/", "ak", "sk", "good-bucket")
    assert s.endpoint == "127.0.0.1:9000" and s.secure is False
    s = S3ObjectStore("https://s3.example.com", "ak", "sk", "good-bucket")
    assert s.secure is True
    for bad in ("UPPER", "ab", "under_score", "a" * 64):
        with pytest.raises(ValueError):
            S3ObjectStore("127.0.0.1:9000", "ak", "sk", bad)


# -- fs specifics ------------------------------------------------------------------------------
def test_fs_refuses_dotdot_keys_and_writes_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "inner" / "bucket"
    store = LocalDirObjectStore(root)
    store.ensure_bucket()
    for key in ("../escape", "../../escape", "a/../../../escape", "/etc/passwd"):
        with pytest.raises(InvalidObjectKey):
            store.put(key, b"x")
        assert store.get("ok", max_bytes=1) is None
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bucket", "inner"]


def test_fs_layout_atomic_files_and_pruning(tmp_path: Path) -> None:
    store = LocalDirObjectStore(tmp_path / "b")
    store.ensure_bucket()
    store.put("x/y/z", b"data", metadata={"k": "v"})
    files = sorted(str(p.relative_to(tmp_path / "b")) for p in (tmp_path / "b").rglob("*"))
    assert files == ["x.d", "x.d/y.d", "x.d/y.d/z.meta.json", "x.d/y.d/z.obj"]  # no temp files
    store.delete("x/y/z")
    assert list((tmp_path / "b").iterdir()) == []  # empty dirs pruned, root kept


def test_fs_lists_in_byte_order(tmp_path: Path) -> None:
    store = LocalDirObjectStore(tmp_path / "b")
    store.ensure_bucket()
    for k in ("p/b", "p-dash", "p/a", "pz", "é", "z"):
        store.put(k, b"")
    assert [o.key for o in store.list("")] == ["p-dash", "p/a", "p/b", "pz", "z", "é"]


def test_fs_missing_root_is_store_error(tmp_path: Path) -> None:
    store = LocalDirObjectStore(tmp_path / "not-created")
    with pytest.raises(StoreError, match="does not exist"):
        store.put("k", b"v")
    with pytest.raises(StoreError):
        store.get("k", max_bytes=1)
    assert store.stat("k") is None


def test_fs_concurrent_put_delete(tmp_path: Path) -> None:
    store = LocalDirObjectStore(tmp_path / "b")
    store.ensure_bucket()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(200):
                store.put(f"d/e/{n}", b"x" * i)
                store.delete(f"d/e/{n}")
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on by the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- registry and errors -----------------------------------------------------------------------
def test_make_object_store(tmp_path: Path) -> None:
    assert set(STORE_BACKENDS) >= {"s3", "fs"}
    fs = make_object_store("fs", root=tmp_path)
    assert isinstance(fs, LocalDirObjectStore)
    s3 = make_object_store("s3", endpoint="127.0.0.1:9000", access_key="a", secret_key="b", bucket="bkt")
    assert isinstance(s3, S3ObjectStore)
    by_path = make_object_store("shared.store.objects:LocalDirObjectStore", root=tmp_path)
    assert isinstance(by_path, LocalDirObjectStore)
    with pytest.raises(ValueError) as excinfo:
        make_object_store("gcs")
    assert "gcs" in str(excinfo.value) and "fs" in str(excinfo.value) and "s3" in str(excinfo.value)
    with pytest.raises(ValueError):
        make_object_store("no.such.module:Thing")
    with pytest.raises(TypeError):
        make_object_store("shared.errors:StoreError")


def test_object_too_large_round_trips_by_code() -> None:
    err = error_from_code("object_too_large", "too big")
    assert isinstance(err, ObjectTooLarge) and err.message == "too big"
    assert not isinstance(err, StoreError)


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, shared.store.objects as m; "
        "print(','.join(x for x in ('torch', 'minio', 'urllib3') if x in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == ""
