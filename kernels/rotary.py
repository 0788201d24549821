"""Rotary position embedding, neox style (rotate halves), as labkit.layers.rotary.apply_rope, optionally
preceded by a per-head RMSNorm (Qwen3's q_norm / k_norm) in the same pass: the norm needs a whole head,
which this kernel holds anyway, and fusing it saves a copy of the strided q/k views, two norm launches
and a second trip through memory per layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.pdl import pdl_options, pdl_wait


@triton.jit
def rope_heads(
    X,
    Xo,
    W,
    eps,
    t,
    stride_t,
    stride_h,
    stride_ot,
    stride_oh,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FROM_L2: tl.constexpr,  # X was written by other programs of this launch: load past L1 (".cg")
):
    """Rope (after the per-head norm with HAS_NORM) on NUM_HEADS heads of token t, X to Xo."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    x_ptr = X + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    if FROM_L2:
        x1 = tl.load(x_ptr, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # as kernels.norm: normalize in float32, round to the dtype, scale, round again
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(Xo.dtype.element_ty).to(tl.float32) * w1).to(Xo.dtype.element_ty).to(tl.float32)
        x2 = ((x2 * rstd).to(Xo.dtype.element_ty).to(tl.float32) * w2).to(Xo.dtype.element_ty).to(tl.float32)
    o_ptr = Xo + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, (x1 * cos - x2 * sin).to(Xo.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, (x2 * cos + x1 * sin).to(Xo.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Positions,
    Q,
    K,
    Q_out,
    K_out,
    Cos_sin,
    Q_w,
    K_w,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(Cos_sin + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Cos_sin + pos * stride_cs + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:  # q and k in two programs: at a few tokens, latency is the cost
        rope_heads(
            Q,
            Q_out,
            Q_w,
            eps,
            t,
            stride_qt,
            stride_qh,
            stride_qot,
            stride_qoh,
            cos,
            sin,
            NUM_Q_HEADS,
            HALF,
            BLOCK_HQ,
            BLOCK_HALF,
            HAS_NORM,
            False,
        )
    else:
        rope_heads(
            K,
            K_out,
            K_w,
            eps,
            t,
            stride_kt,
            stride_kh,
            stride_kot,
            stride_koh,
            cos,
            sin,
            NUM_K_HEADS,
            HALF,
            BLOCK_HK,
            BLOCK_HALF,
            HAS_NORM,
            False,
        )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inplace: bool = False,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope on q [T, H, D] and k [T, H_kv, D] at positions [T] (int32/int64).

    cos_sin_cache [max_position, D] (kernels.reference.cos_sin_cache): cos(pos * inv_freq) in the first
    D/2 columns, sin in the last D/2. Each head is split into halves x1, x2 and becomes
    [x1 cos - x2 sin, x2 cos + x1 sin] (neox style, = labkit's apply_rope), computed in float32 and
    rounded once to the input dtype. q, k: strides free on the first two dims, last dim contiguous.
    inplace=True overwrites q and k and returns them; otherwise returns new contiguous tensors.
    norm_weights=(q_weight, k_weight), each [D]: every head is first RMS-normalized with eps and scaled
    by its weight, rounded to the input dtype as kernels.norm.rmsnorm does, then rotated."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape[2] == head_dim and cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    q_out, k_out = (
        (q, k)
        if inplace
        else (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
        )
    )
    if num_tokens == 0:
        return q_out, k_out
    if norm_weights is not None:
        assert all(w.shape == (head_dim,) and w.is_contiguous() for w in norm_weights)
    q_w, k_w = norm_weights if norm_weights is not None else (cos_sin_cache, cos_sin_cache)  # unread
    half = head_dim // 2
    _rope_kernel[(num_tokens, 2)](
        positions,
        q,
        k,
        q_out,
        k_out,
        cos_sin_cache,
        q_w,
        k_w,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        HAS_NORM=norm_weights is not None,
        num_warps=4,
        **pdl_options(q.device, num_tokens),
    )
    return q_out, k_out
