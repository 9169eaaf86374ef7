"""A small object-store abstraction: one bucket, ``/``-separated keys, bytes values.

Backends:

* :class:`S3ObjectStore` -- any S3-compatible server through the ``minio`` SDK (plain S3 calls
  only, no MinIO-only extensions). Tested against SeaweedFS.
* :class:`LocalDirObjectStore` -- a directory on the local filesystem with the same semantics
  (for development and tests without an S3 server).

Contract (both backends):

* Keys: non-empty, at most 1024 UTF-8 bytes, ``/``-separated segments; no leading or trailing
  ``/``, no empty, ``.`` or ``..`` segments, no control characters. Anything else raises
  :class:`InvalidObjectKey` (a ``ValueError``) before any I/O.
* User metadata: ``dict[str, str]``; keys are lower-cased and must be ``[a-z0-9-]`` (what
  survives every HTTP hop); values printable ASCII without leading/trailing blanks; 2 KB total
  (the S3 limit). Returned without the ``x-amz-meta-`` prefix, keys lower-case.
* ``get``/``stat`` return ``None`` for a missing key. ``get`` raises :class:`ObjectTooLarge`
  for objects over ``max_bytes``, checking the size before reading the body and never reading
  more than ``max_bytes + 1`` bytes.
* ``delete`` of a missing key is not an error. ``list`` yields objects whose key starts with
  ``prefix`` (plain string prefix, not only whole segments) with ``metadata={}`` (S3 listings
  carry no user metadata: use ``stat``). The order is the backend's: AWS and MinIO list in
  UTF-8 byte order, SeaweedFS directory by directory (``p/a`` before ``p-dash``); sort if it
  matters. The fs backend sorts by UTF-8 bytes.
* A missing bucket is a configuration problem: ``put``/``get``/``delete``/``list`` raise
  :class:`~shared.errors.StoreError`. ``stat``/``exists`` report the key missing instead (an S3
  HEAD response carries no error code to tell the two apart).
* Every network, auth and server error is a :class:`~shared.errors.StoreError` whose message
  names the operation, bucket, key and endpoint, and never contains the secret key.
* Stores are thread-safe; calls block, so async code runs them via ``asyncio.to_thread``.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import importlib
import io
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import ERRORS_BY_CODE, EPDError, StoreError

if TYPE_CHECKING:  # keep minio/urllib3 out of the import of this module
    from minio import Minio

log = logging.getLogger(__name__)

__all__ = [
    "STORE_BACKENDS",
    "InvalidObjectKey",
    "LocalDirObjectStore",
    "ObjectInfo",
    "ObjectStore",
    "ObjectTooLarge",
    "S3ObjectStore",
    "make_object_store",
    "validate_key",
    "validate_metadata",
]

MAX_KEY_BYTES = 1024
MAX_METADATA_BYTES = 2048


class ObjectTooLarge(EPDError):
    """An object is larger than the caller's ``max_bytes``."""

    code = "object_too_large"

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        size: int | None = None,
        max_bytes: int | None = None,
        param: str | None = None,
    ):
        super().__init__(message, param=param)
        self.key = key
        self.size = size
        self.max_bytes = max_bytes


# ``shared.errors`` builds its code registry at import time; make ``error_from_code`` know ours.
ERRORS_BY_CODE.setdefault(ObjectTooLarge.code, ObjectTooLarge)


