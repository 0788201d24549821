"""Starting, configuring and stopping the server; a dead child takes the server down, never hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_process import MODEL

from labkit.server.process import spawn_server, start_server
from labkit.server.server_args import ServerArgs
from labkit.trace.events import Station

ISSUE_OPTIONS = [
    "--model-path",
    "--load-format",
    "--host",
    "--port",
    "--device",
    "--dtype",
    "--page-size",
    "--max-total-tokens",
    "--chunked-prefill-size",
    "--max-prefill-tokens",
    "--max-running-requests",
    "--max-queued-requests",
    "--schedule-policy",
    "--disable-radix-cache",
    "--attention-backend",
    "--api-key",
    "--log-level",
    "--enable-metrics",
    "--trace-file",
    "--config",
]


def test_help_lists_every_option():
    out = subprocess.run([sys.executable, "-m", "labkit.server", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for option in ISSUE_OPTIONS:
        assert option in out.stdout, option


@pytest.mark.parametrize(
    "suffix, text",
    [
        (".yaml", "port: 1234\npage-size: 4\nschedule_policy: lpm\ndisable-radix-cache: true\n"),
        (".json", json.dumps({"port": 1234, "page_size": 4, "schedule-policy": "lpm", "disable_radix_cache": True})),
    ],
)
def test_config_file_merges_under_the_command_line(tmp_path, suffix, text):
    path = tmp_path / f"server{suffix}"
    path.write_text(text)
    args = ServerArgs.from_cli(["--config", str(path), "--port", "999"])
    assert args.port == 999  # the command line wins
    assert args.engine.page_size == 4 and args.engine.schedule_policy == "lpm" and args.engine.disable_radix_cache


def test_config_file_with_an_unknown_option_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prot: 1234\n")
    with pytest.raises(SystemExit, match="unknown option 'prot'"):
        ServerArgs.from_cli(["--config", str(path)])


@pytest.mark.slow
def test_trace_file_is_written_at_shutdown(tmp_path):
    trace = tmp_path / "trace.json"
    s = start_server("--log-level", "warning", "--trace-file", str(trace))
    try:
        r = s.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        assert s.stop() == 0
    rid = r.json()["id"] + "-0"
    events = json.loads(trace.read_text())["traceEvents"]
    stations = {e["name"] for e in events if e.get("cat") == "station" and e["args"]["rid"] == rid}
    assert stations == {f"{int(s)} {s.name.lower()}" for s in Station}  # all ten, across three processes
    assert any(e.get("cat") == "step" for e in events)


@pytest.mark.slow
def test_health_is_503_while_starting_then_a_killed_scheduler_fails_requests_and_exits():
    proc, port = spawn_server("--log-level", "warning")
    url = f"http://127.0.0.1:{port}"
    statuses = []
    deadline = time.monotonic() + 300
    while not statuses or statuses[-1] != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
        try:
            statuses.append(httpx.get(url + "/health", timeout=60).status_code)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert statuses[0] == 503 and set(statuses) == {503, 200}
    info = httpx.get(url + "/get_server_info", timeout=60).json()
    with httpx.stream(
        "POST",
        url + "/generate",
        timeout=60,
        json={
            "text": "Tell me a long story.",
            "stream": True,
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
        },
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(info["pid"], signal.SIGKILL)  # the scheduler process
        rest = [line for line in lines if line.startswith("data: ")]  # must end, not hang
    assert any('"error"' in line for line in rest)
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 503
    except httpx.TransportError:
        pass  # already gone: also a failing health check
    assert proc.wait(timeout=30) != 0
