"""rotary_embedding against its reference and labkit's apply_rope (the convention models use);
rotary_embedding_store against rotary_embedding then store_kv."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import rotary_embedding, rotary_embedding_store, store_kv
from labkit.kernels.reference import cos_sin_cache, reference_rotary_embedding
from labkit.layers.rotary import RotaryEmbedding, apply_rope


def _inputs(num_heads, num_kv_heads, head_dim, dtype, device, gen, fused=False):
    t = 7
    if fused:  # strided views into a fused projection
        qk = torch.randn(t, (num_heads + num_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
        q = qk[:, : num_heads * head_dim].view(t, num_heads, head_dim)
        k = qk[:, num_heads * head_dim :].view(t, num_kv_heads, head_dim)
    else:
        q = torch.randn(t, num_heads, head_dim, generator=gen, device=device).to(dtype)
        k = torch.randn(t, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=gen, device=device)
    return positions, q, k


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (14, 2)], ids=lambda h: f"h{h[0]}-kv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_reference(heads, head_dim, dtype, device, gen, check_close):
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}, 4096)
    cache = cos_sin_cache(rope._inv_freq_cpu.to(device), 4096)
    positions, q, k = _inputs(*heads, head_dim, dtype, device, gen, fused=True)
    q_ref, k_ref = reference_rotary_embedding(positions, q, k, cache)
    q_out, k_out = rotary_embedding(positions, q, k, cache)
    check_close(q_out, q_ref, dtype)
    check_close(k_out, k_ref, dtype)
    q_in, k_in = q.clone(), k.clone()  # in place: the inputs themselves become the result
    q_ip, k_ip = rotary_embedding(positions, q_in, k_in, cache, inplace=True)
    assert q_ip is q_in and k_ip is k_in
    check_close(q_in, q_ref, dtype)
    check_close(k_in, k_ref, dtype)


def test_rope_follows_labkit_apply_rope(device, gen, check_close):
    """Same convention (neox, rotate halves; llama3 frequency scaling included) as the model layers."""
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rope = RotaryEmbedding(64, params, 4096)
    positions, q, k = _inputs(8, 2, 64, torch.float32, device, gen)
    q_ref, k_ref = apply_rope(q, k, *rope.cos_sin(positions, torch.float32))
    q_out, k_out = rotary_embedding(positions, q, k, cos_sin_cache(rope._inv_freq_cpu.to(device), 4096))
    check_close(q_out, q_ref, torch.float32, scale=10)  # cos/sin of large angles: a few float32 ulps
    check_close(k_out, k_ref, torch.float32, scale=10)


@pytest.mark.parametrize("heads", [(16, 8), (14, 2)], ids=lambda h: f"h{h[0]}-kv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_with_qk_norm_matches_reference(heads, head_dim, dtype, device, gen, check_close):
    """Qwen3's per-head q/k RMSNorm fused in front of rope, on strided views of a fused projection."""
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 1000000.0}, 4096)
    cache = cos_sin_cache(rope._inv_freq_cpu.to(device), 4096)
    positions, q, k = _inputs(*heads, head_dim, dtype, device, gen, fused=True)
    q, k = q * 3 + 1, k * 0.5  # off unit scale and mean, so a missing norm shows
    weights = tuple(torch.rand(head_dim, generator=gen, device=device).add_(0.5).to(dtype) for _ in range(2))
    q_ref, k_ref = reference_rotary_embedding(positions, q, k, cache, norm_weights=weights, eps=1e-6)
    q_out, k_out = rotary_embedding(positions, q, k, cache, norm_weights=weights, eps=1e-6)
    check_close(q_out, q_ref, dtype)
    check_close(k_out, k_ref, dtype)


def test_rope_inputs_fused_norm_matches_torch_path(device, gen, check_close):
    """The layer's two paths agree: RopeInputs' kernel table with the norms fused, and its torch ops."""
    from labkit.layers import RMSNorm
    from labkit.layers.rotary import RopeInputs

    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 10000.0}, 4096)
    positions, q, k = _inputs(8, 2, 64, torch.float32, device, gen, fused=True)
    q_norm, k_norm = RMSNorm(64, 1e-6).to(device), RMSNorm(64, 1e-6).to(device)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=gen)
        k_norm.weight.uniform_(0.5, 1.5, generator=gen)
        q_f, k_f = rope.kernel_inputs(positions).apply(q, k, q_norm, k_norm)
        q_t, k_t = RopeInputs(cos_sin=rope.cos_sin(positions, torch.float32)).apply(q, k, q_norm, k_norm)
    check_close(q_f, q_t, torch.float32, scale=10)
    check_close(k_f, k_t, torch.float32, scale=10)


@pytest.mark.parametrize("pool_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=["model", "e4m3", "e5m2"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=lambda h: f"h{h[0]}-kv{h[1]}")
def test_rope_store_writes_what_rope_then_store_kv_write(heads, norm, pool_dtype, dtype, device, gen):
    """Bit for bit: q, and the pool (the rows at the slots written, every other row untouched). A
    float8 pool holds k / k_scale and v / v_scale, rounded and saturated as store_kv stores them
    (inputs large enough that some saturate)."""
    num_heads, num_kv_heads = heads
    head_dim, t, slots = 64, 7, 40
    scales = {"k_scale": 0.5, "v_scale": 2.0} if pool_dtype else {}
    magnitude = 400.0 if pool_dtype else 1.0
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device) * magnitude
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(t, -1, head_dim) for x in (q, k, v))
    table = torch.randn(t, head_dim, generator=gen, device=device)  # rows of cos | sin, as the layers' table
    rows = torch.arange(t, device=device)
    loc = torch.randperm(slots, generator=gen, device=device)[:t]
    weights = tuple(torch.randn(head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
    kw = {"norm_weights": weights, "eps": 1e-6} if norm else {}
    pool = torch.randn(2, slots, num_kv_heads, head_dim, generator=gen, device=device).to(pool_dtype or dtype)
    pools = [pool.clone(), pool.clone()]
    q_ref, k_ref = rotary_embedding(rows, q, k, table, **kw)
    store_kv(pools[0][0], pools[0][1], loc, k_ref, v, **scales)
    q_out = rotary_embedding_store(rows, q, k, v, table, pools[1][0], pools[1][1], loc, **kw, **scales)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(pools[1].view(torch.uint8), pools[0].view(torch.uint8))
    assert not torch.equal(pools[1].view(torch.uint8), pool.view(torch.uint8))  # the slots were written
