"""One NATS identity per role, with only the subjects it needs (issue 45).

Every permission is derived here from :class:`~shared.protocol.Subjects` (the one place subjects,
streams, consumers and key-value buckets are named), one function per role; nothing is written
twice. :func:`server_authorization` renders them into the ``authorization { users = [...] }`` block
of a nats-server configuration (``epd up``, Compose's ``nats-init``, the test stacks), and
:func:`permission_table` into the role x permission table of docs/security.md (checked by a test).

**Mechanism: a password per role.** The services already connect with ``EPD_NATS_USER`` /
``EPD_NATS_PASSWORD`` (every deployment - ``epd up``, Compose's ``.env``, Kubernetes secrets -
passes them), the password travels only inside the TLS connection when TLS is on, and the
generated passwords are 256-bit random tokens (no dictionary to guess from). nkeys would keep the
secret off the wire, but need the ``nkeys`` package (ed25519 via PyNaCl) in every image and a seed
file per service instead of a variable; client certificates tie the identity to TLS, which
``epd up`` does not turn on by default. Both map onto the same permissions below should a site
want them (NATS attaches permissions to an nkey or a certificate's subject the same way).

**Who creates what.** The API (and the admin) create and update the streams, the shared durable
consumers and the key-value buckets; the workers only bind (:func:`shared.jetstream.ensure_topology`
with ``create=False``): a worker started before the API waits for them with a log line. A
generating worker creates its own routed consumer (its name holds the worker id). Reads that scan a
stream make short-lived ephemeral consumers.

**Inboxes.** Each identity gets an inbox prefix of its own (``_INBOX_<user>``, set by
:func:`shared.jetstream.connect`): JetStream's replies - stored messages, key-value values - go to
the asker's inbox, and a role may subscribe to its own inboxes only, so it cannot read another
role's replies.

What a role still can do with its own permissions is said in docs/security.md (e.g. the JetStream
API cannot tell an ephemeral consumer's name from a durable one's by subject, so a role that scans a
stream could pull from that stream's consumers; the work consumers are denied to it explicitly).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from shared import protocol
from shared.protocol import JS_ACK, JS_API, JS_FC, Subjects, kv_key_subject_prefix, kv_stream


class Role(enum.StrEnum):
    """A NATS identity: the user name of its generated account is its value."""

    API = "api"
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"
    #: the vLLM EC connector in a vLLM process that is not an epd worker (inside one it uses the
    #: worker's identity, which includes these permissions)
    CONNECTOR = "connector"
    #: ``epd replay list/show/export``, ``epd ec ls``: reads, never publishes a message
    VIEWER = "viewer"
    #: ``epd replay run/import``, ``epd ec purge``: the viewer's reads and the API's publishes
    ADMIN = "admin"


#: The role of each service (``shared.topology.Service`` values).
SERVICE_ROLES = {"api": Role.API, "encoder": Role.ENCODER, "prefill": Role.PREFILL, "decode": Role.DECODE}


#: The identities that create nothing: they bind to the streams, consumers and buckets the API made.
BINDING_ROLES = frozenset({Role.ENCODER, Role.PREFILL, Role.DECODE, Role.CONNECTOR, Role.VIEWER})


def creates_topology(user: str | None) -> bool:
    """Whether a process connected as ``user`` creates the streams, shared consumers and buckets
    it misses (no identity, the API's, the admin's, a site's own user) or only binds to them (a
    worker's, the connector's or the viewer's role identity: it waits for the API)."""
    return user not in {r.value for r in BINDING_ROLES}


def inbox_prefix(user: str) -> str:
    """The inbox prefix of ``user``'s connections: its JetStream replies arrive below it."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", user):
        raise ValueError(f"a NATS user name must be made of [A-Za-z0-9_-] to name an inbox, got {user!r}")
    return f"_INBOX_{user}"


@dataclasses.dataclass
class Permissions:
    """What one identity may publish and subscribe to (NATS subject patterns). ``publish_deny``
    takes precedence over ``publish``."""

    publish: list[str] = dataclasses.field(default_factory=list)
    subscribe: list[str] = dataclasses.field(default_factory=list)
    publish_deny: list[str] = dataclasses.field(default_factory=list)

    def add(self, *, pub: Iterable[str] = (), sub: Iterable[str] = (), deny: Iterable[str] = ()) -> Permissions:
        for target, values in ((self.publish, pub), (self.subscribe, sub), (self.publish_deny, deny)):
            for value in values:
                if value not in target:
                    target.append(value)
        return self

    def merged(self, other: Permissions) -> Permissions:
        out = Permissions(list(self.publish), list(self.subscribe), list(self.publish_deny))
        return out.add(pub=other.publish, sub=other.subscribe, deny=other.publish_deny)


# -- building blocks: what one kind of JetStream use needs ------------------------------------------
def _inbox(role: Role) -> Permissions:
    """Replies to this role's requests (and its own echo probes, ``shared.jetstream.server_answers``)."""
    own = inbox_prefix(role.value) + ".>"
    return Permissions(publish=[f"{JS_API}.INFO", own], subscribe=[own])


def _stream_info(*streams: str) -> list[str]:
    return [f"{JS_API}.STREAM.INFO.{s}" for s in streams]


def _read(*streams: str) -> list[str]:
    """Get stored messages by sequence or subject (``get_msg`` / ``get_last_msg``, direct or not)."""
    out = _stream_info(*streams)
    for s in streams:
        out += [f"{JS_API}.STREAM.MSG.GET.{s}", f"{JS_API}.DIRECT.GET.{s}", f"{JS_API}.DIRECT.GET.{s}.>"]
    return out


def _work_consumers(subjects: Subjects) -> list[tuple[str, str]]:
    """(stream, durable) of every shared work consumer."""
    return [(subjects.work_stream(queue), durable) for queue, durable in protocol.WORK_CONSUMERS.values()]


def _consume(stream: str, consumer: str) -> Permissions:
    """Bind and pull a durable consumer and acknowledge what it delivers (``*``: any of the stream's)."""
    return Permissions(
        publish=[
            f"{JS_API}.CONSUMER.INFO.{stream}.{consumer}",
            f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"{JS_ACK}.{stream}.{consumer}.>",
        ]
    )


def _scan(subjects: Subjects, *streams: str) -> Permissions:
    """Short-lived ephemeral consumers that read a stream (``shared.history``, ``kv_latest``). The
    JetStream API names a consumer by a subject token, so a pattern cannot tell ephemeral from
    durable: the work consumers are denied explicitly."""
    perms = Permissions()
    for s in streams:
        perms.add(
            pub=[
                f"{JS_API}.CONSUMER.CREATE.{s}.>",
                f"{JS_API}.CONSUMER.INFO.{s}.*",
                f"{JS_API}.CONSUMER.MSG.NEXT.{s}.*",
                f"{JS_API}.CONSUMER.DELETE.{s}.*",
                # an ordered consumer's flow control (key-value purges, watches)
                f"{JS_FC}.{s}.>",
            ]
        )
    return perms.add(deny=_protect_work_consumers(subjects, streams))


def _protect_work_consumers(subjects: Subjects, streams: Iterable[str]) -> list[str]:
    streams = set(streams)
    out = []
    for stream, durable in _work_consumers(subjects):
        if stream in streams:
            out += [
                f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
                f"{JS_API}.CONSUMER.DELETE.{stream}.{durable}",
                f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}",
                f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}.>",
                f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            ]
    return out


