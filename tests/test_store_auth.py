"""One store identity per role (issue 45, item 3), against a real SeaweedFS (``weed mini``).

Each refusal has its control: the same action by the role that owns it succeeds. The whole
role x kind x action matrix is run against the server and must equal ``shared.store_auth``'s
table, so a role given another's permissions (or a policy that stops narrowing ``Write``) fails.
"""

from __future__ import annotations

import json
import stat

import pytest

from shared.errors import StoreError
from shared.nats_auth import Role
from shared.store.format import ec_key, media_key
from shared.store.kv import kv_key, kv_prefix
from shared.store.objects import S3ObjectStore
from shared.store_auth import (
    PERMISSIONS,
    STORE_ROLES,
    Action,
    Kind,
    allowed,
    compose_minio_policies,
    load_or_create_keys,
    minio_policy,
    permission_table,
    prefixes,
    seaweed_bucket_policy,
)
from shared.tools.infra import SEAWEED_REGION, EmbeddedS3

BUCKET, NS = "epd-auth", "epd"
FP = "0123456789abcdef01234567"  # an encoder / model fingerprint: 24 hex characters
MAX = 1 << 20


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[Role, tuple[str, str]]:
    return load_or_create_keys(tmp_path_factory.mktemp("s3roles") / "roles")


@pytest.fixture(scope="module")
def server(tmp_path_factory, keys):
    with EmbeddedS3(tmp_path_factory.mktemp("s3auth"), role_keys=keys, bucket=BUCKET, namespace=NS) as s3:
        yield s3


def role_store(server: EmbeddedS3, keys, role: Role) -> S3ObjectStore:
    access, secret = keys[role]
    return S3ObjectStore(server.url, access, secret, BUCKET, region=SEAWEED_REGION, max_retries=0)


def sample_key(kind: Kind, name: str) -> str:
    """A key of ``kind`` from the key builders (the janitor's listing: any key of the namespace)."""
    if kind is Kind.MEDIA:
        return media_key(NS, name)
    if kind is Kind.KV:
        return kv_key(NS, FP, name, 0)
    return ec_key(NS, FP, name)  # EC, and NAMESPACE's sample (an EC object is a key of the namespace)


def attempt(server, keys, role: Role, kind: Kind, action: Action, name: str) -> bool:
    """Whether ``role`` may take ``action`` on a ``kind`` object (True: done; False: refused),
    checked on the server's side through the admin for writes and deletes."""
    store, admin = role_store(server, keys, role), server.admin_store()
    key = sample_key(kind, name)
    admin.put(key, b"seeded")
    try:
        if action is Action.READ:
            return store.get(key, max_bytes=MAX) == b"seeded"
        if action is Action.LIST:
            listed = [info.key for info in store.list(prefixes(kind, NS)[0] if kind is not Kind.EC else key)]
            return key in listed
        if action is Action.WRITE:
            store.put(key, b"overwritten")
            assert admin.get(key, max_bytes=MAX) == b"overwritten"
            return True
        store.delete(key)
        assert admin.get(key, max_bytes=MAX) is None, "a delete answered without an error must have removed the object"
        return True
    except StoreError as exc:
        assert "AccessDenied" in str(exc), exc
        if action in (Action.WRITE, Action.DELETE):  # refused, and nothing changed
            assert admin.get(key, max_bytes=MAX) == b"seeded"
        return False


@pytest.mark.parametrize("role", STORE_ROLES, ids=str)
def test_each_role_may_do_exactly_what_the_table_says(server, keys, role):
    """Every kind x action for the role, against the server: done iff the table allows it."""
    seen = {}
    for kind in (Kind.MEDIA, Kind.EC, Kind.KV):
        for action in Action:
            seen[(kind.value, action.value)] = attempt(server, keys, role, kind, action, f"m-{role}-{kind}-{action}")
    expected = {(k.value, a.value): allowed(role, k, a) for k in (Kind.MEDIA, Kind.EC, Kind.KV) for a in Action}
    if allowed(role, Kind.NAMESPACE, Action.LIST):  # the janitor lists every kind's keys
        expected.update({(k.value, Action.LIST.value): True for k in (Kind.MEDIA, Kind.EC, Kind.KV)})
    assert seen == expected


