"""One store (S3) identity per role, with only the object prefixes it needs (issue 45, item 3).

The one place each role's store permissions are stated: :data:`PERMISSIONS`, a frozen table
role -> kind of object -> actions, from the data flows that exist:

* the API writes request media (a HEAD first: content-addressed, written once), looks an item's EC
  object up (HEAD) before it queues an encode job, and, as the EC janitor, lists the namespace and
  deletes EC and KV objects (SeaweedFS's and S3's HEAD is a read: the API may read EC objects);
* encoders read media and write EC objects (a HEAD first: an item already stored is not redone);
* generating workers (prefill, pd, agg) read media and EC objects, write EC objects when they
  encode locally or steal an encode job, and write (and read) KV hand-offs;
* decode workers read KV hand-offs, delete each once loaded and sweep old ones (list + delete).

The prefixes come from the key builders (``shared.store.format.media_key`` / ``ec_key``,
``shared.store.kv.kv_prefix``), never typed here. EC objects sit right under the namespace
(``<namespace>/<encoder fingerprint>/<item>``), beside the ``media/`` and ``kv/`` folders; an
encoder fingerprint is lower-case hex (``shared.fingerprint``), so the EC objects are exactly the
keys below ``<namespace>/0`` ... ``<namespace>/f``, sixteen prefixes that no media or KV key
starts with (checked at import).

Rendered for SeaweedFS (``epd up``, the test stacks): :func:`seaweed_identities` (the identities
JSON of ``weed -s3.config``: ``Read`` / ``List`` / ``Write`` scoped as ``<Action>:<bucket>/<prefix>*``,
measured to be enforced per prefix) and :func:`seaweed_bucket_policy`. SeaweedFS's ``Write`` also
allows DELETE; the bucket policy's Deny statements (principal ``arn:aws:iam::*:user/<identity>``,
measured) take a delete from a role that may only write and a write from a role that may only
delete. Rendered for MinIO (Docker Compose): :func:`minio_policy`, one IAM policy per role, written
into deploy/minio-policies/ by ``epd config docs``. :func:`permission_table` is docs/security.md's
table (checked by a test).
"""

from __future__ import annotations

import enum
import json
import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from shared.nats_auth import Role
from shared.store.format import ec_key, media_key
from shared.store.kv import kv_prefix


class Kind(enum.StrEnum):
    """A kind of object in the store, by where its keys live."""

    MEDIA = "media"  # request images and videos' sampled frames (content-addressed)
    EC = "ec"  # encoder outputs
    KV = "kv"  # prefill -> decode hand-offs
    #: every key under the namespace (the janitor's listing: names and sizes, no content)
    NAMESPACE = "namespace"


class Action(enum.StrEnum):
    READ = "read"  # GET, HEAD
    LIST = "list"  # list the keys under a prefix
    WRITE = "write"  # PUT
    DELETE = "delete"  # DELETE


_R, _L, _W, _D = Action.READ, Action.LIST, Action.WRITE, Action.DELETE

#: The roles that hold a store identity (the vLLM connectors run inside a worker, as its role).
STORE_ROLES = (Role.API, Role.ENCODER, Role.PREFILL, Role.DECODE)


def _table(rows: Mapping[Role, Mapping[Kind, frozenset[Action]]]) -> Mapping[Role, Mapping[Kind, frozenset[Action]]]:
    return MappingProxyType({role: MappingProxyType(dict(kinds)) for role, kinds in rows.items()})


#: role -> kind -> the actions it may take on that kind's objects (nothing else).
PERMISSIONS: Mapping[Role, Mapping[Kind, frozenset[Action]]] = _table(
    {
        Role.API: {
            Kind.MEDIA: frozenset({_R, _W}),
            Kind.EC: frozenset({_R, _D}),
            Kind.KV: frozenset({_D}),
            Kind.NAMESPACE: frozenset({_L}),
        },
        Role.ENCODER: {Kind.MEDIA: frozenset({_R}), Kind.EC: frozenset({_R, _W})},
        Role.PREFILL: {
            Kind.MEDIA: frozenset({_R}),
            Kind.EC: frozenset({_R, _W}),
            Kind.KV: frozenset({_R, _W}),
        },
        Role.DECODE: {Kind.KV: frozenset({_R, _L, _D})},
    }
)


def _hex_digits() -> str:
    return string.digits + "abcdef"


