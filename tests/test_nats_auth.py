"""One NATS identity per role (``shared.nats_auth``, issue 45): against a real nats-server
configured with the generated permissions, each role does what it must and cannot do what another
role owns - every forbidden case with its negative control (the owning role doing it). And the
E|P|D test stack, whose services connect as their roles: each connection is its role, nothing was
refused, and no password shows in a log, ``/health`` or a replay export."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import urllib.request
from pathlib import Path

import pytest
from pydantic import SecretStr

from shared import nats_auth, protocol
from shared.config import NatsSettings
from shared.ec_lifecycle.claims import EncodeClaims
from shared.ec_lifecycle.index import ECIndex
from shared.jetstream import connect, ensure_topology, open_bucket
from shared.nats_auth import Role
from shared.protocol import Subjects
from shared.routed_jobs import RoutingClaims
from shared.tools.infra import EmbeddedNats
from shared.tools.nats_identities import NatsIdentities
from tests.stackutil import data_url, epd_cli, noise_image, user_message

PREFIX = "auth"
S = Subjects(PREFIX)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A nats-server that knows only the role identities of prefix ``auth``; the API has made the
    streams, consumers and buckets."""
    directory = tmp_path_factory.mktemp("nats-auth")
    identities = NatsIdentities.under(directory / "identities", S)
    server = EmbeddedNats(directory / "nats", extra_config=identities.server_config(), max_file_store=2**30).start()

    async def set_up():
        settings = role_settings(server, identities, Role.API)
        nc = await connect(settings, name="set-up")
        js = nc.jetstream()
        await ensure_topology(js, settings, S, nc=nc)
        await EncodeClaims.open(js, S, settings)
        await RoutingClaims.open(js, S, settings)
        await ECIndex.open(js, S.ec_index_bucket)
        await nc.close()

    asyncio.run(set_up())
    try:
        yield server, identities
    finally:
        server.stop()


def role_settings(server, identities: NatsIdentities, role: Role, **kw) -> NatsSettings:
    env = identities.env(role)
    return NatsSettings(
        nats_url=server.url,
        subject_prefix=PREFIX,
        nats_user=env["EPD_NATS_USER"],
        nats_password=env["EPD_NATS_PASSWORD"],
        stream_max_bytes=8 * 1024**2,
        **kw,
    )


class Session:
    """A connection as one role that records the permission violations the server reports."""

    def __init__(self, nc, errors: list[str]):
        self.nc, self.js, self.errors = nc, nc.jetstream(), errors

    async def refused(self, what: str) -> bool:
        """Whether the server refused something on ``what`` since the last call (a flush waits
        for its answer: the server reports a violation before it answers the ping)."""
        await self.nc.flush(timeout=5)
        await asyncio.sleep(0.05)  # (nats-py hands the server's -ERR to the callback in a task of its own)
        hit = [e for e in self.errors if "permissions violation" in e and what.lower() in e.lower()]
        self.errors.clear()
        return bool(hit)

    async def can_publish(self, subject: str) -> bool:
        await self.nc.publish(subject, b"x")
        return not await self.refused(subject)

    async def can_subscribe(self, subject: str) -> bool:
        sub = await self.nc.subscribe(subject)
        ok = not await self.refused(subject)
        await sub.unsubscribe()
        return ok


async def session(server, identities, role: Role) -> Session:
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    nc = await connect(role_settings(server, identities, role), name=f"test-{role}", error_cb=on_error)
    return Session(nc, errors)


def run_as(auth_server, *roles: Role):
    """Run ``fn(*sessions)`` with a connection per role."""
    server, identities = auth_server

    def decorate(fn):
        async def main():
            sessions = [await session(server, identities, r) for r in roles]
            try:
                return await fn(*sessions)
            finally:
                for s in sessions:
                    await s.nc.close()

        return asyncio.run(main())

    return decorate


