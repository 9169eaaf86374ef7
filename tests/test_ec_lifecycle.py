"""EC store lifecycle (issue 15): the index, the janitor (bounds, LRU, TTL, lease), purges by
model version, the invalidation broadcast, and requests racing them. Real NATS and SeaweedFS;
the request tests run real api / encoder / prefill processes on the tiny model."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import nats
import pytest

from shared.ec_lifecycle.index import ECIndex, Use, entry_key
from shared.ec_lifecycle.invalidation import publish_invalidated, subscribe_invalidations
from shared.ec_lifecycle.janitor import (
    Janitor,
    Policy,
    UnknownFingerprint,
    expiration_days,
    get_expiration_days,
    list_objects,
    purge,
    set_expiration_rule,
)
from shared.ec_lifecycle.uses import UseRecorder
from shared.protocol import ECInvalidated, Subjects
from shared.store.ec import ECStore
from shared.store.kv import KVStore

FP_A = "a" * 24
FP_B = "b" * 24
DATA = bytes(4 * 64 * 4)  # one F32 [4, 64] tensor


@pytest.fixture
async def nc(nats_server):
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


@pytest.fixture
async def world(nc, s3_store):
    """A fresh prefix (index bucket, subjects) and namespace on the session's NATS and S3."""
    tag = uuid.uuid4().hex[:8]
    subjects = Subjects(f"t{tag}")
    index = await ECIndex.open(nc.jetstream(), subjects.ec_index_bucket)
    yield dict(nc=nc, subjects=subjects, index=index, store=s3_store, namespace=f"ns{tag}")
    await nc.jetstream().delete_key_value(subjects.ec_index_bucket)


def ec_store(world, fp: str = FP_A) -> ECStore:
    return ECStore(world["store"], namespace=world["namespace"], fingerprint=fp, producer="test")


def save(world, item: str, fp: str = FP_A) -> tuple[str, int]:
    return ec_store(world, fp).save(item, DATA, dtype="F32", shape=(4, 64))


def janitor(world, holder: str = "j1", interval_s: float = 1.0, headroom: bool = False, **policy) -> Janitor:
    """(no headroom below the bound unless asked: the tests count exactly)"""
    return Janitor(
        nc=world["nc"],
        subjects=world["subjects"],
        index=world["index"],
        store=world["store"],
        namespace=world["namespace"],
        holder=holder,
        policy=Policy(headroom=headroom, **policy),
        interval_s=interval_s,
        reconcile_interval_s=3600,
    )


def stored_items(world, fp: str = FP_A) -> set[str]:
    return {o.name for o in list_objects(world["store"], world["namespace"]) if o.kind == "ec" and o.fingerprint == fp}


async def record(world, items, *, fp: str = FP_A, created: bool = True, size: int = 0):
    recorder = UseRecorder(world["index"], flush_s=3600)
    for item in items:
        recorder.note(ec_store(world, fp).key(item), fp, item, size=size, created=created)
    return await recorder.flush()


# -- the index and the janitor ------------------------------------------------------------------
async def test_uses_are_batched_one_update_per_object(world):
    key, size = save(world, "img0")
    recorder = UseRecorder(world["index"], flush_s=3600)
    recorder.note(key, FP_A, "img0")  # a read of an object without an entry creates none
    assert await recorder.flush() == 1 and await world["index"].get(entry_key(FP_A, "img0")) is None
    recorder.note(key, FP_A, "img0", size=size, created=True)
    for _ in range(500):
        recorder.note(key, FP_A, "img0", size=size)
    assert await recorder.flush() == 1  # a write and 500 hits, one index write
    entry, revision = await world["index"].get(entry_key(FP_A, "img0"))
    assert (entry.key, entry.size) == (key, size)
    recorder.note(key, FP_A, "img0")
    assert await recorder.flush() == 1
    later, later_revision = await world["index"].get(entry_key(FP_A, "img0"))
    assert later.last_use >= entry.last_use and later_revision > revision and later.size == size


