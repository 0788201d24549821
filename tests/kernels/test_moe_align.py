"""moe_align_block_size against its reference (entry for entry) and against the layout's invariants."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import moe_align_block_size
from labkit.kernels.reference import reference_moe_align_block_size

CUDA = torch.cuda.is_available()


def _routing(
    num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, device: torch.device, absent: float = 0.0
) -> torch.Tensor:
    """[T, k] int32 ids: k distinct experts per token (top-k of random logits), a fraction `absent` of
    the slots set to -1."""
    logits = torch.rand(num_tokens, num_experts, generator=gen, device=device)
    ids = logits.topk(top_k, dim=-1).indices.to(torch.int32)
    drop = torch.rand(ids.shape, generator=gen, device=device) < absent
    return torch.where(drop, -1, ids)


def _check_layout(topk_ids: torch.Tensor, block_size: int, num_experts: int, sorted_ids, expert_ids, num_post) -> None:
    """The invariants any consumer relies on, checked without the reference."""
    flat = topk_ids.reshape(-1).long().cpu()
    sorted_ids, expert_ids, n = sorted_ids.long().cpu(), expert_ids.long().cpu(), int(num_post)
    sentinel = flat.numel()
    assert n % block_size == 0 and n <= sorted_ids.numel()
    assert (sorted_ids[n:] == sentinel).all() and (expert_ids[n // block_size :] == -1).all()
    blocks = sorted_ids[:n].view(-1, block_size)
    experts = expert_ids[: n // block_size]
    assert ((experts >= 0) & (experts < num_experts)).all()
    assert (experts[1:] >= experts[:-1]).all(), "blocks in expert order"
    real = blocks != sentinel
    assert real.any(dim=1).all(), "no all-padding block"
    assert (flat[blocks.clamp(max=sentinel - 1)][real] == experts[:, None].expand_as(blocks)[real]).all()
    present = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
    assert torch.equal(blocks[real].sort().values, present), "every present pair exactly once"
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)
    assert torch.equal(torch.bincount(experts, minlength=num_experts), (counts + block_size - 1) // block_size)


def _check(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> None:
    out = moe_align_block_size(topk_ids, block_size, num_experts)
    ref = reference_moe_align_block_size(topk_ids, block_size, num_experts)
    for got, want, name in zip(out, ref, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert got.dtype == torch.int32 and torch.equal(got, want), name
    _check_layout(topk_ids, block_size, num_experts, *out)


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, block_size, absent",
    [
        (1, 8, 2, 4, 0.0),
        (1, 128, 8, 16, 0.0),  # Qwen3-30B-A3B decode: every expert but 8 empty
        (1, 8, 2, 16, 0.5),
        (37, 8, 1, 16, 0.0),
        (29, 16, 2, 8, 0.3),
        (64, 128, 8, 16, 0.2),
        (50, 256, 2, 8, 0.0),  # several chunks, 256 experts
        (1040, 4, 4, 32, 0.1),  # chunks of several tiles each
    ],
    ids=str,
)
def test_align_matches_reference(num_tokens, num_experts, top_k, block_size, absent, device, gen):
    _check(_routing(num_tokens, num_experts, top_k, gen, device, absent), block_size, num_experts)


def test_align_one_expert_takes_every_token(device, gen):
    ids = _routing(40, 16, 4, gen, device)
    ids[:, 1] = 5
    ids[:, 0] = torch.where(ids[:, 0] == 5, 6, ids[:, 0])  # distinct experts per token, as a router gives
    ids[3, 2] = 9
    _check(ids, 16, 16)


def test_align_with_int64_ids_block_size_not_a_power_of_two(device, gen):
    _check(_routing(23, 12, 3, gen, device, 0.2).long(), 6, 12)


def test_align_with_every_slot_absent_or_no_tokens(device):
    ids = torch.full((7, 2), -1, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 16, 8)
    assert int(num_post) == 0 and (sorted_ids == 14).all() and (expert_ids == -1).all()
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids[:0], 16, 8)
    assert int(num_post) == 0 and sorted_ids.numel() == 0 and expert_ids.numel() == 0


def test_align_rejects_bad_arguments(device):
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(4, dtype=torch.int32, device=device), 16, 8)
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(4, 2, device=device), 16, 8)
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(4, 2, dtype=torch.int32, device=device), 0, 8)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_align_replays_in_a_cuda_graph(device, gen):
    ids = _routing(33, 64, 8, gen, device, 0.1)
    moe_align_block_size(ids, 16, 64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_align_block_size(ids, 16, 64)
    ids.copy_(_routing(33, 64, 8, gen, device, 0.3))
    graph.replay()
    for got, want in zip(out, reference_moe_align_block_size(ids, 16, 64)):
        assert torch.equal(got, want)
