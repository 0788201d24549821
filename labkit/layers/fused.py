"""When the layers use labkit.kernels' fused Triton kernels instead of their plain torch ops.

On CUDA an eager forward of a small model is bound by kernel launches: RMSNorm with its residual
add, rotary and SiLU-and-mul are each one Triton kernel instead of three to six torch ops. Under
torch.compile (--enable-torch-compile) the torch ops stay: inductor fuses them itself. On CPU the
kernels would run in Triton's interpreter, so the torch ops stay there too."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def use_triton_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and not torch.compiler.is_compiling()


@functools.cache
def triton_kernels() -> ModuleType:
    """labkit.kernels, imported on first use (a CPU-only run never imports Triton) and then looked up
    once per call instead of re-running an import statement in every layer of every step."""
    import labkit.kernels

    return labkit.kernels
