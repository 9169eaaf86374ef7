"""``epd up`` (what ``make run`` runs) as real processes: the venv's ``epd`` console script starts
embedded NATS + S3 and the services of a topology, prints the ready line and a request to try,
serves that request with the aggregated reference's tokens, and on SIGINT stops every process it
started and frees every port they listened on.

``epd up`` takes every port (``--port``, ``--nats-port``, ``--s3-port``, ``--metrics-port``) and
its data folder (``--data-dir``) as options, so it runs here on free ports in a temporary folder;
nothing else differs from ``make run``. The default run serves the shipped demo model (as ``make run``
does on a fresh checkout) and its printed request gets the right answer; ``agg`` is pointed at the
session's tiny model with ``--model``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image

from shared.config import StoreSettings, ToolSettings
from shared.cpus import available_cpus, format_cpu_list, parse_cpu_list, split_cpus
from shared.ec_lifecycle.janitor import expiration_days, get_expiration_days
from shared.media import content_hash_of
from shared.protocol import EncodeJob, FinalResult
from shared.store.objects import S3ObjectStore
from shared.store_auth import load_or_create_keys
from shared.tools.cli import DEFAULT_DATA_DIR, build_parser
from shared.tools.infra import SEAWEED_REGION, free_port_block, port_available
from shared.tools.launcher import Stack
from shared.tools.models.demo import MODEL_NAME, SHIPPED_DIR
from shared.tools.models.shapes import EXAMPLE
from shared.topology import Topology
from tests.epdup import EPD, EXITED, HEALTHY, READY, REPO, RESTARTED, EpdUp, Proc, descendants, distinct_free_ports
from tests.stackutil import (
    GREEDY,
    RunningStack,
    admin_url,
    engine_encode,
    engine_tokens,
    final_result,
    noise_image,
    wait_for,
)
from tests.test_e2e_epd import REF_PARAMS

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

CURL = re.compile(
    r"^\s*curl -s (?P<url>\S+)/v1/chat/completions "
    r"-H 'Content-Type: application/json' -d '(?P<body>.*)'$",
    re.M,
)
METRICS = re.compile(r"^\s*worker /metrics: (?P<ports>.*)$", re.M)
#: The service processes of each topology (docs/architecture.md: agg is the API plus one worker that encodes,
#: prefills and decodes; e-pd adds encoder workers).
SERVICES = {"e-pd": ["api", "encoder", "prefill"], "agg": ["api", "prefill"]}


# -- make run --------------------------------------------------------------------------------------
def test_cpu_lists_parse_format_and_split():
    assert parse_cpu_list("0,2-3, 5") == [0, 2, 3, 5] and format_cpu_list([5, 0, 2, 3]) == "0,2-3,5"
    for bad in ("", "a", "3-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    assert split_cpus([0, 1], ["encoder", "prefill"]) == {"encoder": "0", "prefill": "1"}
    assert split_cpus(range(5), ["encoder", "prefill"]) == {"encoder": "0-2", "prefill": "3-4"}
    assert split_cpus([0, 1], ["encoder", "prefill", "decode"]) == {"encoder": "0", "prefill": "1", "decode": "1"}


def test_a_worker_lowers_its_priority_and_never_raises_it():
    # In child processes: a process cannot take back a lower priority without privileges, and the
    # test process must keep its own.
    code = (
        "import os; from shared.cpus import lower_priority as lower; "
        "print(lower(0), lower(4), lower(2), os.getpriority(os.PRIO_PROCESS, 0)); "
        "print(open('/proc/self/autogroup').read().strip())"
    )

    def run(**kwargs) -> tuple[list[str], str]:
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, **kwargs)
        assert out.returncode == 0, out
        nice, _, autogroup = out.stdout.partition("\n")
        return nice.split(), autogroup.strip()

    session_group = Path("/proc/self/autogroup").read_text().strip()  # (before a child could change it)
    own_nice, own_group = run(start_new_session=True)
    assert own_nice == ["0", "4", "4", "4"], own_nice
    shared_nice, shared_group = run()
    assert shared_nice == ["0", "4", "4", "4"], shared_nice
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        # Sessions are scheduled as groups: a session leader lowers its group, which is what
        # weighs against the other services; a process in someone else's session leaves that
        # session's group as it was - which reads empty where the session is in the kernel's root
        # group (a CI runner's, for one), "/autogroup-N nice 0" in a login's session.
        assert own_group.split()[-2:] == ["nice", "4"], own_group
        assert shared_group == session_group, (shared_group, session_group)


def test_epd_up_per_service_settings_from_flags():
    from shared.tools.cli import _service_env

    def env(*argv):
        return _service_env(build_parser().parse_args(["up", *argv]), Topology.E_P_D)

    assert env("--cores", "encoder=0", "--service-env", "prefill:EPD_VLLM_KV_CACHE_GIB=2") == {
        "encoder": {"EPD_CPU_CORES": "0"},
        "prefill": {"EPD_VLLM_KV_CACHE_GIB": "2"},
    }
    auto = env("--cores", "auto")
    assert sorted(auto) == ["decode", "encoder", "prefill"]
    # vLLM binds every engine to the same core(s) by itself: split unless told otherwise.
    assert env("--engine", "vllm") == auto
    assert env("--engine", "vllm", "--cores", "encoder=0") == {"encoder": {"EPD_CPU_CORES": "0"}}
    assert env() == {}  # control: transformers engines are left unbound
    from shared.tools.cli import _own_cpus

    assert _own_cpus({"encoder": {"EPD_CPU_CORES": "0"}, "prefill": {"EPD_CPU_CORES": "1-2"}}, Topology.E_PD)
    assert not _own_cpus({"encoder": {"EPD_CPU_CORES": "0-1"}, "prefill": {"EPD_CPU_CORES": "1"}}, Topology.E_PD)
    assert not _own_cpus({"encoder": {"EPD_CPU_CORES": "0"}}, Topology.E_PD)  # the prefill worker may use any
    for bad in (
        ["--cores", "api=0"],
        ["--cores", "encoder=x"],
        ["--service-env", "prefill:VLLM_X=1"],
        ["--service-env", "nope:EPD_X=1"],
    ):
        with pytest.raises(SystemExit):
            env(*bad)


def test_make_run_is_epd_up_on_port_8000():
    """README: `make run` starts everything (epd up) on http://127.0.0.1:8000, files under ./var."""
    # (a clean make environment: under `make test` MAKELEVEL/MAKEFLAGS would add "make[1]: ..." lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "run"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1] == ".venv/bin/epd up"  # after the install steps, if any
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["epd"] == "shared.tools.cli:main"
    args = build_parser().parse_args(["up"])
    assert (args.host, args.port, args.topology, Path(args.data_dir)) == ("127.0.0.1", 8000, "e-pd", DEFAULT_DATA_DIR)
    readme = (REPO / "README.md").read_text()
    assert "make run    # creates .venv, installs, starts NATS + S3 + all services: http://127.0.0.1:8000" in readme
    assert str(DEFAULT_DATA_DIR) == "var" and "keeps every file under `./var`" in readme


