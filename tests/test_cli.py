"""The epd CLI's frictions (issue 23 item 7): what ``epd up`` prints to point other commands at
it, help for every option, ``make run ARGS=...``, ``epd replay show``'s order. Fast: nothing is
started (``epd up`` runs against fake servers)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.tools import cli
from shared.tools.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
EPD = Path(sys.executable).parent / "epd"  # the console script


# -- epd up's ready banner ------------------------------------------------------------------------
class FakeServer:
    def __init__(self, name: str, data_dir: Path, port: int, **_: object):
        self.name, self.port, self.pid = name, port, 1
        self.url = f"{'nats' if name == 'nats' else 'http'}://127.0.0.1:{port}"
        self.endpoint = f"127.0.0.1:{port}"

    def start(self) -> None: ...

    def begin_stop(self) -> None: ...

    def stop(self, grace: float | None = None) -> None: ...

    def is_running(self) -> bool:
        return True


class FakeStack:
    def __init__(self, **kwargs: object):
        self.env = kwargs["env"]
        self.metrics_ports: dict[str, int] = {}
        self.base_url, self.api_ca = "http://127.0.0.1:8000", None

    def start(self, **_: object) -> None: ...

    def wait_ready(self, **_: object) -> None: ...

    def stop(self) -> None: ...


class StopAtOnce:
    """The supervisor loop's first check: Ctrl-C."""

    def __init__(self, stack: FakeStack):
        pass

    def check(self):
        raise KeyboardInterrupt


def epd_up_output(monkeypatch, capsys, tmp_path: Path, env: dict[str, str]) -> str:
    from shared.tools import launcher

    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "EmbeddedNats", lambda data_dir, port, **kw: FakeServer("nats", data_dir, port))
    monkeypatch.setattr(cli, "EmbeddedS3", lambda data_dir, port, **kw: FakeServer("s3", data_dir, port))
    monkeypatch.setattr(launcher, "Stack", FakeStack)
    monkeypatch.setattr(launcher, "Supervisor", StopAtOnce)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text('{"model_type": "qwen2_vl"}')  # a model folder epd up serves
    # --no-fork-server: nothing is started, so no fork server to preload torch (and to wait for at the stop)
    argv = ["up", "--data-dir", str(tmp_path / "var"), "--model", str(tmp_path / "m"), "--nats-port", "14222"]
    argv += ["--no-fork-server"]
    assert main([*argv, "--s3-port", "19000"]) == 0
    return capsys.readouterr().out


def test_epd_up_prints_the_exports_that_point_epd_ec_and_replay_at_it(monkeypatch, capsys, tmp_path):
    """The embedded dev keys (nothing set): one line to paste, keys included."""
    out = epd_up_output(monkeypatch, capsys, tmp_path, {})
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("export "))
    assert line == (
        "export EPD_NATS_URL=nats://127.0.0.1:14222 EPD_S3_ENDPOINT=127.0.0.1:19000 "
        "EPD_S3_ACCESS_KEY=minioadmin EPD_S3_SECRET_KEY=minioadmin"
    )
    assert out.index("epd-serve ready") < out.index(line) < out.index("Try it:")


def test_epd_up_never_prints_keys_it_was_given(monkeypatch, capsys, tmp_path):
    """Keys from the environment (a real deployment's, maybe): the export line names where they
    come from and leaves their values out of the output."""
    keys = {"EPD_S3_ACCESS_KEY": "AKIA-not-to-be-printed", "EPD_S3_SECRET_KEY": "s3cr3t-not-to-be-printed"}
    out = epd_up_output(monkeypatch, capsys, tmp_path, keys)
    assert "not-to-be-printed" not in out
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("export "))
    assert line == "export EPD_NATS_URL=nats://127.0.0.1:14222 EPD_S3_ENDPOINT=127.0.0.1:19000"
    assert "EPD_S3_ACCESS_KEY / EPD_S3_SECRET_KEY as in the environment epd up was started with" in out
    # Only the secret changed: neither key is printed (the pair is what a shell needs).
    out = epd_up_output(monkeypatch, capsys, tmp_path, {"EPD_S3_SECRET_KEY": "s3cr3t-not-to-be-printed"})
    assert "not-to-be-printed" not in out and "EPD_S3_SECRET_KEY=" not in out


def test_epd_up_closes_no_fork_server_it_did_not_start(monkeypatch, capsys, tmp_path):
    """An in-process epd up stops what it started and nothing else: the process's fork server that
    another caller started (the test session's stacks fork their services from it) stays up -
    closing it ends every process forked from it (their parent-death signal: one CI run lost its
    session stacks that way, 25 tests)."""
    from shared.tools import forkserver

    class Running:
        closed = False

        def close(self) -> None:
            self.closed = True

    other = Running()
    monkeypatch.setattr(forkserver, "_default", other)
    epd_up_output(monkeypatch, capsys, tmp_path, {})  # --no-fork-server
    assert not other.closed


