"""Multi-host cases (issue 26, part 3): a 3-node NATS cluster (R3 streams), SeaweedFS with three
volume servers (replication 001), two API replicas and two worker hosts, each on its own network
namespace (``tests/multihost/site.py``). Every case sends real requests, counts each one's fate
(``load.FATES``) against the single-node run's tokens, checks the results stream for a request
completed twice, records its recovery times (``results`` fixture: a JSON and a markdown file,
printed at the end), and restores what it broke.

The strict contract of every fault case: no request lost, wrong or hung, no job run again after
its request completed (two FinalResults for one request), no 503 while a quorum of NATS nodes
is up.

NATS and the store run with one identity per role (issue 45): case 0 checks that every service is
connected to NATS as its role's identity and nothing it did was refused, and that it holds its
role's store keys and no other; case 8, after the faults, that a role's limits hold on every NATS
node from any host (a client run inside a worker host and an API host) and at the S3 gateway (an
S3 client inside a worker host).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from shared.config import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV
from shared.nats_auth import SERVICE_ROLES, Role
from shared.store.kv import kv_key
from shared.store_auth import STORE_ROLES, Kind, prefixes
from tests.faultutil import post_chat
from tests.multihost.load import (
    GREEDY,
    IMAGE_SIZE,
    TEXT,
    TEXT_ONLY,
    Load,
    Reference,
    Results,
    Sent,
    fates,
    finals_since,
    largest_gap,
    plan,
    resume_after,
    stream_replicas,
    work_busy,
)
from tests.multihost.procs import http_get
from tests.multihost.site import Site
from tests.stackutil import chat_body, noise_image, png_bytes, wait_for

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multihost, pytest.mark.slow]

#: A client call with no answer after this long hung (the services' request deadline is 60 s).
CLIENT_TIMEOUT_S = 90
#: "Within a few seconds": a fault of one NATS node must not keep an API from serving longer. What
#: it is made of: the client notices a stalled or cut-off server after ~3 unanswered 1 s pings and
#: reconnects (a try on a dead seed costs up to its 5 s connect timeout); streams the node led
#: elect new leaders after NATS's raft election timeout (4-9 s, nats-server's defaults); jobs a
#: worker on that node had fetched are redelivered after EPD_ACK_WAIT_S (10 s here). Measured
#: 5.5-13.2 s; nats-py's 2-minute default pings kept services on a stalled server for the whole stall.
FEW_S = 15.0
#: Clients of a cut-off NATS node are connected to the majority within this long.
RECONNECT_S = 15.0
#: How long a stalled (SIGSTOP) / cut-off node stays so.
STALL_S = 10.0
CUT_S = 15.0
#: Requests in flight at once during a case (over both API replicas).
CONCURRENCY = 4


# -- helpers ---------------------------------------------------------------------------------------
def last_result_seq(site: Site) -> int:
    return finals_since(site.client_urls(), site.subjects.stream_results, 1 << 62, login=site.login(Role.VIEWER))[1]


def settle(site: Site, timeout: float = 90) -> None:
    """Wait until the work consumers hold no job: a job redelivered after its request completed
    has then run (and its second final result is on record)."""
    busy: dict = {}

    def idle():
        busy.clear()
        busy.update(work_busy(site.client_urls(), site.subjects, login=site.login(Role.VIEWER)))
        return not busy

    try:
        wait_for(idle, timeout, "the work consumers to hold no job", interval=0.3)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (still held: {busy})") from None


def judge(site: Site, results: Results, case: str, sent: list[Sent], first_seq: int, **figures) -> dict:
    """Settle, count fates and final results per request, record the case; returns what the
    assertions need."""
    settle(site)
    finals, _ = finals_since(site.client_urls(), site.subjects.stream_results, first_seq, login=site.login(Role.VIEWER))
    ids = {s.request_id for s in sent if s.request_id}
    twice = {rid: f for rid, f in finals.items() if rid in ids and len(f) > 1}
    counted = fates(sent)
    why = Counter(s.why() for s in sent if s.fate != "completed")
    results.record(
        case,
        fates=counted,
        requests=len(sent),
        completed_twice=len(twice),
        completed_twice_runs=sum(len(f) - 1 for f in twice.values()),
        max_latency_s=max((s.outcome.seconds for s in sent), default=0.0),
        not_completed_why=dict(why.most_common()),
        **figures,
    )
    return {"fates": counted, "twice": twice}


def assert_contract(sent: list[Sent], judged: dict, origin: float, site: Site, *labels: str) -> None:
    bad = [s.describe(origin) for s in sent if s.fate != "completed"]
    problems = []
    if bad:
        head = f"{len(bad)} of {len(sent)} requests not completed with the single-node tokens:"
        problems.append("\n".join([head, *bad]))
    if judged["twice"]:
        lines = [f"{rid}: (attempt, worker) {runs}" for rid, runs in judged["twice"].items()]
        problems.append(
            f"{len(judged['twice'])} requests completed more than once (a job run again after its request "
            "completed):\n" + "\n".join(lines)
        )
    assert not problems, "\n\n".join(problems) + f"\nfates: {judged['fates']}\n{site.logs(*labels)}"


def restore_nats(site: Site) -> float:
    """Every NATS node running and current; returns the seconds it took."""
    assert site.nats is not None
    t0 = time.monotonic()
    for i in range(len(site.nats.nodes)):
        if not site.nats.nodes[i].is_running():
            site.nats.start(i, timeout=60)
    site.nats.wait_ready(timeout=60)
    return time.monotonic() - t0


def node_of(site: Site, labels: list[str]) -> tuple[int, dict[str, set[str]]]:
    """The NATS node most of ``labels`` (service labels, in order of preference) are connected to."""
    assert site.nats is not None
    clients = site.nats_clients()
    scores = []
    for i, node in enumerate(site.nats.nodes):
        on = [label for label in labels if node.server_name in clients.get(label, set())]
        scores.append((len(on), -min((labels.index(x) for x in on), default=99), i))
    return max(scores)[2], clients


def assert_nothing_refused(site: Site) -> None:
    """No NATS node refused a service anything: a permission its role lacks would show as a
    violation in the node's log."""
    refused = site.violations()
    assert not refused, "the NATS nodes refused something:\n" + "\n".join(refused[:20])


