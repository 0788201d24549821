"""CPU cost of one scheduler step with the model taken out (its forward returns zero logits): batch
building, KV allocation, ForwardBatch tensors, sampling bookkeeping and result processing.

    .venv/bin/python -m pytest benchmarks -m microbench --benchmark-enable
"""

from __future__ import annotations

import pytest
import torch

from labkit import Engine

pytestmark = pytest.mark.microbench


def engine_without_model(batch_size: int) -> Engine:
    engine = Engine(
        model_path="tiny-llama",
        load_format="dummy",
        max_running_requests=batch_size,
        max_total_tokens=batch_size * 4096,
        chunked_prefill_size=-1,
        max_prefill_tokens=batch_size * 64,
    )
    runner = engine.model_runner
    runner.forward = lambda fb: torch.zeros(fb.batch_size, runner.vocab_size)
    return engine


def add_requests(engine: Engine, n: int) -> None:
    for i in range(n):
        engine.add_request(
            input_ids=[3 + (i + j) % 250 for j in range(32)],
            sampling_params={"temperature": 0, "max_new_tokens": 1 << 20, "ignore_eos": True},
        )


@pytest.mark.parametrize("batch_size", [1, 64, 256])
def test_decode_step(benchmark, batch_size):
    engine = engine_without_model(batch_size)
    add_requests(engine, batch_size)
    engine.scheduler.step()  # the prefill; every later step decodes all of them
    benchmark.pedantic(engine.scheduler.step, rounds=200, warmup_rounds=5)
    assert len(engine.scheduler.running) == batch_size


@pytest.mark.parametrize("batch_size", [1, 64, 256])
def test_prefill_step(benchmark, batch_size):
    engine = engine_without_model(batch_size)

    def setup():
        for req in list(engine.scheduler.running):
            engine.abort(req.rid)
        engine.scheduler.step()  # releases the aborted requests
        engine.flush_cache()
        add_requests(engine, batch_size)

    benchmark.pedantic(engine.scheduler.step, setup=setup, rounds=30)
    assert len(engine.scheduler.running) == batch_size
