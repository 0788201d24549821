"""The server's parts in one process (labkit.server.inprocess): a request goes through the real app,
TokenizerManager, scheduler and detokenizer over their ZMQ sockets, stepped by hand or served at full
speed, and gets the Engine's answer."""

from __future__ import annotations

import asyncio
import os

import pytest

from labkit import Engine
from labkit.config import EngineConfig
from labkit.io_struct import TokenizedGenerateReqInput
from labkit.server.inprocess import InProcessServer
from labkit.trace import Station
from labkit.viz import journey_latency

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.slow
def test_stepped_and_served_requests_match_the_engine_and_leave_nothing_behind():
    expected = Engine().generate(messages=CHAT, sampling_params={"temperature": 0, "max_new_tokens": 16})
    asyncio.run(_journeys(expected))


async def _journeys(expected: dict) -> None:
    server = InProcessServer(EngineConfig(enable_trace=True))
    ipc_dir = server.ports.ipc_dir
    await server.start()
    try:
        sched, body = (
            server.scheduler,
            {"model": server.model_name, "messages": CHAT, "max_tokens": 16, "temperature": 0},
        )
        # By hand: the message off the scheduler's socket, then step and detokenize until done.
        task = asyncio.create_task(server.client.post("/v1/chat/completions", json=body))
        raw, msg = await server.next_message()
        assert isinstance(msg, TokenizedGenerateReqInput)
        assert len(msg.input_ids) == expected["meta_info"]["prompt_tokens"]
        server.scheduler_loop.process_input_request(msg)
        pieces = []
        while sched.has_work():
            server.scheduler_loop.send_outputs(sched.step())
            pieces += [o.text for o in (await server.detokenize())[1].outputs]
        first = (await task).json()
        assert first["choices"][0]["message"]["content"] == "".join(pieces) == expected["text"]
        assert first["usage"]["completion_tokens"] == expected["meta_info"]["completion_tokens"]
        assert {e.station for e in server.tracer.for_request(msg.rid)} == set(Station)
        zmq_send = next(e for e in server.tracer.for_request(msg.rid) if e.station == Station.ZMQ_SEND)
        assert zmq_send.detail["message_bytes"] == len(raw)

        # At full speed: the same answer, with all of the prompt but its last token from the cache.
        second = (await server.serve(server.client.post("/v1/chat/completions", json=body))).json()
        assert second["choices"][0]["message"]["content"] == expected["text"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(msg.input_ids) - 1
        latency = journey_latency(server, second["id"] + "-0")
        assert latency["tokens"] == second["usage"]["completion_tokens"]
        assert 0 < latency["ttft_ms"] < latency["e2e_ms"]

        # Nothing leaked: no request holds KV or a request slot, and a flush frees the whole pool.
        pool = sched.pool_usage()
        assert pool.protected == pool.request_owned == 0 and pool.free + pool.evictable == pool.total
        assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
        assert (await server.serve(server.client.post("/flush_cache"))).status_code == 200
        assert sched.pool_usage().free == pool.total
    finally:
        await server.close()
    assert not os.path.exists(ipc_dir)