# -- help texts -----------------------------------------------------------------------------------
def options_without_help(parser: argparse.ArgumentParser, path: str = "epd") -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += options_without_help(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_epd_command_has_help():
    assert options_without_help(build_parser()) == []
    up = build_parser()._subparsers._group_actions[0].choices["up"].format_help()  # type: ignore[union-attr]  # argparse keeps its subparsers private and untyped
    for option in ("--engine", "--host", "--port", "--nats-port", "--s3-port"):
        assert option in up


# -- make run ARGS=... ----------------------------------------------------------------------------
def make_run_dry(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert dry.returncode == 0, dry.stderr
    return dry.stdout.splitlines()[-1]


def test_make_run_passes_args_to_epd_up():
    assert make_run_dry("ARGS=--port 8001 --nats-port 14222") == ".venv/bin/epd up --port 8001 --nats-port 14222"
    assert make_run_dry() == ".venv/bin/epd up"  # alone: exactly as before
    assert make_run_dry("ARGS=") == ".venv/bin/epd up"


# -- epd replay show ------------------------------------------------------------------------------
@pytest.fixture
def fake_history(monkeypatch):
    """``epd replay show`` over a fake NATS and history: each part prints one marker line."""
    from shared import history, timeline
    from shared.tools import replay_cli

    class NC:
        async def close(self) -> None: ...

    async def connect(settings):
        return NC()

    async def find_case(nc, subjects, request_id):
        return SimpleNamespace(source="live")

    monkeypatch.setattr(replay_cli, "_connect", connect)
    monkeypatch.setattr(history, "find_case", find_case)
    monkeypatch.setattr(timeline, "build_timeline", lambda case: SimpleNamespace(summary="s", notes=[]))
    monkeypatch.setattr(timeline, "render_summary", lambda summary: "SUMMARY")
    monkeypatch.setattr(timeline, "render_text", lambda tl: "TIMELINE")
    monkeypatch.setattr(timeline, "render_messages", lambda case: "MESSAGES")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), ["SUMMARY  (live)", "TIMELINE"]),
        (("--messages",), ["SUMMARY  (live)", "TIMELINE", "MESSAGES"]),
        (("--no-messages",), ["SUMMARY  (live)", "TIMELINE"]),
    ],
)
def test_replay_show_prints_summary_and_timeline_first_messages_on_request(fake_history, capsys, flags, expected):
    assert main(["replay", "show", "chatcmpl-x", *flags]) == 0
    assert [ln for ln in capsys.readouterr().out.splitlines() if ln] == expected


# -- the first hour (issue 41 items 5, 6) ---------------------------------------------------------
def test_epd_up_with_api_keys_prints_a_curl_that_sends_one_and_never_the_key(monkeypatch, capsys, tmp_path):
    """Keys on (EPD_API_KEYS or --api-key): the printed curl carries an Authorization header that
    reads $OPENAI_API_KEY, the output says so, and no key is printed; without keys: no header."""
    out = epd_up_output(monkeypatch, capsys, tmp_path, {"EPD_API_KEYS": "sk-not-to-be-printed,sk-other"})
    assert "sk-not-to-be-printed" not in out and "sk-other" not in out
    [curl] = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("curl ")]
    assert curl.startswith(
        'curl -s http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer $OPENAI_API_KEY" '
        "-H 'Content-Type: application/json' -d '"
    ), curl
    assert "export OPENAI_API_KEY=<one of the keys>" in out
    # greedy: the answer it promises is the one a paste gets
    assert json.loads(curl.split(" -d '", 1)[1].removesuffix("'"))["temperature"] == 0
    out = epd_up_output(monkeypatch, capsys, tmp_path, {})
    [curl] = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("curl ")]
    assert "Authorization" not in curl and "OPENAI_API_KEY" not in out


