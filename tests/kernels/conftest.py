"""Kernel tests: fixtures. Without CUDA the kernels run in Triton's interpreter (tests/conftest.py
turns it on before any test module loads). On CUDA every test also runs in bfloat16."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator on DEVICE seeded from the test id: fresh inputs per case, reproducible per case."""
    g = torch.Generator(device=DEVICE)
    g.manual_seed(sum(ord(c) * 31**i for i, c in enumerate(request.node.nodeid)) % 2**31)
    return g


def _check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """out vs a float32 reference: every element finite; float32 to ~1e-5, bfloat16 to ~1e-2
    (relative norm of the error, plus an elementwise bound)."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    out, ref = out.double(), ref.double()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5 * scale, rtol=1e-4)
        return
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rel < 1e-2 * scale, f"relative error {rel:.2e}"
    torch.testing.assert_close(out, ref, atol=4e-2 * scale, rtol=4e-2)


@pytest.fixture
def check_close():
    return _check_close


def _paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_rows: int = 2,
):
    """A random pool holding sequences of seq_lens in shuffled, non-contiguous pages.

    Returns (k_buffer, v_buffer [num_slots, H_kv, D], req_to_token [rows, max_ctx] int64,
    req_pool_indices [B] int64 (shuffled rows)). Page 0 is reserved as in TokenToKVPool; every slot,
    used or not, holds random data, so reading a wrong slot shows."""
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = 1 + sum(pages_per_req) + 2
    pages = torch.randperm(num_pages - 1, generator=gen, device=DEVICE) + 1
    rows = torch.randperm(len(seq_lens) + spare_rows, generator=gen, device=DEVICE)[: len(seq_lens)]
    max_ctx = max(max(seq_lens), 1) + page_size
    req_to_token = torch.zeros(len(seq_lens) + spare_rows, max_ctx, dtype=torch.int64, device=DEVICE)
    offsets = torch.arange(page_size, device=DEVICE)
    used = 0
    for row, n, p in zip(rows.tolist(), seq_lens, pages_per_req):
        slots = (pages[used : used + p, None] * page_size + offsets).reshape(-1)[:n]
        req_to_token[row, :n] = slots
        used += p
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v_buffer = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    return k_buffer, v_buffer, req_to_token, rows


@pytest.fixture
def paged_kv():
    return _paged_kv


@pytest.fixture
def device_harness(paged_kv_harness):
    """tests/conftest.py's PagedKVHarness with its pools, forward batches and backend on DEVICE (the
    harness itself builds everything on the CPU). Construct it as PagedKVHarness, backend by name."""
    from dataclasses import fields, replace

    from labkit.attention import get_attention_backend

    class DeviceHarness(paged_kv_harness):
        def __init__(self, *args, backend: str = "triton", **kwargs):
            super().__init__(*args, **kwargs)
            self.req_pool.req_to_token = self.req_pool.req_to_token.to(DEVICE)
            self.kv_pool.k_buffer = [b.to(DEVICE) for b in self.kv_pool.k_buffer]
            self.kv_pool.v_buffer = [b.to(DEVICE) for b in self.kv_pool.v_buffer]
            self.backend = get_attention_backend(backend)(replace(self.backend.config, device=DEVICE))

        def batch(self, mode, items, input_ids=None):
            fb = super().batch(mode, items, input_ids)
            moved = {
                f.name: getattr(fb, f.name).to(DEVICE)
                for f in fields(fb)
                if isinstance(getattr(fb, f.name), torch.Tensor)
            }
            return replace(fb, **moved, attn_backend=self.backend)

    return DeviceHarness
