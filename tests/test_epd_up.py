"""``epd up`` (what ``make run`` runs) as real processes: the venv's ``epd`` console script starts
embedded NATS + S3 and the services of a topology, prints the ready line and a request to try,
serves that request with the aggregated reference's tokens, and on SIGINT stops every process it
started and frees every port they listened on.

``epd up`` takes every port (``--port``, ``--nats-port``, ``--s3-port``, ``--metrics-port``) and
its data folder (``--data-dir``) as options, so it runs here on free ports in a temporary folder;
nothing else differs from ``make run``. The default topology builds the tiny model itself (as
``make run`` does on a fresh checkout); ``agg`` is pointed at the session's copy with ``--model``.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from shared.tools.cli import DEFAULT_DATA_DIR, build_parser, default_model_dir
from shared.config import CommonSettings
from shared.tools.infra import free_port, port_available
from shared.tools.launcher import Stack
from shared.media import content_hash_of
from shared.protocol import EncodeJob
from tests.stackutil import GREEDY, RunningStack, engine_encode, engine_tokens, final_result, noise_image, wait_for
from tests.test_e2e_epd import REF_PARAMS

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EPD = Path(sys.executable).parent / "epd"  # the console script `make run` calls
READY = re.compile(r"^epd-serve ready in [\d.]+s: (?P<url>http://\S+)\s+\(model (?P<model>\S+), engine (?P<engine>\S+), "
                   r"topology (?P<topology>\S+)\)$", re.M)
CURL = re.compile(r"^\s*curl -s (?P<url>\S+)/v1/chat/completions -H 'Content-Type: application/json' -d '(?P<body>.*)'$",
                  re.M)
METRICS = re.compile(r"^\s*worker /metrics: (?P<ports>.*)$", re.M)
#: The service processes of each topology (README: agg is the API plus one worker that encodes,
#: prefills and decodes; e-pd adds encoder workers).
SERVICES = {"e-pd": ["api", "encoder", "prefill"], "agg": ["api", "prefill"]}


# -- make run --------------------------------------------------------------------------------------
def test_make_run_is_epd_up_on_port_8000():
    """README: `make run` starts everything (epd up) on http://127.0.0.1:8000, files under ./var."""
    # (a clean make environment: under `make test` MAKELEVEL/MAKEFLAGS would add "make[1]: ..." lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    dry = subprocess.run(["make", "-n", "--no-print-directory", "run"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1] == ".venv/bin/epd up"  # after the install steps, if any
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["epd"] == "shared.tools.cli:main"
    args = build_parser().parse_args(["up"])
    assert (args.host, args.port, args.topology, Path(args.data_dir)) == ("127.0.0.1", 8000, "e-pd", DEFAULT_DATA_DIR)
    readme = (REPO / "README.md").read_text()
    assert "make run    # creates .venv, installs, starts NATS + S3 + all services: http://127.0.0.1:8000" in readme
    assert str(DEFAULT_DATA_DIR) == "var" and "keeps every file under `./var`" in readme