def test_epd_up_refuses_a_taken_api_port_before_starting_anything(tmp_path):
    """The API binds last, after the workers have loaded: a taken ``--port`` fails at once, clearly."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        nats_port, s3_port = distinct_free_ports(2)
        data_dir = tmp_path / "var"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
        run = subprocess.run(
            [str(EPD), "up", "--data-dir", str(data_dir), "--port", str(port)]
            + ["--nats-port", str(nats_port), "--s3-port", str(s3_port), "--no-fork-server"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=REPO,
        )
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"the API port 127.0.0.1:{port} is already in use; pick another with --port" in run.stderr
    assert "starting services" not in run.stdout  # refused before NATS, S3 or a service started
    assert not (data_dir / "nats").exists() and not (data_dir / "logs").exists()


# -- epd up, for real ------------------------------------------------------------------------------
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


@pytest.fixture(scope="module")
def demo_engine():
    """The aggregated reference on the shipped demo model (what a default ``epd up`` serves)."""
    from shared.engines.transformers_engine import TransformersEngine

    return TransformersEngine(SHIPPED_DIR, dtype="float32", threads=1, model_id=MODEL_NAME)


@pytest.mark.parametrize("topology", [None, "agg"], ids=["default", "agg"])
def test_epd_up_serves_the_printed_request_and_stops_everything_on_sigint(
    topology, tiny_model_dir, reference_engine, demo_engine, tmp_path
):
    expected = topology or build_parser().parse_args(["up"]).topology
    workers = [s for s in SERVICES[expected] if s != "api"]
    data_dir = tmp_path / "var"
    api_port, nats_port, s3_port = distinct_free_ports(3)
    metrics_base = free_port_block(len(workers) + 1, exclude=[api_port, nats_port, s3_port])
    argv = [
        str(EPD),
        "up",
        "--data-dir",
        str(data_dir),
        "--port",
        str(api_port),
        "--nats-port",
        str(nats_port),
        "--s3-port",
        str(s3_port),
        "--metrics-port",
        str(metrics_base),
    ]
    if topology is not None:
        argv += ["--topology", topology, "--model", str(tiny_model_dir)]
    else:  # per-service CPU binding and priority, and one worker service after another
        argv += ["--cores", "auto", "--service-env", "encoder:EPD_CPU_NICE=3", "--start", "staggered"]
        # a retired setting left in a deployment: named at start-up, not silently ignored
        argv += ["--service-env", "encoder:EPD_BATCH_SIZE=4"]
    # Nothing of this session's configuration leaks in; PYTHONPATH: the tree under test (the
    # editable install points at the main checkout; make run runs in the checkout it installed).
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EPD_")},
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    if topology is not None:  # an EC TTL: its S3 lifecycle backstop is set (the default case: none)
        env["EPD_EC_TTL_S"] = "86400"
    out_path = tmp_path / "epd-up.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    output = lambda: out_path.read_text(errors="replace")  # noqa: E731 - a one-line helper
    children: list[Proc] = []
    try:

        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"epd up exited with {proc.returncode} before it was ready:\n{output()[-4000:]}")
            return READY.search(output())

        # A loaded 2-core machine: building the model plus starting four processes can take minutes.
        m = wait_for(ready, 420, "epd up to print that it is ready", interval=0.5)
        assert m["url"] == f"http://127.0.0.1:{api_port}" and m["topology"] == expected, m.group(0)
        # While it waited it said what was ready (the last line: every worker, nothing starting).
        progress = re.findall(r"^\s+[\d.]+s  (api ready; workers .*|waiting for the API)$", output(), re.M)
        assert progress and progress[-1] == "api ready; workers " + ", ".join(f"{w} 1/1" for w in workers), progress
        assert (m["model"], m["engine"]) == (MODEL_NAME if topology is None else "qwen2-vl-tiny", "transformers")
        reference = demo_engine if topology is None else reference_engine

        # Real processes: the topology's services (and nothing else of ours), NATS, S3 and the fork
        # server the services were forked from (shared.tools.forkserver).
        children = descendants(proc.pid)
        modules = sorted(
            re.search(r"-m services\.(\w+)", p.cmdline)[1] for p in children if "-m services." in p.cmdline
        )
        assert modules == sorted(SERVICES[expected]), [p.cmdline for p in children]
        assert any("nats-server" in p.cmdline for p in children) and any(" mini " in p.cmdline for p in children)
        assert sum("-m shared.tools.forkserver" in p.cmdline for p in children) == 1, [p.cmdline for p in children]
        assert len(children) == len(modules) + 3, [p.cmdline for p in children]
        bound = {
            re.search(r"-m services\.(\w+)", p.cmdline)[1]: os.sched_getaffinity(p.pid)
            for p in children
            if "-m services." in p.cmdline
        }
        nice = {
            re.search(r"-m services\.(\w+)", p.cmdline)[1]: os.getpriority(os.PRIO_PROCESS, p.pid)
            for p in children
            if "-m services." in p.cmdline
        }
        if topology is None:  # --cores auto: each worker on its share of the CPUs, the API anywhere
            split = split_cpus(available_cpus(), workers)
            assert {w: bound[w] for w in workers} == {w: set(parse_cpu_list(c)) for w, c in split.items()}, bound
            assert "starting services one worker service at a time..." in output()
            # EPD_CPU_NICE for the encoder only: it lowered its own priority, nothing else's
            assert nice == {s: 3 if s == "encoder" else 0 for s in nice}, nice
            retired = {
                w: "EPD_BATCH_SIZE is no longer read" in (data_dir / "logs" / f"{w}-0.log").read_text() for w in workers
            }
            assert retired == {w: w == "encoder" for w in workers}, retired
        else:  # control: without --cores every process may run anywhere, at the priority it started with
            assert all(cores == set(available_cpus()) for cores in bound.values()), bound
            assert set(nice.values()) == {0}, nice
        # EPD_EC_TTL_S's S3 lifecycle backstop is on the bucket (set by the admin: the API's role key
        # may not set a bucket's rules), and the API did not try and warn; without a TTL, no rule.
        admin = StoreSettings()
        admin_store = S3ObjectStore(
            f"http://127.0.0.1:{s3_port}",
            admin.s3_access_key.get_secret_value(),
            admin.s3_secret_key.get_secret_value(),
            admin.s3_bucket,
            region=SEAWEED_REGION,
        )
        days = get_expiration_days(admin_store, f"{admin.namespace}/")
        assert days == (None if topology is None else expiration_days(86400)), days
        api_log = (data_dir / "logs" / "api-0.log").read_text()
        assert "refused a lifecycle rule" not in api_log, api_log[-2000:]
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
        if topology is None:  # the demo model answers the printed question, and says so
            assert EXAMPLE.correct(resp.json()["choices"][0]["message"]["content"]), resp.json()
            assert f"(the answer is {EXAMPLE.answer!r}" in output()
        # ... and greedily, with the aggregated reference's tokens (same messages, same image).
        resp = httpx.post(f"{m['url']}/v1/chat/completions", json={**body, **GREEDY}, timeout=300)
        assert resp.status_code == 200, resp.text
        got, rid = resp.json()["choices"][0]["token_ids"], resp.json()["id"]
        messages, images = engine_form(body["messages"])
        assert len(images) == 1
        assert got == generate(reference, messages, images)
        # Negative control: another image gives other tokens, so the equality above can fail (for
        # the demo model: the same scene with a circle, so the answer is another word).
        other = noise_image(7, images[0].size)
        if topology is None:
            item = dataclasses.replace(EXAMPLE.scenes[0].items[0], shape="circle")
            other = dataclasses.replace(EXAMPLE.scenes[0], items=(item,)).render()
        assert generate(reference, messages, [other]) != got

        # What the topology means on the wire: agg encodes in the worker (then keeps the features in
        # its cache) and queues no encode job; e-pd queues one for the image's first request.
        defaults = ToolSettings.env_fields()
        running = RunningStack(
            Stack(env={}, log_dir=tmp_path, topology=expected, api_port=api_port),
            admin_url(data_dir, nats_port),  # (epd up's NATS knows only its role identities)
            defaults["subject_prefix"].field.default,
            defaults["namespace"].field.default,
            defaults["s3_bucket"].field.default,
            {},
        )
        item = content_hash_of(images[0])
        jobs = [running.messages_of("stream_encode", EncodeJob, r) for r in (first_rid, rid)]
        sources = [final_result(running, r).ec_sources[item] for r in (first_rid, rid)]
        if expected == "agg":
            assert jobs == [[], []] and sources == ["local", "local_cache"], (jobs, sources)
        else:
            assert [[j.image.item_hash for j in js] for js in jobs] == [[item], []], jobs
            assert sources[0] == "store" and sources[1] in ("store", "local_cache"), sources

        # `epd bench run` against it (a short run): every request completes, with stage timings.
        out_json = tmp_path / "bench.json"
        bench = subprocess.run(
            [
                str(EPD),
                "bench",
                "run",
                "--url",
                m["url"],
                "--requests",
                "4",
                "--concurrency",
                "2",
                "--image-sizes",
                "64x64",
                "--repeat-share",
                "0.5",
                "--output-tokens",
                "4,4",
                "--no-progress",
                "--out",
                str(out_json),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
        from shared.tools.bench.schema import load as load_bench

        (run,) = load_bench(out_json.read_bytes()).runs
        assert [(r.ok, r.output_tokens) for r in run.requests] == [(True, 4)] * 4, run.requests
        assert all("prefill" in r.stages for r in run.requests) and run.summary.ec_counts, run.summary

        # One store identity per role (shared.store_auth): the keys kept 0600, no secret in a log or
        # the banner (the requests above: each service did its part with its own role's key).
        role_keys = load_or_create_keys(data_dir / "s3" / "roles")
        assert {stat.S_IMODE(f.stat().st_mode) for f in (data_dir / "s3" / "roles").iterdir()} == {0o600}
        secrets = [secret for _, secret in role_keys.values()]
        texts = [output()] + [f.read_text(errors="replace") for f in (data_dir / "logs").glob("*.log")]
        assert len(texts) > len(workers) and not [s for s in secrets if any(s in t for t in texts)]
        # Every service did its part as its NATS role: nothing refused (with EPD_EC_TTL_S, the API's
        # janitor has run its first pass by now, its tombstone purge included).
        refused = [line for t in texts for line in t.splitlines() if "permissions violation" in line]
        assert not refused, refused

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


# -- supervision: a dead service is restarted, only NATS / S3 death or Ctrl-C stops the stack -----


def test_restart_policy_backs_off_exponentially_caps_and_resets():
    from shared.tools.launcher import RestartPolicy

    policy = RestartPolicy()  # 1 s doubling to 30 s; reset after 60 s up
    streak, delays = 0, []
    for _ in range(8):  # a worker that dies 5 s after each start (a bad model path, say)
        streak = policy.streak_after_exit(streak, uptime_s=5.0)
        delays.append(policy.delay(streak))
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    # It stayed up long enough: the next exit starts over at the initial delay.
    assert policy.delay(policy.streak_after_exit(streak, uptime_s=60.0)) == 1
    assert policy.delay(policy.streak_after_exit(streak, uptime_s=59.0)) == 30
    assert RestartPolicy(initial_s=0.5, max_s=3, factor=3).delay(3) == 3


def _script_process(tmp_path: Path, name: str, code: str):
    """A ServiceProcess running ``python -c code`` (what a Stack starts, minus the services)."""
    from shared.tools.launcher import ServiceProcess

    proc = ServiceProcess(
        name, None, tmp_path / f"{name}-0.log", argv=[sys.executable, "-c", code], env=dict(os.environ), cwd=tmp_path
    )  # type: ignore[arg-type]  # the wrong type on purpose
    proc.respawn()  # (the first start, the way a restart does it)
    proc.restarts = 0
    return proc


def test_supervisor_restarts_an_exited_process_with_backoff_unless_stopped(tmp_path):
    """Real child processes, a fake clock: exits are restarted after 1, 2, 4 s (no hot loop);
    a stopped process, or one of a stopping stack, is not."""
    from shared.tools.launcher import Stack, Supervisor

    stack = Stack(env={}, log_dir=tmp_path)
    crasher = _script_process(tmp_path, "encoder", "import sys; print('no model here', flush=True); sys.exit(3)")
    sleeper = _script_process(tmp_path, "decode", "import time; time.sleep(600)")
    stack.processes += [crasher, sleeper]
    supervisor = Supervisor(stack)
    crasher.popen.wait(60)
    t = crasher.started_at + 5  # it "ran" 5 s: no reset of the streak
    delays = []
    try:
        for restart in (1, 2, 3):
            events = supervisor.check(now=t)
            assert [e.kind for e in events] == ["exited"], events
            assert events[0].process == "encoder-0" and "exit code 3" in events[0].message
            assert "no model here" in events[0].log_tail
            delays.append(crasher.restart_at - t)
            # Not before the backoff has passed ...
            assert supervisor.check(now=t + delays[-1] - 0.01) == []
            old_pid = crasher.popen.pid
            events = supervisor.check(now=t + delays[-1])
            assert [e.kind for e in events] == ["restarted"] and crasher.restarts == restart, events
            assert crasher.popen.pid != old_pid and crasher in stack.processes
            crasher.popen.wait(60)
            t += delays[-1] + 5
        assert delays == [1, 2, 4]
        assert stack.processes == [crasher, sleeper] and sleeper.restarts == 0
        # The log is appended to, with a line per restart.
        assert crasher.log_tail(100).count(
            "no model here"
        ) == 4 and "epd: restarting encoder-0 (restart 3)" in crasher.log_tail(100)
        # Stopped on purpose: left alone.
        sleeper.stop()
        crasher.popen.wait(60)
        crasher.stop()
        assert supervisor.check(now=t + 100) == [] and not sleeper.alive() and not crasher.alive()
        # Killed from outside: restarted; a stopping stack restarts nothing.
        sleeper.stopped = False
        sleeper.respawn()
        os.kill(sleeper.popen.pid, signal.SIGKILL)
        sleeper.popen.wait(60)
        [event] = supervisor.check(now=t + 200)
        assert "killed by signal SIGKILL" in event.message and "restarting in 1.0s" in event.message, event
        stack.stop()
        assert supervisor.check(now=t + 300) == [] and not sleeper.alive()
    finally:
        for proc in (crasher, sleeper):
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait(30)


def _blocked_signals(pid: int) -> int:
    """The signal mask of a running process (``SigBlk`` in /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M)[1], 16)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigkill"])