async def test_bound_keeps_namespace_under_it_and_evicts_least_recently_used(world):
    """A stream of distinct objects under a 4-object byte bound: after each pass the namespace is
    under the bound; an object hit recently survives, the cold ones go first, and every eviction
    is announced."""
    got: list[ECInvalidated] = []
    sub = await subscribe_invalidations(world["nc"], world["subjects"], got.append)
    _, size = save(world, "probe")
    bound = 4 * size
    jan = janitor(world, max_bytes=bound, grace_s=0)
    hot = "img-hot"
    save(world, hot)
    await record(world, [hot])
    evicted: list[str] = []
    for i in range(12):
        item = f"img-{i:02d}"
        save(world, item)
        await record(world, [item])
        await record(world, [hot], created=False)  # the hot image is hit again with every new one
        before = stored_items(world)
        report = await jan.run_once()
        after = stored_items(world)
        evicted += sorted(before - after)
        assert report is not None and not report.over_bound
        indexed = sum(e.size for e, _ in (await world["index"].snapshot()).values())
        assert indexed <= bound, (i, indexed)
        stored = list_objects(world["store"], world["namespace"])
        assert sum(o.info.size for o in stored) <= bound, (
            i,
            [(o.name, o.info.size) for o in stored],
            {e.item_hash: e.size for e, _ in (await world["index"].snapshot()).values()},
        )
        assert hot in after
    # Least recently used first: the never-used probe, then the cold images in the order they came.
    assert evicted == ["probe"] + [f"img-{i:02d}" for i in range(9)]
    assert stored_items(world) == {hot, "img-09", "img-10", "img-11"}
    deadline = time.time() + 60
    while sum(len(e.item_hashes) for e in got) < len(evicted) and time.time() < deadline:
        await asyncio.sleep(0.05)
    assert sorted(h for e in got for h in e.item_hashes) == sorted(evicted)
    assert {e.reason for e in got} == {"bytes"} and {e.fingerprint for e in got} == {FP_A}
    await sub.unsubscribe()


async def test_a_pass_over_the_bound_leaves_room_for_the_next_interval(world):
    """A pass evicts down to the bound minus what was written lately (at most half the bound);
    below that it evicts nothing."""
    items = [f"img-{i:02d}" for i in range(6)]
    for item in items[:2]:
        save(world, item)
    await record(world, items[:2], size=1)
    assert not (await janitor(world, interval_s=3600, headroom=True, max_objects=4, grace_s=0).run_once()).evicted
    for item in items[2:]:
        save(world, item)
    await record(world, items[2:], size=1)
    report = await janitor(world, interval_s=3600, headroom=True, max_objects=4, grace_s=0).run_once()
    assert dict(report.evicted) == {"objects": 4}  # 6 -> 4 - min(6 written, 4 // 2)
    assert stored_items(world) == set(items[4:])


async def test_ttl_and_grace(world):
    for item in ("old", "new"):
        save(world, item)
    await world["index"].record(
        Use(
            key=ec_store(world).key("old"),
            fingerprint=FP_A,
            item_hash="old",
            at=time.time() - 1000,
            size=1,
            created=True,
        )
    )
    await record(world, ["new"], size=1)
    # TTL: only the object unused for longer goes.
    report = await janitor(world, ttl_s=500).run_once()
    assert dict(report.evicted) == {"ttl": 1} and stored_items(world) == {"new"}
    # Grace: over the bound, but the only object left was just used - kept, and said so.
    report = await janitor(world, max_objects=0, grace_s=600).run_once()
    assert report.over_bound and not report.evicted and stored_items(world) == {"new"}


async def test_two_janitors_never_both_evict(world):
    """Two janitors, passes run at the same time, again and again: one holds the lease, every
    object is deleted exactly once, and the evictions add up to exactly what the bound requires."""
    items = [f"img-{i:02d}" for i in range(20)]
    for item in items:
        save(world, item)
    await record(world, items)
    j1, j2 = janitor(world, "j1", max_objects=5, grace_s=0), janitor(world, "j2", max_objects=5, grace_s=0)
    reports = []
    for _ in range(4):
        reports += await asyncio.gather(j1.run_once(), j2.run_once())
    ran = [r for r in reports if r is not None]
    assert len(ran) == len(reports) // 2  # never both in one round
    assert sum(sum(r.evicted.values()) for r in ran) == 15
    assert stored_items(world) == set(items[15:])
    # The lease is held until it expires or is released: then the other one takes over.
    holder, other = (j1, j2) if j1.leading else (j2, j1)
    assert await other.run_once() is None
    await holder.stop()  # releases the lease
    assert await other.run_once() is not None and await holder.run_once() is None


