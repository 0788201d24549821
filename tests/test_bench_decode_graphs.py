"""labkit.bench.decode_graphs: the batch it times is a valid decode batch of the runner (checked on
the padded static path run eagerly, Triton's interpreter on CPU), and without a CUDA device it says
so and stops (its figures come from the GPU machine: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from labkit import Engine
from labkit.bench import decode_graphs
from labkit.model_executor.cuda_graph_runner import CudaGraphRunner


def test_the_timed_batch_replays_every_row_from_one_context():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(
        model_path="tiny-llama",
        load_format="dummy",
        device=device,
        dtype="float32",
        max_total_tokens=256,
        attention_backend="triton",
    )
    runner = CudaGraphRunner(engine.model_runner, max_bs=4, use_cuda_graph=False)
    free_before = engine.model_runner.token_to_kv_pool_allocator.available_size()
    req_slot, kv_slots = decode_graphs.context_of(engine, 40)
    assert engine.model_runner.req_to_token_pool.host[req_slot, :40].tolist() == kv_slots.tolist()
    logits = runner.replay(decode_graphs.decode_batch(runner, 4, req_slot, 40))
    assert logits.shape == (4, engine.model_runner.vocab_size) and torch.isfinite(logits).all()
    assert all(torch.equal(row, logits[0]) for row in logits)  # the same context and token in every row
    engine.model_runner.token_to_kv_pool_allocator.free(kv_slots)
    engine.model_runner.req_to_token_pool.free(req_slot)
    assert engine.model_runner.token_to_kv_pool_allocator.available_size() == free_before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_decode_graphs_needs_a_cuda_device():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        decode_graphs.main(["--batch-sizes", "1", "2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_times_every_size_asked_for():
    rows = decode_graphs.main(["--model", "tiny-llama", "--context", "32", "--batch-sizes", "1", "3", "--replays", "2"])
    assert [bs for bs, *_ in rows] == [1, 3]
    assert all(device > 0 and launch > 0 and replay > 0 for _, device, launch, replay in rows)