def test_restarted_workers_stop_with_epd_up(stop, tiny_model_dir, tmp_path):
    """A worker that `epd up` restarted holds no signal back: Ctrl-C drains it like the others
    (its own "stopped" line, no SIGKILL after the 20 s grace), and `kill -9` of `epd up` leaves no
    worker and no embedded server behind (each gets its parent-death signal). Before the fix the
    restarted worker inherited the supervisor's SIGINT/SIGTERM mask (SigBlk 0x4002), was killed
    after 20 s on Ctrl-C, and outlived a killed `epd up` as an orphan."""
    import time

    up = EpdUp(tmp_path, "--model", str(tiny_model_dir))
    try:
        up.wait_ready()
        encoder = up.service_pid("encoder")
        assert _blocked_signals(encoder) == 0
        mark = len(up.output())
        os.kill(encoder, signal.SIGKILL)
        restarted = up.wait_line(RESTARTED.format(label="encoder-0"), "the encoder's restart line", after=mark)
        up.wait_line(HEALTHY.format(label="encoder-0"), "the restarted encoder to beat", after=mark)
        new_encoder = int(restarted["pid"])
        assert up.service_pid("encoder") == new_encoder
        assert _blocked_signals(new_encoder) == 0, f"SigBlk {_blocked_signals(new_encoder):#x}"
        procs = up.children()
        assert any("weed" in p.cmdline for p in procs) and any("nats-server" in p.cmdline for p in procs), procs
        encoder_log = up.data_dir / "logs" / "encoder-0.log"
        restart_at = encoder_log.read_text().rindex("epd: restarting encoder-0")
        t0 = time.monotonic()
        if stop == "ctrl-c":
            up.proc.send_signal(signal.SIGINT)
            assert up.proc.wait(timeout=120) == 0, up.output()[-3000:]
            took = time.monotonic() - t0
            # The restarted encoder drained and said so (a SIGKILL after the grace leaves no such line).
            assert re.search(
                rf"INFO {new_encoder} .*encoder worker \S+ stopped$", encoder_log.read_text()[restart_at:], re.M
            ), encoder_log.read_text()[restart_at:][-2000:]
        else:
            up.proc.kill()
            up.proc.wait(30)
            wait_for(
                lambda: not [p for p in procs if p.alive()], 30, "every worker and embedded server to die with epd up"
            )
            took = time.monotonic() - t0
        log.info("%s: every process gone %.1fs after the signal", stop, took)
        left = [p.cmdline for p in procs if p.alive()]
        assert left == [], f"still running: {left}"
    finally:
        up.close()


