"""Greedy outputs of the Engine on the embedded model equal transformers' `generate` on the same
weights: 8 prompts of mixed lengths submitted together, under chunked prefill, page sizes 1 and 16,
every policy, mixed batches, the radix cache on and off, and a second run that hits the cache. In
float32 on every device, as the reference: in bfloat16 near-ties flip (tests/test_engine_devices.py
compares a GPU's bfloat16 logprobs within a tolerance)."""

from __future__ import annotations

import pytest
import torch

from labkit import Engine
from labkit.scheduler.schedule_policy import POLICIES

pytestmark = pytest.mark.slow  # the embedded model and its transformers reference

NEW_TOKENS = 32
LONG_SYSTEM = (
    "You are a meticulous assistant for a public library. Answer politely, cite the shelf "
    "section when you recommend a book, and keep every answer short. The library opens at "
    "nine, closes at six, and lends at most five books per visitor for three weeks. "
) * 3
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Write a short poem about the sea and the wind."}],
    [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "When do you open?"}],
    [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Recommend a novel about space."}],
    [{"role": "user", "content": "List five fruits that are red, and say one thing about each of them."}],
    [{"role": "user", "content": "Explain in simple words how a bicycle stays upright while moving. " * 3}],
    [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "84."},
        {"role": "user", "content": "And divided by 4?"},
    ],
    [{"role": "user", "content": "Translate to French: the cat sleeps on the warm windowsill all afternoon."}],
]
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS}


def prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    """transformers' greedy continuation of each prompt, cut after the first EOS (labkit stops there)."""
    eos = hf_model.config.eos_token_id
    outs = []
    for messages in CONVERSATIONS:
        ids = prompt_ids(hf_tokenizer, messages)
        with torch.no_grad():
            gen = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        new = gen[0, len(ids) :].tolist()
        if eos in new:
            new = new[: new.index(eos) + 1]
        outs.append(new)
    return outs


def test_prompts_span_several_chunks(hf_tokenizer):
    lengths = [len(prompt_ids(hf_tokenizer, m)) for m in CONVERSATIONS]
    assert min(lengths) < 64 and max(lengths) > 2 * 64


def run(engine: Engine) -> list[dict]:
    return engine.generate(messages=CONVERSATIONS, sampling_params=GREEDY)


def assert_same(outs, reference):
    got = [o["output_ids"] for o in outs]
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"prompt {i}: labkit {g} != transformers {r}"


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_and_cache_hits_match_hf(page_size, reference):
    engine = Engine(dtype="float32", chunked_prefill_size=64, page_size=page_size, max_total_tokens=8192)
    first = run(engine)
    assert_same(first, reference)
    assert all(o["meta_info"]["completion_tokens"] == len(r) for o, r in zip(first, reference))
    # The shared system prompt is cached by the time the second of those requests runs its prefill.
    assert sum(o["meta_info"]["cached_tokens"] for o in first) > 0 or page_size > 1
    second = run(engine)
    assert_same(second, reference)
    cached = [o["meta_info"]["cached_tokens"] for o in second]
    assert all(c > 0 for c in cached), cached
    assert [o["text"] for o in second] == [o["text"] for o in first]


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"fcfs"}))
def test_every_policy_matches_hf(policy, reference):
    engine = Engine(dtype="float32", chunked_prefill_size=64, schedule_policy=policy, max_total_tokens=8192)
    assert_same(run(engine), reference)


def test_mixed_batches_and_no_radix_cache_match_hf(reference):
    engine = Engine(
        dtype="float32",
        chunked_prefill_size=64,
        enable_mixed_chunk=True,
        disable_radix_cache=True,
        max_running_requests=4,
        max_total_tokens=8192,
    )
    outs = run(engine)
    assert_same(outs, reference)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)


def test_retraction_keeps_greedy_outputs(reference):
    """A pool too small for all requests at once: some are retracted and re-run, same outputs."""
    engine = Engine(
        dtype="float32", chunked_prefill_size=64, max_total_tokens=384, page_size=16, schedule_conservativeness=0.1
    )
    outs = run(engine)
    assert_same(outs, reference)
    assert sum(o["meta_info"]["retractions"] for o in outs) > 0
    engine.flush_cache()
    usage = engine.pool_usage()
    assert usage.free == usage.total
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
