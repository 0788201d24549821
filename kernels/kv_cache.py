"""store_kv: write the K and V of this forward's new tokens into the paged pool (quantized to float8,
with saturation, when the pool stores float8: --kv-cache-dtype fp8_*)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.pdl import pdl_options, pdl_wait
from labkit.mem_cache.memory_pool import is_fp8


@triton.jit
def quantize_fp8(x, scale, FP8_MAX: tl.constexpr):
    """x / scale in float32, saturated to [-FP8_MAX, FP8_MAX] (quantize_kv's rule; the cast after it
    rounds to nearest even)."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_buf,
    V_buf,
    Loc,
    num_tokens,
    k_scale,
    v_scale,
    stride_kt,
    stride_vt,
    stride_kbs,
    stride_vbs,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0: the pool is not float8 (a plain cast, scales unused)
    PDL: tl.constexpr,
):
    """Copies a [BLOCK_T tokens, BLOCK_R elements] tile of the flattened [T, H_kv * D] rows."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_t = offs_t < num_tokens
    mask = mask_t[:, None] & (offs_r < ROW)[None, :]
    slots = tl.load(Loc + offs_t, mask=mask_t, other=0).to(tl.int64)
    rows = offs_t.to(tl.int64)[:, None]
    k = tl.load(K + rows * stride_kt + offs_r[None, :], mask=mask)
    v = tl.load(V + rows * stride_vt + offs_r[None, :], mask=mask)
    if FP8_MAX > 0:
        k = quantize_fp8(k, k_scale, FP8_MAX)
        v = quantize_fp8(v, v_scale, FP8_MAX)
    tl.store(K_buf + slots[:, None] * stride_kbs + offs_r[None, :], k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(V_buf + slots[:, None] * stride_vbs + offs_r[None, :], v.to(V_buf.dtype.element_ty), mask=mask)


def fp8_max(dtype: torch.dtype) -> float:
    """The FP8_MAX constexpr of a store into a buffer of `dtype`: its largest finite value for a
    float8 pool (quantize_fp8 saturates there), 0.0 for any other (a plain cast)."""
    return torch.finfo(dtype).max if is_fp8(dtype) else 0.0


def stores_into(pool_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a kernel that makes K/V in `dtype` may store them into a pool of `pool_dtype` itself,
    as store_kv would (rotary_embedding_store, gemv_qkv_rope_store): the same dtype, or float8
    (quantize_fp8 by the layer's scales)."""
    return pool_dtype == dtype or is_fp8(pool_dtype)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] with each row's H*D elements contiguous (a view when it already is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_buffer[loc[t]] = k[t] and v_buffer[loc[t]] = v[t] for every new token t, cast to the buffer dtype.

    k_buffer, v_buffer: [num_slots, H_kv, D] pool buffers of one layer (each slot's H_kv * D values
    contiguous); loc: [T] int32/int64 slot indices (any page size: a slot is one token's row, pages
    need not be contiguous); k, v: [T, H_kv, D], any token stride (e.g. views into a fused qkv
    output; copied first if a token's values are not contiguous). Slots repeated in loc (padding
    tokens sent to the reserved slot 0) end up holding one of the values. A float8 buffer gets
    k / k_scale and v / v_scale saturated to its finite range (labkit.mem_cache.memory_pool.quantize_kv;
    equal to it on a GPU); other buffers ignore the scales."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    assert _rows_contiguous(k_buffer) is k_buffer and _rows_contiguous(v_buffer) is v_buffer
    assert k_buffer.dtype == v_buffer.dtype
    row = num_heads * head_dim
    block_r = min(triton.next_power_of_2(row), 1024)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), 4096 // block_r))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(row, block_r))
    _store_kv_kernel[grid](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        num_tokens,
        k_scale,
        v_scale,
        k.stride(0),
        v.stride(0),
        k_buffer.stride(0),
        v_buffer.stride(0),
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        FP8_MAX=fp8_max(k_buffer.dtype),
        num_warps=4,
        **pdl_options(k.device, num_tokens),
    )
