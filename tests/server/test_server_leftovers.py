"""What a server leaves behind when it cannot start or is killed: a busy port is refused before the
model loads, and the socket directory of a killed server goes away (its children remove it, and the
next server removes those of dead servers)."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from labkit.server.ipc import IPC_DIR_PREFIX, remove_stale_ipc_dirs
from labkit.server.process import free_port, start_server


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_socket_directories_of_dead_servers_are_removed(tmp_path):
    dead = tmp_path / f"{IPC_DIR_PREFIX}{_dead_pid()}-abc"
    live = tmp_path / f"{IPC_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "labkit-ipc-notapid"
    for d in (dead, live, other):
        d.mkdir()
        (d / "scheduler").write_text("")
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()


def test_a_busy_port_is_refused_before_the_model_loads():
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        # A model path that does not exist: had the model been loaded first, that would be the error.
        done = subprocess.run(
            [sys.executable, "-m", "labkit.server", "--port", str(port), "--model-path", "/nonexistent"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "nonexistent" not in done.stderr


@pytest.mark.slow
def test_a_killed_server_leaves_no_socket_directory():
    server = start_server("--log-level", "warning")
    pattern = os.path.join(tempfile.gettempdir(), f"{IPC_DIR_PREFIX}{server.proc.pid}-*")
    assert len(glob.glob(pattern)) == 1
    children = server.child_pids()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    deadline = time.monotonic() + 30
    while glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert glob.glob(pattern) == []
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if _running(pid)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is reaped by init, not by us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return False
