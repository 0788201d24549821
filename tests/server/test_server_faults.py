"""Faults in the server's children: a killed detokenizer fails the requests in flight and takes the
server down (as a killed scheduler does, tests/server/test_server_lifecycle.py); a scheduler stopped
with SIGSTOP and resumed with SIGCONT loses nothing. No hang, no orphan, no socket directory left."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import MODEL, wait_idle

from labkit.server.ipc import IPC_DIR_PREFIX
from labkit.server.process import ServerProcess, spawn_server, start_server

pytestmark = pytest.mark.slow


def _detokenizer_pid(server: ServerProcess) -> int:
    """The child that is neither the scheduler nor multiprocessing's resource tracker."""
    scheduler = server.info()["pid"]
    for pid in server.child_pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        if pid != scheduler and "resource_tracker" not in cmdline:
            return pid
    raise AssertionError("no detokenizer process found")


def _socket_dirs(server: ServerProcess) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{IPC_DIR_PREFIX}{server.proc.pid}-*"))


def test_a_killed_detokenizer_fails_requests_in_flight_and_takes_the_server_down():
    server = start_server("--log-level", "warning")
    body = {
        "text": "Tell me a long story.",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        assert next(events)
        os.kill(_detokenizer_pid(server), signal.SIGKILL)
        rest = list(events)  # must end, not hang
    assert any('"error"' in line for line in rest)
    assert server.proc.wait(timeout=30) != 0
    server.stop()  # raises if a child outlived the server
    assert _socket_dirs(server) == []


def test_a_stopped_and_resumed_scheduler_loses_nothing():
    server = start_server("--log-level", "warning")
    scheduler = server.info()["pid"]
    try:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        expected = server.post("/v1/completions", body).json()["choices"][0]["text"]
        os.kill(scheduler, signal.SIGSTOP)
        answers: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: answers.append(server.post("/v1/completions", body)))
        worker.start()
        time.sleep(2.0)
        assert worker.is_alive()  # waiting on the stopped scheduler
        os.kill(scheduler, signal.SIGCONT)
        worker.join(timeout=60)
        assert answers and answers[0].status_code == 200
        assert answers[0].json()["choices"][0]["text"] == expected
        wait_idle(server)
    finally:
        os.kill(scheduler, signal.SIGCONT)  # never leave it stopped, whatever failed
        assert server.stop() == 0
    assert _socket_dirs(server) == []
    assert subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True).stdout == b""


def test_children_killed_during_start_up_make_the_server_exit_with_a_clear_error():
    proc, port = spawn_server("--log-level", "warning")
    server = ServerProcess(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while len(server.child_pids()) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the children exist, loading the model: not reported in yet
    for pid in server.child_pids():
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0  # not a server stuck "starting"
    server.stop()
    printed = "".join(server.output)
    assert "process failed to start" in printed or "exited during start-up" in printed, printed
    assert _socket_dirs(server) == []