class InvalidObjectKey(ValueError):
    """A key (or list prefix) that the store contract does not allow. A caller bug."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    #: Backend's entity tag without quotes (MD5 hex of the data for single-part uploads).
    etag: str
    #: User metadata, keys lower-case, without the ``x-amz-meta-`` prefix.
    metadata: dict[str, str] = field(default_factory=dict)
    #: Seconds since the epoch, or None if the backend did not say.
    last_modified: float | None = None


# -- validation --------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_META_KEY = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_META_VALUE = re.compile(r"^[\x20-\x7e]*$")


def validate_key(key: str) -> str:
    """Return ``key`` if it satisfies the key contract, else raise :class:`InvalidObjectKey`."""
    if not isinstance(key, str) or not key:
        raise InvalidObjectKey(f"object key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidObjectKey(f"object key longer than {MAX_KEY_BYTES} bytes: {key[:64]!r}...")
    if _CONTROL.search(key):
        raise InvalidObjectKey(f"object key contains control characters: {key!r}")
    if key.startswith("/") or key.endswith("/"):
        raise InvalidObjectKey(f"object key must not start or end with '/': {key!r}")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise InvalidObjectKey(f"object key has an empty, '.' or '..' segment: {key!r}")
    return key


def _validate_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise InvalidObjectKey(f"list prefix must be a string, got {prefix!r}")
    if not prefix:
        return prefix
    if _CONTROL.search(prefix) or prefix.startswith("/"):
        raise InvalidObjectKey(f"invalid list prefix {prefix!r}")
    # All segments but the last are complete; the last may be partial ("ab" of "abc").
    for seg in prefix.split("/")[:-1]:
        if seg in ("", ".", ".."):
            raise InvalidObjectKey(f"list prefix has an empty, '.' or '..' segment: {prefix!r}")
    return prefix


def validate_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """Normalise user metadata (lower-case keys, optional ``x-amz-meta-`` prefix dropped).

    Raises ``ValueError`` for keys outside ``[a-z0-9-]``, values that are not printable ASCII
    or have leading/trailing blanks (servers strip those), or more than 2 KB in total.
    """
    out: dict[str, str] = {}
    total = 0
    for raw_key, value in (metadata or {}).items():
        if not isinstance(raw_key, str) or not isinstance(value, str):
            raise ValueError(f"metadata keys and values must be str: {raw_key!r}: {value!r}")
        key = raw_key.lower()
        if key.startswith("x-amz-meta-"):
            key = key[len("x-amz-meta-") :]
        if not _META_KEY.match(key):
            raise ValueError(f"metadata key must match [a-z0-9][a-z0-9-]*: {raw_key!r}")
        if not _META_VALUE.match(value) or value != value.strip():
            raise ValueError(
                f"metadata value for {key!r} must be printable ASCII without leading/trailing blanks: {value!r}"
            )
        if key in out:
            raise ValueError(f"duplicate metadata key (case-insensitive): {raw_key!r}")
        out[key] = value
        total += len(key) + len(value)
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {total} bytes, more than {MAX_METADATA_BYTES}")
    return out


def _check_max_bytes(max_bytes: int) -> None:
    if not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")


def _too_large(key: str, size: int | None, max_bytes: int) -> ObjectTooLarge:
    what = f"{size} bytes" if size is not None else "more than that"
    return ObjectTooLarge(
        f"object {key!r} is {what}, over the limit of {max_bytes} bytes",
        key=key,
        size=size,
        max_bytes=max_bytes,
    )


# -- the interface -----------------------------------------------------------------------------
class ObjectStore(abc.ABC):
    """One bucket of objects. See the module docstring for the full contract."""

    @abc.abstractmethod
    def ensure_bucket(self) -> None:
        """Create the bucket if missing. Idempotent and safe against concurrent creators."""

    @abc.abstractmethod
    def put(
        self,
        key: str,
        data: bytes,
        metadata: dict[str, str] | None = None,
        content_type: str = "application/octet-stream",
    ) -> None:
        """Store ``data`` under ``key``, replacing any previous object and its metadata."""

    @abc.abstractmethod
    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The object's bytes, None if missing; :class:`ObjectTooLarge` over ``max_bytes``."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size, etag, user metadata and modification time; None if missing."""

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, with ``metadata={}``; order is the
        backend's (not necessarily sorted)."""


# -- S3 ----------------------------------------------------------------------------------------
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "InvalidSecurity",
    }
)
#: ``_check_credentials``' probe listing: outside every role's prefixes (``shared.store_auth``), so a
#: role's good key gets AccessDenied for it, a wrong secret or an unknown key another error
_CREDENTIALS_PROBE_PREFIX = "epd-credentials-probe/"
_MIN_PART = 5 * 1024 * 1024
_MAX_PART = 5 * 1024 * 1024 * 1024
_READ_CHUNK = 1024 * 1024


