"""Where a vLLM engine's files go (``configure_vllm_environment``): pure path logic and real Unix
sockets, no engine started. CI once failed to start vLLM because a deep work dir put the IPC
socket's path past the 107 bytes a Unix socket address holds."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from pathlib import Path

import pytest

from shared.engines.vllm_engine import MAX_RPC_DIR_BYTES, configure_vllm_environment, vllm_rpc_dir
from shared.errors import EngineError


@pytest.fixture
def saved_env():
    """configure_vllm_environment sets process-wide variables: restore the environment after the test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _bind_like_vllm(rpc_dir: Path) -> None:
    """Bind a Unix socket where vLLM binds its engine's (``ipc://<VLLM_RPC_BASE_PATH>/<uuid4>``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        path = rpc_dir / str(uuid.uuid4())
        sock.bind(str(path))
        path.unlink()


def test_sockets_stay_under_a_short_work_dir(tmp_path, saved_env):
    work = tmp_path / "v"
    env = configure_vllm_environment(work)
    assert Path(env["VLLM_RPC_BASE_PATH"]) == work.resolve() / "rpc" == vllm_rpc_dir(work)
    _bind_like_vllm(Path(env["VLLM_RPC_BASE_PATH"]))


def test_a_deep_work_dir_gets_a_socket_folder_that_fits(tmp_path, saved_env):
    """The negative control is the socket bind: under the deep work dir itself it fails."""
    work = tmp_path / ("deep" * 20) / "vllm"
    assert len(os.fsencode(work / "rpc")) > MAX_RPC_DIR_BYTES
    (work / "rpc").mkdir(parents=True)
    with pytest.raises(OSError):
        _bind_like_vllm(work / "rpc")

    env = configure_vllm_environment(work)
    rpc = Path(env["VLLM_RPC_BASE_PATH"])
    try:
        assert rpc == vllm_rpc_dir(work) != work / "rpc"
        assert len(os.fsencode(rpc)) <= MAX_RPC_DIR_BYTES
        info = rpc.lstat()
        assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700
        assert Path(env["VLLM_CACHE_ROOT"]) == work.resolve() / "cache"  # the rest stays in the work dir
        _bind_like_vllm(rpc)
        # every process of one work dir (API, engine core, workers) agrees on the folder
        assert configure_vllm_environment(work)["VLLM_RPC_BASE_PATH"] == str(rpc)
    finally:
        shutil.rmtree(rpc, ignore_errors=True)


def test_a_socket_folder_others_can_write_is_refused(tmp_path, saved_env):
    work = tmp_path / ("deep" * 20) / "vllm"
    planted = vllm_rpc_dir(work)
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # (mkdir's mode passes through the umask)
    try:
        with pytest.raises(EngineError, match="only it can write"):
            configure_vllm_environment(work)
    finally:
        shutil.rmtree(planted, ignore_errors=True)
