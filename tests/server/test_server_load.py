"""A bounded load on loopback: concurrent chat, completion and native requests, with clients that
disconnect mid-stream, requests aborted by id and /flush_cache attempts in between. Every request
that was neither disconnected nor aborted finishes validly, and afterwards nothing is held."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from server_process import MODEL, wait_idle

from labkit.server.process import start_server

pytestmark = pytest.mark.slow

NUM_REQUESTS = 48
CONCURRENCY = 12
DEADLINE_S = 240


@pytest.fixture(scope="module")
def server():
    s = start_server("--log-level", "warning")
    yield s
    assert s.stop() == 0


async def _chat(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 24}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return "finished"


async def _stream(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 32, "stream": True, "ignore_eos": True}
    leave_after = rng.choice([None, 1, 3])  # a client that disconnects mid-stream
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if leave_after is not None and len(events) >= leave_after:
                    return "disconnected"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    return "finished"


async def _aborted(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    rid = f"load-{i}"
    body = {"text": f"Tell a tale {i}.", "rid": rid, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    task = asyncio.create_task(client.post("/generate", json=body))
    await asyncio.sleep(rng.uniform(0.05, 0.5))
    assert (await client.post("/abort_request", json={"rid": rid})).status_code == 200
    r = await task
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] in ("abort", "length")  # it may have finished first
    return "aborted"


async def _flush(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    r = await client.post("/flush_cache")
    assert r.status_code in (200, 400)  # refused while requests are in flight
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "requests_running"
    return "flush"


async def _load(url: str) -> list[str]:
    rng = random.Random(0)
    kinds = [_chat, _stream, _stream, _aborted, _flush]
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> str:
            async with gate:
                return await rng.choice(kinds)(client, i, rng)

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))), DEADLINE_S)


def test_load_with_disconnects_aborts_and_flushes_leaves_nothing_behind(server):
    outcomes = asyncio.run(_load(server.url))
    assert {"finished", "disconnected", "aborted", "flush"} <= set(outcomes)
    wait_idle(server)
    r = server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    )
    assert r.status_code == 200
