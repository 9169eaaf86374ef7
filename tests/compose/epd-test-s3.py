#!/usr/bin/env python3
"""Test-only S3 service for docker-compose.yml's ``minio`` / ``minio-init`` (tests/compose/):
SeaweedFS (``weed mini``) with the accounts MinIO gets there: the root and one per role.

  epd-test-s3 serve [--certs-dir DIR]   the S3 server on :9000, data in /data. Accounts:
                      MINIO_ROOT_USER (admin) and one identity per role, read from the JSON file
                      EPD_TEST_S3_ROLES names: ``identities`` (shared.store_auth.seaweed_identities,
                      with the keys of the test's env file: what minio-init's policies grant under
                      MinIO), ``bucket_policy`` (seaweed_bucket_policy) and ``namespace``; the test
                      renders it (this image holds no project code). With --certs-dir (MinIO's flag
                      and layout): HTTPS only, with DIR/public.crt and DIR/private.key.
  epd-test-s3 ready [URL [CA]]  exit 0 once URL (default: the S3 server's /healthz) answers 200 (the
                      healthcheck); an https URL is verified against the CA file
  epd-test-s3 init    create EPD_S3_BUCKET and set its policy (the roles file's) with the root
                      account, and check that the API's account lists its namespace (minio-init's
                      job), over HTTPS verified against EPD_S3_TLS_CA when EPD_S3_SECURE; idempotent

The cluster stand-in (tests/compose/compose.cluster.test.yml, in place of a distributed MinIO): the
same S3 store split into SeaweedFS's parts, one per container, with replicated volumes. Arguments
after the command go to ``weed`` as they are (the compose file names the addresses and the
replication, e.g. ``master -ip=seaweed-master -defaultReplication=001``):

  epd-test-s3 master ARGS    the master on :9333 (its state in /data)
  epd-test-s3 volume ARGS    a volume server on :8080 (data in /data); ARGS name the master (-mserver=)
  epd-test-s3 gateway ARGS   a filer (metadata in /data) with its S3 gateway on :9000 and the two
                             accounts above; ARGS name the master (-master=); --certs-dir DIR among
                             them: HTTPS only, as with serve
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

S3_PORT = 9000
# weed mini's other ports, fixed inside the container (nothing else listens there). Its
# maintenance worker dials the admin gRPC port as admin.port + 10000.
PORTS = {
    "master.port": 9333,
    "master.port.grpc": 19333,
    "volume.port": 8080,
    "volume.port.grpc": 18080,
    "filer.port": 8888,
    "filer.port.grpc": 18888,
    "s3.port": S3_PORT,
    "s3.port.grpc": 19000,
    "admin.port": 23646,
    "admin.port.grpc": 33646,
}


def env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        sys.exit(f"epd-test-s3: {name} is not set")
    return value


def roles() -> dict:
    """The roles file (EPD_TEST_S3_ROLES): identities, bucket policy, namespace."""
    with open(env("EPD_TEST_S3_ROLES")) as f:
        data = json.load(f)
    if not data.get("identities") or "bucket_policy" not in data:
        sys.exit("epd-test-s3: the roles file holds no identities or no bucket policy")
    return data


def write_identities() -> str:
    """The S3 accounts (see the module docstring) in a file only this user can read; its path."""
    identities = {
        "identities": [
            {
                "name": "root",
                "credentials": [{"accessKey": env("MINIO_ROOT_USER"), "secretKey": env("MINIO_ROOT_PASSWORD")}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            # What minio-init's policies grant each role under MinIO, rendered from the same table.
            *roles()["identities"],
        ]
    }
    keys = [c["accessKey"] for i in identities["identities"] for c in i["credentials"]]
    if len(set(keys)) != len(keys):
        sys.exit("epd-test-s3: two accounts share an access key (each role gets its own, none the root's)")
    os.makedirs("/tmp/epd-s3", mode=0o700, exist_ok=True)
    path = "/tmp/epd-s3/identities.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(identities, f)
    return path


def tls_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(weed's TLS flags for MinIO's ``--certs-dir DIR`` among ``args``, the other args)."""
    if "--certs-dir" not in args:
        return [], args
    i = args.index("--certs-dir")
    certs = args[i + 1]
    for name in ("public.crt", "private.key"):
        if not os.path.isfile(os.path.join(certs, name)):
            sys.exit(f"epd-test-s3: no {name} in {certs}")
    flags = [f"-s3.cert.file={certs}/public.crt", f"-s3.key.file={certs}/private.key"]
    return flags, args[:i] + args[i + 2 :]


