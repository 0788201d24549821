"""gemv: y = x W^T (+ b) for a single row x, the shape of every linear layer in a batch-1 decode step.

cuBLAS picks a GEMM tile for [1, K] x [K, N] that leaves most of the GPU idle on some shapes (on an
H200, Qwen3-0.6B's o_proj, 2048 -> 1024, took 12.8 us for 4.2 MB: 0.33 TB/s). Here each program
owns BLOCK_N output features and streams their rows of W through registers, BLOCK_K columns at a
time, against the one row of x: a weight-bandwidth-bound dot product with N / BLOCK_N programs in
flight. Products and sums in float32, one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_K = 512


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(X + k, mask=k_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] with unit stride along K, bias [N] or None ->
    [..., N] in x's dtype, equal to F.linear(x, weight, bias) up to float32 summation order."""
    n, k = weight.shape
    if x.numel() != k or x.shape[-1] != k:
        raise ValueError(f"gemv takes one row of {k} features, got x of shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous")
    row = x.reshape(k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n = 16 if n >= 8192 else 8  # the sizes that won on an H200 (docs/benchmarks.md)
    block_k = min(MAX_BLOCK_K, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        row,
        weight,
        bias if bias is not None else row,  # never read without HAS_BIAS
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8 if k >= 2048 else 4,
    )
    return out
