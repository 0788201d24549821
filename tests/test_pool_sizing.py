"""--mem-fraction-static: the KV pool gets free - total * (1 - fraction) bytes of the GPU once the
weights are loaded (SGLang's rule), the smallest such figure of all tensor-parallel ranks on every
rank; clear errors for a fraction out of (0, 1), one that leaves nothing, and a CPU device."""

from __future__ import annotations

import gc
import struct

import pytest
import torch

from labkit import Engine
from labkit.distributed.parallel_state import TPGroup
from labkit.model_executor.model_runner import check_mem_fraction_static, kv_pool_bytes, tp_kv_pool_bytes

GIB = 1 << 30
CUDA = torch.cuda.is_available()


def test_pool_gets_what_the_fraction_leaves_after_the_weights():
    # 80 GiB GPU, 20 GiB taken by weights: at 0.9, 8 GiB stay for activations, 52 GiB for the pool.
    assert kv_pool_bytes(0.9, 60 * GIB, 80 * GIB) == 52 * GIB
    assert kv_pool_bytes(0.5, 60 * GIB, 80 * GIB) == 20 * GIB


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.2])
def test_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match=r"--mem-fraction-static must be in \(0, 1\)"):
        kv_pool_bytes(fraction, 60 * GIB, 80 * GIB)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        check_mem_fraction_static(fraction, torch.device("cuda"))


def test_fraction_that_leaves_nothing_after_the_weights_says_so():
    # 24 GiB taken of 80: at 0.3, 56 GiB must stay free but only 56 GiB are: nothing for the pool.
    with pytest.raises(
        ValueError, match=r"--mem-fraction-static 0.3 leaves no memory for the KV pool: .* take 24.00 GiB of 80.00 GiB"
    ):
        kv_pool_bytes(0.3, 56 * GIB, 80 * GIB)


def test_fraction_on_cpu_points_to_the_cpu_options(tiny_engine_kwargs):
    check_mem_fraction_static(None, torch.device("cpu"))  # unset: fine anywhere
    with pytest.raises(ValueError, match="--kv-memory-gb or --max-total-tokens"):
        check_mem_fraction_static(0.5, torch.device("cpu"))
    with pytest.raises(ValueError, match="--mem-fraction-static .* on cpu"):
        Engine(**tiny_engine_kwargs, mem_fraction_static=0.5)


class _TwoRanks:
    """Stands in for one rank of a two-rank TPGroup whose other rank reports `other` (free, total):
    gather_bytes / broadcast_bytes as TPGroup's, rank 0 or 1."""

    size = 2

    def __init__(self, rank: int, other: tuple[int, int]):
        self.rank, self.other = rank, other
        self.is_leader = rank == 0
        self.mine = b""

    def gather_bytes(self, data: bytes) -> list[bytes]:
        self.mine = data
        return [data, struct.pack("<2q", *self.other)] if self.is_leader else []

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        if self.is_leader:
            assert data is not None
            return data
        return struct.pack("<2q", *self.other) + self.mine  # rank 0's gather: its own first


def test_tensor_parallel_ranks_agree_on_the_smallest_pool():
    assert tp_kv_pool_bytes(0.9, 60 * GIB, 80 * GIB, TPGroup()) == (52 * GIB, 60 * GIB, 80 * GIB)
    roomy, tight = (60 * GIB, 80 * GIB), (50 * GIB, 80 * GIB)  # rank 1's GPU has 10 GiB less free
    leader = tp_kv_pool_bytes(0.9, *roomy, _TwoRanks(0, tight))
    follower = tp_kv_pool_bytes(0.9, *tight, _TwoRanks(1, roomy))
    assert leader == follower == (42 * GIB, *tight)
    with pytest.raises(ValueError, match="leaves no memory"):  # one rank short: every rank refuses
        tp_kv_pool_bytes(0.9, *roomy, _TwoRanks(0, (5 * GIB, 80 * GIB)))


@pytest.mark.skipif(not CUDA, reason="sizes the pool from a GPU's memory")
def test_engine_pool_follows_the_rule_on_cuda(monkeypatch):
    """An Engine at 0.5: the GPU memory is measured once the weights are in it, and the pool's bytes
    are the rule's figure for that measurement (less the rounding to whole tokens)."""
    seen: list[tuple[int, int]] = []
    measure = torch.cuda.mem_get_info

    def recorded(device=None):
        seen.append(measure(device))
        return seen[-1]

    monkeypatch.setattr(torch.cuda, "mem_get_info", recorded)
    total_before = measure()[1]
    engine = Engine(model_path="qwen2.5-0.5b", load_format="dummy", mem_fraction_static=0.5)
    weights = sum(p.numel() * p.element_size() for p in engine.model_runner.model.parameters())
    pool = engine.model_runner.token_to_kv_pool.nbytes()
    del engine  # half the GPU: give it back to the tests after this one
    gc.collect()
    torch.cuda.empty_cache()
    assert len(seen) == 1, "the runner measures the GPU once"
    free, total = seen[0]
    assert total == total_before and total - free >= weights  # measured with the weights loaded
    assert pool == pytest.approx(kv_pool_bytes(0.5, free, total), rel=0.03)
    assert pool + weights <= 0.5 * total