def serve(*args: str) -> None:
    tls, _ = tls_args(list(args))
    path = write_identities()
    argv = [
        "weed",
        "-logtostderr=true",
        "-config_dir=/tmp/epd-s3",
        "mini",
        "-dir=/data",
        "-ip=127.0.0.1",
        "-ip.bind=0.0.0.0",
        *(f"-{k}={v}" for k, v in PORTS.items()),
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",
        "-s3.allowDeleteBucketNotEmpty=false",
        "-s3.autoCreateBucket=false",
        f"-s3.config={path}",
        *tls,
    ]
    os.execvp(argv[0], argv)


# The cluster stand-in's processes: fixed ports inside their containers, listening on every
# interface (other containers reach them by service name, which the ARGS give as -ip=).
COMMON = ["-ip.bind=0.0.0.0"]


def weed(*args: str) -> None:
    argv = ["weed", "-logtostderr=true", "-config_dir=/tmp/epd-s3", *args]
    os.makedirs("/tmp/epd-s3", mode=0o700, exist_ok=True)
    os.makedirs("/data", exist_ok=True)  # the container's own disk (weed mini creates it, these do not)
    os.execvp(argv[0], argv)


def master(args: list[str]) -> None:
    weed("master", *COMMON, "-port=9333", "-port.grpc=19333", "-mdir=/data", "-telemetry=false", *args)


def volume(args: list[str]) -> None:
    weed("volume", *COMMON, "-port=8080", "-port.grpc=18080", "-dir=/data", "-preStopSeconds=0", *args)


def gateway(args: list[str]) -> None:
    tls, args = tls_args(args)
    path = write_identities()
    weed(
        "filer",
        *COMMON,
        "-port=8888",
        "-port.grpc=18888",
        "-defaultStoreDir=/data",
        "-s3",
        f"-s3.port={S3_PORT}",
        "-s3.port.grpc=19000",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-s3.allowDeleteBucketNotEmpty=false",
        "-s3.autoCreateBucket=false",
        f"-s3.config={path}",
        *tls,
        *args,
    )


def ready(url: str = f"http://127.0.0.1:{S3_PORT}/healthz", ca: str | None = None) -> None:
    import ssl

    context = ssl.create_default_context(cafile=ca) if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:
            sys.exit(0 if resp.status == 200 else 1)
    except OSError as exc:
        print(f"epd-test-s3: not ready: {exc}", file=sys.stderr)
        sys.exit(1)


def init() -> None:
    import urllib3
    from minio import Minio
    from minio.error import S3Error

    data = roles()
    api = next(i for i in data["identities"] if i["name"] == "epd-api")["credentials"][0]
    endpoint, bucket = env("EPD_S3_ENDPOINT"), env("EPD_S3_BUCKET")
    secure = os.environ.get("EPD_S3_SECURE", "").lower() in ("true", "1", "yes", "on")
    ca = os.environ.get("EPD_S3_TLS_CA") or None
    # (the certificate verified against the CA: what minio-init's mc does with it)
    http = urllib3.PoolManager(cert_reqs="CERT_REQUIRED", ca_certs=ca) if secure and ca else None
    root = Minio(endpoint, env("MINIO_ROOT_USER"), env("MINIO_ROOT_PASSWORD"), secure=secure, http_client=http)
    # (a role may not ask the bucket's region: the one the services are given, EPD_S3_REGION)
    region = os.environ.get("EPD_S3_REGION") or "us-east-1"
    services = Minio(endpoint, api["accessKey"], api["secretKey"], secure=secure, http_client=http, region=region)
    deadline = time.monotonic() + 120
    while True:  # the filer behind the S3 gateway can lag its /healthz by a moment
        try:
            if not root.bucket_exists(bucket):
                root.make_bucket(bucket)
            root.set_bucket_policy(bucket, json.dumps(data["bucket_policy"]))
            list(services.list_objects(bucket, prefix=f"{data['namespace']}/"))  # the API's janitor listing
            break
        except (S3Error, OSError) as exc:
            if time.monotonic() > deadline:
                raise
            print(f"epd-test-s3: init retrying: {exc}", file=sys.stderr)
            time.sleep(1)
    print(f"bucket {bucket}, its policy and the roles' accounts are ready")


if __name__ == "__main__":
    command, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("serve", [])
    if command in ("master", "volume", "gateway"):
        {"master": master, "volume": volume, "gateway": gateway}[command](args)
    else:
        {"serve": serve, "ready": ready, "init": init}[command](*args)
