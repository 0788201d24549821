"""Overlap scheduling gives the same outputs as scheduling step by step, reports each
batch's tokens one step later, and returns all memory. On CPU it runs with overlap_schedule_on_cpu
(the forward is synchronous there, so only the bookkeeping is exercised); on CUDA, where it is the
default, the same tests run the real thing, and a decode step is checked never to wait for the GPU."""

from __future__ import annotations

import random

import pytest
import torch

from labkit import Engine


def make_engine(overlap: bool, **kw) -> Engine:
    kw.setdefault("model_path", "tiny-llama")
    kw.setdefault("load_format", "dummy")
    # float32: batches differ between the two modes (a finished request rides one more step), and
    # bfloat16 would let that flip near-tied greedy choices on a GPU.
    return Engine(
        overlap_schedule_on_cpu=overlap, disable_overlap_schedule=not overlap, dtype="float32", enable_trace=True, **kw
    )


def random_requests(seed: int, n: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    prompts, params = [], []
    for i in range(n):
        prefix = shared if i % 2 else []
        prompts.append(prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))])
        p = {"max_new_tokens": rng.randrange(1, 30), "temperature": rng.choice([0.0, 0.8]), "seed": i}
        if i % 5 == 3:
            p["frequency_penalty"] = 0.5  # needs the host's token history: that step runs without overlap
        if i % 4 == 1:
            p["stop_token_ids"] = [rng.randrange(3, 256) for _ in range(40)]
        params.append(p)
    return prompts, params


def run(engine: Engine, prompts, params) -> list[tuple[list[int], str]]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [(o["output_ids"], o["meta_info"]["finish_reason"]["type"]) for o in outs]


def assert_all_memory_back(engine: Engine) -> None:
    sched = engine.scheduler
    assert not sched.has_work()
    engine.flush_cache()
    assert engine.allocator.available_size() == engine.allocator.size
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size


@pytest.mark.parametrize(
    "page_size, radix, mixed, pool",
    [
        (1, True, False, 4096),
        (4, True, True, 4096),
        (1, False, True, 4096),
        (1, True, False, 200),  # small pools: eviction and retraction while a batch is in flight
        (8, True, True, 256),
    ],
)
def test_overlap_gives_the_same_outputs(page_size, radix, mixed, pool):
    prompts, params = random_requests(page_size + pool, 16)
    kw = dict(
        page_size=page_size,
        disable_radix_cache=not radix,
        enable_mixed_chunk=mixed,
        max_total_tokens=pool,
        chunked_prefill_size=32,
        max_running_requests=8,
        schedule_conservativeness=0.05 if pool < 1000 else 1.0,
    )
    plain = make_engine(False, **kw)
    overlapped = make_engine(True, **kw)
    assert overlapped.scheduler.overlap and not plain.scheduler.overlap
    assert run(overlapped, prompts, params) == run(plain, prompts, params)
    for step in overlapped.tracer.steps:  # every slot accounted for at every step, placeholders or not
        p = step.pool
        assert p.free + p.evictable + p.protected + p.request_owned == p.total, step.step
    if pool < 1000:
        assert any(step.retracted for step in overlapped.tracer.steps)
    assert_all_memory_back(overlapped)


def test_overlap_reports_a_batch_one_step_later():
    engine = make_engine(True)
    rid = engine.add_request(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3, "temperature": 0})
    first = engine.step()  # the prefill is launched; its token is still on its way
    assert first.forward_mode == "EXTEND" and first.new_tokens == {}
    assert engine.scheduler.running[0].output_ids[-1] < 0  # the placeholder
    second = engine.step()  # the first decode is launched, the prefill's token arrives
    assert second.forward_mode == "DECODE" and list(second.new_tokens) == [rid]
    engine.run_until_done()
    assert len(engine.results[rid]["output_ids"]) == 3
    assert all(t >= 0 for t in engine.results[rid]["output_ids"])
    assert_all_memory_back(engine)


def test_abort_while_a_batch_is_in_flight_returns_everything():
    engine = make_engine(True, max_total_tokens=512)
    rids = [
        engine.add_request(input_ids=[3 + i] * 20, sampling_params={"max_new_tokens": 50, "ignore_eos": True})
        for i in range(4)
    ]
    for _ in range(5):
        engine.step()
    assert engine.scheduler.in_flight is not None
    engine.abort(rids[1])
    engine.run_until_done()
    aborted = engine.results[rids[1]]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert all(t >= 0 for t in aborted["output_ids"])
    assert all(len(engine.results[r]["output_ids"]) == 50 for r in rids if r != rids[1])
    assert_all_memory_back(engine)


@pytest.mark.slow
def test_overlap_with_the_embedded_model_gives_the_same_text():
    prompts = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Once upon a time"]
    params = {"max_new_tokens": 16, "temperature": 0}
    outs = {}
    for overlap in (False, True):
        engine = Engine(overlap_schedule_on_cpu=overlap, disable_overlap_schedule=not overlap)
        outs[overlap] = [o["text"] for o in engine.generate(prompts, params)]
    assert outs[True] == outs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_overlapped_decode_step_never_waits_for_the_gpu():
    engine = Engine(model_path="tiny-llama", load_format="dummy")
    assert engine.scheduler.overlap  # the default on CUDA
    for i in range(8):
        engine.add_request(input_ids=[3 + i] * 50, sampling_params={"max_new_tokens": 64, "ignore_eos": True})
    for _ in range(4):  # prefill and the first decodes (the tokens are then all placeholders)
        engine.step()
    torch.cuda.set_sync_debug_mode("error")  # any blocking copy or stream sync raises
    try:
        for _ in range(30):
            engine.scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine.run_until_done()
    assert_all_memory_back(engine)