class S3ObjectStore(ObjectStore):
    """An S3 bucket through the ``minio`` SDK.

    ``endpoint`` is ``host:port``; an ``http://`` / ``https://`` prefix is accepted and sets
    ``secure``. With ``secure`` the server's certificate is verified against ``ca_file`` (None:
    ``SSL_CERT_FILE``, else certifi's CAs). ``region=None`` lets the SDK ask the server
    (GetBucketLocation, once per bucket). No network I/O happens in the constructor. Timeouts and
    retries are bounded: connection errors and 5xx answers are retried ``max_retries`` times with a
    short backoff.
    """

    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        secure: bool = False,
        region: str | None = None,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_retries: int = 2,
        max_connections: int = 16,
        ca_file: str | os.PathLike[str] | None = None,
    ):
        import certifi
        import urllib3
        from minio import Minio
        from minio.helpers import check_bucket_name

        for scheme, is_secure in (("https://", True), ("http://", False)):
            if endpoint.lower().startswith(scheme):
                endpoint, secure = endpoint[len(scheme) :], is_secure
        endpoint = endpoint.rstrip("/")
        if not endpoint or "/" in endpoint:
            raise ValueError(f"S3 endpoint must be host[:port], got {endpoint!r}")
        if not access_key or not secret_key:
            raise ValueError("S3 access_key and secret_key must be non-empty")
        check_bucket_name(bucket, strict=True)  # ValueError for names S3 would refuse
        if ca_file is not None and not os.path.isfile(ca_file):  # (urllib3 would say so at the first request)
            raise ValueError(f"S3 CA file {os.fspath(ca_file)!r} is not a file")
        self.endpoint = endpoint
        self.bucket = bucket
        self.secure = secure
        self.region = region
        self.access_key = access_key
        self._secret = secret_key
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
            maxsize=max_connections,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.fspath(ca_file) if ca_file is not None else os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(
                total=max_retries,
                backoff_factor=0.1,
                status_forcelist=[500, 502, 503, 504],
                raise_on_status=False,
            ),
        )
        self._client: Minio = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            secure=secure,
            region=region,
            http_client=http,
        )

    def __repr__(self) -> str:
        return (
            f"S3ObjectStore(endpoint={self.endpoint!r}, bucket={self.bucket!r}, "
            f"secure={self.secure}, access_key={self.access_key!r})"
        )

    # -- error translation
    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    @contextlib.contextmanager
    def _errors(self, op: str, key: str | None = None) -> Iterator[None]:
        """Turn SDK / transport errors into StoreError (messages never carry the secret)."""
        from minio.error import MinioException, S3Error
        from urllib3.exceptions import HTTPError

        target = f"s3://{self.bucket}/{key}" if key is not None else f"s3://{self.bucket}"
        where = f"{op} {target} at {self.endpoint}"
        try:
            yield
        except S3Error as exc:
            msg = f"S3 {where} failed: {exc.code}: {exc.message}"
            if exc.code in _AUTH_CODES:
                msg += f" (check the S3 access key {self.access_key!r} and its secret)"
            elif exc.code == "NoSuchBucket":
                msg += " (create it with ensure_bucket())"
            raise StoreError(self._scrub(msg)) from exc
        except MinioException as exc:
            raise StoreError(self._scrub(f"S3 {where} failed: {exc}")) from exc
        except (HTTPError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise StoreError(
                self._scrub(f"S3 {where} failed: cannot reach the server: {type(exc).__name__}: {reason}")
            ) from exc

    def _check_credentials(self) -> None:
        """Raise the S3 error of a request this key signed wrongly (or an unknown key); return when
        the server only refuses it the right (``AccessDenied``), as it does a role's key a listing
        outside its prefixes."""
        from minio.error import S3Error

        try:
            next(iter(self._client.list_objects(self.bucket, prefix=_CREDENTIALS_PROBE_PREFIX)), None)
        except S3Error as exc:
            if exc.code != "AccessDenied":
                raise

    # -- operations
    def ensure_bucket(self) -> None:
        from minio.error import S3Error

        with self._errors("ensure_bucket"):
            try:
                if self._client.bucket_exists(self.bucket):
                    return
            except S3Error as exc:
                # A role's identity (shared.store_auth) may touch its object prefixes only: the
                # bucket is the deployment's to make (epd up, minio-init); its first request says
                # whether it is there.
                if exc.code != "AccessDenied":
                    raise
                # A HEAD's 403 has no body: a wrong secret answers it as a key without the right
                # does. A GET's error names which (SignatureDoesNotMatch, InvalidAccessKeyId:
                # raised; AccessDenied: the key is good, the listing not its to make).
                self._check_credentials()
                log.info("S3 key %s may not look up bucket %s: assuming it exists", self.access_key, self.bucket)
                return
            try:
                self._client.make_bucket(self.bucket, location=self.region)
                log.info("created bucket %s at %s", self.bucket, self.endpoint)
            except S3Error as exc:
                # Lost a creation race (or the bucket belongs to someone else: then the
                # re-check fails and the original error is reported).
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
                if not self._client.bucket_exists(self.bucket):
                    raise

    def put(
        self,
        key: str,
        data: bytes,
        metadata: dict[str, str] | None = None,
        content_type: str = "application/octet-stream",
    ) -> None:
        validate_key(key)
        meta = validate_metadata(metadata)
        size = len(data)
        if size > _MAX_PART:
            raise ValueError(f"object of {size} bytes is over the single-PUT limit of 5 GiB")
        with self._errors("put", key):
            self._client.put_object(
                self.bucket,
                key,
                io.BytesIO(data),
                size,
                content_type=content_type,
                metadata={f"x-amz-meta-{k}": v for k, v in meta.items()},
                # one PUT, never multipart: keeps the ETag the MD5 of the data
                part_size=max(_MIN_PART, size),
            )

    def get(self, key: str, max_bytes: int) -> bytes | None:
        from minio.error import S3Error

        validate_key(key)
        _check_max_bytes(max_bytes)
        with self._errors("get", key):
            try:
                resp = self._client.get_object(self.bucket, key)
            except S3Error as exc:
                if exc.code == "NoSuchKey":
                    return None
                raise
            complete = False
            try:
                length = resp.headers.get("content-length")
                if length is not None and int(length) > max_bytes:
                    raise _too_large(key, int(length), max_bytes)
                buf = bytearray()
                while True:
                    chunk = resp.read(min(_READ_CHUNK, max_bytes + 1 - len(buf)))
                    if not chunk:
                        break
                    buf += chunk
                    if len(buf) > max_bytes:
                        raise _too_large(key, None, max_bytes)
                complete = True
                return bytes(buf)
            finally:
                if not complete:
                    resp.close()  # unread body: drop the connection instead of draining it
                resp.release_conn()

    def stat(self, key: str) -> ObjectInfo | None:
        from minio.error import S3Error

        validate_key(key)
        with self._errors("stat", key):
            try:
                obj = self._client.stat_object(self.bucket, key)
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                    return None
                raise
        meta: dict[str, str] = {}
        for name, value in (obj.metadata or {}).items():
            lname = name.lower()
            if lname.startswith("x-amz-meta-"):
                meta[lname[len("x-amz-meta-") :]] = value
        return ObjectInfo(
            key=key,
            size=int(obj.size or 0),
            etag=(obj.etag or "").strip('"'),
            metadata=meta,
            last_modified=obj.last_modified.timestamp() if obj.last_modified else None,
        )

    def delete(self, key: str) -> None:
        from minio.error import S3Error

        validate_key(key)
        with self._errors("delete", key):
            try:
                self._client.remove_object(self.bucket, key)
            except S3Error as exc:
                if exc.code != "NoSuchKey":  # some servers answer 404 instead of 204
                    raise

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        _validate_prefix(prefix)
        with self._errors("list", prefix + "*"):
            it = iter(self._client.list_objects(self.bucket, prefix=prefix or None, recursive=True))
        while True:
            with self._errors("list", prefix + "*"):
                try:
                    obj = next(it)
                except StopIteration:
                    return
            if obj.is_dir or obj.object_name is None:
                continue
            yield ObjectInfo(
                key=obj.object_name,
                size=int(obj.size or 0),
                etag=(obj.etag or "").strip('"'),
                metadata={},
                last_modified=obj.last_modified.timestamp() if obj.last_modified else None,
            )


# -- local directory ---------------------------------------------------------------------------
_OBJ = ".obj"
_META = ".meta.json"
_DIR = ".d"
_MAX_NAME = 255


class LocalDirObjectStore(ObjectStore):
    """Objects as files under ``root`` (the "bucket"), same contract as S3.

    Layout: key ``a/b/c`` is the file ``root/a.d/b.d/c.obj`` with its metadata in the JSON
    sidecar ``c.meta.json``. The suffixes keep keys ``a`` and ``a/b`` (a file and a directory
    in a naive layout) from colliding. Writes go to a temporary file in the same directory and
    are renamed into place, so readers see the old or the new bytes, never a mix; data and
    sidecar are two renames, so a concurrent ``stat`` may briefly pair new metadata with old
    data. ``fsync=True`` makes writes durable against power loss (slower).
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False):
        self.root = Path(root).absolute()
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"LocalDirObjectStore(root={str(self.root)!r})"

    # -- paths
    def _paths(self, key: str) -> tuple[Path, Path]:
        validate_key(key)
        *dirs, name = key.split("/")
        for seg in (*dirs, name):
            if len((seg + _META).encode("utf-8", "surrogatepass")) > _MAX_NAME:
                raise InvalidObjectKey(
                    f"key segment too long for the fs backend (max {_MAX_NAME - len(_META)} bytes): {seg[:64]!r}..."
                )
        parent = self.root.joinpath(*(d + _DIR for d in dirs))
        data, meta = parent / (name + _OBJ), parent / (name + _META)
        # Defence in depth: validate_key already excludes '..' and absolute keys.
        if os.path.commonpath([self.root, data]) != str(self.root):
            raise InvalidObjectKey(f"object key escapes the store root: {key!r}")
        return data, meta

    def _require_root(self, op: str, key: str | None) -> None:
        if not self.root.is_dir():
            raise StoreError(
                f"fs {op} {key or ''} failed: bucket directory {self.root} does not exist "
                f"(create it with ensure_bucket())"
            )

    @contextlib.contextmanager
    def _errors(self, op: str, key: str | None = None) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise StoreError(f"fs {op} {key or ''} under {self.root} failed: {exc}") from exc

    def _makedirs(self, path: Path) -> None:
        """Create ``path`` below the root. Unlike ``Path.mkdir(exist_ok=True)`` this does not
        fail when a concurrent ``delete`` removes a directory right after it "exists"."""
        rel = path.relative_to(self.root).parts
        current = self.root
        for part in rel:
            current = current / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(current)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.parent / f".{secrets.token_hex(8)}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    # -- operations
    def ensure_bucket(self) -> None:
        with self._errors("ensure_bucket"):
            self.root.mkdir(parents=True, exist_ok=True)

    def put(
        self,
        key: str,
        data: bytes,
        metadata: dict[str, str] | None = None,
        content_type: str = "application/octet-stream",
    ) -> None:
        data_path, meta_path = self._paths(key)
        meta = validate_metadata(metadata)
        self._require_root("put", key)
        sidecar = json.dumps(
            {
                "version": 1,
                "key": key,
                "size": len(data),
                "etag": hashlib.md5(data, usedforsecurity=False).hexdigest(),
                "content_type": content_type,
                "metadata": meta,
            },
            sort_keys=True,
        ).encode()
        with self._errors("put", key):
            attempts = 20
            for attempt in range(attempts):
                try:
                    self._makedirs(data_path.parent)
                    self._write_atomic(meta_path, sidecar)
                    self._write_atomic(data_path, data)
                    return
                except FileNotFoundError:
                    # a concurrent delete pruned a directory on our path: recreate and retry
                    if attempt == attempts - 1 or not self.root.is_dir():
                        raise

    def get(self, key: str, max_bytes: int) -> bytes | None:
        data_path, _ = self._paths(key)
        _check_max_bytes(max_bytes)
        self._require_root("get", key)
        with self._errors("get", key):
            try:
                f = open(data_path, "rb")
            except FileNotFoundError:
                return None
            with f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise _too_large(key, size, max_bytes)
                data = f.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise _too_large(key, None, max_bytes)
            return data

    def _read_sidecar(self, meta_path: Path) -> dict[str, Any]:
        try:
            value = json.loads(meta_path.read_bytes())
            return value if isinstance(value, dict) else {}
        except (FileNotFoundError, ValueError):
            return {}

    def stat(self, key: str) -> ObjectInfo | None:
        data_path, meta_path = self._paths(key)
        with self._errors("stat", key):
            try:
                st = data_path.stat()
            except (FileNotFoundError, NotADirectoryError):
                return None
            side = self._read_sidecar(meta_path)
        return ObjectInfo(
            key=key,
            size=st.st_size,
            etag=str(side.get("etag", "")),
            metadata=dict(side.get("metadata") or {}),
            last_modified=st.st_mtime,
        )

    def delete(self, key: str) -> None:
        data_path, meta_path = self._paths(key)
        self._require_root("delete", key)
        with self._errors("delete", key):
            for p in (data_path, meta_path):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            # prune now-empty directories up to (not including) the root
            parent = data_path.parent
            while parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        _validate_prefix(prefix)
        self._require_root("list", prefix + "*")
        *dirs, partial = prefix.split("/") if prefix else [""]
        start = self.root.joinpath(*(d + _DIR for d in dirs))
        found: list[tuple[bytes, ObjectInfo]] = []
        with self._errors("list", prefix + "*"):
            if not start.is_dir():
                return
            for dirpath, dirnames, filenames in os.walk(start):
                rel = Path(dirpath).relative_to(self.root).parts
                if Path(dirpath) == start:  # prune subtrees that cannot match
                    dirnames[:] = [d for d in dirnames if d.startswith(partial)]
                key_dirs = [p[: -len(_DIR)] for p in rel if p.endswith(_DIR)]
                if len(key_dirs) != len(rel):
                    continue  # not one of ours
                dirnames[:] = [d for d in dirnames if d.endswith(_DIR)]
                for fname in filenames:
                    if not fname.endswith(_OBJ):
                        continue  # sidecars and temporary files
                    key = "/".join([*key_dirs, fname[: -len(_OBJ)]])
                    if not key.startswith(prefix):
                        continue
                    path = Path(dirpath) / fname
                    try:
                        st = path.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    side = self._read_sidecar(path.with_name(fname[: -len(_OBJ)] + _META))
                    found.append(
                        (
                            key.encode("utf-8", "surrogatepass"),
                            ObjectInfo(
                                key=key,
                                size=st.st_size,
                                etag=str(side.get("etag", "")),
                                metadata={},
                                last_modified=st.st_mtime,
                            ),
                        )
                    )
        found.sort(key=lambda item: item[0])  # S3 order: UTF-8 byte order of keys
        for _, info in found:
            yield info


# -- registry ----------------------------------------------------------------------------------
#: Backend kinds for :func:`make_object_store`, as lazy ``"module:Class"`` references.
STORE_BACKENDS: dict[str, str] = {
    "s3": "shared.store.objects:S3ObjectStore",
    "fs": "shared.store.objects:LocalDirObjectStore",
}


def make_object_store(kind: str, **kwargs: Any) -> ObjectStore:
    """Build a store by kind (``"s3"``, ``"fs"``) or by a ``"package.module:Class"`` path.

    ``kwargs`` go to the class constructor. Unknown kinds raise ``ValueError`` listing the
    known ones; a target that is not an :class:`ObjectStore` subclass raises ``TypeError``.
    """
    target = STORE_BACKENDS.get(kind)
    if target is None:
        if ":" not in kind:
            raise ValueError(
                f"unknown object store kind {kind!r}; known kinds: "
                f"{', '.join(sorted(STORE_BACKENDS))} (or a 'package.module:ClassName' path)"
            )
        target = kind
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"object store backend {target!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, ObjectStore)):
        raise TypeError(f"object store backend {target!r} is not an ObjectStore subclass")
    return cls(**kwargs)
