"""KV rollback: rejected drafts' slots go back to the allocator in the step that drafted them, and
after random workloads with speculation, aborts and retractions every KV slot and request slot (the
draft model's too) is accounted for."""

from __future__ import annotations

import random

import pytest

from labkit import Engine
from tests.random_workload import run_random_workload
from tests.speculative.conftest import FIXED_GAIN, NOISY


@pytest.mark.parametrize(
    "seed, algorithm, page_size, radix, mixed, overlap",
    [
        (0, NOISY, 1, True, False, False),
        (1, NOISY, 4, False, True, True),
        (2, NOISY, 16, True, True, False),
        (3, "draft", 4, True, False, True),
        (4, "ngram", 1, False, False, False),
    ],
)
def test_random_workload_with_speculation_accounts_for_every_slot(seed, algorithm, page_size, radix, mixed, overlap):
    rng = random.Random(seed)
    engine = Engine(
        model_path="tiny-llama",
        load_format="dummy",
        enable_trace=True,
        page_size=page_size,
        max_total_tokens=320,
        chunked_prefill_size=32,
        disable_radix_cache=not radix,
        enable_mixed_chunk=mixed,
        max_running_requests=6,
        schedule_conservativeness=0.3,
        overlap_schedule_on_cpu=overlap,
        **FIXED_GAIN,
        speculative_algorithm=algorithm,
        speculative_num_draft_tokens=rng.choice([2, 5]),
        speculative_draft_model_path="tiny-qwen3",
        speculative_draft_load_format="dummy",
    )
    run_random_workload(engine, rng)
    records = engine.tracer.steps
    assert any(r.forward_mode == "TARGET_VERIFY" for r in records)
    if algorithm == NOISY:
        assert sum(r.rollback_slots for r in records) > 0
    engine.flush_cache()
    assert engine.allocator.available_size() == engine.allocator.size
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert engine.scheduler.drafter.idle()


def test_rejected_drafts_slots_are_free_again_after_their_step():
    engine = Engine(
        model_path="tiny-llama",
        load_format="dummy",
        device="cpu",  # no overlap: step 2 is the verify step
        enable_trace=True,
        max_total_tokens=4096,
        speculative_algorithm="test-wrong",
        speculative_num_draft_tokens=4,
        speculative_min_accept_rate=0,
    )
    rid = engine.add_request(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    engine.step()  # prefill
    step = engine.step()  # verify: 4 wrong drafts, one token kept
    assert step.forward_mode == "TARGET_VERIFY" and len(step.new_tokens[rid]) == 1
    record = engine.tracer.steps[-1]
    assert record.drafts[rid] and record.accepted[rid] == 0 and record.rollback_slots == 4
    # The request holds its prompt's and its first output token's KV (the prompt's shared with the
    # cache), nothing of the drafts.
    pool = step.pool
    assert pool.protected + pool.request_owned == 4 and pool.free == pool.total - 4


def test_a_request_whose_drafts_keep_failing_stops_drafting_and_outputs_are_unchanged():
    kw = dict(model_path="tiny-llama", load_format="dummy", max_total_tokens=4096, dtype="float32")
    params = {"max_new_tokens": 80, "ignore_eos": True, "temperature": 0}
    plain = Engine(**kw).generate(input_ids=[9, 8, 7], sampling_params=params)
    out = Engine(**kw, **FIXED_GAIN, speculative_algorithm="test-wrong").generate(
        input_ids=[9, 8, 7], sampling_params=params
    )
    assert out["output_ids"] == plain["output_ids"]
    # Five failures from a fresh start, then two after each pause of 8, 16, 32, ... steps: 11 in 80 tokens.
    assert 2 <= out["meta_info"]["spec_verify_ct"] <= 12