# -- the cases, each refusal with its control -------------------------------------------------
def test_an_encoder_cannot_read_a_kv_object_the_roles_that_own_it_can(server, keys):
    assert not attempt(server, keys, Role.ENCODER, Kind.KV, Action.READ, "c1")
    assert attempt(server, keys, Role.DECODE, Kind.KV, Action.READ, "c1")  # control
    assert attempt(server, keys, Role.PREFILL, Kind.KV, Action.READ, "c1")  # control


def test_an_encoder_cannot_delete_an_ec_object_the_janitor_can(server, keys):
    """SeaweedFS's ``Write`` covers DELETE: the bucket policy's Deny takes it from the encoder."""
    assert attempt(server, keys, Role.ENCODER, Kind.EC, Action.WRITE, "c2")  # it may write ...
    assert not attempt(server, keys, Role.ENCODER, Kind.EC, Action.DELETE, "c2")  # ... not delete
    assert attempt(server, keys, Role.API, Kind.EC, Action.DELETE, "c2")  # control: the janitor


def test_the_api_cannot_write_an_ec_object_an_encoder_can(server, keys):
    assert not attempt(server, keys, Role.API, Kind.EC, Action.WRITE, "c3")
    assert attempt(server, keys, Role.ENCODER, Kind.EC, Action.WRITE, "c3")  # control


def test_a_decode_worker_cannot_write_ec_objects_a_prefill_worker_can(server, keys):
    assert not attempt(server, keys, Role.DECODE, Kind.EC, Action.WRITE, "c4")
    assert not attempt(server, keys, Role.DECODE, Kind.KV, Action.WRITE, "c4")  # nor KV hand-offs
    assert attempt(server, keys, Role.PREFILL, Kind.EC, Action.WRITE, "c4")  # control
    assert attempt(server, keys, Role.PREFILL, Kind.KV, Action.WRITE, "c4")  # control


def test_a_roles_list_stays_within_its_prefixes(server, keys):
    decode = role_store(server, keys, Role.DECODE)
    with pytest.raises(StoreError, match="AccessDenied"):
        list(decode.list(f"{NS}/"))  # the whole namespace: the janitor's
    assert isinstance(list(role_store(server, keys, Role.API).list(f"{NS}/")), list)  # control


