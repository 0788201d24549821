"""store_kv against its reference: every new token lands at its slot, nothing else changes."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import store_kv
from labkit.kernels.reference import reference_store_kv


@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 128), (8, 128)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_writes_each_token_at_its_slot(num_kv_heads, head_dim, page_size, dtype, device, gen):
    num_slots, num_tokens = 8 * page_size + page_size, 6
    slots = torch.randperm(num_slots - page_size, generator=gen, device=device)[:num_tokens] + page_size
    # The new tokens' K and V as strided views into one fused projection output, as models pass them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen, device=device).to(dtype)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    k_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv(k_buf, v_buf, slots, k, v)
    reference_store_kv(k_ref, v_ref, slots, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


def test_store_kv_casts_to_the_pool_dtype(device, gen):
    """float32 K/V into a bfloat16 pool: rounded to nearest on a GPU (exactly torch's cast); Triton's
    interpreter truncates instead, so on the CPU the values may differ by one bfloat16 step."""
    k = torch.randn(3, 2, 64, generator=gen, device=device)
    v = torch.randn(3, 2, 64, generator=gen, device=device)
    k_buf = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device=device)
    v_buf = torch.zeros_like(k_buf)
    slots = torch.tensor([5, 1, 7], device=device, dtype=torch.int32)
    store_kv(k_buf, v_buf, slots, k, v)
    for buf, src in ((k_buf, k), (v_buf, v)):
        if device.type == "cuda":
            assert torch.equal(buf[slots.long()], src.to(torch.bfloat16))
        else:
            torch.testing.assert_close(buf[slots.long()].float(), src, atol=0, rtol=2**-7)
