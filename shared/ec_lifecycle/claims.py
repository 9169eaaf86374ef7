"""Encode claims: who computes an item's encoder output, an encoder worker or a generating worker
that steals the queued encode job (``EPD_ENCODE_STEALS``; docs/architecture.md, "Encode stealing").

**Why.** In a burst the encoders' queue is long while the generating workers' engines wait for
features (measured: a PD engine idle 43-59% of its jobs' slot time at 448x448). A generating
worker that has waited ``EPD_ENCODE_STEAL_AFTER_S`` for an item whose encode job no encoder has
started encodes it itself (its engine has the vision tower), stores it and announces it with the
``ECReady`` the encoder would have sent, so the encoders' backlog shrinks by what idle generators
take.

**The claim.** One create-only key per item (``<fingerprint>.<item hash>``) in the
``<P>_EC_CLAIMS`` key-value bucket, written right before the encoder runs:

* an encoder writes ``enc:<worker>`` when it starts encoding; a claim already there is either an
  encoder's (a redelivery after a crash, or an item encoded before and evicted since: it encodes
  anyway) or a stealer's ``steal:<worker>``: it acks the job without encoding (outcome
  ``stolen``), the stealer announces the item;
* a generating worker steals only by creating the key: any claim already there (an encoder that
  started) means it waits for the ``ECReady`` as before.

Whoever announced the item deletes its claim (best effort), so a later encode of the same item (after
an eviction) can be stolen again; a stealer that wins a claim checks the store once more (the
encoder may have just announced and released it).

**The lease.** A stealer renews its claim every :data:`STEAL_RENEW_S` (a new revision of the
key) while its steal runs. A job waiting for an item another worker stole watches the claim's
revision; one unchanged for :data:`STEAL_LEASE_S` of the waiter's own clock means the stealer
died or stalls: the waiter takes the claim over (an update expecting that revision, so of several
waiters exactly one wins) and steals the item itself. Without it a killed stealer's waiters waited
``EPD_EC_WAIT_S`` (the encoder had acked the job as stolen), then each encoded locally. An
encoder's claim has no lease: a killed encoder's job is redelivered to another encoder.

Claims never decide correctness: every path stays idempotent (the store's object is overwritten
by an equal one, ``ECReady`` is announced again; a stalled stealer that resumes after a takeover
only duplicates the work), a worker that cannot reach the bucket encodes (encoders) or does not
steal (generators). Keys left behind expire after :func:`claim_ttl_s` (longer than any delivery
of the encode job can wait).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext

from shared.claims import BucketSpec, KvClaims
from shared.config import NatsSettings
from shared.protocol import Subjects

log = logging.getLogger(__name__)

ENCODER_PREFIX = "enc:"
STEAL_PREFIX = "steal:"
#: How often a stealer renews its claim while its steal runs (the lease, module docstring).
STEAL_RENEW_S = 1.0
#: A stealer's claim unchanged this long (three renewals missed) has lapsed: a waiter takes it over.
STEAL_LEASE_S = 3.0


def claim_ttl_s(settings: NatsSettings) -> float:
    """How long a claim lives: past every delivery of its encode job (``ack_wait`` x
    ``max_deliver``), at least a minute."""
    return max(60.0, settings.ack_wait_s * settings.max_deliver * 2)


def claim_key(fingerprint: str, item_hash: str) -> str:
    return f"{fingerprint}.{item_hash}"


@dataclass(frozen=True)
class Claim:
    """Who claimed an item: ``stealer`` True for a generating worker's steal."""

    owner: str
    stealer: bool

    @classmethod
    def parse(cls, value: str) -> Claim:
        if value.startswith(STEAL_PREFIX):
            return cls(value[len(STEAL_PREFIX) :], True)
        return cls(value.removeprefix(ENCODER_PREFIX), False)


class EncodeClaims:
    """The ``<P>_EC_CLAIMS`` bucket (module docstring) over :class:`shared.claims.KvClaims`. Raises
    what nats-py raises when NATS does not answer: callers fail open (see the module docstring)."""

    def __init__(self, claims: KvClaims):
        self.claims = claims

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects, settings: NatsSettings) -> EncodeClaims:
        """Open the bucket, creating it when missing."""
        description = "epd encode claims: which worker computes an item's encoder output"
        spec = BucketSpec("the encode claims", description, settings.stream_replicas, claim_ttl_s(settings))
        return cls(await KvClaims.open(js, subjects.ec_claims_bucket, spec))

    async def get(self, fingerprint: str, item_hash: str) -> Claim | None:
        held = await self.held(fingerprint, item_hash)
        return held[0] if held is not None else None

    async def held(self, fingerprint: str, item_hash: str) -> tuple[Claim, int] | None:
        """The item's claim and its revision (None: unclaimed)."""
        state = await self.claims.get(claim_key(fingerprint, item_hash))
        return None if state is None else (Claim.parse(state.value), state.revision)

    async def for_encoder(self, fingerprint: str, item_hash: str, worker_id: str) -> Claim | None:
        """An encoder is about to encode the item: None when it should (its claim is written),
        else the stealer that took it."""
        key, value = claim_key(fingerprint, item_hash), ENCODER_PREFIX + worker_id
        if await self.claims.create(key, value) is not None:
            return None
        held = await self.get(fingerprint, item_hash)
        if held is not None and held.stealer:
            return held
        await self.claims.put(key, value)  # an earlier encoder's claim (a redelivery, a re-encode): ours now
        return None

    async def steal(self, fingerprint: str, item_hash: str, worker_id: str, *, lapsed: int | None = None) -> int | None:
        """A generating worker takes the item: its claim's revision when it won, None when someone
        holds the item. ``lapsed``: the revision of another stealer's claim whose lease lapsed -
        taken over only if no one renewed or took it since."""
        key, value = claim_key(fingerprint, item_hash), STEAL_PREFIX + worker_id
        if lapsed is None:
            return await self.claims.create(key, value)
        return await self.claims.swap(key, value, lapsed)

    async def renew(self, fingerprint: str, item_hash: str, worker_id: str, revision: int) -> int | None:
        """Keep a steal's claim (of ``revision``) alive: its new revision, or None when it is no
        longer this worker's (taken over, or gone). The same write as a takeover: an update
        expecting the revision it holds."""
        return await self.steal(fingerprint, item_hash, worker_id, lapsed=revision)

    async def release(self, fingerprint: str, item_hash: str, revision: int | None = None) -> None:
        """The item is announced: forget the claim (best effort; it expires anyway). ``revision``:
        only if the claim is still that one (a steal taken over belongs to its new owner)."""
        try:
            await self.claims.delete(claim_key(fingerprint, item_hash), revision)
        except Exception as exc:  # noqa: BLE001 - nats raises several unrelated types (a revision mismatch too); the key expires
            log.debug("could not release the encode claim of %s: %s: %s", item_hash[:12], type(exc).__name__, exc)