def _kv(bucket: str, keys: str = ">", *, write: bool = True, watch: bool = False) -> Permissions:
    """A key-value bucket's keys ``keys`` (a pattern below the bucket): look the bucket up, get
    (direct), put / create / update / delete when ``write``, hear new values when ``watch``."""
    stream, key_subject = kv_stream(bucket), kv_key_subject_prefix(bucket) + keys
    perms = Permissions(
        publish=[
            *_stream_info(stream),
            f"{JS_API}.DIRECT.GET.{stream}.{key_subject}",
            f"{JS_API}.STREAM.MSG.GET.{stream}",
        ]
    )
    if write:
        perms.add(pub=[key_subject])
    if watch:
        perms.add(sub=[key_subject])
    return perms


def _buckets(subjects: Subjects) -> list[str]:
    return [subjects.ec_index_bucket, subjects.routing_bucket, subjects.ec_claims_bucket]


def _create_topology(subjects: Subjects) -> Permissions:
    """Create and update the streams, the shared durable consumers and the key-value buckets."""
    perms = Permissions()
    for stream in [*subjects.streams(), *(kv_stream(b) for b in _buckets(subjects))]:
        perms.add(pub=[f"{JS_API}.STREAM.CREATE.{stream}", f"{JS_API}.STREAM.UPDATE.{stream}", *_stream_info(stream)])
    for stream, durable in _work_consumers(subjects):
        perms.add(
            pub=[
                f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
                f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}",
                f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}.>",
                f"{JS_API}.CONSUMER.INFO.{stream}.{durable}",
            ]
        )
    return perms