# -- publishing what another role owns -------------------------------------------------------------
@pytest.mark.parametrize(
    "intruder, subject, owner",
    [
        (Role.ENCODER, S.generate_jobs, Role.API),  # a generation job
        (Role.ENCODER, S.generate_routed("w1"), Role.API),  # ... routed to one worker
        (Role.ENCODER, S.cancel("r1"), Role.API),  # cancel someone's request
        (Role.ENCODER, S.tokens("r1"), Role.PREFILL),  # answer someone's request
        (Role.ENCODER, S.request("r1"), Role.API),  # a request record
        (Role.ENCODER, S.ec_invalidated("fp"), Role.API),  # make workers drop features (janitor)
        (Role.DECODE, S.ec_ready("fp", "item"), Role.ENCODER),  # announce an EC object
        (Role.DECODE, S.encode_jobs, Role.API),
        (Role.DECODE, S.decode_jobs, Role.PREFILL),
        (Role.PREFILL, S.encode_jobs, Role.API),
        (Role.PREFILL, S.heartbeat("encoder"), Role.ENCODER),  # pose as an encoder
        (Role.CONNECTOR, S.ec_invalidated("fp"), Role.API),
        (Role.API, S.ec_ready("fp", "item"), Role.ENCODER),  # the API announces no EC object
        (Role.API, S.decode_jobs, Role.PREFILL),
        # a replay viewer publishes nothing
        (Role.VIEWER, S.request("r1"), Role.API),
        (Role.VIEWER, S.generate_jobs, Role.API),
        (Role.VIEWER, S.cancel("r1"), Role.API),
        (Role.VIEWER, S.tokens("r1"), Role.DECODE),
        (Role.VIEWER, S.ec_ready("fp", "item"), Role.ENCODER),
        (Role.VIEWER, S.imported("r1", "chat_request"), Role.ADMIN),
        (Role.VIEWER, protocol.kv_key_subject_prefix(S.ec_index_bucket) + "ec.fp.x", Role.PREFILL),
    ],
)
def test_a_role_cannot_publish_what_another_role_owns(auth_server, intruder, subject, owner):
    @run_as(auth_server, intruder, owner)
    async def outcome(bad: Session, good: Session):
        return await bad.can_publish(subject), await good.can_publish(subject)

    assert outcome == (False, True), f"{intruder} publishing {subject}: {outcome[0]}; {owner}: {outcome[1]}"


@pytest.mark.parametrize(
    "intruder, subject, owner",
    [
        (Role.ENCODER, S.tokens_all, Role.API),  # read everyone's tokens
        (Role.ENCODER, S.heartbeat_all, Role.API),
        (Role.DECODE, S.ec_invalidated_all, Role.PREFILL),
        (Role.ENCODER, S.routing_claims_all, Role.API),
        (Role.ENCODER, "_INBOX.>", None),  # the default inbox: nobody's
        (Role.ENCODER, "_INBOX_api.>", Role.API),  # another role's replies (stored messages, values)
        (Role.VIEWER, "_INBOX_admin.>", Role.ADMIN),
        (Role.VIEWER, S.cancel_all, Role.ENCODER),
        (Role.CONNECTOR, S.tokens_all, Role.API),
    ],
)
def test_a_role_cannot_hear_what_it_does_not_need(auth_server, intruder, subject, owner):
    roles = (intruder,) if owner is None else (intruder, owner)

    @run_as(auth_server, *roles)
    async def outcome(bad: Session, good: Session | None = None):
        return await bad.can_subscribe(subject), None if good is None else await good.can_subscribe(subject)

    assert outcome[0] is False
    assert outcome[1] in (None, True)


@pytest.mark.parametrize(
    "intruder, stream, owner",
    [
        (Role.ENCODER, S.stream_results, Role.PREFILL),  # the tokens of stored requests
        (Role.ENCODER, S.stream_requests, Role.VIEWER),  # prompts
        (Role.DECODE, S.stream_events, Role.VIEWER),
        (Role.CONNECTOR, S.stream_control, Role.ENCODER),
    ],
)
def test_a_role_cannot_read_streams_it_does_not_need(auth_server, intruder, stream, owner):
    api_subject = f"$JS.API.STREAM.MSG.GET.{stream}"

    @run_as(auth_server, intruder, owner)
    async def outcome(bad: Session, good: Session):
        return await bad.can_publish(api_subject), await good.can_publish(api_subject)

    assert outcome == (False, True)


def test_key_value_buckets_are_open_to_their_roles_only(auth_server):
    @run_as(auth_server, Role.ENCODER, Role.PREFILL, Role.VIEWER, Role.API)
    async def outcome(encoder: Session, prefill: Session, viewer: Session, api: Session):
        routing_get = f"$JS.API.DIRECT.GET.{protocol.kv_stream(S.routing_bucket)}.$KV.{S.routing_bucket}.r1"
        index = protocol.kv_key_subject_prefix(S.ec_index_bucket)
        claims = await open_bucket(encoder.js, S.ec_claims_bucket, replicas=1, what="claims", description="")
        await claims.put("fp.item", b"encoder-1")  # the encoder's own claims: allowed
        return {
            "encoder reads routing claims": await encoder.can_publish(routing_get),
            "prefill reads routing claims": await prefill.can_publish(routing_get),
            "encoder writes the EC index": await encoder.can_publish(index + "ec.fp.x"),
            "prefill records a use": await prefill.can_publish(index + "ec.fp.x"),
            "prefill takes the janitor lease": await prefill.can_publish(index + "lease.janitor"),
            "api takes the janitor lease": await api.can_publish(index + "lease.janitor"),
            "viewer writes the EC index": await viewer.can_publish(index + "ec.fp.x"),
        }

    assert outcome == {
        "encoder reads routing claims": False,
        "prefill reads routing claims": True,
        "encoder writes the EC index": False,
        "prefill records a use": True,
        "prefill takes the janitor lease": False,
        "api takes the janitor lease": True,
        "viewer writes the EC index": False,
    }


