"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from labkit.layers.fused import triton_kernels, use_triton_kernels


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 and cast back (as Hugging Face does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: return norm(x). With it: x += residual first and return
        (norm(x + residual), x + residual), the new residual stream."""
        if use_triton_kernels(x):
            kernels = triton_kernels()
            if residual is None:
                return kernels.rmsnorm(x, self.weight, self.eps)
            return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused kernel
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:  # as Hugging Face: normalize in float32, cast back, then scale
            out = self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) when there is no residual yet (a
        model's first layer): the normalized input of a block and the residual stream after it."""
        if residual is None:
            return cast(torch.Tensor, self(x)), x
        normed, residual = self(x, residual)
        return normed, residual