async def test_a_use_recorded_after_the_pass_read_the_index_saves_the_object(world):
    """Eviction removes the index entry at the revision the pass read (compare-and-set): a use
    recorded in between wins, and the object stays."""
    for item in ("a", "b"):
        save(world, item)
    await record(world, ["a", "b"])
    jan = janitor(world, max_objects=0, grace_s=0)
    snap = await world["index"].snapshot()
    entries = sorted(((k, e, r) for k, (e, r) in snap.items()), key=lambda t: t[1].last_use)
    from shared.ec_lifecycle.janitor import PassReport

    report = PassReport()
    victims = jan._select(entries, {}, time.time(), report)
    assert {v[1].item_hash for v in victims} == {"a", "b"}
    await record(world, ["a"], created=False)  # a request used "a" meanwhile
    await jan._evict(victims, report)
    assert report.skipped == 1 and dict(report.evicted) == {"objects": 1}
    assert stored_items(world) == {"a"}


async def test_reconcile_indexes_unannounced_objects_and_drops_gone_ones(world):
    save(world, "unannounced")
    await record(world, ["ghost"], size=10)
    entry, revision = await world["index"].get(entry_key(FP_A, "ghost"))
    # (entries younger than a minute may name an object written after the listing: kept)
    aged = msgspec.structs.replace(entry, created=entry.created - 120)
    await world["index"].kv.update(entry_key(FP_A, "ghost"), msgspec.json.encode(aged), last=revision)
    assert await janitor(world).reconcile() == 1
    snap = await world["index"].snapshot()
    assert set(snap) == {entry_key(FP_A, "unannounced")}
    assert snap[entry_key(FP_A, "unannounced")][0].size == len(
        world["store"].get(ec_store(world).key("unannounced"), max_bytes=1 << 20)
    )


# -- purges by model version ------------------------------------------------------------------------
async def test_purge_by_fingerprint_removes_exactly_that_version(world):
    got: list[ECInvalidated] = []
    sub = await subscribe_invalidations(world["nc"], world["subjects"], got.append)
    for item in ("x", "y", "z"):
        save(world, item, FP_A)
        save(world, item, FP_B)
    await record(world, ["x", "y", "z"], fp=FP_A)
    await record(world, ["x", "y", "z"], fp=FP_B)
    kv_a = KVStore(
        world["store"], namespace=world["namespace"], fingerprint=FP_A, producer="t", max_object_bytes=1 << 20
    )
    kv_b = KVStore(
        world["store"], namespace=world["namespace"], fingerprint=FP_B, producer="t", max_object_bytes=1 << 20
    )
    for kv in (kv_a, kv_b):
        world["store"].put(kv.key("req-1", 0), b"kv")
    media = ec_store(world).put_media("x", b"png")
    common = dict(
        nc=world["nc"],
        subjects=world["subjects"],
        index=world["index"],
        store=world["store"],
        namespace=world["namespace"],
        by="test",
    )
    # A mistyped fingerprint is refused, naming the known ones, and removes nothing (dry run or not).
    typo = FP_A[:-1] + ("0" if FP_A[-1] != "0" else "1")
    for dry_run in (True, False):
        with pytest.raises(UnknownFingerprint) as refused:
            await purge(**common, fingerprint=typo, dry_run=dry_run)
        assert refused.value.fingerprint == typo and {FP_A, FP_B} <= set(refused.value.known)
    assert stored_items(world, FP_A) == {"x", "y", "z"}
    assert (await purge(**common, fingerprint=typo, allow_unknown=True)).objects == 0
    dry = await purge(**common, fingerprint=FP_A, dry_run=True)
    assert dry.objects == 4 and stored_items(world, FP_A) == {"x", "y", "z"}
    result = await purge(**common, fingerprint=FP_A)
    assert dict(result.removed) == {
        ("ec", FP_A): [3, 3 * len(world["store"].get(ec_store(world, FP_B).key("x"), max_bytes=1 << 20))],
        ("kv", FP_A): [1, 2],
    }
    assert stored_items(world, FP_A) == set() and stored_items(world, FP_B) == {"x", "y", "z"}
    assert world["store"].exists(kv_b.key("req-1", 0)) and not world["store"].exists(kv_a.key("req-1", 0))
    assert world["store"].exists(media)
    snap = await world["index"].snapshot()
    assert {e.fingerprint for e, _ in snap.values()} == {FP_B} and len(snap) == 3
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        await asyncio.sleep(0.05)
    assert [(e.fingerprint, sorted(e.item_hashes), e.reason) for e in got] == [(FP_A, ["x", "y", "z"], "purge")]
    await sub.unsubscribe()


