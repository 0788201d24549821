"""Run `python -m labkit.server` as a child process, as a supervisor would: start it on a free port,
wait for its ready line, stop it with SIGTERM and check that no process of it is left. The server
tests and the serving notebook use it.

    server = start_server("--enable-metrics")     # returns once the server can answer
    httpx.get(server.url + "/v1/models")
    server.stop()                                 # SIGTERM; raises if something had to be killed
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

READY_LINE = "labkit server ready"  # printed by labkit.server.launch once a generation went through
START_TIMEOUT_S = 300.0  # the first start on a machine converts the embedded model (about 30 s)
STOP_TIMEOUT_S = 60.0
CHILD_EXIT_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(*args: str, api_key: str | None = None) -> tuple[subprocess.Popen, int]:
    """Start `python -m labkit.server --port <free port> *args` (stdout and stderr in one pipe); do
    not wait. Returns the process and its port."""
    port = free_port()
    cmd = [sys.executable, "-m", "labkit.server", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1), port


@dataclass
class ServerProcess:
    """A running server process. A thread collects what it prints into `output` (so its pipe never
    fills up) and sets `ready` when the ready line appears."""

    proc: subprocess.Popen
    url: str
    api_key: str | None = None
    output: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read_output, name="labkit-server-output", daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        for line in self.proc.stdout:  # ends when the process and its children have closed the pipe
            self.output.append(line)
            if READY_LINE in line:
                self.ready.set()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers=self.headers(), timeout=120, **kw)

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def child_pids(self) -> list[int]:
        """The server's child processes: the scheduler, the detokenizer, multiprocessing's resource tracker."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True, check=False
        )
        return [int(p) for p in out.stdout.split()]

    def dump_stacks(self) -> None:
        """Have the server and its children print every thread's stack (they register SIGUSR1 with
        faulthandler), so a server that hangs says where."""
        for pid in [self.proc.pid, *self.child_pids()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait for the exit and for the children to go; returns the exit code (again on a
        second call). Raises RuntimeError if the server did not stop within `timeout` or a child
        outlived it: they are killed then, so nothing of the server is left running either way."""
        children = self.child_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        problems = []
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            problems.append(f"the server did not stop within {timeout:.0f} s of SIGTERM")
        left = [pid for pid in children if not _exited(pid, CHILD_EXIT_TIMEOUT_S)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left:
            problems.append(f"child processes {left} outlived it")
        self._reader.join(timeout=5)  # the rest of its output
        if problems:
            raise RuntimeError("; ".join(problems) + " (killed)")
        return code


def start_server(*args: str, api_key: str | None = None, timeout: float = START_TIMEOUT_S) -> ServerProcess:
    """Start a server (see spawn_server) and wait for its ready line. Raises RuntimeError, with what
    it printed, if it exits or is not ready within `timeout` (then it is killed)."""
    proc, port = spawn_server(*args, api_key=api_key)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", api_key)
    deadline = time.monotonic() + timeout
    while not server.ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:  # it hangs
                server.dump_stacks()
            proc.kill()
            proc.wait()
            server._reader.join(timeout=5)
            raise RuntimeError("server did not become ready:\n" + "".join(server.output))
    return server


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` for process `pid` to be gone; False if it is still running."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone in every sense that matters once reaped or <defunct>.
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, check=False)
    state = out.stdout.strip()
    return bool(state) and not state.startswith("Z")