def _bind_topology(subjects: Subjects) -> Permissions:
    """A worker's start-up check that the streams exist (it creates none)."""
    return Permissions(publish=_stream_info(*subjects.streams()))


# -- the roles ---------------------------------------------------------------------------------------
def api_permissions(subjects: Subjects) -> Permissions:
    """The API: accepts requests (records them, queues encode and generation jobs, routes, cancels),
    streams tokens back, supervises deliveries, indexes EC objects and runs the janitor."""
    s = subjects
    perms = _inbox(Role.API).merged(_create_topology(s))
    perms.add(
        pub=[
            s.requests_all,
            s.encode_jobs,
            s.generate_jobs,
            s.generate_routed_all,
            s.cancel_all,
            s.ec_wanted("*", "*"),
            # the supervisor's terminal events (a job out of deliveries)
            s.tokens_all,
            s.ec_failed("*", "*"),
            # the janitor
            s.ec_invalidated("*"),
        ],
        sub=[
            s.tokens_all,
            s.ec_ready_all,
            s.heartbeat_all,
            s.routing_claims_all,
            *(s.max_deliveries_advisory(stream, "*") for stream, _ in _work_consumers(s)),
        ],
    )
    # reads: a request's tokens (a stream resumed), cancellation records, a job out of deliveries,
    # and a request's whole history (``/debug/requests/<id>``: every stream, scanned; the API may
    # touch the work consumers it creates anyway, so the viewer's denials are not its)
    perms.add(pub=_read(*s.streams()), deny=[])
    perms.add(pub=_scan(s, *s.streams()).publish)
    # the scaling signal: every consumer of the work streams (a generating worker's routed ones too)
    for stream, _ in _work_consumers(s):
        perms.add(pub=[f"{JS_API}.CONSUMER.INFO.{stream}.*", f"{JS_API}.CONSUMER.LIST.{stream}"])
    perms = perms.merged(_kv(s.ec_index_bucket)).merged(_scan(s, kv_stream(s.ec_index_bucket)))
    # the janitor's tombstone purge (``purge_deletes``): nats-py reads the markers through an ordered
    # consumer it creates on the legacy subject, which names no consumer (``_scan``'s pattern needs
    # one); the index stream has no work consumer to protect
    index_stream = kv_stream(s.ec_index_bucket)
    perms.add(pub=[f"{JS_API}.STREAM.PURGE.{index_stream}", f"{JS_API}.CONSUMER.CREATE.{index_stream}"])
    return perms.merged(_kv(s.routing_bucket, watch=True)).merged(_kv(s.ec_claims_bucket, write=False))


