"""A streaming handler that falls behind the scheduler catches up in one chunk: the outputs that
arrived for its request since it last woke go out merged (TokenizerManager.stream, ReqOutput.merge)."""

from __future__ import annotations

import json

from inprocess_tiny import MODEL, answer_with, run_with_server

from labkit.io_struct import ReqOutput

LENGTH = {"type": "length", "length": 3}


def test_merge_joins_pieces_sums_counts_and_keeps_the_last_state():
    first = ReqOutput(
        rid="r",
        token_ids=[5],
        text="a",
        cached_tokens=2,
        spec_draft_tokens=3,
        spec_accepted_tokens=1,
        token_logprobs=[-0.5],
        top_logprobs=[[(5, -0.5)]],
        input_token_logprobs=[(None, 1), (-1.0, 2)],
    )
    second = ReqOutput(
        rid="r",
        token_ids=[6, 7],
        text="bc",
        cached_tokens=2,
        spec_draft_tokens=3,
        spec_accepted_tokens=2,
        token_logprobs=[-0.25, -1.5],
        top_logprobs=[[(6, -0.25)], [(7, -1.5)]],
        finish_reason=LENGTH,
    )
    merged = ReqOutput.merge([first, second])
    assert merged.token_ids == [5, 6, 7] and merged.text == "abc"
    assert merged.token_logprobs == [-0.5, -0.25, -1.5]
    assert merged.top_logprobs == [[(5, -0.5)], [(6, -0.25)], [(7, -1.5)]]
    assert (merged.spec_draft_tokens, merged.spec_accepted_tokens) == (6, 3)
    assert merged.input_token_logprobs == first.input_token_logprobs
    assert merged.finish_reason == LENGTH and merged.cached_tokens == 2
    assert ReqOutput.merge([first]) is first
    plain = ReqOutput.merge([ReqOutput(rid="r", token_ids=[1]), ReqOutput(rid="r", token_ids=[2])])
    assert plain.token_logprobs is None and plain.top_logprobs is None


async def _late_handler_chunks(server, path: str, body: dict) -> list[dict]:
    """Stream `body` to `path`; while the handler waits, two steps' outputs reach the
    TokenizerManager back to back. The data chunks the client got."""
    steps = [
        ReqOutput(rid="", token_ids=[5], text="a"),
        ReqOutput(rid="", token_ids=[6, 7], text="bc", finish_reason=LENGTH),
    ]
    response = await answer_with(server, path, {**body, "stream": True}, steps)
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_outputs_that_arrive_before_the_handler_wakes_go_out_as_one_chunk():
    async def test(server):
        server.args.incremental_streaming_output = True
        [chunk] = await _late_handler_chunks(
            server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}
        )
        assert chunk["output_ids"] == [5, 6, 7] and chunk["meta_info"]["finish_reason"] == "length"
        # OpenAI's completions: one delta with both steps' text, then the finish.
        completion = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3}
        chunks = await _late_handler_chunks(server, "/v1/completions", completion)
        assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
            ("abc", None),
            ("", "length"),
        ]

    run_with_server(test)
