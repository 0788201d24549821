"""decode_attention (split-KV, grouped query heads) against its dense reference."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import decode as decode_module
from labkit.kernels import decode_attention, decode_kv_splits
from labkit.kernels.decode import (
    FP8_DEEP_MIN_SHARED,
    FP8_NUM_STAGES,
    FP8_ONE_WARP,
    FP8_ONE_WARP_RESIDENT,
    FP8_PROGRAMS_PER_SM,
    FP8_RESIDENT_PROGRAMS,
    decode_order,
    decode_semaphore_count,
    longest_first,
    resident_programs,
    stage1_config,
)
from labkit.kernels.reference import reference_decode_attention

CUDA = torch.cuda.is_available()

# (num_heads, num_kv_heads, head_dim, page_size): GQA ratios 1, 4, 8; head dims 64, 128; pages 1, 16.
SHAPES = [(4, 4, 64, 1), (8, 2, 128, 16), (8, 1, 64, 16), (4, 4, 128, 16), (8, 2, 64, 1), (8, 1, 128, 1)]
if CUDA:  # the full grid, and model-sized head counts
    SHAPES = [(h * k, k, d, p) for h in (1, 4, 8) for k in (1, 2) for d in (64, 128) for p in (1, 16)]
    SHAPES += [(32, 8, 128, 16), (64, 8, 128, 1), (14, 2, 64, 16), (8, 2, 256, 16), (4, 4, 96, 1)]


def _run(shape, seq_lens, num_kv_splits, max_kv_splits, dtype, device, gen, paged_kv):
    num_heads, num_kv_heads, head_dim, page_size = shape
    k_buf, v_buf, req_to_token, rows = paged_kv(seq_lens, num_kv_heads, head_dim, page_size, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    seq = torch.tensor(seq_lens, device=device)
    splits = None if num_kv_splits is None else torch.tensor(num_kv_splits, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    scale = head_dim**-0.5
    decode_attention(
        q, k_buf, v_buf, req_to_token, rows, seq, scale, out=out, num_kv_splits=splits, max_kv_splits=max_kv_splits
    )
    return out, reference_decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}-page{s[3]}")
def test_decode_matches_reference_on_ragged_lengths(shape, dtype, device, gen, paged_kv, check_close):
    """Ragged lengths (1 token up to several pages), each request cut into its own number of splits."""
    seq_lens = [1, 37, 130] if not CUDA else [1, 37, 130, 1000, 4097, 16]
    splits = [1, 3, 4] if not CUDA else [1, 3, 4, 8, 16, 2]
    out, ref = _run(shape, seq_lens, splits, 4 if not CUDA else 16, dtype, device, gen, paged_kv)
    check_close(out, ref, dtype)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_long_context_with_default_split_heuristic(page_size, dtype, device, gen, paged_kv, check_close):
    """A long request alone gets several splits from decode_kv_splits; the merge is exact."""
    seq_lens = [300] if not CUDA else [32768, 5]
    out, ref = _run((8, 2, 64, page_size), seq_lens, None, 16, dtype, device, gen, paged_kv)
    check_close(out, ref, dtype)


@pytest.mark.parametrize(
    "shape", [(8, 2, 128, 16), (4, 4, 64, 1)], ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}-page{s[3]}"
)
def test_decode_single_split_bound_writes_output_in_stage_one(shape, dtype, device, gen, paged_kv, check_close):
    """max_kv_splits=1 (what large batches get): every program writes its output, no merge runs."""
    seq_lens = [1, 37, 130] if not CUDA else [1, 37, 130, 4097, 16] + [i * 37 % 300 + 1 for i in range(251)]
    out, ref = _run(shape, seq_lens, [1] * len(seq_lens), 1, dtype, device, gen, paged_kv)
    check_close(out, ref, dtype)


def test_decode_merge_leaves_its_semaphores_zero_and_is_repeatable(device, gen, paged_kv):
    """The last split to arrive merges, in split order, and resets its semaphore: the same
    semaphores serve launch after launch (as in a CUDA graph) with bit-identical outputs."""
    seq_lens, splits = [300, 90, 7], torch.tensor([4, 2, 1], dtype=torch.int32, device=device)
    k_buf, v_buf, req_to_token, rows = paged_kv(seq_lens, 2, 64, 16, torch.float32, gen)
    q = torch.randn(3, 8, 64, generator=gen, device=device)
    seq = torch.tensor(seq_lens, device=device)
    semaphores = torch.zeros(decode_semaphore_count(3, 8, 2), dtype=torch.int32, device=device)
    outs = [
        decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125, None, splits, 4, semaphores=semaphores)
        for _ in range(3)
    ]
    assert not semaphores.any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], reference_decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125))


def test_decode_merges_a_large_group_in_chunks_of_heads(dtype, device, gen, paged_kv, check_close):
    """8 query heads per KV head, 16 splits of 128 features: the merge loads 4 heads' partials at a
    time (MERGE_TILE), in two rounds."""
    out, ref = _run((16, 2, 128, 16), [200, 40], [16, 3], 16, dtype, device, gen, paged_kv)
    check_close(out, ref, dtype)


def test_decode_tolerates_empty_splits(dtype, device, gen, paged_kv, check_close):
    """5 tokens in 4 splits of ceil(5/4) = 2: the last split is empty and must drop out of the merge."""
    out, ref = _run((4, 2, 64, 1), [5, 2], [4, 2], 4, dtype, device, gen, paged_kv)
    check_close(out, ref, dtype)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefetching_the_first_block_changes_no_output(page_size, dtype, device, gen, paged_kv):
    """With prefetch a program loads its first block's older K/V before the PDL wait and the new
    token's row (seq_len - 1) after it: the same bits as the plain loop, whether the new token falls
    in a split's first block (short requests, one-block splits) or a later one, and for empty splits."""
    seq_lens, splits = [1, 5, 64, 65, 130, 300], [1, 4, 2, 1, 2, 3]
    k_buf, v_buf, req_to_token, rows = paged_kv(seq_lens, 2, 64, page_size, dtype, gen)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen, device=device).to(dtype)
    seq = torch.tensor(seq_lens, device=device)
    counts = torch.tensor(splits, dtype=torch.int32, device=device)
    on, off = (
        decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125, None, counts, 4, prefetch=p)
        for p in (True, False)
    )
    assert torch.equal(on, off)