def test_the_api_purges_the_ec_index_tombstones_as_its_role(auth_server):
    """The EC janitor's tombstone purge (``Janitor._purge_tombstones``: ``purge_deletes`` of the index
    bucket, which nats-py reads through an ordered consumer created on the legacy subject without a
    name, then purges each marker) works on the API's identity: a deleted key's marker is in the
    stream before and gone after, and nothing was refused. (The janitor logs a failure at debug and
    tries next pass: refused, the markers stayed for good.)"""
    import nats.js.errors

    key = "ec.fp.tombstone"
    stream = protocol.kv_stream(S.ec_index_bucket)
    subject = protocol.kv_key_subject_prefix(S.ec_index_bucket) + key

    @run_as(auth_server, Role.API)
    async def outcome(api: Session):
        index = await ECIndex.open(api.js, S.ec_index_bucket)
        await index.kv.put(key, b"{}")
        await index.kv.delete(key)
        marker = await api.js.get_last_msg(stream, subject)  # the delete marker
        try:
            await asyncio.wait_for(index.kv.purge_deletes(olderthan=0), 10)
        except (TimeoutError, nats.errors.Error) as exc:  # (refused: the consumer's create is never answered)
            return marker, f"purge failed: {type(exc).__name__}", await api.refused("CONSUMER.CREATE")
        try:
            left = await api.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            left = None
        return marker, left, await api.refused("CONSUMER.CREATE")

    marker, left, refused = outcome
    assert (marker.headers or {}).get("KV-Operation") == "DEL", marker  # (so "gone" below can fail)
    assert (left, refused) == (None, False), outcome


def test_work_consumers_serve_their_role_only(auth_server):
    """An encoder binds and takes its jobs; nobody else pulls its queue or deletes its consumer
    (the viewer's scans may make consumers on the stream, not use the work one)."""
    next_encode = f"$JS.API.CONSUMER.MSG.NEXT.{S.stream_encode}.{protocol.CONSUMER_ENCODER}"
    delete_encode = f"$JS.API.CONSUMER.DELETE.{S.stream_encode}.{protocol.CONSUMER_ENCODER}"

    @run_as(auth_server, Role.API, Role.ENCODER, Role.VIEWER, Role.PREFILL)
    async def outcome(api: Session, encoder: Session, viewer: Session, prefill: Session):
        await api.js.publish(S.encode_jobs, b"job", headers={protocol.HDR_MSG_ID: os.urandom(8).hex()})
        psub = await encoder.js.pull_subscribe_bind(durable=protocol.CONSUMER_ENCODER, stream=S.stream_encode)
        msgs = await psub.fetch(1, timeout=5)
        await msgs[0].ack_sync(timeout=5)
        return {
            "encoder took and acked its job": len(msgs) == 1,
            "viewer pulls the encode queue": await viewer.can_publish(next_encode),
            "prefill pulls the encode queue": await prefill.can_publish(next_encode),
            "viewer deletes the encoder consumer": await viewer.can_publish(delete_encode),
            "viewer scans the encode stream": await viewer.can_publish(
                f"$JS.API.CONSUMER.CREATE.{S.stream_encode}.scan1.{S.encode_jobs}"
            ),
        }

    assert outcome == {
        "encoder took and acked its job": True,
        "viewer pulls the encode queue": False,
        "prefill pulls the encode queue": False,
        "viewer deletes the encoder consumer": False,
        "viewer scans the encode stream": True,
    }


def test_only_the_api_creates_streams_and_a_worker_started_first_waits_for_it(tmp_path):
    """Workers create nothing (their identities may not): an encoder started before the API waits
    with a log line and binds once the API has made the streams and its consumer. Mutation: a
    worker that creates what it misses (``creates_topology`` True for it) is refused."""
    identities = NatsIdentities.under(tmp_path / "identities", S)
    with EmbeddedNats(tmp_path / "nats", extra_config=identities.server_config()) as server:

        async def main():
            encoder = role_settings(server, identities, Role.ENCODER)
            api = role_settings(server, identities, Role.API)
            enc = await session(server, identities, Role.ENCODER)
            refused = not await enc.can_publish(f"$JS.API.STREAM.CREATE.{S.stream_encode}")
            waiting = asyncio.create_task(
                ensure_topology(enc.js, encoder, S, consumer=(S.stream_encode, protocol.CONSUMER_ENCODER), wait_s=30)
            )
            await asyncio.sleep(1.0)
            still_waiting = not waiting.done()
            nc = await connect(api, name="api")
            await ensure_topology(nc.jetstream(), api, S, nc=nc)
            await asyncio.wait_for(waiting, 10)
            await nc.close()
            await enc.nc.close()
            return refused, still_waiting

        refused, still_waiting = asyncio.run(main())
    assert refused and still_waiting
    assert not nats_auth.creates_topology("encoder") and nats_auth.creates_topology("api")
    assert nats_auth.creates_topology(None)  # no identity (a development NATS): as before


