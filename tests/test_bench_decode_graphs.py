"""labkit.bench.decode_graphs: it times CUDA graphs, so without a CUDA device it says so and stops
(its figures come from the GPU machine: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from labkit.bench import decode_graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_decode_graphs_needs_a_cuda_device():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        decode_graphs.main(["--batch-sizes", "1", "2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_times_every_size_asked_for():
    rows = decode_graphs.main(["--model", "tiny-llama", "--context", "32", "--batch-sizes", "1", "3", "--replays", "2"])
    assert [bs for bs, *_ in rows] == [1, 3]
    assert all(device > 0 and launch > 0 and replay > 0 for _, device, launch, replay in rows)