@pytest.mark.parametrize("max_kv_splits", [1, 4])
def test_launching_the_longest_requests_first_changes_no_output(max_kv_splits, dtype, device, gen, paged_kv):
    """decode_attention in longest_first's order gives every request the bits of batch order, with
    one split (each program writes its output) and with merges (semaphores indexed by request)."""
    seq_lens = [3, 130, 64, 300, 1, 130]
    k_buf, v_buf, req_to_token, rows = paged_kv(seq_lens, 2, 64, 16, dtype, gen)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen, device=device).to(dtype)
    seq = torch.tensor(seq_lens, device=device)
    splits = torch.tensor([1, 4, 2, 4, 1, 3], dtype=torch.int32, device=device).clamp(max=max_kv_splits)
    order = longest_first(seq)
    assert order.tolist() == [3, 1, 5, 2, 0, 4] and order.dtype == torch.int32  # ties in batch order
    outs = [
        decode_attention(q, k_buf, v_buf, req_to_token, rows, seq, 0.125, None, splits, max_kv_splits, order=o)
        for o in (None, order)
    ]
    assert torch.equal(outs[0], outs[1])


def test_decode_order_only_where_the_grid_takes_more_than_one_wave(monkeypatch):
    """8 KV heads x 165 requests = 1320 programs: one wave of a float8 pool's 10 one-warp programs a
    multiprocessor on 132; a 16-bit pool holds 4, so 67 requests (536 programs) are its first to need
    two, and the 4-warp float8 program (FP8_ONE_WARP None) holds 2, so 34 requests. (The one-warp
    programs' batches from BALANCED_MIN_BATCH on take the balanced partition, unordered: off here.)"""
    monkeypatch.setattr(decode_module, "BALANCED", False)
    seq = torch.arange(1, 167)
    assert decode_order(seq[:165], 16, 8, 1, 132, kv_bytes=1) is None
    assert decode_order(seq, 16, 8, 1, 132, kv_bytes=1).tolist() == list(range(165, -1, -1))
    assert decode_order(seq[:66], 16, 8, 1, 132, kv_bytes=2) is None
    assert decode_order(seq[:67], 16, 8, 1, 132, kv_bytes=2) is not None
    assert decode_order(seq[:17], 16, 8, 2, 132, kv_bytes=2) is None  # 17 x 8 x 2 splits = 272 programs
    monkeypatch.setattr(decode_module, "FP8_ONE_WARP", None)
    assert decode_order(seq[:33], 16, 8, 1, 132, kv_bytes=1) is None
    assert decode_order(seq[:34], 16, 8, 1, 132, kv_bytes=1) is not None
    monkeypatch.setattr(decode_module, "LONGEST_FIRST", False)
    assert decode_order(seq, 16, 8, 1, 132, kv_bytes=2) is None