def prefixes(kind: Kind, namespace: str) -> tuple[str, ...]:
    """The key prefixes of ``kind``'s objects, from the key builders."""
    if kind is Kind.MEDIA:
        return (media_key(namespace, ""),)
    if kind is Kind.KV:
        return (kv_prefix(namespace),)
    if kind is Kind.NAMESPACE:
        return (f"{namespace}/",)
    marker = "\x00"
    before_fingerprint = ec_key(namespace, marker, "item").split(marker)[0]
    return tuple(before_fingerprint + digit for digit in _hex_digits())


def _check_disjoint(namespace: str = "epd") -> None:
    """The EC prefixes hold no media or KV key, and each kind's prefixes lie in the namespace."""
    ec = prefixes(Kind.EC, namespace)
    for other in (Kind.MEDIA, Kind.KV):
        for prefix in prefixes(other, namespace):
            if any(prefix.startswith(p) or p.startswith(prefix) for p in ec):
                raise AssertionError(f"the EC prefixes overlap {other.value}'s {prefix!r}: the policies would too")
    for kind in Kind:
        if not all(p.startswith(f"{namespace}/") for p in prefixes(kind, namespace)):
            raise AssertionError(f"{kind.value}'s prefixes leave the namespace {namespace!r}")


_check_disjoint()


def allowed(role: Role | str, kind: Kind, action: Action) -> bool:
    return action in PERMISSIONS.get(Role(role), {}).get(kind, frozenset())


# -- SeaweedFS ---------------------------------------------------------------------------------------
def identity_name(role: Role | str) -> str:
    """The SeaweedFS identity (and bucket-policy user) of ``role``."""
    return f"epd-{Role(role).value}"


def seaweed_actions(role: Role | str, bucket: str, namespace: str) -> list[str]:
    """``role``'s ``actions`` in the identities JSON: ``Read`` / ``List`` / ``Write`` per prefix
    (``Write`` for a write or a delete: SeaweedFS's Write covers both; see the bucket policy)."""
    out: list[str] = []
    for kind, actions in PERMISSIONS[Role(role)].items():
        verbs = []
        if _R in actions:
            verbs.append("Read")
        if _L in actions:
            verbs.append("List")
        if _W in actions or _D in actions:
            verbs.append("Write")
        for verb in verbs:
            out += [f"{verb}:{bucket}/{prefix}*" for prefix in prefixes(kind, namespace)]
    return out


def seaweed_identities(keys: Mapping[Role, tuple[str, str]], bucket: str, namespace: str) -> list[dict]:
    """One identity per role of ``keys`` (role -> (access key, secret key)) for ``-s3.config``."""
    return [
        {
            "name": identity_name(role),
            "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": seaweed_actions(role, bucket, namespace),
        }
        for role, (access, secret) in keys.items()
    ]


#: S3 actions of a write / a delete, for the bucket policy's Deny statements.
_S3_WRITE = ["s3:PutObject", "s3:CreateMultipartUpload", "s3:UploadPart", "s3:CompleteMultipartUpload"]
_S3_DELETE = ["s3:DeleteObject", "s3:DeleteObjectVersion"]


def seaweed_bucket_policy(bucket: str, namespace: str, roles: tuple[Role, ...] = STORE_ROLES) -> dict:
    """Deny statements for what SeaweedFS's ``Write`` grants beyond :data:`PERMISSIONS`: a delete
    to a role that may only write a kind, a write to a role that may only delete it."""
    statements = []
    for role in roles:
        for kind, actions in PERMISSIONS[role].items():
            denied = (_S3_DELETE if _W in actions and _D not in actions else []) + (
                _S3_WRITE if _D in actions and _W not in actions else []
            )
            if denied:
                statements.append(
                    {
                        "Sid": f"{role.value}-{kind.value}",
                        "Effect": "Deny",
                        "Principal": {"AWS": [f"arn:aws:iam::*:user/{identity_name(role)}"]},
                        "Action": denied,
                        "Resource": [f"arn:aws:s3:::{bucket}/{p}*" for p in prefixes(kind, namespace)],
                    }
                )
    return {"Version": "2012-10-17", "Statement": statements}


# -- MinIO (Docker Compose) -------------------------------------------------------------------------
#: The S3 actions of each table action on MinIO: a HEAD is a GetObject there, a multipart upload's
#: parts a PutObject; a listing is ``s3:ListBucket`` on the bucket, scoped by an ``s3:prefix`` condition.
MINIO_ACTIONS = {_R: "s3:GetObject", _W: "s3:PutObject", _D: "s3:DeleteObject", _L: "s3:ListBucket"}
#: Beyond the table, every role may ask the bucket's region (the S3 client does before its first
#: request when ``EPD_S3_REGION`` is unset; it tells nothing about the objects).
MINIO_BUCKET_LOCATION = "s3:GetBucketLocation"