def _worker(role: Role, subjects: Subjects) -> Permissions:
    """What every worker does: bind its queue, hear cancellations, beat, check a job's records."""
    s = subjects
    perms = _inbox(role).merged(_bind_topology(s))
    perms.add(pub=[s.heartbeat(role.value)], sub=[s.cancel_all])
    perms.add(pub=_read(s.stream_control))  # cancellation records (``shared.cancellation``)
    return perms


def encoder_permissions(subjects: Subjects) -> Permissions:
    """An encoder: takes encode jobs, announces EC objects (ready / failed), claims items."""
    s = subjects
    perms = _worker(Role.ENCODER, s).merged(_consume(s.stream_encode, protocol.CONSUMER_ENCODER))
    perms.add(pub=[s.ec_ready("*", "*"), s.ec_failed("*", "*")])
    return perms.merged(_kv(s.ec_claims_bucket))


def prefill_permissions(subjects: Subjects) -> Permissions:
    """A generating worker (roles pd, prefill, agg): takes generation jobs (shared and routed to it),
    streams tokens, hands E|P|D requests to decode, steals encode jobs (claims, announces), records
    EC uses, hears invalidations and encoder heartbeats."""
    s = subjects
    g = s.stream_generate
    perms = _worker(Role.PREFILL, s).merged(_consume(g, "*"))
    perms.add(
        pub=[
            s.tokens_all,
            s.decode_jobs,
            s.generate_jobs,  # a routed job handed over to the shared queue (drain)
            s.ec_ready("*", "*"),
            s.ec_failed("*", "*"),
            # its own routed consumer (its name holds the worker id)
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{g}.*",
        ],
        # an item's ready-or-failed event it waits for (``ec_any``), invalidations, encoders' beats
        sub=[s.ec_any("*", "*"), s.ec_invalidated_all, s.heartbeat(Role.ENCODER.value)],
    )
    perms.add(pub=_read(s.stream_results))  # whether a job's request already ended
    perms.add(deny=[f"{JS_API}.CONSUMER.DURABLE.CREATE.{g}.{protocol.CONSUMER_PREFILL}"])
    perms = perms.merged(_kv(s.ec_claims_bucket)).merged(_kv(s.routing_bucket))
    return perms.merged(_kv(s.ec_index_bucket, "ec.>"))


def decode_permissions(subjects: Subjects) -> Permissions:
    """A decode worker (E|P|D): takes decode jobs, streams tokens, sends a request back to prefill
    when its KV object is unusable."""
    s = subjects
    perms = _worker(Role.DECODE, s).merged(_consume(s.stream_decode, protocol.CONSUMER_DECODE))
    perms.add(pub=[s.tokens_all, s.generate_jobs])
    perms.add(pub=_read(s.stream_results))
    return perms


def connector_permissions(subjects: Subjects) -> Permissions:
    """A vLLM EC connector process: hears invalidations, records its uses in the EC index."""
    s = subjects
    perms = _inbox(Role.CONNECTOR).add(sub=[s.ec_invalidated_all])
    return perms.merged(_kv(s.ec_index_bucket, "ec.>"))


def viewer_permissions(subjects: Subjects) -> Permissions:
    """``epd replay list/show/export``, ``epd ec ls``: reads every stream and the EC index, hears
    heartbeats; publishes no message."""
    s = subjects
    streams = [*s.streams(), s.stream_imported]
    perms = _inbox(Role.VIEWER).add(pub=_read(*streams), sub=[s.heartbeat_all])
    perms = perms.merged(_scan(s, *streams))
    return perms.merged(_kv(s.ec_index_bucket, write=False)).merged(_scan(s, kv_stream(s.ec_index_bucket)))


