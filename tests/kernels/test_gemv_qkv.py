"""gemv_qkv_rope_store (qkv_proj, rotary and the KV store in one kernel) against the unfused chain it
replaces, gemv_rmsnorm then rotary_embedding then store_kv, on fresh random inputs: the same bits in
q, in the pool rows of the token's slot and in the new residual, nothing else in the pool touched,
the semaphores left zero. One exception, seen on an H200: float32 heads with the q/k norm, whose sum
of squares a GPU may reduce in another order in each kernel, give q within a few float32 ulps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from labkit.kernels import gemv_rmsnorm, rotary_embedding, store_kv
from labkit.kernels.gemv import Split, semaphore_count
from labkit.kernels.gemv_qkv import QKVHeads, fuses_qkv, gemv_qkv_rope_store
from labkit.layers.rotary import RotaryEmbedding

SLOTS = 6


def _layer(num_q, num_kv, head_dim, hidden, bias, qk_norm, dtype, device, gen, split_k=None):
    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    n = (num_q + 2 * num_kv) * head_dim
    norms = (1 + rand(head_dim, scale=0.1), 1 + rand(head_dim, scale=0.1)) if qk_norm else None
    heads = QKVHeads(num_q, num_kv, head_dim, torch.zeros(num_q + num_kv, dtype=torch.int32, device=device), norms)
    weights = {
        "norm_weight": 1 + rand(hidden, scale=0.1),
        "eps": 1e-6,
        "weight": rand(n, hidden, scale=hidden**-0.5),
        "bias": rand(n) if bias else None,
        "split": Split(split_k, torch.zeros(semaphore_count(n), dtype=torch.int32, device=device)),
    }
    return heads, weights


@pytest.mark.parametrize(
    "num_q, num_kv, head_dim, hidden, bias, qk_norm",
    [
        (4, 2, 64, 96, True, False),  # Qwen2.5-like: bias, no q/k norm
        (4, 2, 128, 160, False, True),  # Qwen3-like
        (2, 1, 32, 48, False, False),  # Llama-like, one KV head
    ],
    ids=["qwen2", "qwen3", "llama"],
)
@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "residual"])
@pytest.mark.parametrize("split_k", [None, 4], ids=["whole_k", "split_k"])  # split: a deep TP's narrow qkv
@pytest.mark.parametrize("pool_dtype", [None, torch.float8_e4m3fn], ids=["model", "e4m3"])
def test_fused_qkv_equals_gemv_then_rotary_then_store_kv(
    num_q, num_kv, head_dim, hidden, bias, qk_norm, with_residual, split_k, pool_dtype, dtype, device, gen
):
    """A float8 pool holds k / k_scale and v / v_scale as store_kv stores them (the bytes compared)."""
    heads, w = _layer(num_q, num_kv, head_dim, hidden, bias, qk_norm, dtype, device, gen, split_k)
    scales = {"k_scale": 0.25, "v_scale": 0.125} if pool_dtype else {}
    x = torch.randn(1, hidden, generator=gen, device=device).to(dtype)
    residual = torch.randn(1, hidden, generator=gen, device=device).to(dtype) if with_residual else None
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}, 4096)
    inputs = rope.kernel_inputs(torch.tensor([1234], device=device))
    loc = torch.tensor([3], dtype=torch.int32, device=device)
    before = [torch.randn(SLOTS, num_kv, head_dim, generator=gen, device=device) for _ in range(2)]
    before = [p.to(pool_dtype or dtype) for p in before]
    k_ref, v_ref, k_buf, v_buf = [p.clone() for p in before + before]
    assert fuses_qkv(heads, k_buf, x)

    qkv, res_ref = gemv_rmsnorm(x, residual, w["norm_weight"], w["eps"], w["weight"], w["bias"], w["split"])
    q, k, v = qkv.view(-1).split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim])
    q_ref, k_roped = rotary_embedding(
        inputs.rows, q.view(1, num_q, head_dim), k.view(1, num_kv, head_dim), inputs.table, False, heads.norm_weights
    )
    store_kv(k_ref, v_ref, loc, k_roped, v.view(1, num_kv, head_dim), **scales)

    def same(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    for _ in range(2):  # the semaphores serve launch after launch
        q_out, res_out = gemv_qkv_rope_store(
            x, residual, **w, heads=heads, rope_table=inputs.table, k_buffer=k_buf, v_buffer=v_buf, loc=loc, **scales
        )
        if qk_norm and dtype == torch.float32 and q_out.is_cuda:
            torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(q_out, q_ref)
        assert torch.equal(res_out, res_ref)
        assert same(k_buf, k_ref) and same(v_buf, v_ref)  # slot 3 written, the rest untouched
        assert not heads.semaphores.any() and not w["split"].semaphores.any()
    for buf, old in zip((k_buf, v_buf), before):  # the slot's row was written
        assert not same(buf[3], old[3]) and same(buf[:3], old[:3])


def test_fused_qkv_refuses_what_it_does_not_take(device, gen):
    heads, w = _layer(2, 1, 32, 48, False, False, torch.float32, device, gen)
    x = torch.randn(1, 48, device=device)
    table = torch.zeros(1, 32, device=device)
    loc = torch.zeros(1, dtype=torch.int32, device=device)
    pool = torch.zeros(SLOTS, 1, 32, device=device)
    assert not fuses_qkv(heads, pool.half(), x)  # a pool of another 16-bit dtype: store_kv's cast
    assert fuses_qkv(heads, pool.to(torch.float8_e4m3fn), x)  # float8: quantized in the kernel
    assert not fuses_qkv(QKVHeads(2, 1, 48, heads.semaphores), pool, x)  # heads of 48: not a power of two
    with pytest.raises(ValueError, match="does not take"):
        gemv_qkv_rope_store(
            x,
            None,
            **w,
            heads=QKVHeads(3, 1, 32, heads.semaphores),
            rope_table=table,
            k_buffer=pool,
            v_buffer=pool,
            loc=loc,
        )
    with pytest.raises(ValueError, match="pool buffer"):
        gemv_qkv_rope_store(
            x, None, **w, heads=heads, rope_table=table, k_buffer=pool[:, :, :16], v_buffer=pool, loc=loc
        )
    with pytest.raises(ValueError, match="rope table"):
        gemv_qkv_rope_store(x, None, **w, heads=heads, rope_table=table[:, :16], k_buffer=pool, v_buffer=pool, loc=loc)
    with pytest.raises(ValueError, match="one row"):
        gemv_qkv_rope_store(
            x.expand(2, 48), None, **w, heads=heads, rope_table=table, k_buffer=pool, v_buffer=pool, loc=loc
        )


def test_the_environment_switch_turns_the_fusion_off():
    code = "import labkit.kernels.gemv_qkv as g; print(g.ENABLED)"
    env = {**os.environ, "LABKIT_DISABLE_FUSED_QKV": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
