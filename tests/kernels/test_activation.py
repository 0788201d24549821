"""silu_and_mul against its reference and labkit's SiluAndMul layer."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import silu_and_mul
from labkit.kernels.reference import reference_silu_and_mul
from labkit.layers.activation import SiluAndMul


@pytest.mark.parametrize("shape", [(5, 2 * 128), (3, 2 * 1000), (2, 3, 2 * 2500)], ids=str)
def test_silu_and_mul_matches_reference(shape, dtype, device, gen, check_close):
    x = (2 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    check_close(out, reference_silu_and_mul(x), dtype)
    check_close(out, SiluAndMul()(x), dtype)