async def test_snapshots_miss_no_entry_while_entries_are_rewritten(world):
    """Every snapshot of the index holds every live entry, also while they are being rewritten
    (heartbeats rewrite fingerprint entries every second, uses rewrite EC entries) and while
    others are deleted - a janitor pass or a purge that misses entries under-counts the bound or
    calls a served fingerprint unknown."""
    index = world["index"]
    fps = [f"{i:024x}" for i in range(8)]
    for fp in fps:
        await index.seen(fp, model="m")
    items = [f"img-{i:02d}" for i in range(8)]
    await record(world, items, size=1)
    stop = asyncio.Event()

    async def rewrite() -> int:
        n = 0
        while not stop.is_set():
            await index.seen(fps[n % len(fps)], model="m", at=time.time() + n)
            await record(world, [items[n % len(items)]], created=False)
            await record(world, ["gone"], size=1)  # created, then deleted: a marker among the entries
            await index.remove(entry_key(FP_A, "gone"), None)
            n += 1
        return n

    writer = asyncio.ensure_future(rewrite())
    try:
        incomplete = []
        for i in range(100):
            seen_fps = set(await index.fingerprints())
            seen_items = {e.item_hash for e, _ in (await index.snapshot()).values() if e.item_hash != "gone"}
            if seen_fps != set(fps) or seen_items != set(items):
                incomplete.append((i, len(seen_fps), len(seen_items)))
    finally:
        stop.set()
        rewrites = await writer
    assert rewrites > 20  # the entries were being rewritten while the snapshots were read
    assert not incomplete


async def test_purge_retired_keeps_current_versions(world):
    for fp in (FP_A, FP_B):
        save(world, "x", fp)
    await world["index"].seen(FP_A, model="current-model", model_path="/models/a")
    await world["index"].seen(FP_B, model="old-model", at=time.time() - 7200)
    common = dict(
        nc=world["nc"],
        subjects=world["subjects"],
        index=world["index"],
        store=world["store"],
        namespace=world["namespace"],
        by="test",
    )
    fp_c = "c" * 24  # never named by a heartbeat, used just now: not retired (yet)
    save(world, "x", fp_c)
    result = await purge(**common, retired=True, retired_after_s=600)
    assert set(result.removed) == {("ec", FP_B)} and stored_items(world, fp_c) == {"x"}
    assert stored_items(world, FP_A) == {"x"} and stored_items(world, FP_B) == set()
    # The janitor's option does the same, once the version has been retired for its grace period
    # (FP_B: last served 2 h ago, retired 10 min after that).
    save(world, "y", FP_B)
    await record(world, ["x"], fp=FP_A)
    await record(world, ["y"], fp=FP_B)
    report = await janitor(world, purge_retired_after_s=3 * 3600, retired_after_s=600).run_once()
    assert not report.evicted
    report = await janitor(world, purge_retired_after_s=3600, retired_after_s=600).run_once()
    assert dict(report.evicted) == {"retired": 1}
    assert stored_items(world, FP_A) == {"x"} and stored_items(world, FP_B) == set()
    fps = await world["index"].fingerprints()
    assert fps[FP_A].model_path == "/models/a" and fps[FP_B].model == "old-model"


