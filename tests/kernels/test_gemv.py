"""gemv (one-row linear layers) against F.linear on fresh random inputs, alone and with the norm or
the activation before it fused in (against their references, then F.linear), and the linear layers'
choice of it: a single 16-bit row on CUDA where in_features <= 4 x out_features, F.linear otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import labkit.kernels
from labkit.distributed.parallel_state import TPGroup
from labkit.kernels import gemv, gemv_rmsnorm, gemv_silu_and_mul
from labkit.kernels.reference import reference_fused_add_rmsnorm, reference_rmsnorm, reference_silu_and_mul
from labkit.layers.linear import ColumnParallelLinear

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("n, k", [(64, 48), (1000, 777), (8192, 96), (24, 1536)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (1, 1)], ids=str)
def test_gemv_matches_linear(n, k, bias, lead, dtype, device, gen, check_close):
    x = torch.randn(*lead, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    out = gemv(x, w, b)
    assert out.shape == (*lead, n) and out.dtype == dtype
    check_close(out, F.linear(x.float(), w.float(), None if b is None else b.float()), dtype)


@pytest.mark.parametrize("n, k", [(64, 48), (1000, 777), (24, 1536)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "residual"])
def test_gemv_rmsnorm_is_the_norm_then_the_projection(n, k, with_residual, dtype, device, gen, check_close):
    x = (3 * torch.randn(1, k, generator=gen, device=device)).to(dtype)
    r = torch.randn(1, k, generator=gen, device=device).to(dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype)
    out, res = gemv_rmsnorm(x, r, nw, 1e-6, w, b)
    if r is None:
        normed, ref_res = reference_rmsnorm(x, nw, 1e-6), x
    else:
        normed, ref_res = reference_fused_add_rmsnorm(x, r, nw, 1e-6)
    assert torch.equal(res, ref_res)  # the new residual is x + r rounded as torch rounds it
    assert out.shape == (1, n) and out.dtype == dtype
    check_close(out, F.linear(normed.float(), w.float(), b.float()), dtype)
    if r is not None:
        assert res.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.parametrize("n, k", [(64, 48), (1000, 777), (24, 1536)], ids=str)
def test_gemv_silu_and_mul_is_the_activation_then_the_projection(n, k, dtype, device, gen, check_close):
    x = (2 * torch.randn(1, 1, 2 * k, generator=gen, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    out = gemv_silu_and_mul(x, w)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    check_close(out, F.linear(reference_silu_and_mul(x).float(), w.float()), dtype)


def test_gemv_refuses_more_than_one_row(device):
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device))
    with pytest.raises(ValueError, match="one row"):
        gemv_silu_and_mul(torch.zeros(2, 16, device=device), torch.zeros(4, 8, device=device))
    with pytest.raises(ValueError, match="one row"):
        x, w = torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device)
        gemv_rmsnorm(x, None, torch.ones(8, device=device), 1e-6, w)


@pytest.mark.skipif(not CUDA, reason="the layers take the kernel on CUDA only")
@pytest.mark.parametrize(
    "rows, in_features, out_features, x_dtype, kernel",
    [
        (1, 1024, 4096, torch.bfloat16, True),
        (1, 4864, 896, torch.bfloat16, False),  # tall K: cuBLAS's split-K wins
        (2, 1024, 4096, torch.bfloat16, False),
        (1, 1024, 4096, torch.float32, False),
    ],
)
def test_linear_takes_gemv_for_one_short_16_bit_row(monkeypatch, rows, in_features, out_features, x_dtype, kernel):
    layer = ColumnParallelLinear(in_features, [out_features], bias=True, tp=TPGroup()).to("cuda", x_dtype)
    torch.nn.init.normal_(layer.weight, std=in_features**-0.5)
    torch.nn.init.normal_(layer.bias)
    calls = []
    monkeypatch.setattr(labkit.kernels, "gemv", lambda *a: calls.append(1) or gemv(*a))
    x = torch.randn(rows, in_features, device="cuda", dtype=x_dtype)
    out = layer(x)
    assert bool(calls) == kernel
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()), atol=5e-2, rtol=5e-2
    )
