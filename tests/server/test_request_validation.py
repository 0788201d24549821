"""Input the protocol must refuse with a 400 naming the parameter, on the real app (tiny model):
lone surrogates, loosely typed values, integers beyond 64 bits; and a refused request sends nothing."""

from __future__ import annotations

import json

import pytest
from inprocess_tiny import MODEL, error_of, run_with_server

from labkit.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}


def post_all(cases: list[tuple[str, bytes | dict]]) -> list:
    """POST each (path, body): raw bytes as JSON, or a dict; the responses in order."""

    async def test(server):
        out = []
        for path, body in cases:
            kw = {"json": body} if isinstance(body, dict) else {"content": body}
            out.append(await server.serve(server.client.post(path, headers={"content-type": "application/json"}, **kw)))
        return out

    return run_with_server(test)


S = "\ud800"  # a lone surrogate: JSON can carry it (as an escape), UTF-8 cannot


def said(**message) -> dict:
    return {**CHAT, "messages": [{"role": "user", **message}]}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", said(content=S), "messages"),
        ("/v1/chat/completions", said(content="a", name=S), "messages"),
        ("/v1/chat/completions", said(content=[{"type": "text", "text": S}]), "messages"),
        ("/v1/chat/completions", {**CHAT, "model": S}, "model"),
        ("/v1/completions", {**COMPLETION, "prompt": S}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", S]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "stop": ["a", S]}, "stop"),
        ("/v1/completions", {**COMPLETION, "user": S}, "user"),
        ("/v1/completions", {**COMPLETION, S: 1}, "\\ud800"),
        ("/generate", {"text": S}, "text"),
        ("/generate", {"input_ids": [1, 2, S]}, "input_ids"),  # ids with a string: not skipped as ids
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3, S]]}, "prompt"),
        ("/generate", {"input_ids": [1], "sampling_params": {"stop": S}}, "sampling_params"),
        ("/generate", {"input_ids": [1], "rid": S}, "rid"),
        ("/abort_request", {"rid": S}, "rid"),
    ],
)
def test_lone_surrogates_get_400_naming_the_parameter(path, body, param):
    [r] = post_all([(path, json.dumps(body).encode())])  # json.dumps escapes the surrogate
    err = error_of(r, 400)
    assert err["param"] == param and "surrogate" in err["message"]


@pytest.mark.parametrize(
    "base, field, value",
    [
        (COMPLETION, "max_tokens", "8"),
        (COMPLETION, "max_tokens", True),
        (COMPLETION, "max_tokens", 8.0),
        (COMPLETION, "n", "2"),
        (COMPLETION, "seed", "1"),
        (COMPLETION, "top_k", True),
        (COMPLETION, "stream", "yes"),
        (COMPLETION, "stream", 1),
        (COMPLETION, "ignore_eos", "false"),
        (COMPLETION, "temperature", "0"),
        (COMPLETION, "temperature", False),
        (COMPLETION, "prompt", [True, False]),
        (COMPLETION, "prompt", [[1, True]]),
        (COMPLETION, "stop_token_ids", [True]),
        (COMPLETION, "stop", 5),
        (COMPLETION, "model", 5),
        (COMPLETION, "stream_options", {"include_usage": "yes"}),
        (CHAT, "logprobs", 1),
        (CHAT, "messages", [{"role": "user", "content": 5}]),
        (CHAT, "max_completion_tokens", "4"),
    ],
)
def test_loosely_typed_values_get_400(base, field, value):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    [r] = post_all([(path, {**base, field: value})])
    assert error_of(r, 400)["param"] == field


def test_numbers_valid_as_floats_and_ints_stay_valid():
    for body in ({"temperature": 0, "top_p": 1, "frequency_penalty": 0}, {"temperature": 0.5, "seed": -3}):
        req = CompletionRequest.model_validate({**COMPLETION, **body})
        assert all(getattr(req, k) == v for k, v in body.items())
    assert ChatCompletionRequest.model_validate({**CHAT, "temperature": 1}).temperature == 1.0
    [r] = post_all([("/v1/completions", {**COMPLETION, "temperature": 0, "top_p": 1})])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": 10**30}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "top_k": 10**30}, "top_k"),
        ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed"),
        ("/v1/completions", {**COMPLETION, "seed": -(2**63) - 1}, "seed"),
        ("/v1/completions", {**COMPLETION, "min_tokens": 2**64}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [2**64]}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2**64]]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "logprobs": 2**64}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**64}, "max_completion_tokens"),
        ("/generate", {"input_ids": [1, 2**64]}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"seed": 2**64}}, None),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**30}}, None),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": 10**400}}, None),
    ],
)
def test_integers_beyond_64_bits_get_400(path, body, param):
    [r] = post_all([(path, body)])
    assert error_of(r, 400)["param"] == param


def test_a_refused_choice_sends_no_choice():
    """n=2 whose second choice's seed (seed + 1) is out of range: nothing reaches the scheduler."""

    async def test(server):
        r = await server.client.post("/v1/completions", json={**COMPLETION, "n": 2, "seed": 2**64 - 1})
        error_of(r, 400)
        assert not server.tm.rid_to_state and not server.scheduler_loop.recv_from_tokenizer.poll(100)

    run_with_server(test)


@pytest.mark.parametrize(
    "body",
    [{"n": 0}, {"n": 17}, {"max_tokens": 0}, {"logprobs": 6}, {"top_p": 0}, {"temperature": 2.5}, {"seed": 2**63}],
)
def test_each_fields_own_bounds_hold(body):
    with pytest.raises(ValueError, match=next(iter(body))):
        CompletionRequest.model_validate({**COMPLETION, **body})