def test_decode_refuses_more_requests_than_a_grid_axis_holds():
    q = torch.zeros(65536, 1, 16)
    k_buf = torch.zeros(2, 1, 16)
    ones = torch.ones(65536, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 65535 requests"):
        decode_attention(q, k_buf, k_buf, torch.ones(1, 1, dtype=torch.int32), ones * 0, ones, 0.25)


def test_split_heuristic_fills_the_device_but_respects_length():
    seq = torch.tensor([1, 64, 65, 10_000])
    splits, bound = decode_kv_splits(
        seq, num_heads=32, num_kv_heads=8, device_sms=132, max_kv_splits=16, programs_per_sm=2
    )
    # 4 requests x 8 KV heads = 32 programs per split; 2 x 132 SMs wants ceil(264/32) = 9 splits.
    assert bound == 9 and splits.tolist() == [1, 1, 2, 9]
    assert splits.dtype == torch.int32
    splits, bound = decode_kv_splits(torch.full((512,), 10_000), 32, 8, 132, 16, programs_per_sm=2)
    assert bound == 1 and splits.max().item() == 1  # enough programs already: no split
    splits, bound = decode_kv_splits(torch.tensor([100_000]), 32, 8, 132, 16, programs_per_sm=2)
    assert bound == 16 and splits.tolist() == [16]  # capped


def test_a_float8_pool_takes_one_warp_programs_and_more_splits(monkeypatch):
    assert stage1_config(128, 1, FP8_DEEP_MIN_SHARED) == FP8_ONE_WARP
    assert stage1_config(128, 2, FP8_DEEP_MIN_SHARED)["num_warps"] == 4  # 16-bit pools as timed
    # 64 requests x 8 KV heads: a 16-bit pool's 2 programs a multiprocessor want one split, the
    # one-warp float8 programs' FP8_PROGRAMS_PER_SM more
    seq = torch.full((64,), 4096)
    assert decode_kv_splits(seq, 16, 8, 132)[1] == 1
    assert decode_kv_splits(seq, 16, 8, 132, kv_bytes=1)[1] == -(-FP8_PROGRAMS_PER_SM * 132 // 512)
    # head dims over 128 keep the 4-warp program, and its splits and residency with it
    assert stage1_config(256, 1, FP8_DEEP_MIN_SHARED)["num_warps"] == 4
    assert decode_kv_splits(seq, 16, 8, 132, kv_bytes=1, head_dim=256)[1] == 1
    assert resident_programs(1, 256) == FP8_RESIDENT_PROGRAMS and resident_programs(1, 128) == FP8_ONE_WARP_RESIDENT
    monkeypatch.setattr(decode_module, "FP8_ONE_WARP", None)  # the 4-warp float8 program
    assert decode_kv_splits(seq, 16, 8, 132, kv_bytes=1)[1] == 1
    assert stage1_config(128, 1, FP8_DEEP_MIN_SHARED)["num_stages"] == FP8_NUM_STAGES  # Hopper
    assert stage1_config(128, 1, 164 * 1024)["num_stages"] == 3  # an A100's 164 KB
    assert stage1_config(128, 2, FP8_DEEP_MIN_SHARED)["num_stages"] == 3
