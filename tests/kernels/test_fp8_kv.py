"""The Triton kernels on a float8 KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2), CUDA only:
store_kv quantizes (with saturation) exactly as the pool's torch path, decode_attention and
extend_attention dequantize in-kernel and match their torch references on fresh random inputs, and
the triton backend passes each layer's scales. CUDA only: Triton's interpreter (3.9) mis-rounds
float32 to float8 where rounding up reaches the next power of two (1.98 gives 1.0, not 2.0); on the
CPU the float8 pool is checked through torch_native (tests/test_kv_cache_fp8.py)."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.attention import AttentionLayerSpec
from labkit.attention.torch_native import TorchNativeAttnBackend
from labkit.kernels import ExtendPlan, decode_attention, extend_attention, store_kv
from labkit.kernels import decode_balanced as decode_balanced_module
from labkit.kernels.decode import BALANCED_MIN_BATCH, balanced
from labkit.kernels.extend import extend_blocks
from labkit.kernels.reference import reference_decode_attention, reference_extend_attention, reference_store_kv
from labkit.mem_cache.memory_pool import TokenToKVPool, quantize_kv
from labkit.model_executor.forward_batch import ForwardMode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="float8 kernels are checked on a GPU")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Powers of two: dividing by them is exact in the kernel as in torch, so stores compare bit for bit.
K_SCALE, V_SCALE = 0.5, 2.0
# (num_heads, num_kv_heads, head_dim, page_size)
SHAPES = [(32, 8, 128, 16), (8, 2, 64, 1), (14, 2, 64, 16), (8, 1, 256, 16), (4, 4, 96, 1)]
# Attention over float8-rounded K/V against the same attention over the unrounded K/V: the relative
# error of the output (its norm), a loose bound on the rounding of 3 / 2 mantissa bits.
QUANTIZATION_ERROR = {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.1}
LAYER = 1


def _fp8_ids(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _shape_id(s: tuple[int, int, int, int]) -> str:
    return f"h{s[0]}-kv{s[1]}-d{s[2]}-page{s[3]}"


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _fp8_pool(seq_lens, shape, fp8, gen, paged_kv):
    """(k, v float32 buffers, their float8 forms at K_SCALE / V_SCALE, req_to_token, rows)."""
    _, num_kv_heads, head_dim, page_size = shape
    k, v, req_to_token, rows = paged_kv(seq_lens, num_kv_heads, head_dim, page_size, torch.float32, gen)
    return k, v, quantize_kv(k, K_SCALE, fp8), quantize_kv(v, V_SCALE, fp8), req_to_token, rows


@pytest.mark.parametrize("fp8", FP8, ids=_fp8_ids)
def test_store_kv_quantizes_and_saturates_as_the_pool(fp8, dtype, device, gen):
    num_slots, num_tokens = 64, 20
    slots = torch.randperm(num_slots - 1, generator=gen, device=device)[:num_tokens] + 1
    k = (torch.randn(num_tokens, 2, 128, generator=gen, device=device) * 50).to(dtype)
    v = (torch.randn(num_tokens, 2, 128, generator=gen, device=device) * 50).to(dtype)
    k[0, 0, :3] = torch.tensor([1e5, -1e5, float("inf")], device=device)  # beyond e4m3's 448 at any scale
    v[1, 1, :2] = torch.tensor([1e38 if dtype == torch.float32 else 1e30, float("-inf")], device=device)
    bufs = [torch.zeros(num_slots, 2, 128, dtype=fp8, device=device) for _ in range(4)]
    store_kv(bufs[0], bufs[1], slots, k, v, K_SCALE, V_SCALE)
    reference_store_kv(bufs[2], bufs[3], slots, k, v, K_SCALE, V_SCALE)
    assert torch.equal(bufs[0].view(torch.uint8), bufs[2].view(torch.uint8))
    assert torch.equal(bufs[1].view(torch.uint8), bufs[3].view(torch.uint8))
    top = torch.finfo(fp8).max
    assert bufs[0][slots[0], 0, :3].float().tolist() == [top, -top, top]
    assert bufs[1][slots[1], 1, :2].float().tolist() == [top, -top]
    assert torch.isfinite(bufs[0].float()).all() and torch.isfinite(bufs[1].float()).all()


@pytest.mark.parametrize("fp8", FP8, ids=_fp8_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_decode_on_fp8_pool_matches_reference(shape, fp8, dtype, device, gen, paged_kv, check_close):
    """Ragged lengths with several splits each (and the default split heuristic): the dequantized
    attention of the torch reference, and close to attention over the unrounded K/V."""
    num_heads, _, head_dim, _ = shape
    seq_lens = [1, 37, 130, 1000, 4097, 16]
    k, v, k8, v8, req_to_token, rows = _fp8_pool(seq_lens, shape, fp8, gen, paged_kv)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    seq = torch.tensor(seq_lens, device=device)
    scale = head_dim**-0.5
    for splits in (torch.tensor([1, 3, 4, 8, 16, 2], dtype=torch.int32, device=device), None):
        out = torch.full_like(q, float("nan"))
        decode_attention(
            q, k8, v8, req_to_token, rows, seq, scale, out=out, num_kv_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE
        )
        ref = reference_decode_attention(q, k8, v8, req_to_token, rows, seq, scale, K_SCALE, V_SCALE)
        check_close(out, ref, dtype)
    unrounded = reference_decode_attention(q, k, v, req_to_token, rows, seq, scale)
    assert _relative_error(out, unrounded) < QUANTIZATION_ERROR[fp8]


@pytest.mark.parametrize("fp8", FP8, ids=_fp8_ids)
@pytest.mark.parametrize("batch", [BALANCED_MIN_BATCH, 130])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] <= 128], ids=_shape_id)
def test_decode_on_fp8_pool_over_the_balanced_partition_matches_reference(
    shape, batch, fp8, dtype, device, gen, paged_kv, check_close
):
    """Batches the one-warp programs take over the balanced partition (kernels/decode_balanced.py),
    ragged lengths up to 2000 tokens, at the device's own occupancy: the dequantized reference."""
    num_heads, _, head_dim, _ = shape
    seq_lens = torch.randint(1, 2001, (batch,), generator=gen, device=device).tolist()
    _, _, k8, v8, req_to_token, rows = _fp8_pool(seq_lens, shape, fp8, gen, paged_kv)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device).to(dtype)
    seq = torch.tensor(seq_lens, device=device)
    assert balanced(batch, 1, head_dim)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k8, v8, req_to_token, rows, seq, head_dim**-0.5, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = reference_decode_attention(q, k8, v8, req_to_token, rows, seq, head_dim**-0.5, K_SCALE, V_SCALE)
    check_close(out, ref, dtype)


