"""Ctrl-C with a stream in flight: the stream ends with an error event, and the server exits quietly
(no traceback of cancelled connections) with its children."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from server_process import MODEL

from labkit.server.process import start_server

pytestmark = pytest.mark.slow


def test_ctrl_c_ends_streams_with_an_error_event_and_exits_quietly():
    server = start_server()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
            events = (line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: "))
            first = [next(events) for _ in range(3)]  # the stream is under way
            server.proc.send_signal(signal.SIGINT)
            rest = list(events)
    finally:
        code = server.stop()
    assert all("choices" in json.loads(e) for e in first)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["error"]["code"] == "server_unavailable"
    assert code == 0
    printed = "".join(server.output)
    assert "Traceback" not in printed and "CancelledError" not in printed, printed
