"""Claims in a JetStream key-value bucket: the create-only claim and the compare-and-set that the
encode claims (``shared.ec_lifecycle.claims``) and the routing claims (``shared.routed_jobs``) are
made of.

A claim is a key whose value names who holds it. Whoever creates the key first holds it: the
server refuses a create of a key that exists, so of several writers racing exactly one wins. A
claim changes hands (a takeover, a renewal, ``done``) only by an update that names the revision
its writer read: a write in between makes it fail, so again exactly one wins. Both answer the new
revision, or None when the writer lost; anything else NATS raises (no answer, no bucket) goes to
the caller, which decides whether it fails open.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.jetstream import open_bucket


@dataclass(frozen=True)
class ClaimState:
    """A claim as read: its value and its revision (what a compare-and-set names)."""

    value: str
    revision: int


class BucketSpec(NamedTuple):
    """A claims bucket: ``what`` names it in errors ("the encode claims"), ``description`` is the
    bucket's own, keys expire after ``ttl_s``."""

    what: str
    description: str
    replicas: int
    ttl_s: float


class KvClaims:
    """The claims of one key-value bucket (module docstring)."""

    def __init__(self, kv: KeyValue):
        self.kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, spec: BucketSpec) -> KvClaims:
        """Open the bucket, creating it when missing (one revision per key, on disk)."""
        kv = await open_bucket(
            js, bucket, replicas=spec.replicas, what=spec.what, ttl=spec.ttl_s, description=spec.description
        )
        return cls(kv)

    async def get(self, key: str) -> ClaimState | None:
        """The claim of ``key``; None when there is none (never written, deleted, expired)."""
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:  # (a deleted key's marker too)
            return None
        if entry.value is None or entry.revision is None:
            return None
        return ClaimState(entry.value.decode(), entry.revision)

    async def create(self, key: str, value: str) -> int | None:
        """Claim ``key`` for ``value`` if no one holds it: the claim's revision, None when held."""
        try:
            return await self.kv.create(key, value.encode())
        except KeyWrongLastSequenceError:
            return None

    async def swap(self, key: str, value: str, revision: int) -> int | None:
        """Compare-and-set: write ``value`` if the claim is still at ``revision``; its new revision,
        None when it changed (or is gone)."""
        try:
            return await self.kv.update(key, value.encode(), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def put(self, key: str, value: str) -> int:
        """Write ``value`` whoever holds the claim: its new revision."""
        return await self.kv.put(key, value.encode())

    async def delete(self, key: str, revision: int | None = None) -> None:
        """Forget the claim (``revision``: only if it is still that one; raises if not)."""
        await self.kv.delete(key, last=revision)
