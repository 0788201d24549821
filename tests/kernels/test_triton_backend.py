"""The "triton" attention backend gives torch_native's results: per layer call, and as whole-model
logits over prefill, decode, mixed and extend-with-prefix steps. The per-layer test also runs the
"flashinfer" backend where FlashInfer is importable (CUDA, 16-bit)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from labkit.attention import ATTENTION_BACKENDS, AttentionLayerSpec
from labkit.attention.torch_native import TorchNativeAttnBackend
from labkit.attention.triton_backend import TritonAttnBackend
from labkit.model_executor.forward_batch import ForwardMode

LAYER = 1  # not 0, so a layer-index mix-up shows
CUDA = torch.cuda.is_available()
BACKENDS = ["triton"] + (["flashinfer"] if CUDA and importlib.util.find_spec("flashinfer") else [])

SHAPES = {  # (prefix_len, new_len) per request
    ForwardMode.EXTEND: [(0, 7), (5, 9), (33, 1), (16, 20)],
    ForwardMode.DECODE: [(0, 1), (6, 1), (40, 1), (17, 1), (1, 1)],
    ForwardMode.MIXED: [(11, 1), (0, 13), (30, 1), (20, 6), (3, 1)],
}
if CUDA:  # long enough for several KV splits and several extend tiles
    SHAPES = {
        m: s + [(300, 1), (1000, 1)] if m == ForwardMode.DECODE else s + [(250, 70), (600, 1)]
        for m, s in SHAPES.items()
    }


# ((num_heads, num_kv_heads), head_dim, page_size); GQA 8 and more shapes only on CUDA (the
# interpreter is slow; the kernel tests cover GQA 8 on the CPU).
LAYER_SHAPES = [((8, 2), 64, 16), ((4, 4), 128, 1)]
if CUDA:
    LAYER_SHAPES += [((8, 1), 64, 1), ((32, 8), 128, 16), ((14, 2), 64, 1)]


def test_triton_is_a_registered_backend():
    assert ATTENTION_BACKENDS["triton"] is TritonAttnBackend


def _native_twin(h) -> TorchNativeAttnBackend:
    return TorchNativeAttnBackend(h.backend.config)


def _fill(h, shape, gen, device, dtype, spec):
    """Requests with their prefixes already in the pool; returns their slots."""
    reqs = []
    for prefix, _ in shape:
        r = h.new_req()
        if prefix:
            fb = h.batch(ForwardMode.EXTEND, [(r, prefix)])
            kv = torch.randn(2, prefix, spec.num_kv_heads, spec.head_dim, generator=gen, device=device).to(dtype)
            h.kv_pool.set_kv_buffer(LAYER, fb.out_cache_loc, kv[0], kv[1])
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(SHAPES), ids=lambda m: m.name)
@pytest.mark.parametrize(
    "heads,head_dim,page_size", LAYER_SHAPES, ids=[f"h{h}-kv{kv}-d{d}-page{p}" for (h, kv), d, p in LAYER_SHAPES]
)
def test_backend_matches_torch_native(
    backend, mode, heads, head_dim, page_size, dtype, device, gen, device_harness, check_close
):
    if backend == "flashinfer" and dtype == torch.float32:
        pytest.skip("FlashInfer's kernels take 16-bit K/V")
    num_heads, num_kv_heads = heads
    h = device_harness(
        2,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        dtype=dtype,
        num_pages=2048 // page_size,
        max_ctx=2048,
        backend=backend,
    )
    spec = AttentionLayerSpec(LAYER, num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim))
    reqs = _fill(h, SHAPES[mode], gen, device, dtype, spec)
    fb = h.batch(mode, [(r, n) for r, (_, n) in zip(reqs, SHAPES[mode])])
    q = torch.randn(fb.num_tokens, num_heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(fb.num_tokens, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(fb.num_tokens, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    h.backend.init_forward_metadata(fb)
    out = h.backend.forward(q, k, v, spec, fb)
    assert torch.equal(h.kv_pool.get_key_buffer(LAYER)[fb.out_cache_loc], k)
    assert torch.equal(h.kv_pool.get_value_buffer(LAYER)[fb.out_cache_loc], v)
    native = _native_twin(h)
    native.init_forward_metadata(fb)
    check_close(out, native.forward(q, k, v, spec, fb), dtype)


def test_decode_without_saving_kv_reads_new_token_from_arguments(dtype, device, gen, device_harness, check_close):
    """save_kv_cache=False: the pool is left alone and the new token's K/V still count."""
    h = device_harness(2, 8, 2, 64, 4, dtype=dtype)
    spec = AttentionLayerSpec(LAYER, 8, 2, 64, 0.125)
    reqs = _fill(h, [(5, 1), (30, 1), (12, 1)], gen, device, dtype, spec)
    fb = h.batch(ForwardMode.DECODE, [(r, 1) for r in reqs])
    q, k, v = (torch.randn(3, n, 64, generator=gen, device=device).to(dtype) for n in (8, 2, 2))
    before = h.kv_pool.get_key_buffer(LAYER).clone()
    h.backend.init_forward_metadata(fb)
    out = h.backend.forward(q, k, v, spec, fb, save_kv_cache=False)
    assert torch.equal(h.kv_pool.get_key_buffer(LAYER), before)
    native = _native_twin(h)
    native.init_forward_metadata(fb)
    check_close(out, native.forward(q, k, v, spec, fb, save_kv_cache=False), dtype)


