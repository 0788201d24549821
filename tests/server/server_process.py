"""Starting and stopping a real `python -m labkit.server` subprocess for the server tests."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

START_TIMEOUT_S = 300
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    proc: subprocess.Popen
    url: str
    api_key: str | None
    output: list[str]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers=self.headers(), timeout=120, **kw)

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def child_pids(self) -> list[int]:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """/get_server_info once nothing is in flight; fails if the pool does not come back."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            pool = info["pool"]
            if info["in_flight"] == 0 and info["running"] == 0 and info["waiting"] == 0 \
                    and pool["request_owned"] == 0 and pool["protected"] == 0 \
                    and info["req_slots"]["free"] == info["req_slots"]["total"]:
                assert pool["free"] + pool["evictable"] == pool["total"]
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not return to idle: {info}")
            time.sleep(0.2)


def spawn_server(*args: str, api_key: str | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "labkit.server", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1), port


def start_server(*args: str, api_key: str | None = None) -> RunningServer:
    """Start a server and wait for its ready line."""
    proc, port = spawn_server(*args, api_key=api_key)
    output: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            output.append(line)
            if "labkit server ready" in line:
                os.set_blocking(proc.stdout.fileno(), False)
                return RunningServer(proc, f"http://127.0.0.1:{port}", api_key, output)
        elif proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("server did not become ready:\n" + "".join(output))


def stop_server(server: RunningServer) -> int:
    """SIGTERM, as a supervisor would; returns the exit code after checking no child is left."""
    children = server.child_pids()
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    for pid in children:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"child process {pid} was left behind"
    return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone in every sense that matters once reaped or <defunct>.
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")
