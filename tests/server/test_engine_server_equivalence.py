"""One code path per station: the same requests through the in-process Engine and through the
server's parts (the real app, TokenizerManager, scheduler loop and detokenizer loop over ZMQ) give
the same text, finish reasons and matched stops, for stop strings, UTF-8 characters split across
tokens, and n > 1 sampled choices."""

from __future__ import annotations

import asyncio

import pytest

from labkit import Engine
from labkit.config import EngineConfig
from labkit.server.inprocess import InProcessServer
from labkit.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
JAPANESE = [{"role": "user", "content": "Translate to Japanese: good morning"}]  # multi-byte output
# (endpoint, body without model): each is sent alone, so both paths batch the same requests.
REQUESTS = [
    ("chat/completions", {"messages": FRANCE, "temperature": 0, "stop": ["Paris"]}),
    ("chat/completions", {"messages": JAPANESE, "temperature": 0}),
    ("chat/completions", {"messages": JAPANESE, "temperature": 0, "stop": ["でな", "zzz"]}),
    ("completions", {"prompt": "Once upon a time", "temperature": 0.9, "seed": 11, "n": 3, "stop": [" the "]}),
]


def _engine_outputs(engine: Engine, endpoint: str, body: dict) -> list[dict]:
    """The server's sub-requests for `body`, built by its own protocol classes, through the Engine."""
    model = ChatCompletionRequest if endpoint == "chat/completions" else CompletionRequest
    req = model(model="m", max_tokens=MAX_TOKENS, **body)
    params = [req.sampling_params(MAX_TOKENS, j) for j in range(req.n)]
    if endpoint == "chat/completions":
        return engine.generate(messages=[body["messages"]] * req.n, sampling_params=params)
    return engine.generate([body["prompt"]] * req.n, sampling_params=params)


async def _server_outputs(server: InProcessServer) -> list[list[dict]]:
    await server.start()
    try:
        results = []
        for endpoint, body in REQUESTS:
            request = server.client.post(
                f"/v1/{endpoint}", json={"model": server.model_name, "max_tokens": MAX_TOKENS, **body}
            )
            response = await server.serve(request)
            assert response.status_code == 200, response.text
            results.append(response.json()["choices"])
        return results
    finally:
        await server.close()


def test_engine_and_server_give_the_same_text_finish_reasons_and_matched_stops():
    config = EngineConfig(dtype="float32")  # exact equality across batch shapes, on a GPU too
    engine = Engine(config)
    expected = [_engine_outputs(engine, endpoint, body) for endpoint, body in REQUESTS]
    # The workload exercises what it claims to: stop strings end some outputs, some tokens hold only
    # part of a UTF-8 character, and the sampled choices differ from each other.
    flat = [o for outs in expected for o in outs]
    assert {o["meta_info"]["matched_stop"] for o in flat} >= {"Paris", "でな"}
    assert any("\ufffd" in engine.tokenizer.decode([t]) for o in flat for t in o["output_ids"])
    assert len({o["text"] for o in expected[-1]}) > 1

    served = asyncio.run(_server_outputs(InProcessServer(config)))
    for (endpoint, _), outs, choices in zip(REQUESTS, expected, served):
        assert len(choices) == len(outs)
        for out, choice in zip(outs, sorted(choices, key=lambda c: c["index"])):
            text = choice["message"]["content"] if endpoint == "chat/completions" else choice["text"]
            assert text == out["text"]
            assert choice["finish_reason"] == out["meta_info"]["finish_reason"]["type"]
            assert choice["matched_stop"] == out["meta_info"]["matched_stop"]
