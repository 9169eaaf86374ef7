"""The embedded NATS / SeaweedFS servers really work, stop, and fail clearly."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import nats
import nats.js.errors
import pytest
from minio import Minio
from minio.error import S3Error

from shared.jetstream import through_elections
from shared.tools.infra import (
    SEAWEED_MAX_VOLUMES,
    EmbeddedNats,
    EmbeddedS3,
    InfraError,
    NatsCluster,
    PortInUseError,
    PortReservation,
    ephemeral_port_range,
    find_binary,
    free_port,
    free_port_block,
    free_ports,
    port_available,
    stop_servers,
)
from tests.stackutil import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _connectable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(10)  # loopback: answered (or refused) by the kernel; the bound only catches a hang
        return s.connect_ex(("127.0.0.1", port)) == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists"; check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def listening_socket():
    """A socket listening on a random 127.0.0.1 port (the port is 'taken')."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s
    s.close()


def test_a_free_port_block_is_below_the_ephemeral_range_and_free(monkeypatch) -> None:
    """A listener meant to start later (a worker's metrics port) gets ports the OS never hands out
    to outgoing connections: all n of them free, none excluded."""
    low, high = ephemeral_port_range()
    assert 1024 < low < high
    assert low <= free_port() <= high  # control: what bind(0) gives is in the range
    for _ in range(20):
        base = free_port_block(4, exclude=[low - 10])
        assert 1024 <= base and base + 4 <= low
        assert all(port_available(p) for p in range(base, base + 4))
    # every candidate excluded: refused, not a block with a taken port
    monkeypatch.setattr("shared.tools.infra.ephemeral_port_range", lambda: (1030, 60999))
    with pytest.raises(RuntimeError, match="no room"):
        free_port_block(8)
    monkeypatch.setattr("shared.tools.infra.ephemeral_port_range", lambda: (2050, 60999))
    with pytest.raises(RuntimeError, match="no block"):
        free_port_block(4, exclude=range(1024, 2050))


# -- NATS --------------------------------------------------------------------------------------
async def test_jetstream_publish_and_pull_consume(nats_server: EmbeddedNats) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    nc = await nats.connect(nats_server.url, connect_timeout=30, max_reconnect_attempts=1)
    try:
        assert nc.max_payload == 8 * 1024 * 1024  # from the generated config
        js = nc.jetstream()
        name = f"T{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        try:
            ack = await js.publish(f"{name}.work", b"hello", headers={"Nats-Msg-Id": "m1"})
            assert ack.stream == name and ack.seq == 1
            dup = await js.publish(f"{name}.work", b"hello", headers={"Nats-Msg-Id": "m1"})
            assert dup.duplicate
            big = os.urandom(2 * 1024 * 1024)  # over the 1 MB server default
            await js.publish(f"{name}.big", big)

            sub = await js.pull_subscribe(f"{name}.work", durable="workers")
            msgs = await sub.fetch(1, timeout=5)
            assert [m.data for m in msgs] == [b"hello"]
            await msgs[0].ack_sync()
            info = await js.consumer_info(name, "workers")
            assert info.num_ack_pending == 0 and info.num_pending == 0
        finally:
            await js.delete_stream(name)
    finally:
        await nc.close()


def test_nats_health_endpoint(nats_server: EmbeddedNats) -> None:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{nats_server.monitor_url}/healthz?js-enabled-only=true", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_nats_stop_closes_port(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    try:
        port, pid = server.port, server.pid
        assert pid is not None and _connectable(port) and server.is_running()
        assert server.log_path.exists() and "Server is ready" in server.log_path.read_text()
    finally:
        code = server.stop()
    # Stopped by its SIGTERM (a clean exit), not by the SIGKILL that follows an ignored one.
    assert code == 0, f"nats-server exit code {code}:\n{server.log_tail()}"
    assert server.stop_seconds is not None and server.stop_seconds < 60  # only catches a hang
    assert not server.is_running() and not _pid_alive(pid)
    assert not _connectable(port)
    assert server.stop() is None  # idempotent
    with pytest.raises(InfraError):
        _ = server.url


