"""An S3 client run inside a lab host (``python -m tests.multihost.store_probe SPEC``): what each
store identity may do from there. ``site.Site.store_probe`` runs it through the host's
``ip netns exec``.

SPEC (JSON, argv[1]): ``url`` (the S3 gateway, ``https://``), ``ca`` (what the gateway is verified
against), ``bucket``, ``region`` and ``steps``, each ``[identity, op, key]`` with ``op`` one of
``put`` (a few bytes of its own), ``get``, ``stat``, ``delete``, run in order through
``shared.store.objects.S3ObjectStore`` (the services' client). The identities' keys come from
:data:`KEYS_ENV` (JSON: name -> [access key, secret key]), never the command line. Prints one JSON
list, a line per step: ``ok`` (the call answered), ``code`` (the S3 error code when refused, e.g.
``AccessDenied``; never a key), and what it found: ``found`` (``get``: the bytes equal the probe's
own, ``stat``: the object exists).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

KEYS_ENV = "MH_STORE_PROBE_KEYS"
#: what a probe's ``put`` writes (and its ``get`` compares)
DATA = b"mh-store-probe"
MAX_BYTES = 1 << 26


def _code(exc: BaseException) -> str:
    cause = exc.__cause__
    code = getattr(cause, "code", None)
    return str(code) if code else type(cause or exc).__name__


def run(spec: dict[str, Any], keys: dict[str, list[str]]) -> list[dict[str, Any]]:
    from shared.errors import StoreError
    from shared.store.objects import S3ObjectStore

    stores = {
        name: S3ObjectStore(
            spec["url"], access, secret, spec["bucket"], region=spec["region"], ca_file=spec["ca"], max_retries=0
        )
        for name, (access, secret) in keys.items()
    }
    out: list[dict[str, Any]] = []
    for who, op, key in spec["steps"]:
        store = stores[who]
        step: dict[str, Any] = {"identity": who, "op": op, "key": key}
        try:
            if op == "put":
                store.put(key, DATA)
            elif op == "get":
                step["found"] = store.get(key, MAX_BYTES) == DATA
            elif op == "stat":
                step["found"] = store.stat(key) is not None
            elif op == "delete":
                store.delete(key)
            else:
                raise ValueError(f"unknown op {op!r}")
            step["ok"] = True
        except StoreError as exc:
            step |= {"ok": False, "code": _code(exc)}
        out.append(step)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    keys = json.loads(os.environ[KEYS_ENV])
    print(json.dumps(run(spec, keys)))


if __name__ == "__main__":
    main()
