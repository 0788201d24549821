"""decode_attention over the balanced partition (kernels/decode_balanced.py) against its dense
reference. Triton's interpreter has no float8, so on the CPU the partition runs over 16- and 32-bit
pools with `balanced` patched to take every batch of 2 or more; on CUDA the float8 pool's own
batches run it too (tests/kernels/test_fp8_kv.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from labkit.kernels import decode as decode_module
from labkit.kernels import decode_attention
from labkit.kernels.decode import (
    BALANCED_MAX_BATCH,
    BALANCED_MIN_BATCH,
    DEFAULT_MAX_KV_SPLITS,
    balanced,
    decode_order,
    decode_semaphore_count,
    decode_workspace_splits,
    default_prefetch,
    takes_balanced,
)
from labkit.kernels.decode_balanced import multiprocessor_occupancy
from labkit.kernels.reference import reference_decode_attention

CUDA = torch.cuda.is_available()
# (num_heads, num_kv_heads, head_dim, page_size): GQA 4, 1 and 8
SHAPES = [(8, 2, 64, 16), (4, 4, 64, 1), (16, 2, 128, 1)]
# A 700-token request cut by ranges of ~80 tokens (16 a KV head on the CPU's nominal 8
# multiprocessors), and ranges holding several short requests.
SEQ_LENS = [1, 5, 300, 64, 700, 3, 2, 130, 33]


@pytest.fixture
def every_batch_balanced(monkeypatch):
    monkeypatch.setattr(decode_module, "balanced", lambda batch, kv_bytes, head_dim: batch >= 2)


def _inputs(shape, seq_lens, dtype, device, gen, paged_kv):
    num_heads, num_kv_heads, head_dim, page_size = shape
    k_buf, v_buf, req_to_token, rows = paged_kv(seq_lens, num_kv_heads, head_dim, page_size, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    return q, k_buf, v_buf, req_to_token, rows, torch.tensor(seq_lens, device=device)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}-page{s[3]}")
def test_balanced_partition_matches_reference_across_cut_and_shared_ranges(
    shape, dtype, device, gen, paged_kv, check_close, every_batch_balanced
):
    """Requests cut between several programs (merged by the last) and programs walking several
    requests (each written directly): every output element written, equal to the reference."""
    q, k_buf, v_buf, req_to_token, rows, seq = _inputs(shape, SEQ_LENS, dtype, device, gen, paged_kv)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, shape[2] ** -0.5, out=out)
    check_close(out, reference_decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, shape[2] ** -0.5), dtype)


def test_the_workspace_room_bounds_a_requests_pieces(device, gen, paged_kv, every_batch_balanced):
    """With room for 3 splits the ranges grow to half the longest request (2000 tokens, after a
    7-token one), so it is cut in 3 pieces, however many programs there are, and the partials stay
    inside the workspace."""
    seq_lens = [7, 2000, 10]
    q, k_buf, v_buf, req_to_token, rows, seq = _inputs((8, 2, 64, 16), seq_lens, torch.float32, device, gen, paged_kv)
    mid_o = torch.full((3, 8, 3, 64), float("nan"), device=device)
    mid_lse = torch.full((3, 8, 3), float("nan"), device=device)
    semaphores = torch.zeros(decode_semaphore_count(3, 8, 2), dtype=torch.int32, device=device)
    out = decode_attention(
        q, k_buf, v_buf, req_to_token, rows, seq, 0.125, mid_o=mid_o, mid_lse=mid_lse, semaphores=semaphores
    )
    torch.testing.assert_close(out, reference_decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125))
    assert torch.isfinite(mid_lse[1]).all()  # the long request's 3 pieces all left partials
    assert not semaphores.any()


def test_balanced_partition_leaves_its_semaphores_zero_and_is_repeatable(device, gen, paged_kv, every_batch_balanced):
    """The same semaphores serve launch after launch (as in a CUDA graph), with bit-identical outputs."""
    q, k_buf, v_buf, req_to_token, rows, seq = _inputs((8, 2, 64, 16), SEQ_LENS, torch.float32, device, gen, paged_kv)
    semaphores = torch.zeros(decode_semaphore_count(len(SEQ_LENS), 8, 2), dtype=torch.int32, device=device)
    outs = [decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125, semaphores=semaphores) for _ in range(3)]
    assert not semaphores.any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_workspace_with_room_for_one_split_takes_the_split_kernel(
    device, gen, paged_kv, monkeypatch, every_batch_balanced
):
    def refuse(*args, **kwargs):
        raise AssertionError("the balanced partition cannot cut requests into a workspace of one split")

    monkeypatch.setattr(decode_module, "decode_balanced", refuse)
    q, k_buf, v_buf, req_to_token, rows, seq = _inputs((8, 2, 64, 16), SEQ_LENS, torch.float32, device, gen, paged_kv)
    ones = torch.ones(len(SEQ_LENS), dtype=torch.int32, device=device)
    mid_o = torch.empty(len(SEQ_LENS), 8, 1, 64, device=device)
    mid_lse = torch.empty(len(SEQ_LENS), 8, 1, device=device)
    out = decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125, None, ones, 1, mid_o, mid_lse)
    torch.testing.assert_close(out, reference_decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125))


def test_float8_one_warp_batches_from_the_minimum_take_the_balanced_partition(monkeypatch):
    """Only one-warp float8 programs, BALANCED_MIN_BATCH to BALANCED_MAX_BATCH requests: their
    workspace gets DEFAULT_MAX_KV_SPLITS of room and no launch order; other batches keep both."""
    for batch in (BALANCED_MIN_BATCH, 256, BALANCED_MAX_BATCH):
        assert balanced(batch, 1, 128) and decode_workspace_splits(batch, 1, 1, 128) == DEFAULT_MAX_KV_SPLITS
    for batch, kv_bytes, head_dim in ((BALANCED_MIN_BATCH - 1, 1, 128), (BALANCED_MAX_BATCH + 1, 1, 128),
                                      (256, 2, 128), (256, 1, 256)):  # fmt: skip
        assert not balanced(batch, kv_bytes, head_dim) and decode_workspace_splits(batch, 1, kv_bytes, head_dim) == 1
    seq = torch.arange(1, 257)  # 2048 one-warp programs: more than a wave of the split kernel's
    assert decode_order(seq, 16, 8, 1, 132, kv_bytes=1) is None
    monkeypatch.setattr(decode_module, "BALANCED", False)
    assert not balanced(256, 1, 128)
    assert decode_order(seq, 16, 8, 1, 132, kv_bytes=1) is not None


def test_a_call_takes_the_balanced_partition_unless_it_prefetches_or_has_room_for_one_split(monkeypatch):
    """takes_balanced, the rule decode_attention and a CUDA graph's replay share: a prefetching batch
    (PREFETCH_MAX_BATCH raised past it, as an A/B variant may) or a one-split workspace runs the
    split kernel, whose split counts the replay must then write."""
    assert takes_balanced(BALANCED_MIN_BATCH, 1, 128, default_prefetch(BALANCED_MIN_BATCH), None)
    assert takes_balanced(BALANCED_MIN_BATCH, 1, 128, False, 2)
    assert not takes_balanced(BALANCED_MIN_BATCH, 1, 128, False, 1)
    assert not takes_balanced(BALANCED_MIN_BATCH - 1, 1, 128, False, None)
    monkeypatch.setattr(decode_module, "PREFETCH_MAX_BATCH", BALANCED_MIN_BATCH)
    assert not takes_balanced(BALANCED_MIN_BATCH, 1, 128, default_prefetch(BALANCED_MIN_BATCH), None)


@triton.jit
def _copy(X, Y):
    tl.store(Y + tl.arange(0, 32), tl.load(X + tl.arange(0, 32)))


@pytest.mark.skipif(not CUDA, reason="the CUDA driver's occupancy")
def test_the_driver_says_how_many_programs_a_multiprocessor_holds(device):
    x = torch.zeros(32, device=device)
    compiled = _copy[(1,)](x, torch.empty_like(x))
    assert 1 <= multiprocessor_occupancy(compiled) <= 64
    assert multiprocessor_occupancy(object()) is None