async def test_nats_restart_on_same_dir_keeps_jetstream_data(tmp_path: Path) -> None:
    async def roundtrip(url: str, publish: bool) -> int:
        nc = await nats.connect(url, connect_timeout=30, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            if publish:
                await js.add_stream(name="KEEP", subjects=["keep.>"])
                await js.publish("keep.x", b"persisted")
            return (await js.stream_info("KEEP")).state.messages
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path) as a:
        assert await roundtrip(a.url, publish=True) == 1
    with EmbeddedNats(tmp_path) as b:
        assert await roundtrip(b.url, publish=False) == 1


def test_nats_fixed_port_taken_gives_clear_error(tmp_path: Path, listening_socket) -> None:
    port = listening_socket.getsockname()[1]
    assert not port_available(port)
    server = EmbeddedNats(tmp_path, port=port)
    with pytest.raises(PortInUseError) as excinfo:
        server.start()
    msg = str(excinfo.value)
    assert str(port) in msg and "already in use" in msg and "nats-server" in msg
    assert excinfo.value.port == port
    assert server.pid is None  # nothing was launched


def test_a_reserved_port_is_refused_to_servers_until_released(tmp_path: Path) -> None:
    """``epd up`` holds its API port while NATS and S3 start (their own port picks must not take
    it): a server asking for a held port is refused, SO_REUSEADDR or not; released, it binds."""
    port = free_port()
    held = PortReservation([port])
    try:
        assert not port_available(port)  # (binds with SO_REUSEADDR, as the Go servers do)
        with pytest.raises(PortInUseError):
            EmbeddedNats(tmp_path / "a", port=port).start()
        with pytest.raises(PortInUseError):  # a taken port: nothing is held
            PortReservation([free_port(), port])
    finally:
        held.release()
    with EmbeddedNats(tmp_path / "b", port=port) as server:
        assert server.url == f"nats://127.0.0.1:{port}"


def _time_wait_on(port: int) -> bool:
    """Whether a TCP connection on local port ``port`` is in TIME_WAIT (/proc/net/tcp, state 06)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "06" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            return True
    return False


def test_a_port_left_in_time_wait_can_be_reserved_and_stays_exclusive() -> None:
    """`epd up` started again at once on the API port it just used: the port's connections closed
    by the server sit in TIME_WAIT for a minute; they must not refuse the reservation (the server's
    own bind, SO_REUSEADDR, does not mind them), and the reservation still keeps every other bind out."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            conn, _ = server.accept()
            conn.close()  # the server closes first: its side of the connection goes to TIME_WAIT
            assert client.recv(1) == b""
    wait_for(lambda: _time_wait_on(port), 10, f"a TIME_WAIT connection on port {port}")
    held = PortReservation([port])  # (refused before: "the API port ... is already in use")
    try:
        assert not port_available(port)  # a SO_REUSEADDR bind, as the Go servers and uvicorn do
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    finally:
        held.release()
    assert port_available(port)