def test_s3_lifecycle_backstop(s3_store):
    """SeaweedFS takes (and reports back) a lifecycle expiration rule on the EC prefix."""
    assert expiration_days(3600) == 1 and expiration_days(3 * 86400) == 6
    assert set_expiration_rule(s3_store, "ns/", 2) is True
    assert get_expiration_days(s3_store, "ns/") == 2


def test_lifecycle_backstop_on_a_backend_without_rules(tmp_path, caplog):
    from shared.store.objects import LocalDirObjectStore

    assert set_expiration_rule(LocalDirObjectStore(tmp_path), "ns/", 2) is False
    assert "only the janitor bounds the store" in caplog.text


async def test_vllm_connector_side_drops_invalidated_items_and_records_uses(world, nats_server):
    """The EC connector's lifecycle thread (vLLM scheduler process): item hashes of its own
    fingerprint's invalidations come out of ``take()`` (others never do); ``used()`` reaches the
    index."""
    from shared.ec_lifecycle.invalidation import ConnectorLifecycle

    life = ConnectorLifecycle(nats_server.url, world["subjects"].prefix, ec_store(world), flush_s=0.2)
    life.start()
    try:
        assert await asyncio.to_thread(life.ready.wait, 60)
        await publish_invalidated(world["nc"], world["subjects"], FP_B, ["other"], reason="purge", by="t")
        await publish_invalidated(world["nc"], world["subjects"], FP_A, ["i1", "i2"], reason="bytes", by="t")
        got: set[str] = set()
        deadline = time.time() + 60
        while got != {"i1", "i2"} and time.time() < deadline:
            got |= life.take()
            await asyncio.sleep(0.05)
        assert got == {"i1", "i2"}  # (published after FP_B's event, on one connection: that one came first)
        await record(world, ["i1"])  # (an entry exists: uses update entries, writes create them)
        life.used("i1", size=7)
        deadline = time.time() + 60
        while (await world["index"].get(entry_key(FP_A, "i1")))[0].size != 7 and time.time() < deadline:
            await asyncio.sleep(0.1)
        entry, _ = await world["index"].get(entry_key(FP_A, "i1"))
        assert entry.key == ec_store(world).key("i1") and entry.size == 7
    finally:
        await asyncio.to_thread(life.close)


def test_vllm_connector_takes_its_nats_settings_from_its_extra_config(monkeypatch, tmp_path):
    """The connector's lifecycle thread is configured like the rest of the connector (its extra
    config, which epd-serve's vLLM engine fills in from its settings), never from ``EPD_NATS_URL``."""
    from shared.config import PrefillSettings
    from shared.connectors.common import ConnectorConfig
    from shared.ec_lifecycle.invalidation import ConnectorLifecycle
    from shared.engines.vllm_engine import connector_extra_config

    settings = PrefillSettings(nats_url="nats://n1:4222,nats://n2:4222", subject_prefix="tenant7")
    extra = connector_extra_config(settings)
    assert (extra["nats_url"], extra["subject_prefix"]) == ("nats://n1:4222,nats://n2:4222", "tenant7")
    config = ConnectorConfig.from_extra(extra)
    assert (config.nats_url, config.subject_prefix) == ("nats://n1:4222,nats://n2:4222", "tenant7")
    with pytest.raises(ValueError, match="subject_prefix"):
        ConnectorConfig.from_extra({"subject_prefix": "a.b"})

    monkeypatch.setenv("EPD_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("EPD_NATS_USER", "u")
    monkeypatch.setenv("EPD_NATS_PASSWORD", "p")
    config = ConnectorConfig.from_extra({"backend": "fs", "fs_root": str(tmp_path)})
    assert config.nats_url == "" and config.nats_credentials() == ("u", "p")
    store = config.ec_store(FP_A)
    assert ConnectorLifecycle.launch(store, nats_url=config.nats_url, prefix=config.subject_prefix) is None
