"""gemv (linear layers of one row, or up to its MAX_ROWS) against F.linear on fresh random inputs,
alone and with the norm or the activation before it fused in (against their references, then
F.linear), with K in one piece and split over programs (the semaphores left zero after each launch,
repeated launches bit-identical; two rows give each what a launch of it alone gives), and the
linear layers' choice of it: up to MAX_ROWS 16-bit rows on CUDA, F.linear otherwise."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import labkit.kernels
from labkit.distributed.parallel_state import TPGroup
from labkit.kernels import GemvSplit, gemv, gemv_rmsnorm, gemv_silu_and_mul
from labkit.kernels.gemv import Tiles, block_n, default_tiles, gemv_split_k, semaphore_count
from labkit.kernels.reference import reference_fused_add_rmsnorm, reference_rmsnorm, reference_silu_and_mul
from labkit.layers.linear import ColumnParallelLinear

gemv_module = importlib.import_module("labkit.kernels.gemv")  # the package's `gemv` is the function

CUDA = torch.cuda.is_available()


SPLITS = [None, 1, 4]  # the device's choice (pieces for the (24, 1536) weight without PDL), one, four


def split_of(split_k: int | None, n: int, device: torch.device) -> GemvSplit:
    """A split with semaphores of the caller's (as a linear layer keeps them): the tests check
    they are left zero."""
    return GemvSplit(split_k, torch.zeros(semaphore_count(n), dtype=torch.int32, device=device))


SHAPES = [(64, 48), (1000, 777), (24, 1536)]


@pytest.mark.parametrize("n, k, split_k", [(n, k, s) for n, k in SHAPES for s in SPLITS] + [(8192, 96, None)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (1, 1)], ids=str)
def test_gemv_matches_linear(n, k, bias, lead, split_k, dtype, device, gen, check_close):
    x = torch.randn(*lead, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    split = split_of(split_k, n, device)
    out = gemv(x, w, b, split)
    assert out.shape == (*lead, n) and out.dtype == dtype
    check_close(out, F.linear(x.float(), w.float(), None if b is None else b.float()), dtype)
    assert not split.semaphores.any()


@pytest.mark.parametrize("n, k", SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "residual"])
@pytest.mark.parametrize("split_k", SPLITS, ids=str)
def test_gemv_rmsnorm_is_the_norm_then_the_projection(n, k, with_residual, split_k, dtype, device, gen, check_close):
    x = (3 * torch.randn(1, k, generator=gen, device=device)).to(dtype)
    r = torch.randn(1, k, generator=gen, device=device).to(dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype)
    split = split_of(split_k, n, device)
    out, res = gemv_rmsnorm(x, r, nw, 1e-6, w, b, split)
    if r is None:
        normed, ref_res = reference_rmsnorm(x, nw, 1e-6), x
    else:
        normed, ref_res = reference_fused_add_rmsnorm(x, r, nw, 1e-6)
    assert torch.equal(res, ref_res)  # the new residual is x + r rounded as torch rounds it
    assert out.shape == (1, n) and out.dtype == dtype
    check_close(out, F.linear(normed.float(), w.float(), b.float()), dtype)
    if r is not None:
        assert res.data_ptr() not in (x.data_ptr(), r.data_ptr())
    assert not split.semaphores.any()


@pytest.mark.parametrize("n, k", SHAPES, ids=str)
@pytest.mark.parametrize("split_k", SPLITS, ids=str)
def test_gemv_silu_and_mul_is_the_activation_then_the_projection(n, k, split_k, dtype, device, gen, check_close):
    x = (2 * torch.randn(1, 1, 2 * k, generator=gen, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    split = split_of(split_k, n, device)
    out = gemv_silu_and_mul(x, w, None, split)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    check_close(out, F.linear(reference_silu_and_mul(x).float(), w.float()), dtype)
    assert not split.semaphores.any()


@pytest.mark.parametrize("n, k", [(64, 48), (24, 1536)], ids=str)
@pytest.mark.parametrize("split_k", [None, 4])
def test_two_rows_are_each_what_one_row_gives(n, k, split_k, dtype, device, gen):
    """A launch of two rows (a program per row; K whole) gives each row exactly what a launch of
    that row alone gives in one piece, with each prologue; the new residual's rows too."""
    x = (2 * torch.randn(2, 2 * k, generator=gen, device=device)).to(dtype)
    r = torch.randn(2, k, generator=gen, device=device).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype)
    split, one = split_of(split_k, n, device), split_of(1, n, device)
    both, each = gemv(x[:, :k], w, b, split), [gemv(x[i : i + 1, :k], w, b, one) for i in range(2)]
    assert torch.equal(both, torch.cat(each))
    both, each = gemv_silu_and_mul(x, w, b, split), [gemv_silu_and_mul(x[i : i + 1], w, b, one) for i in range(2)]
    assert torch.equal(both, torch.cat(each))
    (out, res), singles = gemv_rmsnorm(x[:, :k], r, nw, 1e-6, w, b, split), []
    for i in range(2):
        singles.append(gemv_rmsnorm(x[i : i + 1, :k], r[i : i + 1], nw, 1e-6, w, b, one))
    assert torch.equal(out, torch.cat([o for o, _ in singles])) and torch.equal(res, torch.cat([h for _, h in singles]))
    assert not split.semaphores.any()


