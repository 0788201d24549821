"""Gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.layers.fused import triton_kernels, use_triton_kernels


class SiluAndMul(nn.Module):
    """Input [..., 2*d] = cat(gate, up); output silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_kernels(x):
            return triton_kernels().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