def minio_policy(role: Role | str, bucket: str, namespace: str) -> dict:
    """``role``'s MinIO IAM policy: one Allow statement per (kind, action) of :data:`PERMISSIONS`,
    on ``arn:aws:s3:::<bucket>/<prefix>*`` (a listing: on the bucket, ``s3:prefix`` like the
    prefixes), and the bucket's location. Nothing else is allowed (IAM denies what no statement allows)."""
    statements: list[dict] = []
    for kind, actions in PERMISSIONS[Role(role)].items():
        ps = prefixes(kind, namespace)
        for action in Action:
            if action not in actions:
                continue
            sid = f"{kind.value.capitalize()}{action.value.capitalize()}"
            statement: dict = {"Sid": sid, "Effect": "Allow", "Action": [MINIO_ACTIONS[action]]}
            if action is _L:
                statement["Resource"] = [f"arn:aws:s3:::{bucket}"]
                statement["Condition"] = {"StringLike": {"s3:prefix": [f"{p}*" for p in ps]}}
            else:
                statement["Resource"] = [f"arn:aws:s3:::{bucket}/{p}*" for p in ps]
            statements.append(statement)
    statements.append(
        {
            "Sid": "BucketLocation",
            "Effect": "Allow",
            "Action": [MINIO_BUCKET_LOCATION],
            "Resource": [f"arn:aws:s3:::{bucket}"],
        }
    )
    return {"Version": "2012-10-17", "Statement": statements}


#: Docker Compose's MinIO policies (one file per role, ``epd config docs`` writes them; minio-init
#: creates a policy ``epd-<role>`` from each), for Compose's default bucket and namespace.
COMPOSE_MINIO_POLICIES = Path("deploy/minio-policies")
COMPOSE_BUCKET = "epd"
COMPOSE_NAMESPACE = "epd"


def compose_minio_policies() -> dict[Path, str]:
    """deploy/minio-policies/<role>.json for every store role (bucket and namespace ``epd``)."""
    return {
        COMPOSE_MINIO_POLICIES / f"{role.value}.json": json.dumps(
            minio_policy(role, COMPOSE_BUCKET, COMPOSE_NAMESPACE), indent=2
        )
        + "\n"
        for role in STORE_ROLES
    }


def access_key_variable(role: Role | str) -> str:
    """The variable of ``role``'s access key in Compose's ``.env`` (``S3_ENCODER_ACCESS_KEY``)."""
    return f"S3_{Role(role).value.upper()}_ACCESS_KEY"


def secret_key_variable(role: Role | str) -> str:
    """The variable of ``role``'s secret key in Compose's ``.env`` (``S3_ENCODER_SECRET_KEY``)."""
    return f"S3_{Role(role).value.upper()}_SECRET_KEY"


# -- the keys of a set-up that runs its own store (epd up, the test stacks) ----------------------------
def _random_key(n: int) -> str:
    return secrets.token_hex(n)


def load_or_create_keys(directory: Path) -> dict[Role, tuple[str, str]]:
    """Every store role's (access key, secret key), kept in ``directory/<role>.json`` (mode 0600, the
    folder 0700) and generated the first time: random, never logged."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    out: dict[Role, tuple[str, str]] = {}
    for role in STORE_ROLES:
        path = directory / f"{role.value}.json"
        if path.exists():
            data = json.loads(path.read_text())
            out[role] = (str(data["access_key"]), str(data["secret_key"]))
            continue
        keys = (f"epd{role.value}{_random_key(6)}", _random_key(24))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"access_key": keys[0], "secret_key": keys[1]}, f)
        out[role] = keys
    return out


# -- docs/security.md --------------------------------------------------------------------------------
def permission_table(namespace: str = "epd") -> str:
    """The role x store-permission table (markdown) for ``namespace``."""

    def where(kind: Kind) -> str:
        ps = prefixes(kind, namespace)
        if kind is Kind.EC:
            return f"`{ps[0][:-1]}<fingerprint>/` (`{ps[0]}*` ... `{ps[-1]}*`)"
        return f"`{ps[0]}*`"

    header = "| role | " + " | ".join(f"{k.value}: {where(k)}" for k in Kind) + " |"
    lines = [header, "|---|" + "---|" * len(Kind)]
    for role in STORE_ROLES:
        cells = []
        for kind in Kind:
            actions = PERMISSIONS[role].get(kind, frozenset())
            cells.append(", ".join(a.value for a in Action if a in actions) or "-")
        lines.append(f"| {role.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
