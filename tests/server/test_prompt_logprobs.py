"""Prompt logprobs through the server's real app (tiny model, in process): /generate's
logprob_start_len gives the Engine's input logprobs; /v1/completions' echo returns the prompt before
the completion, with logprobs its tokens' first (the first one null), and with max_tokens 0 only
scores the prompt; streamed, the prompt is the first chunk; bad values are 400s; nothing is held after."""

from __future__ import annotations

import json

import pytest
from inprocess_tiny import MODEL, error_of, run_with_server

from labkit import Engine

PROMPT = [5, 17, 99, 3, 250, 41, 41, 8, 120, 64]
TOP = 2


@pytest.fixture(scope="module")
def engine_meta() -> dict:
    """The Engine's answer on the in-process server's model (the same seeded random weights)."""
    engine = Engine(model_path=MODEL, load_format="dummy", max_total_tokens=2048)
    params = {"max_new_tokens": 3, "temperature": 0, "return_logprob": True, "top_logprobs_num": TOP}
    return engine.generate(input_ids=PROMPT, sampling_params={**params, "logprob_start_len": 0})["meta_info"]


def token_text(token_id: int) -> str:
    return f"<{token_id}>"  # how the server writes a token without a tokenizer


async def post(server, path: str, body: dict):
    return await server.serve(server.client.post(path, json=body))


def assert_idle(server) -> None:
    sched = server.scheduler
    pool = sched.pool_usage()
    assert pool.protected == pool.request_owned == 0 and pool.free + pool.evictable == pool.total
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def test_generate_and_echo_give_the_engines_prompt_logprobs(engine_meta):
    want = engine_meta["input_token_logprobs"]
    want_tops = engine_meta["input_top_logprobs"]
    completion = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "echo": True, "logprobs": TOP}

    async def test(server):
        gen = await post(
            server,
            "/generate",
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                "return_logprob": True,
                "top_logprobs_num": TOP,
                "logprob_start_len": 4,
            },
        )
        scored = await post(server, "/v1/completions", {**completion, "max_tokens": 0})
        continued = await post(server, "/v1/completions", {**completion, "max_tokens": 3})
        assert_idle(server)
        return gen.json(), scored.json(), continued.json()

    gen, scored, continued = run_with_server(test)

    meta = gen["meta_info"]
    assert [[tok, None] for _, tok, _ in meta["input_token_logprobs"]] == [[tok, None] for _, tok in want[4:]]
    assert [lp for lp, _, _ in meta["input_token_logprobs"]] == pytest.approx([lp for lp, _ in want[4:]], abs=1e-5)
    assert [[t for _, t, _ in top] for top in meta["input_top_logprobs"]] == [
        [t for _, t in top] for top in want_tops[4:]
    ]
    assert gen["output_ids"] == [tok for _, tok in engine_meta["output_token_logprobs"]]

    prompt_text = "".join(map(token_text, PROMPT))
    [choice] = scored["choices"]
    assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(PROMPT)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [token_text(t) for t in PROMPT]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx([lp for lp, _ in want[1:]], abs=1e-5)
    assert [list(top) for top in logprobs["top_logprobs"][1:]] == [
        [token_text(t) for _, t in top] for top in want_tops[1:]
    ]
    assert logprobs["text_offset"] == [sum(len(token_text(t)) for t in PROMPT[:i]) for i in range(len(PROMPT))]

    [choice] = continued["choices"]
    output_ids = gen["output_ids"]
    assert choice["text"] == prompt_text  # + the completion's text, which needs a tokenizer (the slow lane's)
    assert choice["logprobs"]["tokens"] == [token_text(t) for t in PROMPT + output_ids]
    assert choice["logprobs"]["token_logprobs"][len(PROMPT) :] == pytest.approx(
        [lp for lp, _ in engine_meta["output_token_logprobs"]], abs=1e-5
    )
    assert choice["logprobs"]["token_logprobs"][: len(PROMPT)] == logprobs["token_logprobs"]


def test_echo_without_logprobs_and_streamed_echo():
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 3, "echo": True}

    async def test(server):
        plain = await post(server, "/v1/completions", body)
        streamed = await post(server, "/v1/completions", {**body, "logprobs": 1, "stream": True})
        assert_idle(server)
        return plain.json(), streamed.text

    plain, streamed = run_with_server(test)
    [choice] = plain["choices"]
    assert choice["text"].startswith("".join(map(token_text, PROMPT))) and choice["logprobs"] is None
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == "".join(map(token_text, PROMPT))
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
    offsets = [
        o
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == sorted(offsets) and len(offsets) == len(PROMPT) + 3  # one text, prompt then completion


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/generate", {"return_logprob": True, "logprob_start_len": len(PROMPT)}, "logprob_start_len"),
        ("/generate", {"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ("/generate", {"sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ("/v1/completions", {"model": MODEL, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "max_tokens": 0, "echo": True}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ],
)
def test_bad_prompt_logprob_requests_get_400(path, body, says):
    key = "input_ids" if path == "/generate" else "prompt"

    async def test(server):
        r = await post(server, path, {key: PROMPT, **body})
        assert_idle(server)
        return r

    assert says in error_of(run_with_server(test), 400)["message"]