def assert_no_secret_written(site: Site, results: Results | None = None) -> None:
    """No NATS password (a role's, the routes') and no S3 secret key (a role's, the admin's) is in a
    log the site wrote (the services', the NATS nodes', the store's), nor in the results."""
    written = site.written_logs()
    if results is not None:
        written += [p for p in (results.path, results.path.with_suffix(".md")) if p.exists()]
    assert len(written) > 10, written  # (a negative control: the logs are there to read)
    assert any(p.name.startswith("weed-filer") for p in written), written  # (the S3 gateway's log is read)
    assert sum(what.startswith("s3 secret key") for what in site.secrets) == len(STORE_ROLES) + 1, list(site.secrets)
    texts = {str(p): p.read_text(errors="replace") for p in written}
    shown = {path: what for path, text in texts.items() for what, secret in site.secrets.items() if secret in text}
    assert not shown, f"a secret is written in a log: {shown}"


def store_identities_held(site: Site) -> dict[str, dict[str, list[str]]]:
    """Which store identity each service runs with, from its process's environment (as exec'd):
    label -> ``identity`` (whose access and secret key ``EPD_S3_ACCESS_KEY`` / ``EPD_S3_SECRET_KEY``
    are: a role, ``admin``) and ``other_secrets`` (any other identity's secret key found there)."""
    assert site.store is not None
    keys = {"admin": (site.store.access_key, site.store.secret_key)}
    keys |= {role.value: pair for role, pair in site.store_keys.items()}
    out = {}
    for s in site.services:
        assert s.proc.popen is not None and s.proc.alive(), s.label
        raw = Path(f"/proc/{s.proc.popen.pid}/environ").read_bytes().decode(errors="replace")
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        held = (env.get(S3_ACCESS_KEY_ENV), env.get(S3_SECRET_KEY_ENV))
        own = [name for name, pair in keys.items() if pair == held]
        others = [name for name, (_, secret) in keys.items() if secret in raw and name not in own]
        out[s.label] = {"identity": own, "other_secrets": others}
    return out


# -- 0. identities ------------------------------------------------------------------------------------
def test_every_service_connects_as_its_role(site: Site, results: Results):
    """Every service's connection, on whichever node it landed, is authenticated as its role's
    identity (the servers say who: ``/connz?auth=true``); no connection without one; nothing a
    service did while the site started was refused; no password or S3 secret in a log. Every node
    requires authentication (without it, ``authorized_user`` is only what a client claims). Each
    service's process holds its role's store keys and no other identity's secret (its environment
    as exec'd). Mutations: the APIs given the admin's identity, or the cluster without the
    identities' authorization block, fail here; so does a service given the store's admin key
    (tried on :func:`store_identities_held` with processes in a lab host)."""
    assert site.nats is not None
    auth_required = {}
    for i in site.nats.running():
        status, body = http_get(f"{site.nats.monitor_url(i)}/varz", timeout=2, context=site.nats.monitor_context())
        auth_required[site.nats.nodes[i].server_name] = status == 200 and json.loads(body).get("auth_required")
    users: dict[str, set[str]] = {}
    others = []
    conns = site.connections()
    for node, conn in conns:
        service = site.service_of(conn)
        if service is None:
            others.append((node, conn.get("ip"), conn.get("name"), conn.get("authorized_user")))
        else:
            users.setdefault(service.label, set()).add(conn.get("authorized_user") or "")
    store_held = store_identities_held(site)
    results.record(
        "0 identities",
        connections=len(conns),
        users={label: sorted(u) for label, u in sorted(users.items())},
        other_connections=len(others),
        auth_required=auth_required,
        store_identities={label: held["identity"] for label, held in sorted(store_held.items())},
    )
    assert auth_required == {node.server_name: True for node in site.nats.nodes}, auth_required
    want = {s.label: {SERVICE_ROLES[s.name].value} for s in site.services}
    assert users == want, f"connected as {users}, want {want}"
    assert all(user for *_, user in others), f"connections without an identity: {others}"
    want_store = {s.label: {"identity": [SERVICE_ROLES[s.name].value], "other_secrets": []} for s in site.services}
    assert store_held == want_store, f"store identities held {store_held}, want {want_store}"
    assert_nothing_refused(site)
    assert_no_secret_written(site)


