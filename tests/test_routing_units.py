"""Cache-aware routing, in parts: the scorer (pure), the heartbeat summary (``shared.routing``), and
the claims on a real JetStream key-value bucket (``shared.routed_jobs``); the API's watchdog against
a real NATS with heartbeats it is fed (``services.api.routing``). The whole stack: tests/test_routing.py."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.api.routing import Router
from services.api.service import router_tuning
from shared import protocol
from shared.config import ApiSettings
from shared.jetstream import JetStreamPublisher, ensure_topology
from shared.protocol import GenerationJob, ImageRef, RouteReason, SamplingSpec, Subjects, WorkerHeartbeat
from shared.routed_jobs import CLAIM_FALLBACK, RouteClaim, RoutingClaims, claim_key, done_value, takeover_value
from shared.routing import Candidate, RecentItems, advertised, choose, short_hash
from tests.stackutil import opened_claims, until

A, B, C = "a" * 64, "b" * 64, "c" * 64


def cand(worker_id: str, items=(), *, slots=4, free=None, in_flight=0, pending=0, ended=0) -> Candidate:
    return Candidate(
        worker_id=worker_id,
        slots=slots,
        free_slots=slots - in_flight if free is None else free,
        items=frozenset(short_hash(i) for i in items),
        pending=pending,
        ended=ended,
    )


def pick(cands, items, *, affinity=1.0, load=1.0):
    return choose(cands, items, affinity_weight=affinity, load_weight=load)


# -- scorer -----------------------------------------------------------------------------------
def test_the_worker_holding_the_images_wins_while_it_has_room() -> None:
    d = pick([cand("w1"), cand("w2", [A], in_flight=2)], [A])
    assert (d.worker_id, d.reason, d.held) == ("w2", RouteReason.AFFINITY, 1)
    # the holder of both images beats the holder of one
    d = pick([cand("w1", [A]), cand("w2", [A, B])], [A, B])
    assert (d.worker_id, d.reason, d.held) == ("w2", RouteReason.AFFINITY, 2)


def test_a_full_holder_is_skipped_for_the_least_loaded_worker() -> None:
    cands = [cand("w1", [A], in_flight=4), cand("w2", in_flight=1), cand("w3", in_flight=2)]
    d = pick(cands, [A])
    assert (d.worker_id, d.reason) == ("w2", RouteReason.LOAD)
    assert "w1" in d.detail
    # jobs this API routed since the last heartbeat count: w2's free slots are used up by them
    cands = [cand("w1", [A], free=0), cand("w2", free=1, pending=1), cand("w3", in_flight=3)]
    assert pick(cands, [A]).worker_id == "w3"
    # ... and jobs that ended since free their slots again (the heartbeat was sent while they ran)
    cands = [cand("w1", [A], slots=1, in_flight=1, ended=1), cand("w2", slots=1)]
    assert pick(cands, [A]).reason == RouteReason.AFFINITY
    cands = [cand("w1", [A], slots=1, free=1, pending=1, ended=1), cand("w2", slots=1)]
    assert pick(cands, [A]).reason == RouteReason.AFFINITY
    cands = [cand("w1", [A], slots=1, free=1, pending=2, ended=1), cand("w2", slots=1)]
    assert pick(cands, [A]).reason == RouteReason.LOAD


def test_load_weight_trades_affinity_against_load() -> None:
    cands = [cand("w1", [A], slots=4, in_flight=3), cand("w2", slots=4)]
    assert pick(cands, [A], load=1.0).worker_id == "w1"  # 1 - 0.75 > 0
    d = pick(cands, [A], load=2.0)  # 1 - 1.5 < 0
    assert (d.worker_id, d.reason) == ("w2", RouteReason.LOAD)


def test_no_images_or_no_holder_or_everyone_full_keep_the_shared_queue() -> None:
    assert pick([cand("w1", [A])], []).reason == RouteReason.NO_AFFINITY
    d = pick([cand("w1", [A]), cand("w2", [B])], [C])
    assert (d.worker_id, d.reason) == ("", RouteReason.NO_AFFINITY)
    d = pick([cand("w1", [A], free=0), cand("w2", free=0)], [A])
    assert (d.worker_id, d.reason) == ("", RouteReason.LOAD)
    assert pick([], [A]).worker_id == ""


def test_ties_are_deterministic() -> None:
    cands = [cand("w2", [A]), cand("w1", [A])]
    assert pick(cands, [A]).worker_id == "w1"
    assert pick(list(reversed(cands)), [A]).worker_id == "w1"


# -- what workers advertise -------------------------------------------------------------------
def test_advertised_items_are_the_k_most_recent_shortened() -> None:
    recent = RecentItems(3)
    for item in (A, B, C, A):
        recent.used(item)
    assert recent.recent() == [A, C, B]
    recent.used("d" * 64)
    assert recent.recent() == ["d" * 64, A, C]  # B, the least recent, went
    assert advertised(recent.recent(), 2) == (short_hash("d" * 64), short_hash(A))
    assert advertised([A, A, B], 5) == (short_hash(A), short_hash(B))
    assert advertised([A], 0) == ()
    assert len(short_hash(A)) == protocol.ADVERTISED_HASH_CHARS


def test_heartbeat_with_routing_fields_stays_readable_both_ways() -> None:
    hb = WorkerHeartbeat(
        role="prefill",
        worker_id="w",
        fingerprint="f",
        model="m",
        engine="e",
        in_flight=1,
        sent_at=1.0,
        routable=True,
        slots=4,
        free_slots=3,
        items=(short_hash(A),),
    )
    assert protocol.decode(protocol.encode(hb), WorkerHeartbeat) == hb
    # an older worker's heartbeat (no routing fields) is not routable
    import msgspec

    old = msgspec.msgpack.encode(
        {
            "kind": "heartbeat",
            "v": 1,
            "role": "prefill",
            "worker_id": "w",
            "fingerprint": "",
            "model": "m",
            "engine": "e",
            "in_flight": 0,
            "sent_at": 1.0,
        }
    )
    assert protocol.decode(old, WorkerHeartbeat).routable is False


def test_subjects_and_consumer_names_of_odd_worker_ids() -> None:
    s = Subjects("epd")
    assert s.generate_routed("pd-0") == "epd.generate.routed.pd-0"
    assert s.routed_consumer("pd-0") == "prefill-routed-pd-0"
    odd = s.generate_routed("host.example com")
    assert odd.count(".") == 3 and " " not in odd
    assert s.generate_routed("a.b") != s.generate_routed("a_b")
    assert s.streams()[s.stream_generate] == ["epd.generate.jobs", "epd.generate.routed.*"]
    assert claim_key("chatcmpl-0123") == "chatcmpl-0123"
    assert claim_key("a b/c").startswith("h-")


# -- claims on a real bucket --------------------------------------------------------------------
def test_exactly_one_of_many_concurrent_claimers_wins(claims_env) -> None:
    url, subjects, settings = claims_env

    async def main():
        ncs = [await nats.connect(url) for _ in range(4)]
        try:
            claims = [await RoutingClaims.open(nc.jetstream(), subjects, settings) for nc in ncs]
            owners = ["w0", "w1", "w2", CLAIM_FALLBACK]
            results = await asyncio.gather(*(c.claim("req-1", o) for c, o in zip(claims, owners)))
            winners = [o for o, (won, _) in zip(owners, results) if won]
            assert len(winners) == 1, results
            winner = winners[0]
            assert all(state is not None and state.value == winner for _, state in results)
            # the winner claiming again (a redelivery) still holds it; the others still lose
            again = owners.index(winner)
            won, state = await claims[again].claim("req-1", winner)
            assert won and state is not None
            loser = (again + 1) % 4
            assert (await claims[loser].claim("req-1", owners[loser]))[0] is False
            return claims[0], winner, state
        finally:
            for nc in ncs:
                await nc.close()

    asyncio.run(main())


def test_takeover_is_compare_and_set_and_fences_the_old_owner(claims_env) -> None:
    async def main():
        async with opened_claims(RoutingClaims, claims_env) as claims:
            won, state = await claims.claim("req-2", "w0")
            assert won and state is not None
            mine = RouteClaim(claims, "req-2", "w0", state.revision)
            assert await mine.held()
            # a takeover at a stale revision fails; at the current one it wins
            assert not await claims.replace("req-2", takeover_value("w0"), state.revision + 100)
            assert await claims.replace("req-2", takeover_value("w0"), state.revision)
            assert not await mine.held()  # the old owner's fence: it drops its result
            await mine.finish()  # does not overwrite the takeover
            assert (await claims.get("req-2")).value == takeover_value("w0")

            # a worker that finishes first wins against a takeover that read the claim before
            won, state = await claims.claim("req-3", "w1")
            assert won
            await RouteClaim(claims, "req-3", "w1", state.revision).finish()
            assert not await claims.replace("req-3", takeover_value("w1"), state.revision)
            assert (await claims.get("req-3")).value == done_value("w1")

    asyncio.run(main())


# -- the API's watchdog ---------------------------------------------------------------------------
def _hb(worker_id: str, items=(), *, free=4) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        role="prefill",
        worker_id=worker_id,
        fingerprint="",
        model="m",
        engine="transformers",
        in_flight=0,
        sent_at=time.time(),
        routable=True,
        slots=4,
        free_slots=free,
        items=tuple(short_hash(i) for i in items),
    )


def _job(request_id: str, items=(A,)) -> GenerationJob:
    return GenerationJob(
        request_id=request_id,
        model="m",
        messages=[],
        images=tuple(ImageRef(item_hash=i, media_key="k", width=1, height=1) for i in items),
        fingerprint="",
        sampling=SamplingSpec(),
        stream=False,
        deadline=time.time() + 60,
        created_at=time.time(),
    )


async def _shared_copies(js, subjects: Subjects) -> list[GenerationJob]:
    info = await js.stream_info(subjects.stream_generate)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(subjects.stream_generate, seq)
        if raw.subject == subjects.generate_jobs:
            out.append(protocol.decode(raw.data, GenerationJob))
    return out


@pytest.mark.parametrize("case", ["unclaimed", "claimed_then_gone", "claimed_and_done", "done_unseen"])
def test_watchdog_falls_back_only_when_the_target_does_not_run_the_job(claims_env, case) -> None:
    """Unclaimed past the affinity timeout -> one fallback copy (and the late target loses its
    claim); claimed and the target's heartbeat stops -> one takeover copy; claimed and done -> none,
    also when the watchdog never saw the claim's writes (done_unseen: it learns at the timeout,
    when its own claim fails)."""
    url, subjects, nats_settings = claims_env
    settings = ApiSettings(
        nats_url=url,
        subject_prefix=subjects.prefix,
        stream_max_bytes=nats_settings.stream_max_bytes,
        routing="affinity",
        routing_affinity_timeout_s=0.5,
        routing_takeover_s=1.0,
    )

    async def main():
        nc = await nats.connect(url)
        js = nc.jetstream()
        await ensure_topology(js, nats_settings, subjects)
        router = Router(nc, subjects, JetStreamPublisher(js), settings.nats, router_tuning(settings))
        await router.start()
        try:
            router.on_heartbeat(_hb("w1", [A]))
            router.on_heartbeat(_hb("w2"))
            rid = f"req-{case}"
            if case == "done_unseen":  # written before the router watches the key: it misses both writes
                won, state = await router.claims.claim(rid, "w1")
                await RouteClaim(router.claims, rid, "w1", state.revision).finish()
            await router.publish(_job(rid))
            routed = await until(lambda: _routed(js, subjects, "w1"), 5, "the routed job on w1's subject")
            assert routed.route_reason == RouteReason.AFFINITY and routed.routed_to == "w1"
            claims = router.claims
            assert claims is not None
            if case in ("claimed_then_gone", "claimed_and_done"):
                won, state = await claims.claim(rid, "w1")
                assert won
                if case == "claimed_and_done":
                    await RouteClaim(claims, rid, "w1", state.revision).finish()
            # w1 sends no heartbeat from now on: older than routing_takeover_s after 1 s
            await until(lambda: _no_watchdog(router), 10, "the watchdog to end")
            copies = await _shared_copies(js, subjects)
            if case in ("claimed_and_done", "done_unseen"):
                assert copies == []
                return
            assert len(copies) == 1, copies
            assert copies[0].route_reason == RouteReason.FALLBACK and copies[0].routed_to == ""
            assert copies[0].request_id == rid
            if case == "unclaimed":
                assert (await claims.get(rid)).value == CLAIM_FALLBACK
                assert (await claims.claim(rid, "w1"))[0] is False  # the target, late: loses
            else:
                assert (await claims.get(rid)).value == takeover_value("w1")
        finally:
            await router.stop()
            await nc.close()

    asyncio.run(main())


async def _no_watchdog(router: Router) -> bool:
    return not router._watchdogs


async def _routed(js, subjects: Subjects, worker_id: str) -> GenerationJob | None:
    info = await js.stream_info(subjects.stream_generate)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(subjects.stream_generate, seq)
        if raw.subject == subjects.generate_routed(worker_id):
            return protocol.decode(raw.data, GenerationJob)
    return None
