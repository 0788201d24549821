"""RMSNorm, plain and fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    X,
    R,
    W,
    Out,
    Res_out,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded like torch's x + r
        tl.store(Res_out + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    # Normalize in float32, round to x's dtype, then scale (Hugging Face's order).
    normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, N] with a contiguous last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
) -> None:
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    rows = x.numel() // n
    if rows == 0:
        return
    x2, o2 = _rows(x), out.view(-1, n)
    r2 = _rows(residual) if residual is not None else x2
    ro2 = res_out.view(-1, n) if res_out is not None else o2
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(rows,)](
        x2,
        r2,
        weight,
        o2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        ro2.stride(0),
        eps,
        N=n,
        BLOCK_N=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dim of x [..., N]; weight [N].

    Computed in float32; the normalized value is rounded to x's dtype before the weight multiplies it
    (as labkit.layers.RMSNorm and Hugging Face do). Returns a new tensor of x's shape and dtype, or
    writes `out` (contiguous; may be x itself)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) in one pass; x, residual [..., N] of one dtype.

    The sum is rounded to x's dtype (as torch's x + residual) and both the norm and the returned
    residual use it. inplace=True writes the norm into x and the sum into residual (both contiguous)
    and returns them; otherwise both results are new tensors."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    if inplace:
        assert x.is_contiguous() and residual.is_contiguous()
        out, res_out = x, residual
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out
