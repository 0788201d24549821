"""Prompt logprobs (return_logprob with logprob_start_len) against transformers' teacher-forced
log-softmax of the same prompt, in float32: from several start positions, with top alternatives,
across prefill chunks, with a radix-cache hit, beside requests that ask for none, and for a prompt
only scored (max_new_tokens 0); bad values are refused; nothing is left held afterwards."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import random_hf_checkpoint
from test_engine_api import assert_idle

import labkit.layers.logits
from labkit import Engine

TOP = 3
PROMPT = [(7 * i + 3) % 256 for i in range(23)]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    return random_hf_checkpoint("tiny-llama", False, None, path), path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' log-softmax at every position of PROMPT (row j scores token j + 1)."""
    hf, _ = checkpoint
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


ENGINES = {
    "one-pass": {},
    # Chunks of 5 tokens over pages of 4 (the radix match limit stays page-aligned), overlap
    # scheduling, mixed batches and the trace hooks all at work.
    "chunked": {
        "chunked_prefill_size": 5,
        "page_size": 4,
        "overlap_schedule_on_cpu": True,
        "enable_mixed_chunk": True,
        "enable_trace": True,
    },
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, checkpoint):
    _, path = checkpoint
    engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=1024, **ENGINES[request.param])
    yield engine
    engine.flush_cache()
    assert engine.allocator.available_size() == engine.allocator.size


def expected(reference: torch.Tensor, start: int) -> tuple[list, list]:
    """(input_token_logprobs, input_top_logprobs) that prompt logprobs from `start` must give."""
    tokens, tops = [], []
    for j in range(start, len(PROMPT)):
        if j == 0:
            tokens.append((None, PROMPT[0]))
            tops.append(None)
            continue
        row = reference[j - 1]
        tokens.append((float(row[PROMPT[j]]), PROMPT[j]))
        top = torch.topk(row, TOP)
        tops.append(list(zip(top.values.tolist(), top.indices.tolist())))
    return tokens, tops


def assert_matches(meta: dict, reference: torch.Tensor, start: int) -> None:
    want_tokens, want_tops = expected(reference, start)
    got_tokens = meta["input_token_logprobs"]
    assert [t for _, t in got_tokens] == [t for _, t in want_tokens]
    for (got, _), (want, _) in zip(got_tokens, want_tokens):
        assert got == pytest.approx(want, abs=1e-5) if want is not None else got is None
    got_tops = meta["input_top_logprobs"]
    assert len(got_tops) == len(want_tops)
    for got, want in zip(got_tops, want_tops):
        if want is None:
            assert got is None
            continue
        assert [i for _, i in got] == [i for _, i in want]
        assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-5)


def scored(start: int, **extra) -> dict:
    return {**GREEDY, "return_logprob": True, "top_logprobs_num": TOP, "logprob_start_len": start, **extra}


@pytest.mark.parametrize("start", [0, 1, 7, len(PROMPT) - 1])
def test_prompt_logprobs_match_transformers(engine, reference, start):
    engine.flush_cache()
    out = engine.generate(input_ids=PROMPT, sampling_params=scored(start))
    assert_matches(out["meta_info"], reference, start)
    # The first output token's logprob continues the prompt's: the last position's distribution.
    first_lp, first_token = out["meta_info"]["output_token_logprobs"][0]
    assert first_lp == pytest.approx(float(reference[-1, first_token]), abs=1e-5)
    assert_idle(engine)


def test_a_cached_prompt_is_scored_again_from_its_start_position(engine, reference):
    engine.flush_cache()
    engine.generate(input_ids=PROMPT, sampling_params=GREEDY)  # the whole prompt is now cached
    again = engine.generate(input_ids=PROMPT, sampling_params=scored(9))
    page = engine.config.page_size
    # Matched no further than position 8, whose hidden state scores token 9 (whole pages only).
    assert again["meta_info"]["cached_tokens"] == 8 // page * page
    assert_matches(again["meta_info"], reference, 9)
    plain = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)  # others still get the full hit
    assert plain["meta_info"]["cached_tokens"] == (len(PROMPT) - 1) // page * page
    assert_idle(engine)


def test_requests_without_prompt_logprobs_are_unchanged_and_pay_nothing(engine, monkeypatch):
    other = [5, 9, 11, 200, 31, 64, 2, 77, 18, 19, 20]
    plain = {**GREEDY, "return_logprob": True, "top_logprobs_num": TOP}
    engine.flush_cache()
    alone = engine.generate(input_ids=other, sampling_params=plain)
    engine.flush_cache()
    _, beside = engine.generate(input_ids=[PROMPT, other], sampling_params=[scored(0), plain])
    assert beside["output_ids"] == alone["output_ids"]
    for (got, _), (want, _) in zip(
        beside["meta_info"]["output_token_logprobs"], alone["meta_info"]["output_token_logprobs"]
    ):
        assert got == pytest.approx(want, abs=1e-5)
    assert "input_token_logprobs" not in beside["meta_info"]

    calls = []
    monkeypatch.setattr(labkit.layers.logits, "score_prompt", lambda *args: calls.append(args))
    engine.generate(input_ids=other, sampling_params=plain)
    assert calls == []  # no prompt row is projected for a batch that asks for none
    assert_idle(engine)


def test_max_new_tokens_0_only_scores_the_prompt(engine, reference):
    engine.flush_cache()
    out = engine.generate(input_ids=PROMPT, sampling_params=scored(0, max_new_tokens=0))
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["output_token_logprobs"] == []
    assert_matches(out["meta_info"], reference, 0)
    assert_idle(engine)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"return_logprob": True, "logprob_start_len": len(PROMPT)}, "logprob_start_len"),
        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"return_logprob": True, "logprob_start_len": "0"}, "logprob_start_len"),
        ({"return_logprob": True, "logprob_start_len": True}, "logprob_start_len"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 0, "return_logprob": True}, "max_new_tokens"),  # nothing to score
    ],
)
def test_bad_prompt_logprob_parameters_are_refused(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=PROMPT, sampling_params=params)
    assert_idle(engine)
