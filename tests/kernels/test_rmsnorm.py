"""rmsnorm and fused_add_rmsnorm against their references and labkit's RMSNorm layer."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import fused_add_rmsnorm, rmsnorm
from labkit.kernels.reference import reference_fused_add_rmsnorm, reference_rmsnorm
from labkit.layers.rmsnorm import RMSNorm


@pytest.mark.parametrize("shape", [(5, 64), (3, 576), (2, 4, 128)], ids=str)
def test_rmsnorm_matches_reference(shape, dtype, device, gen, check_close):
    x = (3 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device=device)).to(dtype)
    check_close(rmsnorm(x, w, 1e-6), reference_rmsnorm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_fused_add_rmsnorm_returns_norm_and_new_residual(hidden, inplace, dtype, device, gen, check_close):
    x = torch.randn(4, hidden, generator=gen, device=device).to(dtype)
    r = torch.randn(4, hidden, generator=gen, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    ref_out, ref_res = reference_fused_add_rmsnorm(x, r, w, 1e-5)
    out, res = fused_add_rmsnorm(x, r, w, 1e-5, inplace=inplace)
    check_close(out, ref_out, dtype)
    assert torch.equal(res, ref_res)  # the sum is rounded exactly as torch's x + r
    if inplace:
        assert out.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()


def test_rmsnorm_matches_the_model_layer(dtype, device, gen, check_close):
    layer = RMSNorm(128, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.1 * torch.randn(128, generator=gen, device=device))
        x = torch.randn(6, 128, generator=gen, device=device).to(dtype)
        r = torch.randn(6, 128, generator=gen, device=device).to(dtype)
        check_close(rmsnorm(x, layer.weight, 1e-6), layer(x), dtype)
        out, res = fused_add_rmsnorm(x, r, layer.weight, 1e-6)
        ref_out, ref_res = layer(x, r)
        check_close(out, ref_out, dtype)
        assert torch.equal(res, ref_res)
