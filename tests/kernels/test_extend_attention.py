"""extend_attention (cached prefix + causal new tokens) against its dense reference."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import ExtendPlan, extend_attention
from labkit.kernels.extend import extend_blocks
from labkit.kernels.reference import reference_extend_attention

CUDA = torch.cuda.is_available()

SHAPES = [(4, 4, 64, 1), (8, 2, 128, 16), (8, 1, 64, 16), (8, 2, 64, 1), (9, 3, 64, 1), (12, 1, 64, 1), (4, 2, 256, 16)]
if CUDA:
    SHAPES = [(h * k, k, d, p) for h in (1, 4, 8) for k in (1, 2) for d in (64, 128) for p in (1, 16)]
    SHAPES += [(32, 8, 128, 16), (14, 2, 64, 1), (8, 2, 256, 16), (4, 4, 96, 1), (9, 3, 64, 1), (48, 1, 128, 1)]


def _run(shape, prefix_lens, extend_lens, dtype, device, gen, paged_kv, fused_qkv=False, plan=True):
    num_heads, num_kv_heads, head_dim, page_size = shape
    k_buf, v_buf, req_to_token, rows = paged_kv(prefix_lens, num_kv_heads, head_dim, page_size, dtype, gen)
    total = sum(extend_lens)
    if fused_qkv:  # strided views into one projection output, as models pass them
        qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(total, -1, head_dim) for t in (q, k, v))
    else:
        q = torch.randn(total, num_heads, head_dim, generator=gen, device=device).to(dtype)
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(len(extend_lens))], device=device)
    prefix, ext = torch.tensor(prefix_lens, device=device), torch.tensor(extend_lens, device=device)
    out = torch.full((total, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    scale = head_dim**-0.5
    extend_attention(
        q,
        k,
        v,
        k_buf,
        v_buf,
        req_to_token,
        rows,
        prefix,
        ext,
        starts,
        scale,
        out=out,
        plan=ExtendPlan.build(extend_lens, extend_blocks(head_dim, num_heads // num_kv_heads, dtype), device)
        if plan
        else None,
    )
    ref = reference_extend_attention(q, k, v, k_buf, v_buf, req_to_token, rows, prefix, ext, starts, scale)
    return out, ref


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}-page{s[3]}")
def test_extend_matches_reference_with_prefix_and_ragged_lengths(shape, dtype, device, gen, paged_kv, check_close):
    """No prefix, a prefix, one-token extends (decodes in a mixed batch), a tile boundary (> 64 new)."""
    prefix_lens, extend_lens = [0, 19, 40, 3], [7, 1, 70, 5]
    if CUDA:
        prefix_lens, extend_lens = [0, 19, 1500, 3, 0, 64], [7, 1, 300, 129, 1000, 64]
    out, ref = _run(shape, prefix_lens, extend_lens, dtype, device, gen, paged_kv)
    check_close(out, ref, dtype)


def test_extend_reads_strided_qkv_views_and_plans_itself(dtype, device, gen, paged_kv, check_close):
    out, ref = _run((8, 2, 64, 16), [16, 0], [3, 9], dtype, device, gen, paged_kv, fused_qkv=True, plan=False)
    check_close(out, ref, dtype)


def test_extend_plan_covers_every_token_once_longest_reach_first():
    blocks = extend_blocks(128, 4, torch.bfloat16)
    assert (blocks.rows, blocks.tile_tokens) == (128, 32)
    plan = ExtendPlan.build([1, 32, 33, 0, 70], blocks, device="cpu")
    tiles = list(zip(plan.tile_start.tolist(), plan.tile_req.tolist()))
    assert tiles == [(64, 4), (32, 4), (32, 2), (0, 4), (0, 2), (0, 1), (0, 0)]


def test_extend_blocks_pad_a_group_wider_than_the_rows():
    blocks = extend_blocks(128, 200, torch.bfloat16)
    assert blocks.rows == 256 and blocks.tile_tokens == 1