def test_decode_with_kv_stored_by_the_layer_equals_decode_that_stores_it(dtype, device, gen, device_harness):
    """k = v = None (takes_stored_kv): attention over the pool as the layer left it, the same as the
    backend storing k, v first; a backend that reads the new K/V from its arguments refuses None."""
    h = device_harness(2, 8, 2, 64, 4, dtype=dtype)
    spec = AttentionLayerSpec(LAYER, 8, 2, 64, 0.125)
    reqs = _fill(h, [(5, 1), (30, 1), (12, 1)], gen, device, dtype, spec)
    fb = h.batch(ForwardMode.DECODE, [(r, 1) for r in reqs])
    q, k, v = (torch.randn(3, n, 64, generator=gen, device=device).to(dtype) for n in (8, 2, 2))
    h.backend.init_forward_metadata(fb)
    stored = h.backend.forward(q, k, v, spec, fb)  # stores k, v at out_cache_loc
    assert torch.equal(h.backend.forward(q, None, None, spec, fb), stored)
    native = _native_twin(h)
    native.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="needs the new tokens"):
        native.forward(q, None, None, spec, fb)


def test_decode_is_batch_invariant(device, gen, device_harness):
    """A request's decode output does not depend on which other requests share the batch (the split
    count may change with the batch: only rounding differs)."""
    h = device_harness(2, 8, 2, 64, 4)
    spec = AttentionLayerSpec(LAYER, 8, 2, 64, 0.125)
    reqs = _fill(h, [(5, 1), (130, 1), (12, 1)], gen, device, torch.float32, spec)
    q, k, v = (torch.randn(3, n, 64, generator=gen, device=device) for n in (8, 2, 2))
    fb = h.batch(ForwardMode.DECODE, [(r, 1) for r in reqs])
    h.backend.init_forward_metadata(fb)
    together = h.backend.forward(q, k, v, spec, fb)
    for i, r in enumerate(reqs):  # the same token again, alone
        h.lens[r] -= 1
        fb1 = h.batch(ForwardMode.DECODE, [(r, 1)])
        h.backend.init_forward_metadata(fb1)
        alone = h.backend.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], spec, fb1)
        torch.testing.assert_close(alone[0], together[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4] if CUDA else [4])  # the interpreter is slow: one on CPU
def test_tiny_model_logits_match_torch_native(page_size, dtype, device, device_harness):
    """tiny-llama with random weights, one harness per backend (same page layout): logits agree at
    every step of prefill, decode, mixed with a prefix-sharing extend, and extend-with-prefix."""
    from labkit.model_loader import load_model

    model, config = load_model("tiny-llama", "dummy", dtype, device)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # larger weights than the dummy init, so attention is far from uniform
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen).to(device=device, dtype=dtype)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    shapes = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    hs = {b: device_harness(*shapes, page_size, dtype=dtype, backend=b) for b in ("triton", "torch_native")}
    steps = [
        (ForwardMode.EXTEND, [("a", 9), ("b", 5), ("c", 3)]),
        (ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1)]),
        (ForwardMode.MIXED, [("a", 1), ("d", 6), ("b", 1)]),  # d shares a's first 4 tokens
        (ForwardMode.EXTEND, [("e", 3), ("c", 4)]),  # e shares a's first 8; c: a second prefill chunk
        (ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)]),
    ]
    tokens = {name: torch.randint(0, config.vocab_size, (20,), generator=gen) for name in "abcde"}
    tokens["d"][:4], tokens["e"][:8] = tokens["a"][:4], tokens["a"][:8]
    names = {b: {} for b in hs}
    with torch.inference_mode():
        for mode, items in steps:
            logits = {}
            for b, h in hs.items():
                rows = names[b]
                for name, _ in items:
                    if name not in rows:
                        share = {"d": 4, "e": 8}.get(name, 0)
                        rows[name] = h.new_req(rows["a"], share) if share else h.new_req()
                batch = [(rows[name], n) for name, n in items]
                ids = torch.cat([tokens[name][h.lens[rows[name]] : h.lens[rows[name]] + n] for name, n in items])
                fb = h.batch(mode, batch, ids)
                fb.attn_backend.init_forward_metadata(fb)
                logits[b] = model(fb.input_ids, fb.positions, fb)
            ref = logits["torch_native"]
            tol = (1e-4 if dtype == torch.float32 else 3e-2) * max(1.0, ref.abs().max().item())
            torch.testing.assert_close(
                logits["triton"], ref, atol=tol, rtol=0, msg=lambda m, mode=mode: f"{mode.name}: {m}"
            )