# -- the generated parts -------------------------------------------------------------------------
def test_permissions_are_derived_from_the_subjects_of_the_deployment():
    """Another prefix, other subjects: nothing of the default prefix is left (nothing hand-written)."""
    for role in Role:
        for pattern in (p := nats_auth.permissions(role, Subjects("other"))).publish + p.subscribe + p.publish_deny:
            assert ".epd." not in f".{pattern}." and "EPD_" not in pattern, (role, pattern)
    # the connector inside a worker uses the worker's identity: it must need nothing more
    prefill, connector = nats_auth.permissions(Role.PREFILL, S), nats_auth.permissions(Role.CONNECTOR, S)
    assert set(connector.subscribe) - {"_INBOX_connector.>"} <= set(prefill.subscribe)
    assert set(connector.publish) - {"_INBOX_connector.>"} <= set(prefill.publish)


def test_the_docs_table_is_the_generated_one():
    """docs/security.md holds :func:`shared.nats_auth.permission_table` verbatim (``epd config docs``
    writes it). Mutation: a permission changed in the code and not in the docs fails here."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    assert nats_auth.permission_table() in text


def test_identities_are_kept_private_and_reused(tmp_path):
    first = NatsIdentities.under(tmp_path / "ids", S)
    assert stat.S_IMODE((tmp_path / "ids").stat().st_mode) == 0o700
    for role in Role:
        assert stat.S_IMODE(first.path(role).stat().st_mode) == 0o600
        assert len(first.passwords[role]) >= 40
    assert NatsIdentities.under(tmp_path / "ids", S).passwords == first.passwords  # a restart keeps them
    assert not any(p in repr(first) for p in first.passwords.values())
    assert len(set(first.passwords.values())) == len(Role)


def test_a_wrong_password_is_refused(auth_server):
    server, identities = auth_server
    bad = role_settings(server, identities, Role.ENCODER).model_copy(update={"nats_password": SecretStr("not-it")})
    with pytest.raises(Exception, match="[Aa]uthorization"):
        asyncio.run(connect(bad, name="bad", max_reconnect_attempts=0, allow_reconnect=False))


# -- the E|P|D stack, each service as its role ----------------------------------------------------
def test_the_stack_runs_each_service_as_its_role_and_shows_no_password(epd_stack_epd, tmp_path):
    stack = epd_stack_epd
    assert stack.own_nats is not None and stack.identities is not None
    resp = stack.chat([user_message("Describe the image.", [data_url(noise_image(451, (56, 56)))])], max_tokens=4)
    assert resp.status_code == 200, resp.text
    rid = resp.json()["id"]
    # every service connection is its role's identity (the server says who authenticated)
    with urllib.request.urlopen(f"{stack.own_nats.monitor_url}/connz?auth=true&limit=1024") as r:
        conns = json.load(r)["connections"]
    services = {"api", "encoder", "prefill", "decode"}
    seen = {(c["name"].split("-")[1], c.get("authorized_user")) for c in conns if c.get("name", "").startswith("epd-")}
    assert {service for service, _ in seen} == services, seen
    assert all(user == service for service, user in seen), seen
    # nothing the services did was refused
    assert "Violation" not in stack.own_nats.log_path.read_text()
    # the viewer exports the request (reads only) ...
    out = tmp_path / "case.json"
    viewer_env = {**stack.env, **stack.identities.env(Role.VIEWER)}
    done = epd_cli(viewer_env, "replay", "export", rid, "--no-media", "-o", str(out))
    assert done.returncode == 0, done.stderr
    # ... and no password is in it, in a service log, in /health or in the CLI's output
    health = urllib.request.urlopen(f"{stack.url}/health").read().decode()
    logs = "\n".join(p.log_path.read_text() for p in stack.stack.processes)
    for password in stack.identities.passwords.values():
        for where, text in (("export", out.read_text()), ("logs", logs), ("/health", health)):
            assert password not in text, f"a NATS password in {where}"
        assert password not in done.stdout + done.stderr
    assert rid in out.read_text()  # (a negative control: the export holds the request)