def test_balanced_partition_cuts_the_same_ranges_from_its_first_launch(device, gen, paged_kv, monkeypatch):
    """The program count comes from the driver before a variant's first launch (not after it, from a
    guess): a fresh variant's first call and the next give the same bits."""
    monkeypatch.setattr(decode_balanced_module, "_PROGRAMS_PER_SM", {})
    seq_lens = torch.randint(1, 2001, (130,), generator=gen, device=device).tolist()
    _, _, k8, v8, req_to_token, rows = _fp8_pool(seq_lens, (16, 8, 128, 1), torch.float8_e4m3fn, gen, paged_kv)
    q = torch.randn(130, 16, 128, generator=gen, device=device).to(torch.bfloat16)
    seq = torch.tensor(seq_lens, device=device)
    first, again = (decode_attention(q, k8, v8, req_to_token, rows, seq, 128**-0.5) for _ in range(2))
    assert len(decode_balanced_module._PROGRAMS_PER_SM) == 1  # the balanced partition ran
    assert torch.equal(first, again)


@pytest.mark.parametrize("fp8", FP8, ids=_fp8_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_extend_on_fp8_pool_matches_reference(shape, fp8, dtype, device, gen, paged_kv, check_close):
    """Prefixes from the float8 pool (dequantized in-kernel), the new tokens from k, v unrounded."""
    num_heads, num_kv_heads, head_dim, _ = shape
    prefix_lens, extend_lens = [0, 19, 1500, 3, 64], [7, 1, 300, 129, 64]
    k_buf, v_buf, k8, v8, req_to_token, rows = _fp8_pool(prefix_lens, shape, fp8, gen, paged_kv)
    total = sum(extend_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(len(extend_lens))], device=device)
    prefix, ext = torch.tensor(prefix_lens, device=device), torch.tensor(extend_lens, device=device)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    plan = ExtendPlan.build(extend_lens, extend_blocks(head_dim, num_heads // num_kv_heads, dtype), device)
    extend_attention(
        q,
        k,
        v,
        k8,
        v8,
        req_to_token,
        rows,
        prefix,
        ext,
        starts,
        scale,
        out=out,
        plan=plan,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    args = (q, k, v, k8, v8, req_to_token, rows, prefix, ext, starts, scale)
    check_close(out, reference_extend_attention(*args, K_SCALE, V_SCALE), dtype)
    unrounded = reference_extend_attention(q, k, v, k_buf, v_buf, req_to_token, rows, prefix, ext, starts, scale)
    assert _relative_error(out, unrounded) < QUANTIZATION_ERROR[fp8]


@pytest.mark.parametrize("fp8", FP8, ids=_fp8_ids)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE], ids=lambda m: m.name)
def test_triton_backend_on_fp8_pool_passes_each_layers_scales(
    mode, fp8, dtype, device, gen, device_harness, check_close
):
    """Layer LAYER has its own scales (another layer's would give other values): the triton backend
    stores and reads with them. Extend and mixed rows match torch_native on the same pool; decode rows
    read their new token back from the pool, so they match the kernel reference over the pool."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    h = device_harness(2, num_heads, num_kv_heads, head_dim, 16, dtype=dtype, num_pages=128, max_ctx=2048)
    h.kv_pool = TokenToKVPool(h.kv_pool.size, 16, fp8, 2, num_kv_heads, head_dim, device)
    h.kv_pool.k_scale, h.kv_pool.v_scale = [1.0, K_SCALE], [1.0, V_SCALE]
    spec = AttentionLayerSpec(LAYER, num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim))
    shape = {
        ForwardMode.EXTEND: [(0, 7), (300, 70), (16, 20)],
        ForwardMode.MIXED: [(11, 1), (0, 13), (600, 1), (20, 6)],
        ForwardMode.DECODE: [(6, 1), (1000, 1), (17, 1)],
    }[mode]
    reqs = []
    for prefix, _ in shape:
        reqs.append(h.new_req())
        if prefix:
            fb = h.batch(ForwardMode.EXTEND, [(reqs[-1], prefix)])
            kv = torch.randn(2, prefix, num_kv_heads, head_dim, generator=gen, device=device) * 4
            h.kv_pool.set_kv_buffer(LAYER, fb.out_cache_loc, kv[0], kv[1])
    fb = h.batch(mode, [(r, n) for r, (_, n) in zip(reqs, shape)])
    q = torch.randn(fb.num_tokens, num_heads, head_dim, generator=gen, device=device).to(dtype)
    k = (torch.randn(fb.num_tokens, num_kv_heads, head_dim, generator=gen, device=device) * 4).to(dtype)
    v = (torch.randn(fb.num_tokens, num_kv_heads, head_dim, generator=gen, device=device) * 4).to(dtype)
    h.backend.init_forward_metadata(fb)
    out = h.backend.forward(q, k, v, spec, fb)
    k_stored, v_stored = (
        h.kv_pool.get_key_buffer(LAYER)[fb.out_cache_loc],
        h.kv_pool.get_value_buffer(LAYER)[fb.out_cache_loc],
    )
    assert torch.equal(k_stored.view(torch.uint8), quantize_kv(k, K_SCALE, fp8).view(torch.uint8))
    assert torch.equal(v_stored.view(torch.uint8), quantize_kv(v, V_SCALE, fp8).view(torch.uint8))
    if mode == ForwardMode.DECODE:
        r2t = h.req_pool.req_to_token
        ref = reference_decode_attention(
            q,
            h.kv_pool.k_buffer[LAYER],
            h.kv_pool.v_buffer[LAYER],
            r2t,
            fb.req_pool_indices,
            fb.seq_lens,
            spec.scaling,
            K_SCALE,
            V_SCALE,
        ).view(out.shape)
    else:
        native = TorchNativeAttnBackend(h.backend.config)
        native.init_forward_metadata(fb)
        ref = native.forward(q, k, v, spec, fb, save_kv_cache=False)
    check_close(out, ref, dtype)
