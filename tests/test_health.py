"""`epd healthcheck`: the worker heartbeat file and the API probe (shared/health.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shared.health import DEFAULT_MAX_AGE_S, HealthFile, api_health_url, check_api, check_worker, main
from shared.topology import Service


def test_fresh_heartbeat_is_healthy(tmp_path):
    hf = HealthFile(tmp_path / "hb" / "encoder.json")
    hf.write(role="encoder", worker_id="enc-1", in_flight=2)
    ok, reason = check_worker(hf.path, role="encoder")
    assert ok, reason
    assert json.loads(hf.path.read_text())["pid"] == os.getpid()
    assert not list(hf.path.parent.glob(".*.tmp"))  # atomic replace leaves nothing behind


@pytest.mark.parametrize(
    "case,expected",
    [
        ("missing", "no heartbeat file"),
        ("stale", "stale"),
        ("wrong-role", "expected encoder"),
        ("dead-pid", "is gone"),
        ("garbage", "not a valid heartbeat"),
        ("old-schema", "schema"),
    ],
)
def test_unhealthy_heartbeats(tmp_path, case, expected):
    path = tmp_path / "hb.json"
    hf = HealthFile(path)
    now = time.time()
    if case == "stale":
        hf.write(role="encoder", worker_id="w", now=now - DEFAULT_MAX_AGE_S - 1)
    elif case == "wrong-role":
        hf.write(role="prefill", worker_id="w")
    elif case == "dead-pid":
        proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        path.write_text(
            json.dumps(
                {
                    "schema": 1,
                    "role": "encoder",
                    "worker_id": "w",
                    "pid": int(proc.stdout),
                    "in_flight": 0,
                    "written_at": now,
                }
            )
        )
    elif case == "garbage":
        path.write_text("{not json")
    elif case == "old-schema":
        path.write_text(json.dumps({"schema": 0, "role": "encoder", "pid": os.getpid(), "written_at": now}))
    ok, reason = check_worker(path, role="encoder", now=now)
    assert not ok and expected in reason, reason


def test_remove_makes_it_unhealthy(tmp_path):
    hf = HealthFile(tmp_path / "hb.json")
    hf.write(role="decode", worker_id="d")
    assert check_worker(hf.path, role="decode")[0]
    hf.remove()
    hf.remove()  # idempotent
    assert not check_worker(hf.path, role="decode")[0]


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        body = json.dumps({"status": "ok", "workers": {"encoder": 1}}).encode()
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_api_check(fake_api):
    url = f"http://127.0.0.1:{fake_api.server_address[1]}/health"
    _Health.status = 200
    assert check_api(url) == (True, "api healthy: workers {'encoder': 1}")
    _Health.status = 503  # NATS down
    ok, reason = check_api(url)
    assert not ok and "503" in reason
    _Health.status = 200
    fake_api.shutdown()
    fake_api.server_close()
    ok, reason = check_api(url, timeout=1)
    assert not ok and "unreachable" in reason


def test_api_health_url():
    assert api_health_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/health"
    assert api_health_url("10.1.2.3", 81) == "http://10.1.2.3:81/health"
    assert api_health_url("::", 8000) == "http://[::1]:8000/health"


def test_cli_reads_the_services_env(tmp_path, monkeypatch, capsys, fake_api):
    for key in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)
    assert main(["--role", "encoder"]) == 1
    assert "no heartbeat file configured" in capsys.readouterr().err
    path = tmp_path / "hb.json"
    monkeypatch.setenv("EPD_HEALTH_FILE", str(path))
    assert main(["--role", "encoder"]) == 1
    HealthFile(path).write(role="encoder", worker_id="w")
    assert main(["--role", "encoder"]) == 0
    assert main(["--role", "prefill"]) == 1
    assert main(["--role", "encoder", "--max-age", "0"]) == 1
    monkeypatch.setenv("EPD_HOST", "0.0.0.0")
    monkeypatch.setenv("EPD_PORT", str(fake_api.server_address[1]))
    assert main(["--role", "api"]) == 0


def test_role_is_a_service(capsys):
    """A worker beats as its service, so `--role` takes a service name; a prefill role such as
    `pd` (EPD_ROLE) would never match a heartbeat file and is refused up front."""
    with pytest.raises(SystemExit) as exc:
        main(["--role", "pd"])
    assert exc.value.code == 2 and "invalid choice: 'pd'" in capsys.readouterr().err
    # Control: every service is accepted (each fails here only for want of a file / an API).
    for service in Service:
        assert main(["--role", service.value, "--url", "http://127.0.0.1:9/health", "--timeout", "0.2"]) in (0, 1)


def test_worker_runner_writes_and_removes_the_file(tmp_path, nats_server):
    """The real WorkerRunner: the file appears once consuming, and goes on stop."""
    from shared import protocol
    from shared.config import EncoderSettings
    from shared.topology import Role, Service
    from shared.worker import Delivery, Handler, WorkerContext, WorkerRunner

    class Idle(Handler):
        service = Service.ENCODER
        role = Role.ENCODER
        job_type = protocol.EncodeJob
        queue = protocol.WorkQueue.ENCODE
        durable = protocol.CONSUMER_ENCODER

        async def setup(self, ctx: WorkerContext) -> None:
            pass

        async def handle(self, job: protocol.EncodeJob, delivery: Delivery) -> None:
            pass

    path = tmp_path / "hb.json"
    settings = EncoderSettings(
        nats_url=nats_server.url, subject_prefix=f"hc{os.getpid()}", health_file=path, worker_id="hc-worker"
    )

    async def scenario():
        runner = WorkerRunner(Idle(), settings)
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 120  # only catches a worker that never writes the file
        while not path.exists():
            assert time.monotonic() < deadline and not task.done(), "no heartbeat file"
            await asyncio.sleep(0.1)
        ok, reason = check_worker(path, role="encoder")
        assert ok, reason
        assert json.loads(path.read_text())["worker_id"] == "hc-worker"
        runner.request_stop()
        await asyncio.wait_for(task, 120)
        assert not path.exists()

    asyncio.run(scenario())
