"""A streamed chunk is one server-sent event: `data: ` and one line of JSON, UTF-8 written as it is."""

from __future__ import annotations

import json

from labkit.server.openai_api import sse


def test_sse_event_is_one_line_of_utf8_json():
    payload = {"choices": [{"index": 0, "text": 'héllo ✓\n"q"\tend', "logprobs": None}], "x": -9999.0}
    event = sse(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # the text's newline is escaped inside the JSON string
    assert json.loads(event[len(b"data: ") :]) == payload
    assert "héllo ✓".encode() in event  # not \u escapes