# -- 1. equality ------------------------------------------------------------------------------------
def test_cluster_equals_single_node(site: Site, reference: Reference, results: Results):
    """Image and text-only requests through either API replica give the single-node run's tokens;
    a different image gives different ones (the comparison can fail)."""
    image_a, image_b = noise_image(7001, IMAGE_SIZE), noise_image(7002, IMAGE_SIZE)
    want_a, want_text = reference.tokens(TEXT, image_a), reference.tokens(TEXT_ONLY, None)
    got: dict[str, dict[str, list[int] | None]] = {}
    for url in site.api_urls:
        row = {}
        for what, body in (
            ("image_a", chat_body(TEXT, [image_a], **GREEDY)),
            ("image_b", chat_body(TEXT, [image_b], **GREEDY)),
            ("text", chat_body(TEXT_ONLY, [], **GREEDY)),
        ):
            out = post_chat(url, body, what=what, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
            assert out.status == 200, (url, what, out.status, out.body, out.error)
            row[what] = out.tokens
        got[url] = row
    replicas = stream_replicas(site.client_urls(), site.subjects, login=site.login(Role.ADMIN))
    results.record("1 equality", apis=len(got), requests=3 * len(got), streams=replicas)
    for url, row in got.items():
        assert row["image_a"] == want_a, f"{url}: image tokens {row['image_a']} != single-node {want_a}"
        assert row["text"] == want_text, f"{url}: text-only tokens {row['text']} != single-node {want_text}"
        # negative control: another image's tokens differ from the first image's single-node run
        assert row["image_b"] != want_a, f"{url}: a different image gave the same tokens {want_a}"
        assert row["image_b"] == reference.tokens(TEXT, image_b)
    # every stream (job queues, results, the KV buckets) is replicated on all three nodes
    assert site.subjects.stream_generate in replicas, replicas
    assert any(name.startswith("KV_") for name in replicas), f"no KV bucket: {replicas}"
    not_r3 = {name: r for name, r in replicas.items() if r != (3, 3)}
    assert not not_r3, f"streams not on 3 nodes (configured, placed): {not_r3}"


# -- 2. SIGKILL of the job stream's leader ------------------------------------------------------------
def test_sigkill_of_the_generate_stream_leader(site: Site, reference: Reference, results: Results):
    assert site.nats is not None
    stream = site.subjects.stream_generate
    leader = site.nats.wait_stream_leader(stream, timeout=30)
    planned = plan(reference, 24)
    first_seq = last_result_seq(site) + 1
    load = Load(site.api_urls, planned, concurrency=CONCURRENCY, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
    load.wait_done(3, 120)
    killed_at = time.monotonic()
    site.nats.kill(leader)
    new_leader = site.nats.wait_stream_leader(stream, timeout=30, not_on=leader)
    elected_s = time.monotonic() - killed_at
    sent = load.finish(at_least=len(planned))
    catch_up_s = restore_nats(site)
    judged = judge(
        site,
        results,
        "2 SIGKILL generate-stream leader",
        sent,
        first_seq,
        killed=site.nats.nodes[leader].server_name,
        new_leader=site.nats.nodes[new_leader].server_name,
        election_s=elected_s,
        pause_s=largest_gap(sent, killed_at),
        sent_after_kill=sum(1 for s in sent if s.outcome.started >= killed_at),
        restart_catch_up_s=catch_up_s,
    )
    assert_contract(sent, judged, load.origin, site)


# -- 3. SIGSTOP of the node an API and a worker use ------------------------------------------------------
def test_sigstop_of_the_node_an_api_and_a_worker_use(site: Site, reference: Reference, results: Results):
    assert site.nats is not None
    apis = [s.label for s in site.services if s.name == "api"]
    workers = [s.label for s in site.services if s.name != "api"]
    api_restarts = 0
    while True:  # clients pick a seed at random: restart an API replica until one shares a worker's node
        node, clients = node_of(site, apis + workers)
        name = site.nats.nodes[node].server_name
        on_node = sorted(label for label, nodes in clients.items() if name in nodes)
        if (set(on_node) & set(apis) and set(on_node) & set(workers)) or api_restarts >= 6:
            break
        api = site.service(apis[api_restarts % len(apis)])
        api.proc.stop()
        api.proc.start()
        site.wait_apis()
        site.wait_workers(timeout=60)
        api_restarts += 1
    planned = plan(reference, 40)
    first_seq = last_result_seq(site) + 1
    load = Load(site.api_urls, planned, concurrency=CONCURRENCY, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
    load.wait_done(3, 120)
    stopped_at = time.monotonic()
    site.nats.pause(node)
    try:
        wait_for(lambda: time.monotonic() - stopped_at >= STALL_S, STALL_S + 5, "the stall's end", interval=0.2)
    finally:
        site.nats.resume(node)
    resumed_at = time.monotonic()
    load.wait_done(load.done_count() + 4, 120)
    sent = load.finish()
    per_api = {url: resume_after(sent, stopped_at, url) for url in site.api_urls}
    judged = judge(
        site,
        results,
        "3 SIGSTOP 10s of a node",
        sent,
        first_seq,
        stopped=name,
        clients_on_it=on_node,
        api_and_worker_on_it=any(x in on_node for x in apis) and any(x in on_node for x in workers),
        api_restarts_to_get_there=api_restarts,
        pause_s=largest_gap(sent, stopped_at, resumed_at),
        resume_per_api_s={url.split("//")[1]: v for url, v in per_api.items()},  # None: not within the case
        slowest_during_stall_s=max(
            (s.outcome.seconds for s in sent if s.outcome.ended >= stopped_at and s.outcome.started <= resumed_at),
            default=0.0,
        ),
    )
    restore_nats(site)
    assert set(on_node) & set(apis) and set(on_node) & set(workers), f"no node with an API and a worker: {clients}"
    assert_contract(sent, judged, load.origin, site, *on_node)
    slow = {url: v for url, v in per_api.items() if v > FEW_S}
    assert not slow, f"API replicas serving nothing for more than {FEW_S}s of the stall of {name}: {slow}"


# -- 4. minority partition ------------------------------------------------------------------------------
def test_minority_partition_of_one_nats_node(site: Site, reference: Reference, results: Results, lab):
    assert site.nats is not None
    labels = [s.label for s in site.services]
    node, clients = node_of(site, labels)
    name = site.nats.nodes[node].server_name
    moved = sorted(label for label, nodes in clients.items() if name in nodes)
    planned = plan(reference, 60)
    first_seq = last_result_seq(site) + 1
    load = Load(site.api_urls, planned, concurrency=CONCURRENCY, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
    load.wait_done(3, 120)
    cut_at = time.monotonic()
    lab.cut(name)
    reconnected_s = None
    try:

        def all_on_majority():
            now = site.nats_clients(skip=(node,))
            return all(label in now for label in labels)

        try:
            wait_for(all_on_majority, RECONNECT_S, "every service connected to the majority", interval=0.25)
            reconnected_s = time.monotonic() - cut_at
        except AssertionError:
            pass
        wait_for(lambda: time.monotonic() - cut_at >= CUT_S, CUT_S + 5, "the cut's end", interval=0.2)
    finally:
        lab.heal(name)
    healed_at = time.monotonic()
    load.wait_done(load.done_count() + 4, 120)
    sent = load.finish()
    rejoin_s = restore_nats(site)
    per_api = {url: resume_after(sent, cut_at, url) for url in site.api_urls}
    judged = judge(
        site,
        results,
        "4 minority partition",
        sent,
        first_seq,
        cut=name,
        clients_on_it=moved,
        all_clients_on_majority_s=reconnected_s,
        pause_s=largest_gap(sent, cut_at, healed_at),
        resume_per_api_s={url.split("//")[1]: v for url, v in per_api.items()},  # None: not within the case
        rejoin_after_heal_s=rejoin_s,
    )
    assert_contract(sent, judged, load.origin, site, *moved)
    assert reconnected_s is not None, (
        f"clients of the cut node {name} ({moved}) not on the majority within {RECONNECT_S}s"
    )
    slow = {url: v for url, v in per_api.items() if v > FEW_S}
    assert not slow, f"API replicas serving nothing for more than {FEW_S}s after {name} was cut off: {slow}"


# -- 5. a worker host lost -------------------------------------------------------------------------------
_HELD = re.compile(r"\[request_id=(chatcmpl-[0-9a-f]+)\] fault injection")


def test_a_whole_worker_host_lost(site: Site, reference: Reference, results: Results, lab):
    host = "w1"
    encoder = site.service(f"encoder@{host}")
    log_start = encoder.proc.log_path.stat().st_size
    planned = plan(reference, 24, text_every=0)  # images: every request has an encode job

    def held() -> set[str]:
        with encoder.proc.log_path.open("rb") as fh:
            fh.seek(log_start)
            return set(_HELD.findall(fh.read().decode(errors="replace")))

    first_seq = last_result_seq(site) + 1
    site.switch(host, "encoder", 3.0)  # w1's encoder holds each job 3 s: it has jobs when it dies
    load = Load(site.api_urls, planned, concurrency=CONCURRENCY, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
    try:
        wait_for(held, 60, f"an encode job held on {host}", interval=0.1)
        killed_at = time.monotonic()
        pids = lab.kill_host(host)
        held_ids = held()
        sent = load.finish(at_least=len(planned))
    finally:
        site.switch(host, "encoder", None)
    by_id = {s.request_id: s for s in sent if s.request_id}
    held_latency = [by_id[r].outcome.ended - killed_at for r in held_ids if r in by_id]
    restart_at = time.monotonic()
    for s in site.services_on(host):
        s.proc.start()
    site.wait_workers(timeout=300)
    judged = judge(
        site,
        results,
        "5 worker host lost",
        sent,
        first_seq,
        host=host,
        processes_killed=len(pids),
        jobs_held_by_it=len(held_ids),
        held_completed=sum(1 for r in held_ids if r in by_id and by_id[r].fate == "completed"),
        held_done_after_kill_s=max(held_latency, default=None),
        pause_s=largest_gap(sent, killed_at),
        host_back_s=time.monotonic() - restart_at,
    )
    assert held_ids, f"no job was held on {host} when it died: the case did not test redelivery"
    missing = held_ids - set(by_id)
    assert not missing, f"requests whose encode job died with {host} got no 200 with an id: {missing}"
    assert_contract(sent, judged, load.origin, site)


# -- 6. a store volume server lost ------------------------------------------------------------------------
def test_a_store_volume_server_lost(site: Site, reference: Reference, results: Results):
    assert site.store is not None
    victim = site.store.volumes[1]
    planned = plan(reference, 24, text_every=0)  # fresh images: EC written and read
    first_seq = last_result_seq(site) + 1
    load = Load(site.api_urls, planned, concurrency=CONCURRENCY, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
    load.wait_done(3, 120)
    killed_at = time.monotonic()
    victim.stop(signal.SIGKILL)
    sent = load.finish(at_least=len(planned))
    restart_at = time.monotonic()
    victim.start()
    wait_for(lambda: site.store.data_nodes() >= len(site.store.volumes), 60, "the volume server back")
    judged = judge(
        site,
        results,
        "6 store volume server lost",
        sent,
        first_seq,
        killed=f"{victim.label}@{victim.host.name}",
        pause_s=largest_gap(sent, killed_at),
        volume_back_s=time.monotonic() - restart_at,
    )
    assert_contract(sent, judged, load.origin, site)


# -- 7. rolling restart ----------------------------------------------------------------------------------
def test_rolling_restart_of_the_nats_nodes(site: Site, reference: Reference, results: Results):
    assert site.nats is not None
    planned = plan(reference, 80)
    first_seq = last_result_seq(site) + 1
    load = Load(site.api_urls, planned, concurrency=CONCURRENCY, timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
    load.wait_done(3, 120)
    began = time.monotonic()
    per_node = {}
    for i, node in enumerate(site.nats.nodes):
        t0 = time.monotonic()
        site.nats.stop(i)
        site.nats.start(i, timeout=60)
        per_node[node.server_name] = round(time.monotonic() - t0, 2)
        load.wait_done(load.done_count() + 2, 120)  # some requests served between two restarts
    sent = load.finish()
    judged = judge(
        site,
        results,
        "7 rolling restart",
        sent,
        first_seq,
        restart_and_current_s=per_node,
        pause_s=largest_gap(sent, began),
    )
    assert_contract(sent, judged, load.origin, site)


# -- 8. a role's limits across hosts ----------------------------------------------------------------------
def an_ec_object(site: Site) -> str:
    """The key of an EC object the site's load wrote (one image request first if none is there: the
    case run alone), listed by the admin."""
    assert site.store is not None
    ec = tuple(prefixes(Kind.EC, site.namespace))

    def listed() -> list[str]:
        assert site.store is not None
        return sorted(o.key for o in site.store.admin_store().list(f"{site.namespace}/") if o.key.startswith(ec))

    keys = listed()
    if not keys:
        body = chat_body("Describe this image.", [noise_image(9050, IMAGE_SIZE)], **GREEDY)
        out = post_chat(site.api_urls[0], body, what="an EC object", timeout=CLIENT_TIMEOUT_S, verify=site.client_tls)
        assert out.status == 200, (out.status, out.error)
        keys = listed()
    assert keys, f"no EC object under {site.namespace}/ after an image request"
    return keys[0]


def store_limits_from(site: Site, host: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """From ``host``, with the roles' store identities: the encoder is refused reading a KV object
    and deleting an EC object; the controls: the prefill identity writes (E|PD's workers hand no KV
    over: the probe's own object, its role's right) and reads that KV object, the encoder still reads
    the EC object (the refusal was the delete's), the API deletes it (the janitor's right) and it is
    gone; the API deletes the probe's KV object. Returns (step, what the gateway did, the step's
    answer) for each step."""
    ec = an_ec_object(site)
    kv = kv_key(site.namespace, uuid.uuid4().hex[:24], f"mh-store-probe-{uuid.uuid4().hex[:12]}", 0)
    plan_: list[tuple[str, Role, str, str, dict[str, Any]]] = [
        ("prefill writes KV", Role.PREFILL, "put", kv, {"ok": True}),
        ("encoder reads KV", Role.ENCODER, "get", kv, {"ok": False, "code": "AccessDenied"}),
        ("prefill reads KV", Role.PREFILL, "get", kv, {"ok": True, "found": True}),
        ("encoder deletes EC", Role.ENCODER, "delete", ec, {"ok": False, "code": "AccessDenied"}),
        ("encoder reads EC (still there)", Role.ENCODER, "stat", ec, {"ok": True, "found": True}),
        ("api deletes EC", Role.API, "delete", ec, {"ok": True}),
        ("prefill reads EC (gone)", Role.PREFILL, "stat", ec, {"ok": True, "found": False}),
        ("api deletes KV", Role.API, "delete", kv, {"ok": True}),
    ]
    answers = site.store_probe(host, [(who, op, key) for _, who, op, key, _ in plan_])
    assert len(answers) == len(plan_), answers
    return [(step[0], step[4], answer) for step, answer in zip(plan_, answers, strict=True)]


def test_a_role_s_limits_hold_on_every_node_from_any_host(site: Site, results: Results):
    """After every fault case: nothing a service did was refused and no password or S3 secret is in
    a log. Then a client inside worker host w1 as the encoder's identity, on each NATS node in turn,
    is refused a generation job (shared and routed) and a cancel (the node reports a permissions violation),
    while it may look up its own stream; the API's identity inside a1 publishes the same (the
    negative control). Inside w2, no identity and the encoder's name with another role's password
    are refused, and so is a route connection with a wrong password on every cluster port. The
    publishes name no stream (``Nats-Expected-Stream``): nothing is stored or run. Mutations: the
    encoder given the API's permissions fails here; so does the cluster without route credentials
    (a stranger joins as a route) or without the identities (anyone connects).

    TLS (every link between hosts): from w2, the encoder's own identity in plaintext (a
    ``nats://`` client) and over TLS verifying another CA is refused by every node (the same
    identity over TLS with the site's CA, from w1, is the control). Every cluster port refuses a
    plaintext route and a TLS one presenting a certificate another CA signed (the handshake);
    with the site's certificate the handshake passes and the wrong password is what is refused
    (the control). Mutation: routes without TLS fails here (dropping ``verify: true`` from the
    routes' TLS does not: nats-server verifies a route's certificate either way).

    The store (an S3 client inside w1, over HTTPS as the services): the encoder's identity is
    refused reading a KV object and deleting an EC object the load wrote (``AccessDenied``); the
    prefill identity reads the KV object and the API's deletes the EC object (the controls;
    :func:`store_limits_from`). No S3 secret (a role's, the admin's) is in a log either. Mutations
    (tried on :func:`store_limits_from` with a one-host store in a lab of two hosts): the encoder
    given KV reads, or a gateway without the bucket policy, fail it."""
    assert site.nats is not None and site.identities is not None
    restore_nats(site)
    assert_nothing_refused(site)
    assert_no_secret_written(site, results)
    s = site.subjects
    publish = {
        "generation job": s.generate_jobs,
        "routed generation job": s.generate_routed("prefill-w2"),
        "cancel": s.cancel(f"mh-probe-{uuid.uuid4().hex[:12]}"),
    }
    info = [s.stream_encode]
    encoder = site.probe("w1", Role.ENCODER, publish=publish, stream_info=info, routes=True)
    api = site.probe("a1", Role.API, publish=publish, stream_info=info)
    anonymous = site.probe("w2", None)
    wrong = site.probe("w2", Role.ENCODER, password=site.identities.passwords[Role.API])
    assert site.stranger is not None
    plaintext = site.probe("w2", Role.ENCODER, plaintext=True)
    other_ca = site.probe("w2", Role.ENCODER, ca=site.stranger.ca_cert)
    refusals = [line for line in site.violations() if "Violation" in line]
    store = store_limits_from(site, "w1")
    results.record(
        "8 role limits across hosts",
        store_from_w1={label: "ok" if a["ok"] else a.get("code") for label, _, a in store},
        encoder_from_w1={n["server_name"]: n.get("refused") for n in encoder["nodes"]},
        api_from_a1={n["server_name"]: n.get("refused") for n in api["nodes"]},
        no_identity_connected=[n["connected"] for n in anonymous["nodes"]],
        wrong_password_connected=[n["connected"] for n in wrong["nodes"]],
        plaintext_client={n["url"]: n["error"] for n in plaintext["nodes"]},
        other_ca_client={n["url"]: n["error"] for n in other_ca["nodes"]},
        route_ports=encoder["routes"],
    )
    nodes = {node.server_name for node in site.nats.nodes}
    for who, probed, host in (("encoder@w1", encoder, "w1"), ("api@a1", api, "a1")):
        assert {n.get("server_name") for n in probed["nodes"]} == nodes, (who, probed)
        for n in probed["nodes"]:
            assert n["connected"], (who, n)
            assert n["client_ip"] == site.lab.hosts[host].address, (who, n)  # from that host
            assert n["info"] == {s.stream_encode: True}, (who, n)  # what its role may: it works
    for n in encoder["nodes"]:
        assert n["refused"] == {label: True for label in publish}, f"the encoder on {n['server_name']}: {n}"
    for n in api["nodes"]:
        assert n["refused"] == {label: False for label in publish}, f"the API on {n['server_name']}: {n}"
    for who, probed in (("no identity", anonymous), ("the encoder with the API's password", wrong)):
        for n in probed["nodes"]:
            assert not n["connected"] and "Authorization Violation" in n["error"], (who, n)
    for who, probed in (("a plaintext client", plaintext), ("a client verifying another CA", other_ca)):
        assert len(probed["nodes"]) == len(nodes), (who, probed)
        for n in probed["nodes"]:
            assert not n["connected"], (who, n)
    for n in other_ca["nodes"]:
        assert "CERTIFICATE_VERIFY_FAILED" in n["error"], n
    assert len(encoder["routes"]) == len(nodes), encoder["routes"]
    for address, knocks in encoder["routes"].items():
        ca, stranger, plain = knocks["ca"], knocks["stranger"], knocks["plaintext"]
        # the control: the site's certificate passes the handshake; the wrong password is refused
        assert ca["tls"] == "ok" and ca["auth_required"] and "Authorization Violation" in ca["answer"], (address, ca)
        assert stranger["tls"] != "ok" and "unknown ca" in stranger["tls"].lower(), (address, stranger)
        assert "INFO" not in plain["answer"] and "PONG" not in plain["answer"], (address, plain)
    # each node refused the encoder's publishes itself, and nobody else's
    for node in nodes:
        mine = [line for line in refusals if line.startswith(f"{node}: ")]
        assert any('user:encoder" - Publish Violation' in line and s.generate_jobs in line for line in mine), (
            node,
            mine,
        )
    assert all("user:encoder" in line for line in refusals if "Publish Violation" in line), refusals
    # the store: each step as the table says (the refusals with the gateway's own code)
    off = [(label, want, answer) for label, want, answer in store if {k: answer.get(k) for k in want} != want]
    assert not off, f"the store from w1 (step, want, got): {off}"
    assert_no_secret_written(site, results)


# -- 9. what a worker host's wire holds ---------------------------------------------------------------
#: the negative control's plaintext NATS server (in w2)
CONTROL_NATS_PORT, CONTROL_MONITOR_PORT = 4333, 8333
#: the most bytes of a TLS stream outside its records: the head of a stream captured from its middle
TLS_HEAD = (1 << 14) + 2048 + 5


def test_a_capture_on_a_worker_host_holds_no_secret_no_prompt_and_no_image(site: Site, results: Results):
    """A capture of worker host w1's wire (every frame of its interface, both ways) while image
    requests run - each with a prompt of its own, until w1's prefill worker has run one (its job,
    prompt included, came to w1, and the encoders read the images from the store) - holds, in no
    TCP stream, a NATS password (a role's, the routes'), an S3 secret or access key (a role's, the
    admin's) or a SigV4 signature header, NATS's protocol in the clear (CONNECT, INFO, PUB, MSG,
    SUB), a prompt or an image's bytes (the encoders on w1 read the requests' image files from the store);
    and every TCP stream of w1 is TLS records (at most one record's worth of head outside them: a
    connection captured from its middle). The negative control, in the same capture: a plaintext
    NATS connection from w1 (to a plaintext server in w2) as the encoder, with the encoder's own
    password, that publishes a prompt and an image file, and a plaintext S3 PUT signed with the admin's keys - the
    same check finds the password, the protocol, the prompt and the image, the access key and the signature,
    and the TLS check finds them not TLS. Mutations: the services' S3 without TLS, or the NATS
    client ports without TLS, fail here."""
    assert site.nats is not None and site.store is not None and site.identities is not None
    from shared.tools.infra import EmbeddedNats
    from tests.multihost import capture as cap
    from tests.multihost.procs import MASTER_PORT

    w1, w2 = site.lab.hosts["w1"], site.lab.hosts["w2"]
    tag = uuid.uuid4().hex[:12]
    prompts = {f"prompt {i}": f"Describe this image, mh-prompt-{tag}-{i}." for i in range(8)}
    control_prompt = f"Describe this image, mh-control-{tag}."
    # the requests' images: the encoders on w1 read their files from the store (what the API stored)
    images = [noise_image(9100 + k, IMAGE_SIZE) for k in range(8)]
    control_image = png_bytes(noise_image(9199, IMAGE_SIZE))

    def middle(data: bytes) -> bytes:  # 64 bytes of a file's middle: its pixels, not a PNG header
        return data[len(data) // 2 : len(data) // 2 + 64]

    role = Role.ENCODER
    password = site.identities.passwords[role]
    control_nats = EmbeddedNats(
        site.data_dir / "control-nats",
        host=w2.address,
        port=CONTROL_NATS_PORT,
        monitor_port=CONTROL_MONITOR_PORT,
        server_name="control",
        wrap=w2.wrap,
        extra_config=f"authorization {{ users: [ {{ user: {json.dumps(role.value)}, "
        f"password: {json.dumps(password)} }} ] }}",
    )
    control_nats.start(timeout=30)
    control_s3 = f"{site.store.head.address}:{MASTER_PORT}"  # plain HTTP, not S3: the request is on the wire
    capture = cap.Capture(w1, site.data_dir / "w1.pcap").start()
    sent: list = []
    on_w1: list[str] = []
    try:
        env = {
            **os.environ,
            cap.CONTROL_USER_ENV: role.value,
            cap.CONTROL_PASSWORD_ENV: password,
            cap.CONTROL_PROMPT_ENV: control_prompt,
            cap.CONTROL_S3_KEYS_ENV: f"{site.store.access_key}:{site.store.secret_key}",
            cap.CONTROL_IMAGE_ENV: control_image.hex(),
        }
        done = subprocess.run(
            [*w1.wrap, sys.executable, "-m", cap.__name__, "control", control_nats.url, "mh.control", control_s3],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"the control client failed ({done.returncode}):\n{done.stderr[-2000:]}"
        first_seq = last_result_seq(site) + 1
        items = list(prompts.values())
        for round_ in range(2):  # 4 requests at once over both APIs, again if w1's prefill ran none
            batch = items[4 * round_ : 4 * round_ + 4]
            bodies = [chat_body(p, [images[4 * round_ + i]], **GREEDY) for i, p in enumerate(batch)]
            with ThreadPoolExecutor(len(bodies)) as pool:
                outs = list(
                    pool.map(
                        lambda ib: post_chat(
                            site.api_urls[ib[0] % 2],
                            ib[1],
                            what="capture",
                            timeout=CLIENT_TIMEOUT_S,
                            verify=site.client_tls,
                        ),
                        enumerate(bodies),
                    )
                )
            sent += outs
            finals, _ = finals_since(
                site.client_urls(), site.subjects.stream_results, first_seq, login=site.login(Role.VIEWER)
            )
            on_w1 = [rid for rid, runs in finals.items() if any(worker == "prefill-w1" for _, worker in runs)]
            if on_w1:
                break
    finally:
        capture.stop()
        control_nats.stop()
    assert all(o.status == 200 for o in sent), [(o.status, o.error) for o in sent]
    streams = cap.tcp_streams(capture.path)
    # every role's NATS password and store keys (the services' S3 requests are signed with theirs) and
    # the admin's (the control's S3 request)
    secrets = {what: secret.encode() for what, secret in site.secrets.items()}
    secrets |= {f"s3 access key of {r.value}": access.encode() for r, (access, _) in site.store_keys.items()}
    secrets |= {
        "s3 access key of the admin": site.store.access_key.encode(),
        "s3 signature": b"AWS4-HMAC-SHA256",
        "control prompt": control_prompt.encode(),
        **{label: text.encode() for label, text in prompts.items()},
        "control image": middle(control_image),
        **{f"image {k}": middle(png_bytes(image)) for k, image in enumerate(images)},
    }

    store_head = site.store.head.address

    def control_of(flow: tuple[str, int, str, int]) -> str | None:
        ends = {(flow[0], flow[1]), (flow[2], flow[3])}
        if (w2.address, CONTROL_NATS_PORT) in ends:
            return "nats"
        if (store_head, MASTER_PORT) in ends:
            return "s3"
        return None

    found: dict[str, set[str]] = {"nats": set(), "s3": set()}
    control_tls: dict[str, tuple[int, int]] = {}
    leaks: dict[str, list[str]] = {}
    not_tls: dict[str, tuple[int, int, int, bytes]] = {}
    peers: Counter[str] = Counter()
    for flow, stream in streams.items():
        what = cap.exposed(stream, secrets)
        records, outside = cap.tls_coverage(stream)
        if (kind := control_of(flow)) is not None:
            found[kind] |= set(what)
            control_tls[f"{kind} {flow}"] = (records, outside)
            continue
        peer = flow[2:] if flow[0] == w1.address else flow[:2]
        peers[f"{peer[0]}:{peer[1]}"] += len(stream)
        if what:
            leaks[str(flow)] = what
        if records == 0 or outside > TLS_HEAD:
            not_tls[str(flow)] = (len(stream), records, outside, stream[:80])
    results.record(
        "9 capture on a worker host",
        capture_bytes=capture.path.stat().st_size,
        tcp_streams=len(streams),
        bytes_per_peer=dict(peers),
        requests=len(sent),
        run_by_prefill_w1=len(on_w1),
        control_found={k: sorted(v) for k, v in found.items()},
        leaks=leaks,
        not_tls=len(not_tls),
    )
    assert on_w1, "no request was run by w1's prefill worker: the capture saw no job"
    # the negative control: the same checks on the plaintext connections of the same capture
    want_nats = {f"nats password of {role.value}", "nats protocol", "control prompt", "control image"}
    assert want_nats <= found["nats"], f"the plaintext NATS control: found {found['nats']}, want {want_nats}"
    want_s3 = {"s3 access key of the admin", "s3 signature"}
    assert want_s3 <= found["s3"], f"the plaintext S3 control: found {found['s3']}, want {want_s3}"
    assert control_tls and all(records == 0 or outside > TLS_HEAD for records, outside in control_tls.values()), (
        control_tls
    )
    # what crossed w1's wire: the NATS nodes (client ports) and the S3 gateway, TLS only, nothing in the clear
    nats_peers = {f"{site.nats.nodes[i].host}:{site.nats.nodes[i].requested_port}" for i in range(len(site.nats.nodes))}
    assert set(peers) & nats_peers and f"{site.store.endpoint}" in peers, peers
    assert not leaks, f"in the clear on w1's wire: {leaks}"
    assert not not_tls, f"streams of w1 that are not TLS (bytes, records, bytes outside, head): {not_tls}"
