"""Logprobs the JSON way: a token a grammar rules out has logprob -inf, which JSON cannot write; the
server writes it as LOGPROB_FLOOR in every response that carries logprobs (OpenAI's completions and
chat shapes, /generate's), streamed or not, so answers stay valid JSON instead of failing."""

from __future__ import annotations

import json
import math

from inprocess_tiny import MODEL, answer_with, run_with_server

from labkit.io_struct import ReqOutput
from labkit.server.openai_api import LOGPROB_FLOOR

NEG_INF = float("-inf")
STEPS = [
    ReqOutput(rid="", token_ids=[5], token_logprobs=[-0.25], top_logprobs=[[(5, -0.25), (9, NEG_INF)]],
              input_token_logprobs=[(None, 1), (NEG_INF, 2)], input_top_logprobs=[None, [(3, NEG_INF)]]),
    ReqOutput(rid="", token_ids=[6], token_logprobs=[float("nan")], top_logprobs=[[(6, NEG_INF)]],
              finish_reason={"type": "length", "length": 2}),
]  # fmt: skip


def numbers(value) -> list[float]:
    """Every float in a decoded JSON value."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [x for v in value for x in numbers(v)] if isinstance(value, list) else []


def test_minus_infinity_and_nan_logprobs_are_written_as_the_floor():
    async def test(server):
        completion = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "logprobs": 2, "echo": True}
        generate = {
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 0,
        }
        for path, body in [("/v1/completions", completion), ("/generate", generate)]:
            for stream in (False, True):
                r = await answer_with(server, path, {**body, "stream": stream}, STEPS)
                assert r.status_code == 200, r.text
                texts = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")][:-1]
                values = [json.loads(t, parse_constant=lambda c: math.nan) for t in texts or [r.text]]
                found = [x for v in values for x in numbers(v)]
                assert LOGPROB_FLOOR in found and all(map(math.isfinite, found)), (path, stream, found)

    run_with_server(test)