def test_a_stranger_and_a_wrong_secret_are_refused(server, keys):
    access, _ = keys[Role.ENCODER]
    store = S3ObjectStore(server.url, access, "0" * 48, BUCKET, region=SEAWEED_REGION, max_retries=0)
    with pytest.raises(StoreError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId"):
        store.get(media_key(NS, "x"), max_bytes=MAX)


def test_the_services_code_paths_work_with_their_role_keys(server, keys):
    """The stores a worker opens (ensure_bucket tolerated: a role may not look the bucket up),
    and an EC object saved by an encoder and fetched by a prefill worker."""
    from shared.store.ec import ECStore

    def ec(role: Role) -> ECStore:
        store = role_store(server, keys, role)
        store.ensure_bucket()  # AccessDenied on HeadBucket: the deployment made it
        return ECStore(store, namespace=NS, fingerprint=FP, producer=role.value)

    data = bytes(range(16))
    ec(Role.ENCODER).save("item-1", data, dtype="F32", shape=(2, 2))
    assert ec(Role.PREFILL).exists("item-1")
    assert ec(Role.PREFILL).fetch("item-1").data == data
    api = role_store(server, keys, Role.API)
    api.put(media_key(NS, "img-1"), b"jpeg")
    assert role_store(server, keys, Role.ENCODER).get(media_key(NS, "img-1"), max_bytes=MAX) == b"jpeg"


# -- the table itself ---------------------------------------------------------------------------------
def test_the_ec_prefixes_are_the_hex_fingerprints_and_miss_media_and_kv():
    ec = prefixes(Kind.EC, NS)
    assert len(ec) == 16 and all(ec_key(NS, FP, "i").startswith(p) for p in ec if p.endswith(FP[0]))
    for key in (media_key(NS, "abc"), kv_key(NS, FP, "r", 0)):
        assert not any(key.startswith(p) for p in ec), key


def test_the_bucket_policy_narrows_write_only_where_the_table_does():
    sids = {s["Sid"] for s in seaweed_bucket_policy(BUCKET, NS)["Statement"]}
    # write without delete: deny delete; delete without write: deny write
    assert sids == {"api-media", "api-ec", "api-kv", "encoder-ec", "prefill-ec", "prefill-kv", "decode-kv"}, sids


def test_keys_are_random_kept_0600_and_reused(tmp_path):
    first = load_or_create_keys(tmp_path / "roles")
    assert set(first) == set(STORE_ROLES) and len({k for pair in first.values() for k in pair}) == 8
    for role in STORE_ROLES:
        path = tmp_path / "roles" / f"{role.value}.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "roles").stat().st_mode) == 0o700
    assert load_or_create_keys(tmp_path / "roles") == first


def test_no_key_in_the_servers_log_or_repr(server, keys):
    log = server.log_path.read_text(errors="replace")
    assert log, "the server logged nothing: the check below would pass vacuously"
    secrets = [secret for _, secret in keys.values()] + [server.secret_key]
    assert not [s for s in secrets if s in log or s in repr(server)]
    assert json.loads(server.identities_path.read_text())  # (they are there, mode 0600)
    assert stat.S_IMODE(server.identities_path.stat().st_mode) == 0o600


def test_the_docs_table_is_the_permissions():
    table = permission_table(NS)
    for role in STORE_ROLES:
        (row,) = [line for line in table.splitlines() if line.startswith(f"| {role.value} |")]
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        for kind, cell in zip(Kind, cells, strict=True):
            got = set() if cell == "-" else set(cell.split(", "))
            assert got == {a.value for a in PERMISSIONS[role].get(kind, ())}, (role, kind, cell)


# -- MinIO (Docker Compose): the same table as IAM policies, evaluated here ----------------------------
def _like(pattern: str, value: str) -> bool:
    """IAM's wildcard match (``*`` any run, ``?`` one character), as MinIO's StringLike and resources."""
    import fnmatch

    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]"))


def iam_allows(policy: dict, action: str, resource: str, prefix: str | None = None) -> bool:
    """Whether an IAM policy of Allow statements allows ``action`` on ``resource`` (a listing: with
    ``s3:prefix`` = ``prefix``). What no statement allows is denied, as in MinIO."""
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow", st  # (a Deny would need evaluating first)
        if action not in st["Action"] or not any(_like(r, resource) for r in st["Resource"]):
            continue
        like = st.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if like is not None and (prefix is None or not any(_like(p, prefix) for p in like)):
            continue
        return True
    return False


def minio_may(policy: dict, kind: Kind, action: Action, bucket: str = BUCKET) -> bool:
    """``action`` on a sample ``kind`` object (a listing: of that kind's keys) under ``policy``."""
    key = sample_key(kind, "item")
    if action is Action.LIST:
        prefix = {Kind.MEDIA: media_key(NS, ""), Kind.KV: kv_prefix(NS)}.get(kind, f"{NS}/{FP}/")
        return iam_allows(policy, "s3:ListBucket", f"arn:aws:s3:::{bucket}", prefix)
    s3_action = {Action.READ: "s3:GetObject", Action.WRITE: "s3:PutObject", Action.DELETE: "s3:DeleteObject"}[action]
    return iam_allows(policy, s3_action, f"arn:aws:s3:::{bucket}/{key}")


