"""Request bodies over --max-request-bytes get a 413 in OpenAI's error shape before anything parses
them, whether they declare their length or arrive in chunks; smaller bodies pass through whole."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_process import MODEL

from labkit.server.body_limit import BodySizeLimitMiddleware
from labkit.server.process import start_server

LIMIT = 100


async def _echo_length(scope, receive, send) -> None:
    """An app that reads the whole body and answers its length."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


async def _call(chunks: list[bytes], declared: int | None) -> tuple[int, bytes]:
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await BodySizeLimitMiddleware(_echo_length, LIMIT)(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    "chunks, declared, status",
    [
        ([b"x" * LIMIT], LIMIT, 200),
        ([b"x" * 40, b"x" * 60], None, 200),  # chunked, exactly at the limit
        ([b"x" * (LIMIT + 1)], LIMIT + 1, 413),  # refused on its declared length
        ([b"x" * 60, b"x" * 60], None, 413),  # chunked: refused once past the limit
        ([b"x" * 60, b"x" * 60], 10, 413),  # a declared length that lies
    ],
)
def test_bodies_over_the_limit_get_413_and_the_rest_pass_whole(chunks, declared, status):
    got_status, body = asyncio.run(_call(chunks, declared))
    assert got_status == status
    if status == 200:
        assert body == str(sum(map(len, chunks))).encode()
    else:
        error = json.loads(body)["error"]
        assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


@pytest.mark.slow
def test_a_huge_request_is_refused_while_small_ones_are_served():
    server = start_server("--log-level", "warning")
    try:
        huge = {"model": MODEL, "prompt": "word " * 10_000_000, "max_tokens": 1}  # 50 MB
        refused: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: refused.append(server.post("/v1/completions", huge)))
        start = time.monotonic()
        sender.start()
        latencies = []
        while sender.is_alive():
            t0 = time.monotonic()
            assert server.get("/v1/models").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)
        sender.join()
        assert refused[0].status_code == 413 and time.monotonic() - start < 10
        assert max(latencies, default=0.0) < 2.0
    finally:
        assert server.stop() == 0
