"""gemv (one-row linear layers) against F.linear on fresh random inputs, and the linear layers' choice
of it: a single 16-bit row on CUDA where in_features <= 4 x out_features, F.linear otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import labkit.kernels
from labkit.distributed.parallel_state import TPGroup
from labkit.kernels import gemv
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


def test_gemv_refuses_more_than_one_row(device):
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device))


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