class RecordingStack(FakeStack):
    """A FakeStack that keeps the environment ``epd up`` gave its services."""

    envs: list[dict[str, str]] = []

    def __init__(self, **kwargs: object):
        super().__init__(**kwargs)
        RecordingStack.envs.append(dict(self.env))


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ((), {}, {}),
        (("--api-key", "sk-a", "--api-key", "sk-b"), {}, {"EPD_API_KEYS": "sk-a,sk-b"}),
        (("--api-key", "sk-flag"), {"EPD_API_KEYS": "sk-env"}, {"EPD_API_KEYS": "sk-flag"}),
        (("--allow-local-urls",), {}, {"EPD_URL_ALLOW_NETWORKS": "127.0.0.0/8,::1/128"}),
        (
            ("--allow-local-urls",),
            {"EPD_URL_ALLOW_NETWORKS": "10.1.0.0/16"},
            {"EPD_URL_ALLOW_NETWORKS": "10.1.0.0/16,127.0.0.0/8,::1/128"},
        ),
    ],
)
def test_epd_up_flags_set_the_api_settings(monkeypatch, capsys, tmp_path, flags, env, expected):
    from shared.tools import launcher

    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    RecordingStack.envs = []
    monkeypatch.setattr(cli, "EmbeddedNats", lambda data_dir, port, **kw: FakeServer("nats", data_dir, port))
    monkeypatch.setattr(cli, "EmbeddedS3", lambda data_dir, port, **kw: FakeServer("s3", data_dir, port))
    monkeypatch.setattr(launcher, "Stack", RecordingStack)
    monkeypatch.setattr(launcher, "Supervisor", StopAtOnce)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    argv = ["up", "--data-dir", str(tmp_path / "var"), "--nats-port", "14222", "--s3-port", "19000", *flags]
    argv += ["--no-fork-server"]  # nothing is started
    assert main(argv) == 0
    [stack_env] = RecordingStack.envs
    assert {k: stack_env[k] for k in ("EPD_API_KEYS", "EPD_URL_ALLOW_NETWORKS") if k in stack_env} == expected
    out = capsys.readouterr().out
    assert "sk-" not in out  # keys reach the services, never the output
    assert ("--allow-local-urls: image URLs on this host are fetched" in out) == ("--allow-local-urls" in flags)


@pytest.mark.parametrize(
    ("make", "argv", "env", "named"),
    [
        (None, ["--model", "{tmp}/nonexistent"], {}, "--model {tmp}/nonexistent: no such folder"),
        ("file", ["--model", "{tmp}/m"], {}, "--model {tmp}/m: not a folder"),
        ("dir", ["--model", "{tmp}/m"], {}, "--model {tmp}/m: no config.json in it"),
        (None, [], {"EPD_MODEL_PATH": "{tmp}/nonexistent"}, "EPD_MODEL_PATH {tmp}/nonexistent: no such folder"),
    ],
)
def test_epd_up_refuses_a_model_that_is_no_model_folder_before_starting_anything(
    monkeypatch, capsys, tmp_path, make, argv, env, named
):
    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    if make == "file":
        (tmp_path / "m").write_text("")
    elif make == "dir":
        (tmp_path / "m").mkdir()

    def nothing_starts(*a, **kw):
        raise AssertionError("epd up started something")

    monkeypatch.setattr(cli, "EmbeddedNats", nothing_starts)
    data_dir = tmp_path / "var"
    assert main(["up", "--data-dir", str(data_dir), *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"epd up: {named.format(tmp=tmp_path)}" + (
        " (a model folder in Hugging Face layout, with config.json)"
        if "no such" in named or "not a folder" in named
        else ": not a model folder in Hugging Face layout"
    )
    assert not data_dir.exists()


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_epd_up_refuses_a_family_its_engine_does_not_serve_before_starting_anything(
    monkeypatch, capsys, tmp_path, engine
):
    """A model folder of a family not in the support table (shared.families) is refused by
    epd up itself, naming the supported ones - not by each worker's engine after the stack started."""
    from shared.families import SUPPORTED_FAMILIES

    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))

    def nothing_starts(*a, **kw):
        raise AssertionError("epd up started something")

    monkeypatch.setattr(cli, "EmbeddedNats", nothing_starts)
    data_dir = tmp_path / "var"
    argv = ["up", "--data-dir", str(data_dir), "--model", str(tmp_path / "m"), "--engine", engine]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"epd up: --model {tmp_path / 'm'}: unsupported model_type 'llava_onevision' for the {engine} engine"
    )
    assert str(list(SUPPORTED_FAMILIES[engine])) in err
    assert not data_dir.exists()


