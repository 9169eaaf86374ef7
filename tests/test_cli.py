"""The epd CLI's frictions (issue 23 item 7): what ``epd up`` prints to point other commands at
it, help for every option, ``make run ARGS=...``, ``epd replay show``'s order. Fast: nothing is
started (``epd up`` runs against fake servers)."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.tools import cli
from shared.tools.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


# -- epd up's ready banner ------------------------------------------------------------------------
class FakeServer:
    def __init__(self, name: str, data_dir: Path, port: int, **_: object):
        self.name, self.port, self.pid = name, port, 1
        self.url = f"nats://127.0.0.1:{port}"
        self.endpoint = f"127.0.0.1:{port}"

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def is_running(self) -> bool:
        return True


class FakeStack:
    def __init__(self, **kwargs: object):
        self.env = kwargs["env"]
        self.metrics_ports: dict[str, int] = {}

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
    monkeypatch.setattr(cli, "EmbeddedNats", lambda data_dir, port: FakeServer("nats", data_dir, port))
    monkeypatch.setattr(cli, "EmbeddedS3", lambda data_dir, port, **kw: FakeServer("s3", data_dir, port))
    monkeypatch.setattr(launcher, "Stack", FakeStack)
    monkeypatch.setattr(launcher, "Supervisor", StopAtOnce)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    argv = ["up", "--data-dir", str(tmp_path / "var"), "--model", str(tmp_path / "m"), "--nats-port", "14222"]
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
