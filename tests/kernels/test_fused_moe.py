"""fused_moe against reference_fused_moe and against a dense formula (every expert on every token,
weighted by the routing scattered to [T, E]), which shares no code with either."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit.kernels import fused_moe
from labkit.kernels.reference import reference_fused_moe

CUDA = torch.cuda.is_available()


def _dense_moe(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64: out = sum_e W[t, e] * mlp_e(hidden[t]), W[t, e] the summed weights of t's slots on e."""
    num_experts, inter = w13.shape[0], w2.shape[2]
    gate_up = torch.einsum("th,enh->ten", hidden.double(), w13.double())
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    y = torch.einsum("tei,ehi->teh", act, w2.double())
    here = (topk_ids >= 0) & (topk_ids < num_experts)
    dense = torch.zeros(hidden.shape[0], num_experts + 1, dtype=torch.float64, device=hidden.device)
    dense.scatter_add_(1, torch.where(here, topk_ids, num_experts).long(), topk_weights.double())
    return torch.einsum("te,teh->th", dense[:, :num_experts], y)


def _problem(num_tokens, num_experts, top_k, hidden_size, inter, dtype, gen, device, absent=0.0):
    """Random inputs at the scale of a real layer (unit-variance hidden, 1/sqrt(fan-in) weights), k
    distinct experts per token from top-k of random logits with softmax weights, a fraction `absent`
    of the slots set to -1."""
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen, device=device) / hidden_size**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    drop = torch.rand(ids.shape, generator=gen, device=device) < absent
    return hidden, w13, w2, weights, torch.where(drop, -1, ids).to(torch.int32)


def _check(args, dtype, check_close, config=None) -> torch.Tensor:
    out = fused_moe(*args, config=config)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    check_close(out, reference_fused_moe(*args), dtype)
    check_close(out, _dense_moe(*args), dtype)
    return out


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden_size, inter, absent",
    [
        (1, 8, 2, 48, 40, 0.0),
        (1, 16, 1, 64, 32, 0.0),
        (6, 8, 8, 48, 40, 0.0),  # k = E: every expert takes every token
        (13, 16, 2, 40, 24, 0.3),  # -1 slots (expert parallelism)
        (5, 64, 4, 32, 16, 0.0),  # most experts take no token
    ],
    ids=str,
)
def test_fused_moe_matches_reference_and_dense(
    num_tokens, num_experts, top_k, hidden_size, inter, absent, dtype, device, gen, check_close
):
    args = _problem(num_tokens, num_experts, top_k, hidden_size, inter, dtype, gen, device, absent)
    _check(args, dtype, check_close)


@pytest.mark.parametrize(
    "config",
    [
        {"SORTED": 1, "BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 4},  # K steps
        {"SORTED": 1, "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 16, "num_warps": 8},
        {"SORTED": 0, "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8},
    ],
    ids=["sorted_m32_n32_k32_g4", "sorted_m16_n128_k16", "unsorted_n32_k32_g8"],
)
def test_fused_moe_with_other_tile_configs(config, dtype, device, gen, check_close):
    # 11 tokens x 3 of 8 experts: every expert takes several pairs.
    _check(_problem(11, 8, 3, 48, 40, dtype, gen, device, 0.2), dtype, check_close, config)


@pytest.mark.parametrize("layout", [0, 1], ids=["unsorted", "sorted"])
def test_fused_moe_with_intermediate_not_a_multiple_of_block_n(layout, dtype, device, gen, check_close):
    """The first GEMM makes silu(gate) * up per BLOCK_SIZE_N columns of the intermediate dim, reading
    gate rows n and up rows I + n of the expert: I 19 over N tiles of 16 leaves a last tile of 3
    columns (the rows it masks off lie past the expert's up rows), H 37 a last K step of 5."""
    config = {"SORTED": layout, "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2}
    _check(_problem(9, 6, 3, 37, 19, dtype, gen, device, 0.2), dtype, check_close, config)


@pytest.mark.parametrize("num_tokens", [1, 5, 9, 70])
def test_default_configs_cover_both_block_layouts(num_tokens, dtype, device, gen, check_close):
    """Decode batches run unsorted (SORTED 0), larger ones sorted; both against the references."""
    _check(_problem(num_tokens, 8, 2, 32, 24, dtype, gen, device, 0.1), dtype, check_close)


def test_fused_moe_with_strided_inputs_and_int64_ids(dtype, device, gen, check_close):
    hidden, w13, w2, weights, ids = _problem(7, 8, 2, 48, 40, dtype, gen, device, 0.2)
    wide = torch.randn(7, 64, generator=gen, device=device).to(dtype)
    wide[:, 8:56] = hidden
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] stored H-major
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    weights_t = weights.t().contiguous().t()
    args = (wide[:, 8:56], w13_t, w2_t, weights_t, ids.t().contiguous().t().long())
    assert not (args[0].is_contiguous() or args[1].is_contiguous() or args[3].is_contiguous())
    _check(args, dtype, check_close)


def test_fused_moe_tokens_without_experts_get_zeros(dtype, device, gen, check_close):
    hidden, w13, w2, weights, ids = _problem(4, 8, 2, 48, 40, dtype, gen, device)
    ids[1] = -1
    out = _check((hidden, w13, w2, weights, ids), dtype, check_close)
    assert (out[1] == 0).all()
    ids[:] = -1
    assert (fused_moe(hidden, w13, w2, weights, ids) == 0).all()


def test_fused_moe_with_no_tokens(device):
    hidden, w13, w2, weights, ids = _problem(0, 8, 2, 48, 40, torch.float32, None, device)
    out = fused_moe(hidden, w13, w2, weights, ids)
    assert out.shape == (0, 48)


def test_fused_moe_rejects_bad_arguments(device, gen):
    hidden, w13, w2, weights, ids = _problem(3, 4, 2, 16, 8, torch.float32, gen, device)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(hidden, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="topk"):
        fused_moe(hidden, w13, w2, weights[:2], ids[:2])
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(hidden, w13.double(), w2, weights, ids)
    with pytest.raises(ValueError, match="config"):
        fused_moe(hidden, w13, w2, weights, ids, config={"BLOCK_M": 16})


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("num_tokens", [3, 9], ids=["unsorted", "sorted"])
def test_fused_moe_replays_in_a_cuda_graph(num_tokens, dtype, device, gen, check_close):
    args = _problem(num_tokens, 16, 4, 64, 32, dtype, gen, device, 0.1)
    fused_moe(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*args)
    for buf, new in zip(args, _problem(num_tokens, 16, 4, 64, 32, dtype, gen, device, 0.3)):
        buf.copy_(new)
    graph.replay()
    check_close(out, reference_fused_moe(*args), dtype)


@pytest.mark.skipif(not CUDA, reason="real shapes are for the GPU (the interpreter would take minutes)")
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256, 1000])
def test_fused_moe_at_qwen3_30b_a3b_shapes(num_tokens, dtype, device, gen, check_close):
    """128 experts, top-8, hidden 2048, expert intermediate 768: every default tile config row."""
    args = _problem(num_tokens, 128, 8, 2048, 768, dtype, gen, device)
    check_close(fused_moe(*args), reference_fused_moe(*args), dtype)