# -- epd up, for real ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    pid: int
    start_time: str  # /proc/<pid>/stat field 22: tells a pid from a later reuse of it
    cmdline: str

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[19] == self.start_time and stat[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state first), or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if stat is None or stat[0] == "Z":
            continue
        out.append(Proc(pid, stat[19], cmdline))
        todo.extend(children.get(pid, []))
    return out


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports the processes ``pids`` listen on (from their socket fds and /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def free_port_block(n: int, exclude: list[int]) -> int:
    """A port ``p`` with p .. p + n - 1 free a moment ago and not in ``exclude`` (``--metrics-port``
    gives the workers p+1, p+2, ...)."""
    for _ in range(100):
        base = free_port()
        block = range(base, base + n)
        if base + n < 65536 and not set(block) & set(exclude) and all(port_available(p) for p in block):
            return base
    raise AssertionError(f"no block of {n} free ports")


def image_from_data_url(url: str) -> Image.Image:
    head, b64 = url.split(",", 1)
    assert head == "data:image/png;base64", head
    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


def engine_form(messages: list[dict]) -> tuple[list[dict], list[Image.Image]]:
    """The engine's placeholder form of chat ``messages`` (image_url parts -> {"type": "image"}, in
    place) and their images, decoded."""
    out, images = [], []
    for msg in messages:
        parts = []
        for part in msg["content"]:
            if part["type"] == "image_url":
                images.append(image_from_data_url(part["image_url"]["url"]))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out, images


def generate(engine, messages, images) -> list[int]:
    return engine_tokens(engine, messages, engine_encode(engine, images), REF_PARAMS)


@pytest.mark.parametrize("topology", [None, "agg"], ids=["default", "agg"])
def test_epd_up_serves_the_printed_request_and_stops_everything_on_sigint(topology, tiny_model_dir, reference_engine,
                                                                          tmp_path):
    expected = topology or build_parser().parse_args(["up"]).topology
    workers = [s for s in SERVICES[expected] if s != "api"]
    data_dir = tmp_path / "var"
    api_port, nats_port, s3_port = distinct_free_ports(3)
    metrics_base = free_port_block(len(workers) + 1, exclude=[api_port, nats_port, s3_port])
    argv = [str(EPD), "up", "--data-dir", str(data_dir), "--port", str(api_port), "--nats-port", str(nats_port),
            "--s3-port", str(s3_port), "--metrics-port", str(metrics_base)]
    if topology is not None:
        argv += ["--topology", topology, "--model", str(tiny_model_dir)]
    # Nothing of this session's configuration leaks in; PYTHONPATH: the tree under test (the
    # editable install points at the main checkout; make run runs in the checkout it installed).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EPD_")}, "PYTHONPATH": str(REPO),
           "PYTHONUNBUFFERED": "1"}
    out_path = tmp_path / "epd-up.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    output = lambda: out_path.read_text(errors="replace")  # noqa: E731
    children: list[Proc] = []
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"epd up exited with {proc.returncode} before it was ready:\n{output()[-4000:]}")
            return READY.search(output())

        # A loaded 2-core machine: building the model plus starting four processes can take minutes.
        m = wait_for(ready, 420, "epd up to print that it is ready", interval=0.5)
        assert m["url"] == f"http://127.0.0.1:{api_port}" and m["topology"] == expected, m.group(0)
        assert (m["model"], m["engine"]) == ("qwen2-vl-tiny", "transformers")
        if topology is None:  # it built the tiny model itself: the very model of the reference
            built = default_model_dir(data_dir)
            assert (built / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()

        # Real processes: the topology's services (and nothing else of ours), NATS and S3.
        children = descendants(proc.pid)
        modules = sorted(re.search(r"-m services\.(\w+)", p.cmdline)[1] for p in children if "-m services." in p.cmdline)
        assert modules == sorted(SERVICES[expected]), [p.cmdline for p in children]
        assert any("nats-server" in p.cmdline for p in children) and any(" mini " in p.cmdline for p in children)
        assert len(children) == len(modules) + 2, [p.cmdline for p in children]
        metrics = dict(re.findall(r"(\S+) :(\d+)", METRICS.search(output())["ports"]))
        assert sorted(metrics) == sorted(f"{w}-0" for w in workers)
        ports = listening_ports([p.pid for p in children])
        assert {api_port, nats_port, s3_port, *map(int, metrics.values())} <= ports, ports

        # The request it prints, as printed, is answered ...
        curl = CURL.search(output())
        assert curl and curl["url"] == m["url"], output()[-2000:]
        body = json.loads(curl["body"])
        resp = httpx.post(f"{m['url']}/v1/chat/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        assert 1 <= resp.json()["usage"]["completion_tokens"] <= body["max_tokens"]
        first_rid = resp.json()["id"]
        # ... and greedily, with the aggregated reference's tokens (same messages, same image).
        resp = httpx.post(f"{m['url']}/v1/chat/completions", json={**body, **GREEDY}, timeout=300)
        assert resp.status_code == 200, resp.text
        got, rid = resp.json()["choices"][0]["token_ids"], resp.json()["id"]
        messages, images = engine_form(body["messages"])
        assert len(images) == 1
        assert got == generate(reference_engine, messages, images)
        # Negative control: another image gives other tokens, so the equality above can fail.
        assert generate(reference_engine, messages, [noise_image(7, images[0].size)]) != got

        # What the topology means on the wire: agg encodes in the worker (then keeps the features in
        # its cache) and queues no encode job; e-pd queues one for the image's first request.
        defaults = CommonSettings.model_fields
        running = RunningStack(Stack(env={}, log_dir=tmp_path, topology=expected, api_port=api_port),
                               f"nats://127.0.0.1:{nats_port}", defaults["subject_prefix"].default,
                               defaults["namespace"].default, defaults["s3_bucket"].default, {})
        item = content_hash_of(images[0])
        jobs = [running.messages_of("stream_encode", EncodeJob, r) for r in (first_rid, rid)]
        sources = [final_result(running, r).ec_sources[item] for r in (first_rid, rid)]
        if expected == "agg":
            assert jobs == [[], []] and sources == ["local", "local_cache"], (jobs, sources)
        else:
            assert [[j.image.item_hash for j in js] for js in jobs] == [[item], []], jobs
            assert sources[0] == "store" and sources[1] in ("store", "local_cache"), sources

        # Ctrl-C: it stops every process it started, and their ports are free again.
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=180) == 0, output()[-4000:]
        except subprocess.TimeoutExpired:
            pytest.fail(f"epd up still running 180 s after SIGINT:\n{output()[-2000:]}")
        assert "\nstopping..." in output()
        left = [p for p in children if p.alive()]
        assert left == [], f"still running after epd up exited: {[p.cmdline for p in left]}"
        taken = sorted(p for p in ports if not port_available(p))
        assert taken == [], f"ports still taken after epd up exited: {taken}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        for p in children:  # only what this test started, by pid
            if p.alive():
                log.warning("killing leftover %s (%d)", p.cmdline, p.pid)
                os.kill(p.pid, signal.SIGKILL)
