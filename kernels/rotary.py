"""Rotary position embedding, neox style (rotate halves), as labkit.layers.rotary.apply_rope, optionally
preceded by a per-head RMSNorm (Qwen3's q_norm / k_norm) in the same pass: the norm needs a whole head,
which this kernel holds anyway, and fusing it saves a copy of the strided q/k views, two norm launches
and a second trip through memory per layer. rotary_embedding_store also writes the rotated k and the
v of each token into the KV pool (store_kv's work) in the same launch: a decode or verify forward of
several rows then launches one kernel a layer fewer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.kv_cache import fp8_max, quantize_fp8, stores_into
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
    scale=1.0,
    FP8_MAX: tl.constexpr = 0.0,  # > 0: Xo is a float8 pool's row, stored as store_kv quantizes
):
    """Rope (after the per-head norm with HAS_NORM) on NUM_HEADS heads of token t, X to Xo. Results
    round to X's dtype, as the unfused kernels' outputs do; into a float8 pool (FP8_MAX), that rounded
    value is then quantized by `scale` as store_kv would store it."""
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
        x1 = ((x1 * rstd).to(X.dtype.element_ty).to(tl.float32) * w1).to(X.dtype.element_ty).to(tl.float32)
        x2 = ((x2 * rstd).to(X.dtype.element_ty).to(tl.float32) * w2).to(X.dtype.element_ty).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(X.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(X.dtype.element_ty)
    if FP8_MAX > 0:
        y1 = quantize_fp8(y1, scale, FP8_MAX)
        y2 = quantize_fp8(y2, scale, FP8_MAX)
    o_ptr = Xo + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, y1.to(Xo.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, y2.to(Xo.dtype.element_ty), mask=mask)


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
    V,
    V_buf,
    Loc,
    k_scale,
    v_scale,
    stride_vt,
    stride_kbs,
    stride_vbs,
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
    STORE: tl.constexpr,  # k to K_buf and v to V_buf at slot Loc[t] (a third program copies v)
    FP8_MAX: tl.constexpr,  # > 0: the pool is float8, stored divided by k_scale / v_scale (store_kv's rule)
    V_ROW: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    if STORE:
        slot = tl.load(Loc + t).to(tl.int64)
        if tl.program_id(1) == 2:
            offs_v = tl.arange(0, BLOCK_V)
            row = tl.load(V + t * stride_vt + offs_v, mask=offs_v < V_ROW)
            if FP8_MAX > 0:
                row = quantize_fp8(row, v_scale, FP8_MAX)
            tl.store(V_buf + slot * stride_vbs + offs_v, row.to(V_buf.dtype.element_ty), mask=offs_v < V_ROW)
            return
        # The slot's row as K_out's token 0: rope_heads writes token t at K_out + t * stride_kot.
        K_out += slot * stride_kbs
        stride_kot = 0
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
            k_scale,
            FP8_MAX,
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
    q_out, k_out = (
        (q, k)
        if inplace
        else (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
        )
    )
    _launch(positions, q, k, q_out, k_out, cos_sin_cache, norm_weights, eps, None)
    return q_out, k_out


def rotary_embedding_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """rotary_embedding's q (a new contiguous tensor), with the rotated k and v [T, H_kv, D] (last dim
    contiguous, the heads of a token adjacent) written into the pool's k_buffer / v_buffer [slots,
    H_kv, D] at slots loc [T], as store_kv(..., k_scale, v_scale) writes them: the same bits as the
    two kernels. The buffers hold q's dtype or float8 (quantized by the layer's scales)."""
    assert k_buffer.dtype == v_buffer.dtype and stores_into(k_buffer.dtype, q.dtype)
    assert k_buffer.shape[1:] == k.shape[1:] == v.shape[1:]
    assert k_buffer[0].is_contiguous() and v_buffer[0].is_contiguous() and v.stride()[1:] == (v.shape[2], 1)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    store = (v, v_buffer, loc, k_scale, v_scale)
    _launch(positions, q, k, q_out, k_buffer, cos_sin_cache, norm_weights, eps, store)
    return q_out


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None,  # (v, v_buffer, loc, scales)
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape[2] == head_dim and cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    if norm_weights is not None:
        assert all(w.shape == (head_dim,) and w.is_contiguous() for w in norm_weights)
    q_w, k_w = norm_weights if norm_weights is not None else (cos_sin_cache, cos_sin_cache)  # unread
    v, v_buffer, loc, k_scale, v_scale = store if store is not None else (q, q, positions, 1.0, 1.0)  # unread
    half = head_dim // 2
    _rope_kernel[(num_tokens, 2 if store is None else 3)](
        positions,
        q,
        k,
        q_out,
        k_out,
        cos_sin_cache,
        q_w,
        k_w,
        eps,
        v,
        v_buffer,
        loc,
        k_scale,
        v_scale,
        v.stride(0),
        k_out.stride(0),
        v_buffer.stride(0),
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
        STORE=store is not None,
        FP8_MAX=fp8_max(k_out.dtype) if store is not None else 0.0,
        V_ROW=num_k_heads * head_dim,
        BLOCK_V=triton.next_power_of_2(num_k_heads * head_dim),
        num_warps=4,
        **pdl_options(q.device, num_tokens),
    )
