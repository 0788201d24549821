"""gemv: y = x W^T (+ b) for a single row x, the shape of every linear layer in a batch-1 decode step.

cuBLAS picks a GEMM tile for [1, K] x [K, N] that leaves most of the GPU idle on some shapes (on an
H200, Qwen3-0.6B's o_proj, 2048 -> 1024, took 12.8 us for 4.2 MB: 0.33 TB/s). Here each program
owns BLOCK_N output features and streams their rows of W through registers, BLOCK_K columns at a
time, against the one row of x: a weight-bandwidth-bound dot product with N / BLOCK_N programs in
flight. Products and sums in float32, one rounding to the output dtype.

At batch 1 a decode step is a chain of a few hundred kernels of 2-8 us each, and the elementwise ones
between the projections cost their launch, not their bytes. Two of them run here, in the prologue
that makes the row x each program multiplies (every program re-reads the few KB of input, from L2):
- gemv_rmsnorm: x = rmsnorm(h + residual), the decoder layer's norm before qkv_proj and gate_up_proj
  (program 0 also writes the new residual stream h + residual);
- gemv_silu_and_mul: x = silu(gate) * up from gate_up_proj's output, before down_proj.
The activation rounds where labkit.kernels.silu_and_mul rounds. The norm needs the whole row's
statistic before it can scale, which would mean a pass over the row before the first weight load;
instead the products take h * norm_weight in float32 and the sum is scaled by 1 / rms(h) at the end
(one pass). That skips the two roundings to 16 bits of labkit.kernels.rmsnorm (normalized, then
scaled): the fused result is the more exact one, a few 16-bit ulps from the unfused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_K = 512
PLAIN, RMSNORM, SILU_AND_MUL = 0, 1, 2  # the prologue


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    R,
    NW,
    RES_OUT,
    N,
    K,
    stride_wn,
    eps,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)  # the norm's statistic, gathered on the way
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(X + k, mask=k_mask, other=0.0)
        if PROLOGUE == 1:  # sum w (h * norm weight); the 1 / rms(h) that scales it comes at the end
            if HAS_RESIDUAL:  # h = x + residual, rounded like torch's x + residual
                x = (x.to(tl.float32) + tl.load(R + k, mask=k_mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
                if pid == 0:
                    tl.store(RES_OUT + k, x, mask=k_mask)
            hf = x.to(tl.float32)
            sq += hf * hf
            x = hf * tl.load(NW + k, mask=k_mask, other=0.0).to(tl.float32)
        if PROLOGUE == 2:  # X is [gate | up], 2K wide
            gate = x.to(tl.float32)
            up = tl.load(X + K + k, mask=k_mask, other=0.0).to(tl.float32)
            x = (gate / (1.0 + tl.exp(-gate)) * up).to(X.dtype.element_ty)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if PROLOGUE == 1:
        acc *= tl.rsqrt(tl.sum(sq, 0) / K + eps)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, width: int) -> None:
    if x.numel() != width or x.shape[-1] != width:
        raise ValueError(f"gemv takes one row of {width} features, got x of shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous")


def _launch(
    row: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    prologue: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    res_out: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    n, k = weight.shape
    block_n = 16 if n >= 8192 else 8  # the sizes that won on an H200 (docs/benchmarks.md)
    block_k = min(MAX_BLOCK_K, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        row,
        weight,
        bias if bias is not None else row,  # never read without HAS_BIAS
        out,
        residual if residual is not None else row,  # nor these without their prologue
        norm_weight if norm_weight is not None else row,
        res_out if res_out is not None else row,
        n,
        k,
        weight.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8 if k >= 2048 else 4,
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] with unit stride along K, bias [N] or None ->
    [..., N] in x's dtype, equal to F.linear(x, weight, bias) up to float32 summation order."""
    n, k = weight.shape
    _check(x, weight, k)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(x.reshape(k).contiguous(), weight, bias, out)
    return out


def gemv_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rmsnorm(h, norm_weight, eps), weight, bias), h) with h = x + residual (residual None:
    h = x, returned as is): labkit.kernels.fused_add_rmsnorm (or rmsnorm) then gemv, in one kernel.
    x and residual [..., K] hold one row of one dtype; the new residual is a new tensor."""
    n, k = weight.shape
    _check(x, weight, k)
    if norm_weight.shape != (k,):
        raise ValueError(f"norm weight of shape {tuple(norm_weight.shape)} for {k} features")
    row = x.reshape(k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if residual is None:
        _launch(row, weight, bias, out, RMSNORM, None, norm_weight.contiguous(), None, eps)
        return out, x
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("the residual must have x's shape and dtype")
    res_out = torch.empty_like(row)  # not in place: other programs still read the residual
    _launch(row, weight, bias, out, RMSNORM, residual.reshape(k).contiguous(), norm_weight.contiguous(), res_out, eps)
    return out, res_out.view(x.shape)


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gemv(silu_and_mul(x), weight, bias) in one kernel: x [..., 2K] = [gate | up] holding one row,
    weight [N, K] -> [..., N] in x's dtype."""
    n, k = weight.shape
    _check(x, weight, 2 * k)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(x.reshape(2 * k).contiguous(), weight, bias, out, SILU_AND_MUL)
    return out