def test_epd_up_refuses_an_invalid_setting_before_starting_anything(monkeypatch, capsys, tmp_path):
    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("EPD_MAX_IMAGES_PER_REQUEST", "-1")

    def nothing_starts(*a, **kw):
        raise AssertionError("epd up started something")

    monkeypatch.setattr(cli, "EmbeddedNats", nothing_starts)
    assert main(["up", "--data-dir", str(tmp_path / "var")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd up: invalid settings in the environment: ") and "max_images_per_request" in err, err
    assert "Traceback" not in err and not (tmp_path / "var").exists()


def test_epd_version_and_help_without_a_command(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"epd-serve {importlib.metadata.version('epd-serve')}\n"
    # The console script, bare: its help, not argparse's "the following arguments are required".
    bare = subprocess.run([str(EPD)], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and bare.stdout.startswith("usage: epd ") and "positional arguments" in bare.stdout
    assert "required" not in bare.stdout + bare.stderr
    for group in ("replay", "ec", "bench", "config", "model"):
        assert main([group]) == 2, group
        out = capsys.readouterr()
        assert out.out.startswith(f"usage: epd {group} ") and "positional arguments" in out.out, (group, out)
        assert "required" not in out.out + out.err, group


def test_a_tool_that_cannot_reach_nats_says_where_its_url_comes_from(capsys):
    """Real: a port nothing listens on. The one line names the flag, the variable and epd up's
    export line."""
    from shared.tools.infra import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    for argv in (["replay", "list"], ["ec", "ls"], ["plan", "--from-streams", "1h", "--rate", "1"]):
        assert main([*argv, "--nats-url", url]) == 2
        err = capsys.readouterr().err
        assert f"cannot connect to NATS at {url}" in err, err
        assert "--nats-url or EPD_NATS_URL" in err and "export EPD_NATS_URL=" in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_config_show_prints_the_effective_settings_with_secrets_masked(monkeypatch, capsys):
    import json

    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    secrets = {
        "EPD_API_KEYS": "sk-hidden-1,sk-hidden-2",
        "EPD_S3_SECRET_KEY": "hidden-s3",
        "EPD_NATS_PASSWORD": "hidden-nats",
        "EPD_NATS_URL": "nats://user:hidden-url@nats.example:4222",
    }
    for name, value in {**secrets, "EPD_MAX_IMAGES_PER_REQUEST": "3"}.items():
        monkeypatch.setenv(name, value)
    assert main(["config", "show"]) == 0
    text = capsys.readouterr().out
    assert "hidden" not in text
    rows = {ln.split()[0]: ln.split()[1:] for ln in text.splitlines() if ln.startswith("EPD_")}
    assert rows["EPD_MAX_IMAGES_PER_REQUEST"] == ["3", "env", "api"]
    assert rows["EPD_API_KEYS"][:2] == ["****", "env"]
    assert rows["EPD_S3_SECRET_KEY"][:2] == ["****", "env"]
    assert rows["EPD_NATS_URL"][:2] == ["nats://***@nats.example:4222", "env"]
    assert rows["EPD_PORT"][:2] == ["8000", "default"]
    assert main(["config", "show", "--json", "--service", "api", "--env-only"]) == 0
    shown = {r["name"]: r["value"] for r in json.loads(capsys.readouterr().out)["settings"]}
    assert set(shown) == set(secrets) | {"EPD_MAX_IMAGES_PER_REQUEST"}
    assert "hidden" not in json.dumps(shown)
    monkeypatch.setenv("EPD_MAX_IMAGES_PER_REQUEST", "-1")
    assert main(["config", "show"]) == 2
    assert "max_images_per_request" in capsys.readouterr().err


def test_bench_progress_is_plain_lines_when_stderr_is_not_a_terminal(capsys):
    from shared.tools.bench.runner import PlainProgress, progress_bar

    bar = progress_bar(20, "concurrency 1", enabled=True)  # pytest's stderr is no terminal
    assert isinstance(bar, PlainProgress)
    for _ in range(20):
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[0] == "concurrency 1: 2/20 req" and lines[-1] == "concurrency 1: 20/20 req" and len(lines) == 10
    off = progress_bar(20, "x", enabled=False)
    off.update()
    off.close()
    assert capsys.readouterr().err == ""


def test_epd_prints_no_progress_bar_when_its_output_is_not_a_terminal(tmp_path):
    """``epd model build-tiny`` into a pipe: Hugging Face's "Writing model shards" bar (carriage
    returns) is off; the line that says what was written is there."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run(
        [str(EPD), "model", "build-tiny", str(tmp_path / "m")], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stdout + done.stderr and "Writing model shards" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("wrote qwen2_vl/tiny (seed 0) to "), done.stdout


def test_the_cli_starts_from_an_installed_copy_without_the_checkout(tmp_path):
    """An image runs `epd` (its healthchecks: `epd healthcheck`) from site-packages, where there is
    no pyproject.toml: every subcommand's module must import there (a renderer reading the
    checkout's pyproject.toml at import once made every container's healthcheck fail)."""
    import importlib.metadata
    import shutil

    root = Path(__file__).resolve().parents[1]
    for package in ("shared", "services"):
        skip = shutil.ignore_patterns("__pycache__", "*.safetensors")
        shutil.copytree(root / package, tmp_path / package, ignore=skip)
    assert not (tmp_path / "pyproject.toml").exists()
    code = "import shared.tools.cli as c, shared.tools.kubernetes as k; c.build_parser(); print(k.VERSION)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == importlib.metadata.version("epd-serve")
