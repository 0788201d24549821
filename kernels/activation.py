"""silu_and_mul: the gated MLP activation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2d] = cat(gate, up) -> silu(gate) * up [..., d], computed in float32 and rounded once
    to x's dtype. x needs a contiguous last dim; `out` (if given) must be contiguous."""
    d = x.shape[-1] // 2
    assert x.shape[-1] == 2 * d
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, d)
    if x2.shape[0] == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, o2, x2.stride(0), o2.stride(0), D=d, BLOCK=block, num_warps=4
    )
    return out
