"""torch_native attention backend vs a dense float64 reference, on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.attention import AttentionLayerSpec
from labkit.attention.reference import dense_attention
from labkit.model_executor.forward_batch import ForwardMode

LAYER = 1  # not 0, so a layer-index mix-up shows


def _run(
    harness_cls,
    mode: ForwardMode,
    shape: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
) -> None:
    """shape: (prefix_len, new_len) per request. Prefixes are stored in the pool beforehand."""
    h = harness_cls(2, num_heads, num_kv_heads, head_dim, page_size, num_pages=4096 // page_size)
    gen = torch.Generator().manual_seed(hash((mode, tuple(shape), num_heads, head_dim, page_size)) % 2**31)
    spec = AttentionLayerSpec(LAYER, num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim))

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    reqs, full_k, full_v = [], [], []
    for prefix, _ in shape:
        r = h.new_req()
        kp, vp = rand(prefix, num_kv_heads, head_dim), rand(prefix, num_kv_heads, head_dim)
        if prefix:
            h.kv_pool.set_kv_buffer(LAYER, h.batch(ForwardMode.EXTEND, [(r, prefix)]).out_cache_loc, kp, vp)
        reqs.append(r)
        full_k.append(kp)
        full_v.append(vp)
    fb = h.batch(mode, [(r, n) for r, (_, n) in zip(reqs, shape)])
    total = fb.num_tokens
    q, k, v = rand(total, num_heads, head_dim), rand(total, num_kv_heads, head_dim), rand(total, num_kv_heads, head_dim)
    h.backend.init_forward_metadata(fb)
    out = h.backend.forward(q, k, v, spec, fb)
    assert out.shape == (total, num_heads * head_dim)
    torch.testing.assert_close(h.kv_pool.get_key_buffer(LAYER)[fb.out_cache_loc], k)
    torch.testing.assert_close(h.kv_pool.get_value_buffer(LAYER)[fb.out_cache_loc], v)
    start = 0
    for (prefix, n), kp, vp in zip(shape, full_k, full_v):
        sl = slice(start, start + n)
        ref = dense_attention(
            q[sl], torch.cat([kp, k[sl]]), torch.cat([vp, v[sl]]), prefix, spec.scaling, torch.float64
        ).reshape(n, -1)
        torch.testing.assert_close(out[sl].double(), ref, atol=2e-5, rtol=1e-5)
        start += n


SHAPES = {
    ForwardMode.EXTEND: [(0, 7), (5, 9), (33, 1), (16, 20)],
    ForwardMode.DECODE: [(0, 1), (6, 1), (40, 1), (17, 1), (1, 1)],
    ForwardMode.MIXED: [(11, 1), (0, 13), (30, 1), (20, 6), (3, 1)],
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("mode", list(SHAPES), ids=lambda m: m.name)
def test_backend_matches_dense_reference(mode, heads, head_dim, page_size, paged_kv_harness):
    _run(paged_kv_harness, mode, SHAPES[mode], heads[0], heads[1], head_dim, page_size)


def test_decode_is_batch_invariant(paged_kv_harness):
    """A request's decode output does not depend on which other requests share the batch."""
    h = paged_kv_harness(2, 8, 2, 64, 4)
    spec = AttentionLayerSpec(LAYER, 8, 2, 64, 0.125)
    gen = torch.Generator().manual_seed(0)
    reqs = [h.new_req() for _ in range(3)]
    for r, n in zip(reqs, (5, 30, 12)):
        fb = h.batch(ForwardMode.EXTEND, [(r, n)])
        h.kv_pool.set_kv_buffer(
            LAYER, fb.out_cache_loc, torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
        )
    q, k, v = (
        torch.randn(3, 8, 64, generator=gen),
        torch.randn(3, 2, 64, generator=gen),
        torch.randn(3, 2, 64, generator=gen),
    )
    fb = h.batch(ForwardMode.DECODE, [(r, 1) for r in reqs])
    h.backend.init_forward_metadata(fb)
    together = h.backend.forward(q, k, v, spec, fb, save_kv_cache=True)
    for i, r in enumerate(reqs):  # the same token again, alone; save_kv_cache=False reads k, v from args
        h.lens[r] -= 1
        fb1 = h.batch(ForwardMode.DECODE, [(r, 1)])
        h.backend.init_forward_metadata(fb1)
        alone = h.backend.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], spec, fb1, save_kv_cache=False)
        torch.testing.assert_close(alone[0], together[i], atol=1e-6, rtol=1e-6)