def minio_matrix(policy: dict) -> dict[tuple[str, str], bool]:
    return {(k.value, a.value): minio_may(policy, k, a) for k in (Kind.MEDIA, Kind.EC, Kind.KV) for a in Action}


def table_matrix(role: Role) -> dict[tuple[str, str], bool]:
    expected = {(k.value, a.value): allowed(role, k, a) for k in (Kind.MEDIA, Kind.EC, Kind.KV) for a in Action}
    if allowed(role, Kind.NAMESPACE, Action.LIST):  # the janitor lists every kind's keys
        expected.update({(k.value, Action.LIST.value): True for k in (Kind.MEDIA, Kind.EC, Kind.KV)})
    return expected


@pytest.mark.parametrize("role", STORE_ROLES, ids=str)
def test_each_roles_minio_policy_allows_exactly_what_the_table_says(role):
    """Every role x kind x action under the role's MinIO policy: allowed iff the table allows it; the
    namespace's listing iff the table's, and nothing of another bucket or outside the namespace."""
    policy = minio_policy(role, BUCKET, NS)
    assert minio_matrix(policy) == table_matrix(role)
    bucket = f"arn:aws:s3:::{BUCKET}"
    assert iam_allows(policy, "s3:ListBucket", bucket, f"{NS}/") == allowed(role, Kind.NAMESPACE, Action.LIST)
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        assert not iam_allows(policy, action, f"{bucket}/other/{FP}/item")  # another namespace
        assert not iam_allows(policy, action, f"arn:aws:s3:::other/{sample_key(Kind.MEDIA, 'x')}")  # another bucket
    assert not iam_allows(policy, "s3:ListBucket", bucket, "")  # the whole bucket
    assert not iam_allows(policy, "s3:ListBucket", bucket, None)
    # nothing beyond the table's actions and the bucket's region
    granted = {a for st in policy["Statement"] for a in st["Action"]}
    assert granted <= {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket", "s3:GetBucketLocation"}
    assert iam_allows(policy, "s3:GetBucketLocation", bucket)
    assert not iam_allows(policy, "s3:DeleteBucket", bucket) and not iam_allows(policy, "s3:PutBucketPolicy", bucket)


@pytest.mark.parametrize(
    "role,edit,differs",
    [
        # an encoder given KV read, the API given EC write, decode given KV write (cf. the SeaweedFS mutations)
        (
            Role.ENCODER,
            lambda p: p["Statement"][0]["Resource"].append(f"arn:aws:s3:::{BUCKET}/{NS}/kv/*"),
            ("kv", "read"),
        ),
        (
            Role.API,
            lambda p: p["Statement"].append(
                {**p["Statement"][0], "Action": ["s3:PutObject"], "Resource": [f"arn:aws:s3:::{BUCKET}/{NS}/*"]}
            ),
            ("ec", "write"),
        ),
        (Role.DECODE, lambda p: p["Statement"][0]["Action"].append("s3:PutObject"), ("kv", "write")),
        # a listing without its prefix condition: the whole bucket
        (Role.DECODE, lambda p: [st.pop("Condition", None) for st in p["Statement"]], ("media", "list")),
    ],
    ids=["encoder-kv-read", "api-ec-write", "decode-kv-write", "list-unconditioned"],
)
def test_an_edited_minio_policy_no_longer_matches_the_table(role, edit, differs):
    """Negative controls of the matrix check: each widened policy is caught."""
    policy = minio_policy(role, BUCKET, NS)
    edit(policy)
    matrix = minio_matrix(policy)
    assert matrix != table_matrix(role) and matrix[differs] and not table_matrix(role)[differs]


def test_compose_minio_policies_are_the_roles_policies_for_epd():
    files = compose_minio_policies()
    assert sorted(str(p) for p in files) == sorted(f"deploy/minio-policies/{r.value}.json" for r in STORE_ROLES)
    for role in STORE_ROLES:
        assert json.loads(files[next(p for p in files if p.stem == role.value)]) == minio_policy(role, "epd", "epd")
