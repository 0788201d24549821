"""Tracing through the server's parts: long prompts (whose recorded token lists are shortened),
multi-turn chat, n > 1, an abort and a retraction all travel as trace records between the processes'
sockets, the server keeps serving, and the records export to Perfetto and read back."""

from __future__ import annotations

import asyncio

import pytest

from labkit.config import EngineConfig
from labkit.server.inprocess import InProcessServer
from labkit.trace import Station, from_perfetto

pytestmark = pytest.mark.slow

STORY = " ".join(["Once upon a time there was a small village by the sea."] * 12)  # well over 64 tokens
TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Name another one."},
]


def test_trace_records_of_long_multi_turn_sampled_aborted_and_retracted_requests_cross_the_sockets(tmp_path):
    # A pool of 400 KV slots cannot hold the three long completions' outputs at once: one retracts.
    server = InProcessServer(EngineConfig(enable_trace=True, max_total_tokens=400))
    asyncio.run(_run(server, tmp_path))


async def _run(server: InProcessServer, tmp_path) -> None:
    await server.start()
    model = server.model_name
    try:
        longs = [
            server.client.post(
                "/v1/completions",
                json={"model": model, "prompt": STORY, "max_tokens": 90, "ignore_eos": True, "temperature": 0},
            )
            for _ in range(3)
        ]
        chat = server.client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": TURNS, "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 1},
        )
        done = await server.serve(asyncio.gather(*longs, chat), timeout_s=600)
        assert [r.status_code for r in done] == [200] * 4, [r.text for r in done]
        assert len(done[-1].json()["choices"]) == 2

        # An abort: a long request stopped by /abort_request while it runs.
        task = asyncio.ensure_future(
            server.client.post("/generate", json={"text": STORY, "sampling_params": {"max_new_tokens": 200}})
        )
        while not server.scheduler.running:
            server.scheduler_loop.run_once(0)
            server.detokenizer_loop.run_once(0)
            await asyncio.sleep(0.001)
        rid = server.scheduler.running[0].rid
        aborted = (await server.serve(server.client.post("/abort_request", json={"rid": rid}))).json()
        finished = (await server.serve(task)).json()
        assert rid in str(aborted) and finished["meta_info"]["finish_reason"] == "abort"
    finally:
        await server.close()

    tracer = server.tracer
    assert any(step.retracted for step in tracer.steps), "the workload must retract a request"
    assert any(isinstance(t, str) for e in tracer.tree_events for t in e.tokens), "a shortened tree key"
    for response in done:
        for choice in range(len(response.json()["choices"])):
            rid_of_choice = f"{response.json()['id']}-{choice}"
            stations = {e.station for e in tracer.for_request(rid_of_choice)}
            assert {Station.TOKENIZE, Station.FORWARD, Station.DETOKENIZE, Station.RESPOND} <= stations
    read_back = from_perfetto(tracer.save_perfetto(tmp_path / "trace.json"))
    assert len(read_back.events) == len(tracer.events) and len(read_back.steps) == len(tracer.steps)
