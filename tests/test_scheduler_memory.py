"""Randomized scheduler runs on a tiny random-weight model: whatever happens (chunked prefill, mixed
batches, retraction, aborts, shared prefixes, pages), memory is accounted for at every step and all
of it comes back at the end."""

from __future__ import annotations

import random

import pytest

from labkit import Engine
from tests.random_workload import run_random_workload


def make_engine(**kw) -> Engine:
    return Engine(model_path="tiny-llama", load_format="dummy", enable_trace=True, **kw)


@pytest.mark.parametrize(
    "seed, page_size, radix, mixed, policy",
    [
        (0, 1, True, False, "fcfs"),
        (1, 4, True, True, "lpm"),
        (2, 1, False, True, "dfs-weight"),
        (3, 8, True, False, "random"),
        (4, 4, False, False, "lof"),
        (5, 1, True, True, "dfs-weight"),
    ],
)
def test_random_workload_accounts_for_every_slot(seed, page_size, radix, mixed, policy):
    rng = random.Random(seed)
    engine = make_engine(
        page_size=page_size,
        max_total_tokens=256,
        chunked_prefill_size=32,
        disable_radix_cache=not radix,
        enable_mixed_chunk=mixed,
        schedule_policy=policy,
        max_running_requests=6,
        schedule_conservativeness=0.3,
    )
    live = run_random_workload(engine, rng)
    for rid in live:
        reason = engine.results[rid]["meta_info"]["finish_reason"]["type"]
        assert reason in ("length", "abort")
    engine.flush_cache()
    assert engine.allocator.available_size() == engine.allocator.size
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert engine.tree_cache.total_size() == 0


def test_retraction_happens_and_requests_resume():
    engine = make_engine(page_size=1, max_total_tokens=160, chunked_prefill_size=64, schedule_conservativeness=0.05)
    prompts = [[10 + i] * 30 for i in range(4)]
    outs = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    )
    assert sum(o["meta_info"]["retractions"] for o in outs) > 0
    assert any(s.retracted for s in engine.tracer.steps)
    reference = make_engine(page_size=1, max_total_tokens=4096)
    expected = reference.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    )
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]


def test_chunked_prefill_size_defaults_by_device_and_zero_disables():
    """Unset, the chunk is 2048 tokens on CPU (8192 on CUDA, where a prefill step's launch cost is
    fixed); <= 0 turns chunking off."""
    assert Engine(model_path="tiny-llama", load_format="dummy").scheduler.chunked_prefill_size == 2048
    assert (
        Engine(model_path="tiny-llama", load_format="dummy", chunked_prefill_size=0).scheduler.chunked_prefill_size
        is None
    )