@pytest.mark.parametrize("split_k", [2, 8])
def test_split_k_sums_the_pieces_in_a_fixed_order(split_k, device, gen):
    """The last split to arrive adds every split's partial in split order: repeated launches give
    bit-identical results, and the same semaphores serve launch after launch."""
    n, k = 96, 2048
    x = torch.randn(1, k, generator=gen, device=device)
    w = torch.randn(n, k, generator=gen, device=device)
    split = split_of(split_k, n, device)
    first = gemv(x, w, None, split)
    for _ in range(3):
        assert torch.equal(gemv(x, w, None, split), first)
    torch.testing.assert_close(first, F.linear(x, w), atol=1e-3, rtol=1e-4)


def test_gemv_split_k_cuts_tall_weights_only():
    sms = 132
    assert gemv_split_k(4096, 1024, sms) == 1  # qkv_proj: 512 tiles fill the GPU
    assert gemv_split_k(1024, 3072, sms) > 1  # down_proj: 128 tiles would leave half of it idle
    assert gemv_split_k(1024, 256, sms) == 1  # too short to cut
    assert gemv_split_k(8, 1 << 20, sms) <= 16


def test_default_tiles_narrow_a_whole_tall_weight_of_few_tiles_only():
    assert default_tiles(1024, 3072, 132) == Tiles(4, 2048, 8)  # Qwen3's down_proj: 128 tiles
    assert default_tiles(512, 1024, 132) == Tiles(4, 1024, 8)  # never a step past K
    assert default_tiles(4096, 14336, 132).block_n == block_n(4096)  # Llama-3-8B's: 512 tiles
    assert default_tiles(4096, 1024, 132).block_n == block_n(4096)  # wide
    # split pieces keep block_n(n): a split launch has semaphore_count(n) tiles
    assert default_tiles(1024, 3072, 132, split_k=4).block_n == block_n(1024)


def test_gemv_split_k_leaves_tall_weights_whole_under_pdl(monkeypatch):
    assert gemv_split_k(1024, 3072, 132, pdl=True) == 1
    monkeypatch.setattr(gemv_module, "SPLIT_UNDER_PDL", True)
    assert gemv_split_k(1024, 3072, 132, pdl=True) > 1


def test_gemv_refuses_a_bad_split(device):
    x, w = torch.zeros(1, 64, device=device), torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match="power of two"):
        gemv(x, w, None, GemvSplit(3))
    with pytest.raises(ValueError, match="semaphores"):
        gemv(x, w, None, GemvSplit(2, torch.zeros(0, dtype=torch.int32, device=device)))


def test_gemv_refuses_more_rows_than_it_takes(device):
    rows = gemv_module.MAX_ROWS + 1
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(rows, 8, device=device), torch.zeros(4, 8, device=device))
    with pytest.raises(ValueError, match="rows"):
        gemv_silu_and_mul(torch.zeros(rows, 16, device=device), torch.zeros(4, 8, device=device))
    with pytest.raises(ValueError, match="rows"):
        x, w = torch.zeros(rows, 8, device=device), torch.zeros(4, 8, device=device)
        gemv_rmsnorm(x, None, torch.ones(8, device=device), 1e-6, w)


@pytest.mark.skipif(not CUDA, reason="the layers take the kernel on CUDA only")
@pytest.mark.parametrize(
    "rows, in_features, out_features, x_dtype, kernel",
    [
        (1, 1024, 4096, torch.bfloat16, True),
        (1, 4864, 896, torch.bfloat16, True),  # tall: split along K
        (2, 1024, 4096, torch.bfloat16, True),
        (3, 1024, 4096, torch.bfloat16, False),
        (0, 1024, 4096, torch.bfloat16, False),
        (1, 1024, 4096, torch.float32, False),
    ],
)
def test_linear_takes_gemv_for_up_to_max_rows_of_16_bits(monkeypatch, rows, in_features, out_features, x_dtype, kernel):
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