def _image_request(image: Image.Image, text: str, **params) -> dict:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {
        "model": "qwen2-vl-tiny",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ],
        **params,
    }


def _stream_tokens(url: str, body: dict, on_first_tokens=None) -> tuple[list[int], str, str]:
    """The token ids of a streamed completion, its finish reason and request id;
    ``on_first_tokens()`` runs once, when the first tokens have arrived."""
    tokens, finish, rid = [], None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=600) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            rid = chunk["id"]
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids", [])
            finish = choice["finish_reason"] or finish
            if tokens and on_first_tokens is not None:
                on_first_tokens()
                on_first_tokens = None
    return tokens, finish, rid


def _worker_health_file_is_this_pid(data_dir: Path, label: str, pid: int) -> bool:
    from shared.health import check_worker

    path = data_dir / "logs" / f"{label}.health"
    try:
        beat = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return beat["pid"] == pid and check_worker(path, role=label.rsplit("-", 1)[0])[0]


def test_epd_up_restarts_killed_workers_and_requests_in_flight_complete(tiny_model_dir, reference_engine, tmp_path):
    """SIGKILL of the encoder holding a request's encode job, and of the prefill worker while it
    streams a request's tokens: `epd up` says what exited, restarts it after a backoff, the
    restarted worker beats again, and the requests in flight complete with a clean run's tokens
    (jobs redelivered; the token stream drops the repeated tokens). A worker that cannot start
    (its model folder gone) is retried with growing delays, its log tail printed, not in a hot
    loop. Only NATS dying stops the stack: non-zero exit, no process left."""
    import shutil

    model = tmp_path / "models" / tiny_model_dir.name  # (the folder's name is the served model's)
    shutil.copytree(tiny_model_dir, model)
    # the paused encoder must keep the request's encode job: the prefill worker steals none, and does
    # not encode the image itself while the paused encoder is silent
    up = EpdUp(tmp_path, "--model", str(model), env={"EPD_ENCODE_STEALS": "0", "EPD_NO_ENCODER_AFTER_S": "300"})
    try:
        up.wait_ready()
        defaults = ToolSettings.env_fields()
        running = RunningStack(
            Stack(env={}, log_dir=tmp_path, topology="e-pd", api_port=up.api_port),
            admin_url(up.data_dir, up.nats_port),
            defaults["subject_prefix"].field.default,
            defaults["namespace"].field.default,
            defaults["s3_bucket"].field.default,
            {},
        )
        api_log = up.data_dir / "logs" / "api-0.log"
        # Started, every service froze its start-up heap (shared.heap): out of the collector's scans.
        for service in ("api", "encoder", "prefill"):
            log_text = (up.data_dir / "logs" / f"{service}-0.log").read_text()
            frozen = re.search(r"start-up heap frozen: (\d+) objects", log_text)
            assert frozen and int(frozen[1]) > 50_000, (service, log_text[-2000:])

        # 1. The encoder dies holding the encode job of a request in flight. Stopped first, it
        # cannot finish the job before the kill whatever the machine's load.
        encoder = up.service_pid("encoder")
        os.kill(encoder, signal.SIGSTOP)
        image = noise_image(81, (64, 48))
        body = _image_request(image, "Describe this image.", **GREEDY)
        queued = api_log.read_text().count("queued")
        with httpx.Client(timeout=600) as client, ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.post, f"{up.url}/v1/chat/completions", json=body)
            wait_for(
                lambda: future.done() or api_log.read_text().count("queued") > queued,
                120,
                "the encode job to be queued",
            )
            assert not future.done(), future.result().text
            mark = len(up.output())
            os.kill(encoder, signal.SIGKILL)
            exited = up.wait_line(EXITED.format(label="encoder-0"), "the encoder's exit line", after=mark)
            assert int(exited["pid"]) == encoder and exited["how"] == "killed by signal SIGKILL", exited.group(0)
            restarted = up.wait_line(RESTARTED.format(label="encoder-0"), "the encoder's restart line", after=mark)
            resp = future.result(timeout=600)
        assert resp.status_code == 200, resp.text
        messages, images = engine_form(body["messages"])
        assert resp.json()["choices"][0]["token_ids"] == generate(reference_engine, messages, images)
        new_encoder = int(restarted["pid"])
        assert new_encoder != encoder and up.service_pid("encoder") == new_encoder
        healthy = up.wait_line(HEALTHY.format(label="encoder-0"), "the restarted encoder to beat", after=mark)
        log.info("encoder: %s / %s / %s", exited.group(0), restarted.group(0), healthy.group(0))
        assert _worker_health_file_is_this_pid(up.data_dir, "encoder-0", new_encoder)
        # The job was not lost with the killed encoder: its restarted self took it (redelivered,
        # when the killed one had it in hand) and encoded the image - or, when the prefill worker
        # gave up waiting and encoded it first, found it stored and announced it.
        item = content_hash_of(images[0])[:12]
        took = rf"^\S+ \S+ INFO {new_encoder} .* (encoded {item}: .*|item {item} already stored by .*)$"
        m = wait_for(
            lambda: re.search(took, (up.data_dir / "logs" / "encoder-0.log").read_text(), re.M),
            120,
            "the restarted encoder to take the killed one's job",
        )
        log.info("the restarted encoder took the job: %s", m[1])
        assert httpx.get(f"{up.url}/health", timeout=30).json()["workers"].get("encoder", 0) >= 1
        # Every other service still runs the process it started with.
        assert not re.search(r"^(api|prefill)-0 \(pid \d+\) exited", up.output(), re.M), up.output()[-3000:]

        # 2. The prefill worker dies mid-stream: the job is redelivered to its restarted self,
        # which repeats the tokens from the start; the client sees each token once.
        long = _image_request(noise_image(82, (56, 56)), "Tell a long story.", **{**GREEDY, "max_tokens": 1000})
        clean, finish, _ = _stream_tokens(up.url, long)
        assert (len(clean), finish) == (1000, "length")
        prefill = up.service_pid("prefill")
        mark = len(up.output())
        killed = []

        def kill_prefill():
            os.kill(prefill, signal.SIGKILL)
            killed.append(prefill)

        got, finish, rid = _stream_tokens(up.url, long, on_first_tokens=kill_prefill)
        assert killed, "the prefill worker was not killed"
        assert (got, finish) == (clean, "length")
        exited = up.wait_line(EXITED.format(label="prefill-0"), "the prefill worker's exit line", after=mark)
        assert int(exited["pid"]) == prefill and exited["how"] == "killed by signal SIGKILL", exited.group(0)
        restarted = up.wait_line(RESTARTED.format(label="prefill-0"), "the prefill worker's restart", after=mark)
        healthy = up.wait_line(HEALTHY.format(label="prefill-0"), "the restarted prefill worker to beat", after=mark)
        log.info("prefill: %s / %s / %s", exited.group(0), restarted.group(0), healthy.group(0))
        assert _worker_health_file_is_this_pid(up.data_dir, "prefill-0", int(restarted["pid"]))
        # Its one result came from a redelivery: the killed worker did not finish it.
        finals = wait_for(lambda: running.messages_of("stream_results", FinalResult, rid), 60, "the final result")
        assert [f.attempt >= 2 for f in finals] == [True], finals

        # 3. The API is supervised too: killed, it comes back on its port and serves.
        api = up.service_pid("api")
        mark = len(up.output())
        os.kill(api, signal.SIGKILL)
        up.wait_line(EXITED.format(label="api-0"), "the API's exit line", after=mark)
        healthy = up.wait_line(HEALTHY.format(label="api-0"), "the restarted API to answer", after=mark)
        log.info("api: %s", healthy.group(0))
        resp = httpx.post(f"{up.url}/v1/chat/completions", json=body, timeout=300)
        assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == generate(
            reference_engine, messages, images
        ), resp.text

        # 4. A worker that cannot start is retried with growing delays, not in a hot loop.
        hidden = tmp_path / "model-away"
        model.rename(hidden)
        encoder = up.service_pid("encoder")
        mark = len(up.output())
        os.kill(encoder, signal.SIGKILL)
        crash = EXITED.format(label="encoder-0").replace("(?P<how>[^)]*)", "(?P<how>exit code [1-9]\\d*)")
        delays = []
        for _ in range(2):
            m = up.wait_line(crash, "the encoder to fail at start-up", after=mark)
            delays.append(float(m["delay"]))
            tail = up.output()[mark + m.end() :].split("\n", 1)[1].splitlines()[:5]
            assert tail and all(line.startswith("    | ") for line in tail), tail
            mark += m.end()
        assert delays[1] == min(30.0, 2 * delays[0]), delays
        model = hidden.rename(model)
        healthy = up.wait_line(HEALTHY.format(label="encoder-0"), "the encoder to start again", after=mark)
        resp = httpx.post(
            f"{up.url}/v1/chat/completions",
            json=_image_request(noise_image(83, (48, 48)), "Hi.", **GREEDY),
            timeout=300,
        )
        assert resp.status_code == 200, resp.text

        # 5. NATS dies: the stack stops, saying why, and leaves nothing running.
        children = up.children()
        [nats] = [p.pid for p in children if "nats-server" in p.cmdline]
        os.kill(nats, signal.SIGKILL)
        try:
            assert up.proc.wait(timeout=180) != 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"epd up still running 180 s after NATS died:\n{up.output()[-3000:]}")
        assert re.search(
            rf"^epd up failed: nats-server \(pid {nats}\) exited; stopping the stack", up.output(), re.M
        ), up.output()[-3000:]
        left = [p for p in up.seen if p.alive()]
        assert left == [], f"still running after epd up exited: {[p.cmdline for p in left]}"
    finally:
        up.close()