def test_nats_fixed_port_is_used(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedNats(tmp_path, port=port) as server:
        assert server.url == f"nats://127.0.0.1:{port}"


def test_nats_config_carries_sync_interval_and_cluster(tmp_path: Path) -> None:
    plain = EmbeddedNats(tmp_path / "plain")
    plain._prepare()
    assert "sync_interval" not in plain.config_path.read_text() and "cluster" not in plain.config_path.read_text()
    node = EmbeddedNats(
        tmp_path / "node",
        sync_interval="always",
        cluster_name="c1",
        cluster_port=6222,
        routes=["10.0.0.2:6222"],
        route_user="ru",
        route_password="p@ss word",
        host="10.0.0.1",
    )
    node._prepare()
    conf = node.config_path.read_text()
    assert "sync_interval: always" in conf and 'listen: "10.0.0.1:6222"' in conf
    assert '"nats-route://ru:p%40ss%20word@10.0.0.2:6222"' in conf  # credentials URL-encoded
    assert oct(node.config_path.stat().st_mode & 0o777) == "0o600"  # holds the route password
    assert "p@ss" not in repr(node)
    with pytest.raises(ValueError, match="sync_interval"):
        EmbeddedNats(tmp_path, sync_interval="sometimes")
    with pytest.raises(ValueError, match="cluster_port"):
        EmbeddedNats(tmp_path, cluster_name="c1")


async def test_session_nats_reserves_past_the_free_disk(nats_server, tmp_path: Path) -> None:
    """Every file stream reserves its max bytes up front, and the test session's server holds
    every test's streams: at the server's default limit (75% of the free disk at start) a CI
    machine with a smaller disk ran out late in ``make test`` ('insufficient storage resources').
    The session server's limit is set; reservations past the free disk (nothing written) succeed,
    and a server with a small limit refuses them (the control)."""
    free = shutil.disk_usage(tmp_path).free
    per_stream = 2**30
    count = free // per_stream + 2  # more than the whole free disk, reserved
    small = EmbeddedNats(tmp_path / "small", max_file_store=4 * per_stream)
    small._prepare()
    assert f"max_file_store: {4 * per_stream}" in small.config_path.read_text()
    with pytest.raises(ValueError, match="max_file_store"):
        EmbeddedNats(tmp_path, max_file_store=0)

    async def reserve(url: str, n: int) -> int:
        nc = await nats.connect(url)
        js = nc.jetstream()
        prefix = f"r{uuid.uuid4().hex[:8]}"
        made = 0
        try:
            for i in range(n):
                await js.add_stream(name=f"{prefix}{i}", subjects=[f"{prefix}.{i}"], max_bytes=per_stream)
                made += 1
        except nats.js.errors.ServerError as exc:
            assert "insufficient storage" in str(exc)
        finally:
            for i in range(made):
                await js.delete_stream(f"{prefix}{i}")
            await nc.close()
        return made

    assert await reserve(nats_server.url, count) == count
    with small:
        assert await reserve(small.url, 6) == 4


async def test_a_stack_s_streams_fit_an_embedded_server_whatever_the_free_disk(tmp_path: Path, capsys) -> None:
    """CI failed on a disk with 4 GB free: ``epd up``'s server, at NATS's default limit (75% of the
    free disk), refused the 7 streams' 1 GiB reservations and the API exited with NATS's words only.
    An embedded server's limit is set (epd up's grows with EPD_STREAM_MAX_BYTES and warns when the
    disk has less free); a server too small for them gives a ConfigError naming what to change."""
    from shared.config import NatsSettings
    from shared.errors import ConfigError
    from shared.jetstream import ensure_topology, file_store_reserved
    from shared.protocol import Subjects
    from shared.tools.cli import _jetstream_file_store
    from shared.tools.infra import DEFAULT_MAX_FILE_STORE

    settings = NatsSettings(subject_prefix=f"fs{uuid.uuid4().hex[:6]}")
    subjects = Subjects(settings.subject_prefix)
    reserved = file_store_reserved(settings, subjects)
    assert reserved == 7 * settings.stream_max_bytes
    default = EmbeddedNats(tmp_path / "default")
    default._prepare()
    assert f"max_file_store: {DEFAULT_MAX_FILE_STORE}" in default.config_path.read_text()
    assert _jetstream_file_store(settings, tmp_path) == DEFAULT_MAX_FILE_STORE
    assert capsys.readouterr().err == ""
    huge = settings.model_copy(update={"stream_max_bytes": shutil.disk_usage(tmp_path).free})
    assert _jetstream_file_store(huge, tmp_path) == file_store_reserved(huge, subjects) + 2**30
    assert "GiB free under" in capsys.readouterr().err  # the warning

    async def create(server: EmbeddedNats) -> None:
        nc = await nats.connect(server.url)
        try:
            await ensure_topology(nc.jetstream(), settings, subjects, nc=nc)
        finally:
            await nc.close()

    with default:
        await create(default)  # (whatever the free disk: nothing is written)
    with EmbeddedNats(tmp_path / "small", max_file_store=reserved - settings.stream_max_bytes) as small:
        with pytest.raises(ConfigError, match="EPD_STREAM_MAX_BYTES") as refused:
            await create(small)
    assert "max_file_store" in str(refused.value) and "7 GiB in all" in str(refused.value)


async def test_nats_cluster_replicates_and_survives_a_killed_leader(tmp_path: Path) -> None:
    """Three nodes through a command prefix (``env``, which execs like ``ip netns exec``): an R3
    stream has a leader on one node; SIGKILL of that node elects another, the data stays, the node
    restarts on its ports and catches up; a paused node is signalled on the server's own pid."""
    ports = free_ports(9)  # picked together: nine distinct ports (free_port() x 9 may repeat one)
    cluster = NatsCluster(
        tmp_path,
        3,
        wraps=[["env", "EPD_NODE=1"]] * 3,
        ports=ports[:3],
        monitor_ports=ports[3:6],
        cluster_ports=ports[6:],
        route_user="route",
        route_password="s3cret",
        sync_interval="always",
    )
    with cluster:
        assert cluster.seeds == ",".join(f"nats://127.0.0.1:{n.requested_port}" for n in cluster.nodes)
        for node in cluster.nodes:  # the wrapper exec'd: the pid we signal is nats-server's
            assert Path(f"/proc/{node.pid}/comm").read_text().strip() == "nats-server"
        assert cluster.meta_leader() is not None
        nc = await nats.connect(cluster.urls, connect_timeout=10, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        try:
            js = nc.jetstream(timeout=10)
            await js.add_stream(name="R3", subjects=["r3.>"], num_replicas=3)
            # a new R3 stream elects its leader first: until then a publish has no responders
            leader = await asyncio.to_thread(cluster.wait_stream_leader, "R3", 30)
            await through_elections(
                lambda left: js.publish("r3.a", b"one", timeout=left, headers={"Nats-Msg-Id": "r3-a"}),
                doing="publishing r3.a",
                until=time.time() + 30,
            )
            assert (await js.stream_info("R3")).cluster.leader == cluster.nodes[leader].server_name
            cluster.kill(leader)
            assert not cluster.nodes[leader].is_running()
            new = await asyncio.to_thread(cluster.wait_stream_leader, "R3", 30, not_on=leader)
            assert new != leader
            # the client may still be on its way to another seed, or the new leader not yet serving
            # the subject: the product retries such publishes (with a msg id) within their deadline
            await through_elections(
                lambda left: js.publish("r3.b", b"two", timeout=left, headers={"Nats-Msg-Id": "r3-b"}),
                doing="publishing r3.b",
                until=time.time() + 30,
            )
            await asyncio.to_thread(cluster.start, leader)  # same ports, same store: rejoins and catches up (healthz)
            assert (await js.stream_info("R3")).state.messages == 2
            other = (leader + 1) % 3
            cluster.pause(other)
            assert Path(f"/proc/{cluster.nodes[other].pid}/stat").read_text().split(")")[1].split()[0] == "T"
            cluster.resume(other)
            await asyncio.to_thread(cluster.wait_ready, 30)
        finally:
            await nc.close()
    assert cluster.running() == []


def test_nats_startup_failure_reports_exit_and_log_tail(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path, extra_config="this_is { not valid config")
    with pytest.raises(InfraError) as excinfo:
        server.start(timeout=60)  # it exits at once on the bad config; the bound only catches a hang
    msg = str(excinfo.value)
    assert "exited during startup" in msg and "exit code" in msg
    assert str(server.log_path) in msg
    assert "nats-server" in msg and len(msg.splitlines()) > 1  # the log tail follows
    assert not server.is_running()


def test_server_dies_with_its_python_parent(tmp_path: Path) -> None:
    """SIGKILL the Python process that started nats-server: PDEATHSIG stops the server."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from shared.tools.infra import EmbeddedNats
        s = EmbeddedNats({str(tmp_path)!r}).start()
        print(s.pid, s.port, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "child did not start the server"
        pid, port = map(int, line.split())
        assert _pid_alive(pid)
        child.kill()
        child.wait(timeout=60)
        wait_for(lambda: not _pid_alive(pid), 60, "nats-server to die with its parent")
        assert not _connectable(port)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_server_started_from_a_short_lived_thread_survives_it(tmp_path: Path) -> None:
    """PDEATHSIG is per forking *thread*: starting from a worker thread must not tie the
    server's life to that thread (asyncio.to_thread, executors)."""
    import threading

    server = EmbeddedNats(tmp_path)
    t = threading.Thread(target=server.start)
    t.start()
    t.join()
    try:
        # join() returns before the OS thread is gone; the kernel sends a parent-death signal
        # while the thread exits, before its /proc entry goes. Once it is gone, a signal tied to
        # that thread has been sent.
        task = Path(f"/proc/self/task/{t.native_id}")
        wait_for(lambda: not task.exists(), 60, f"thread {t.native_id} to exit")

        async def jetstream_round_trip() -> None:
            # (nats-py retries a first connect forever with max_reconnect_attempts=0; 1 gives up.)
            nc = await nats.connect(server.url, connect_timeout=30, max_reconnect_attempts=1)
            try:
                await nc.jetstream().account_info()
            finally:
                await nc.close()

        asyncio.run(jetstream_round_trip())  # still serving after the thread is gone ...
        assert server.is_running()
        # ... and never told to stop (nats-server logs every signal it traps).
        assert "Trapped" not in server.log_path.read_text(), server.log_tail()
    finally:
        server.stop()


def test_find_binary_prefers_venv_bin() -> None:
    assert Path(find_binary("nats-server")).parent == Path(sys.executable).parent
    with pytest.raises(InfraError, match="not found"):
        find_binary("definitely-not-a-binary-epd")


# -- S3 ----------------------------------------------------------------------------------------
def test_s3_fixture_serves_authenticated_s3(s3_server: EmbeddedS3) -> None:
    assert s3_server.endpoint == f"127.0.0.1:{s3_server.port}"
    assert s3_server.secret_key not in repr(s3_server)
    ident = json.loads(s3_server.identities_path.read_text())
    assert ident["identities"][0]["credentials"][0]["accessKey"] == s3_server.access_key
    assert (s3_server.identities_path.stat().st_mode & 0o777) == 0o600
    client = Minio(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, secure=False)
    client.list_buckets()  # authenticated call works
    anon = Minio(s3_server.endpoint, secure=False)
    with pytest.raises(S3Error) as excinfo:
        anon.list_buckets()  # anonymous access is refused
    assert excinfo.value.code == "AccessDenied", excinfo.value


def _fill_buckets(server: EmbeddedS3, n: int) -> int:
    """Create ``n`` buckets with one object each; how many took their object."""
    import io

    from urllib3.exceptions import MaxRetryError

    client = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
    ok = 0
    for _ in range(n):
        bucket = f"many-{uuid.uuid4().hex[:10]}"
        client.make_bucket(bucket)
        try:
            client.put_object(bucket, "k", io.BytesIO(b"x" * 100), 100)
            ok += 1
        except S3Error as exc:
            assert exc.code == "InternalError", exc
        except MaxRetryError as exc:  # urllib3 retried the 500s
            assert "500 error responses" in str(exc), exc
    return ok


def test_s3_takes_writes_into_many_buckets(s3_server: EmbeddedS3, tmp_path: Path) -> None:
    """Every bucket takes a volume; the test suite makes many. By default SeaweedFS allows free disk /
    1 GiB volumes (38 with 38 GiB free, and the suite failed past that): EmbeddedS3 sets its own."""
    assert SEAWEED_MAX_VOLUMES >= 500
    assert _fill_buckets(s3_server, 45) == 45
    # Control: the same server with room for 3 volumes refuses the writes of the buckets past them.
    small = EmbeddedS3(tmp_path / "small", extra_args=["-volume.max=3"])  # (the last -volume.max wins)
    small.start()
    try:
        assert _fill_buckets(small, 5) < 5
    finally:
        small.stop()


def test_s3_fixed_port_taken_gives_clear_error(tmp_path: Path, listening_socket) -> None:
    port = listening_socket.getsockname()[1]
    server = EmbeddedS3(tmp_path, port=port)
    with pytest.raises(PortInUseError) as excinfo:
        server.start()
    assert str(port) in str(excinfo.value) and "already in use" in str(excinfo.value)
    assert server.pid is None


def test_s3_stop_closes_ports_and_restart_keeps_data(tmp_path: Path) -> None:
    """One extra SeaweedFS start/stop/start (~5 s): the `epd up` restart path."""
    import io

    s3_port = free_port()
    a = EmbeddedS3(tmp_path, access_key="restartkey", secret_key="restart-secret-1234", port=s3_port)
    with a:
        assert a.endpoint == f"127.0.0.1:{s3_port}"
        ports, pid = dict(a.ports), a.pid
        c = Minio(a.endpoint, a.access_key, a.secret_key, secure=False)
        c.make_bucket("keep")
        c.put_object("keep", "k", io.BytesIO(b"v"), 1)
    assert pid is not None and not _pid_alive(pid)
    assert a.stop_seconds is not None
    for flag, port in ports.items():
        assert not _connectable(port), f"{flag} {port} still open after stop"
    with EmbeddedS3(tmp_path, access_key="restartkey", secret_key="restart-secret-1234", port=s3_port) as b:
        c = Minio(b.endpoint, b.access_key, b.secret_key, secure=False)
        resp = c.get_object("keep", "k")
        try:
            assert resp.read() == b"v"
        finally:
            resp.close()
            resp.release_conn()


def test_s3_killed_right_after_its_writes_keeps_them(tmp_path: Path) -> None:
    """Why the S3 server's stop grace can be short (``EmbeddedS3.default_stop_grace``, 1 s, against
    the 10 s ``weed mini`` may wait for an admin session before it stops its filer and volume
    servers): an S3 write is answered once its data is in the volume and filer files. Killed with
    no grace at all right after writes and a delete, restarted on its folder, it serves what it
    acknowledged, byte for byte, lists what it should, and takes new writes."""
    import hashlib
    import io

    keys = {"access_key": "killkey", "secret_key": "kill-secret-12345678"}
    a = EmbeddedS3(tmp_path, **keys).start()
    c = Minio(a.endpoint, a.access_key, a.secret_key, secure=False)
    c.make_bucket("keep")
    objects = {f"o{i}": os.urandom(size) for i, size in enumerate([1, 1000, 300_000, 3_000_000, 9_000_000])}
    for key, data in objects.items():
        c.put_object("keep", key, io.BytesIO(data), len(data))
    c.remove_object("keep", "o1")
    del objects["o1"]
    assert a.stop(grace=0) == -9  # SIGKILL at once (it had no time to act on the SIGTERM)
    with EmbeddedS3(tmp_path, **keys) as b:
        c = Minio(b.endpoint, b.access_key, b.secret_key, secure=False)
        for key, data in objects.items():
            resp = c.get_object("keep", key)
            try:
                assert hashlib.sha256(resp.read()).digest() == hashlib.sha256(data).digest(), key
            finally:
                resp.close()
                resp.release_conn()
        assert sorted(o.object_name for o in c.list_objects("keep")) == sorted(objects)
        c.put_object("keep", "after", io.BytesIO(b"x"), 1)


def test_servers_are_stopped_together_and_s3_within_its_short_grace(tmp_path: Path) -> None:
    """``epd up``'s Ctrl-C stops NATS and the S3 server together (``stop_servers``): both got their
    SIGTERM before either had exited, and the S3 server takes at most its grace (+ the SIGKILL)."""
    nats_server = EmbeddedNats(tmp_path / "nats").start()
    s3 = EmbeddedS3(tmp_path / "s3").start()
    try:
        Minio(s3.endpoint, s3.access_key, s3.secret_key, secure=False).make_bucket("grow")  # a volume grows
    finally:
        stop_servers([s3, nats_server])
    assert not nats_server.is_running() and not s3.is_running()
    assert nats_server.stop_requested_at is not None and s3.stop_requested_at is not None
    assert nats_server.stop_seconds is not None and s3.stop_seconds is not None
    exits = [nats_server.stop_requested_at + nats_server.stop_seconds, s3.stop_requested_at + s3.stop_seconds]
    assert max(nats_server.stop_requested_at, s3.stop_requested_at) < min(exits), "stopped one after the other"
    assert EmbeddedS3.default_stop_grace <= 3.0
    assert s3.stop_seconds < EmbeddedS3.default_stop_grace + 2.0, s3.log_tail()