def admin_permissions(subjects: Subjects) -> Permissions:
    """``epd replay run/import``, ``epd ec purge``: the viewer's reads plus what the API publishes
    (a replay run submits like the API), the import stream and the EC index's purges."""
    s = subjects
    perms = _inbox(Role.ADMIN)
    viewer, api = viewer_permissions(s), api_permissions(s)
    perms.add(pub=[p for p in viewer.publish + api.publish if not p.startswith("_INBOX_")])
    perms.add(sub=[p for p in viewer.subscribe + api.subscribe if not p.startswith("_INBOX_")])
    # (the viewer's denials protect the work consumers, which the admin's set-up may create)
    perms.add(
        pub=[
            s.imported_all,
            f"{JS_API}.STREAM.CREATE.{s.stream_imported}",
            f"{JS_API}.STREAM.UPDATE.{s.stream_imported}",
        ]
    )
    return perms


ROLE_PERMISSIONS = {
    Role.API: api_permissions,
    Role.ENCODER: encoder_permissions,
    Role.PREFILL: prefill_permissions,
    Role.DECODE: decode_permissions,
    Role.CONNECTOR: connector_permissions,
    Role.VIEWER: viewer_permissions,
    Role.ADMIN: admin_permissions,
}


def permissions(role: Role | str, subjects: Subjects) -> Permissions:
    return ROLE_PERMISSIONS[Role(role)](subjects)


# -- identities and the server configuration ---------------------------------------------------------
def new_password() -> str:
    """A 256-bit random password (URL-safe text)."""
    return secrets.token_urlsafe(32)


def load_or_create_identities(directory: Path, roles: Iterable[Role] = tuple(Role)) -> dict[Role, str]:
    """The password of each role, kept in ``directory/<role>`` (mode 0600, the directory 0700):
    created once, reused on the next start (a restarted ``epd up`` keeps its identities)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    out: dict[Role, str] = {}
    for role in roles:
        path = directory / role.value
        try:
            password = path.read_text().strip()
        except FileNotFoundError:
            password = ""
        if not password:
            password = new_password()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
        os.chmod(path, 0o600)
        out[role] = password
    return out


def _conf_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def server_authorization(
    subjects: Subjects,
    passwords: Mapping[Role, str],
    *,
    no_auth_user: str = "",
    password_variables: bool = False,
) -> str:
    """The ``authorization`` block of a nats-server configuration: one user per role in
    ``passwords`` with its permissions. ``no_auth_user``: an unrestricted user (no password) that
    connections without credentials are taken as - the test servers' own clients; never in a
    deployment. ``password_variables``: the values are names of environment variables that
    nats-server reads the passwords from (``password: $NAME``; Compose's ``deploy/nats-auth.conf``)."""
    lines = ["authorization {", "  users = ["]
    for role, password in passwords.items():
        perms = permissions(role, subjects)
        publish = f"allow: {_conf_list(perms.publish)}"
        if perms.publish_deny:
            publish += f", deny: {_conf_list(perms.publish_deny)}"
        if password_variables:
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*", password):
                raise ValueError(f"not an environment variable name: {password!r}")
            secret = "$" + password
        else:
            secret = json.dumps(password)
        lines += [
            f"    {{user: {json.dumps(Role(role).value)}, password: {secret}, permissions: {{",
            f"      publish: {{{publish}}}",
            f"      subscribe: {{allow: {_conf_list(perms.subscribe)}}}",
            "    }}",
        ]
    if no_auth_user:
        lines.append(f"    {{user: {json.dumps(no_auth_user)}, password: {json.dumps(new_password())}}}")
    lines.append("  ]")
    lines.append("}")
    if no_auth_user:
        lines.append(f"no_auth_user: {json.dumps(no_auth_user)}")
    return "\n".join(lines)


def permission_table(subjects: Subjects | None = None) -> str:
    """The role x permission table of docs/security.md (Markdown; default prefix ``epd``)."""
    s = subjects or Subjects()
    rows = ["| role | publishes | subscribes | denied |", "|---|---|---|---|"]

    def cell(values: list[str]) -> str:
        return "<br>".join(f"`{v}`" for v in values) or "-"

    for role in Role:
        perms = permissions(role, s)
        rows.append(f"| {role.value} | {cell(perms.publish)} | {cell(perms.subscribe)} | {cell(perms.publish_deny)} |")
    return "\n".join(rows)
