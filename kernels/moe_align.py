"""moe_align_block_size: the (token, slot) pairs of a top-k routing grouped by expert and padded to
whole blocks, the layout that fused_moe's grouped GEMMs walk one single-expert block at a time.

Sized from the shapes alone (no host sync, so a CUDA graph can hold it). The pairs are cut into
contiguous chunks. A count kernel (one program per chunk) counts each chunk's pairs per expert and
gives every pair its rank among the earlier pairs of the same expert in its chunk. In the scatter
kernel every program sums the chunks' counts (the experts' totals, and what the chunks before its own
hold), puts each pair of its chunk at its expert's start (prefix sum of the padded totals) + the
earlier chunks' count + its rank, and writes its share of the padding sentinels and of the block ->
expert table. Within an expert the pairs therefore keep ascending flat index. When all the pairs fit
in one tile (decode batches) the scatter kernel counts them itself and runs alone: one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 128  # chunks of pairs: each scatter program reads every chunk's counts
MAX_PROGRAMS = 256  # scatter programs, when the padding to fill wants more than one per chunk
# Pairs (and positions) per [tile, experts] comparison. Measured on an H100 (E=128): small tiles
# spread over more programs beat big ones (T=1: 4 us with 16, 13 us with 128), 32 only pays from a
# few hundred pairs on.
SMALL_TILE, LARGE_TILE, SMALL_INPUT = 16, 32, 512
BLOCK_C = 16  # chunks' count rows per load
NUM_WARPS = 2


@triton.jit
def _expert_hits(e, offs_e, E: tl.constexpr):
    """[pairs, experts] int32 one-hot of each pair's expert; ids outside [0, E) match no column."""
    return ((e[:, None] == offs_e[None, :]) & (e[:, None] < E)).to(tl.int32)


@triton.jit
def _ranks_in_tile(hit):
    """For each pair of a tile, how many earlier pairs of the tile have its expert."""
    return tl.sum((tl.cumsum(hit, 0) - hit) * hit, 1)


@triton.jit
def _moe_align_count_kernel(
    Topk_ids,
    Ranks,
    Counts,
    numel,
    chunk,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    p = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    seen = tl.zeros([E_PAD], tl.int32)  # this chunk's pairs per expert so far
    lo = p * chunk
    hi = tl.minimum(lo + chunk, numel)
    for i0 in range(lo, hi, BLOCK_T):
        offs = i0 + tl.arange(0, BLOCK_T)
        hit = _expert_hits(tl.load(Topk_ids + offs, mask=offs < hi, other=-1), offs_e, E)
        rank = _ranks_in_tile(hit) + tl.sum(seen[None, :] * hit, 1)
        tl.store(Ranks + offs, rank, mask=offs < hi)
        seen += tl.sum(hit, 0)
    tl.store(Counts + p * E_PAD + offs_e, seen)


@triton.jit
def _moe_align_scatter_kernel(
    Topk_ids,
    Ranks,
    Counts,
    Sorted_ids,
    Expert_ids,
    Num_post_padded,
    numel,
    chunk,
    num_chunks,
    max_len,
    max_blocks,
    block_size,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ONE_TILE: tl.constexpr,  # all the pairs fit one tile: count them here, no count kernel before
):
    p = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_e = tl.arange(0, E_PAD)
    if ONE_TILE:
        offs = tl.arange(0, BLOCK_T)
        total = tl.sum(_expert_hits(tl.load(Topk_ids + offs, mask=offs < numel, other=-1), offs_e, E), 0)
        before = tl.zeros([E_PAD], tl.int32)
    else:
        total = tl.zeros([E_PAD], tl.int32)
        before = tl.zeros([E_PAD], tl.int32)  # pairs per expert in the chunks before this one
        for c0 in range(0, num_chunks, BLOCK_C):
            rows = c0 + tl.arange(0, BLOCK_C)
            counts = tl.load(Counts + rows[:, None] * E_PAD + offs_e[None, :], mask=rows[:, None] < num_chunks, other=0)
            total += tl.sum(counts, 0)
            before += tl.sum(tl.where(rows[:, None] < p, counts, 0), 0)
    padded = (total + block_size - 1) // block_size * block_size
    end = tl.cumsum(padded, 0)
    start = end - padded  # the padding columns past E hold no pairs: empty ranges at the end
    num_post = tl.sum(padded, 0)
    if p == 0:
        tl.store(Num_post_padded, num_post)

    lo = p * chunk  # programs past the last chunk have no pairs to place
    hi = tl.minimum(lo + chunk, numel)
    base = start + before
    for i0 in range(lo, hi, BLOCK_T):
        offs = i0 + tl.arange(0, BLOCK_T)
        e = tl.load(Topk_ids + offs, mask=offs < hi, other=-1)
        hit = _expert_hits(e, offs_e, E)
        if ONE_TILE:
            rank = _ranks_in_tile(hit)
        else:
            rank = tl.load(Ranks + offs, mask=offs < hi, other=0)
        pos = tl.sum(hit * base[None, :], 1) + rank
        tl.store(Sorted_ids + pos, offs, mask=(offs < hi) & (e >= 0) & (e < E))

    # Every other position (an expert's padding, or past num_post) gets the sentinel; programs take
    # tiles of positions and of blocks round-robin.
    for q0 in range(p * BLOCK_P, max_len, num_programs * BLOCK_P):
        pos = q0 + tl.arange(0, BLOCK_P)
        inside = (pos[:, None] >= start[None, :]) & (pos[:, None] < (start + total)[None, :])
        taken = tl.sum(inside.to(tl.int32), 1) > 0
        tl.store(Sorted_ids + pos, numel, mask=(pos < max_len) & ~taken)
    for b0 in range(p * BLOCK_P, max_blocks, num_programs * BLOCK_P):
        blocks = b0 + tl.arange(0, BLOCK_P)
        first = blocks * block_size
        # A block's expert: the number of experts whose padded range ends at or before it begins.
        expert = tl.sum((end[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(Expert_ids + blocks, tl.where(first < num_post, expert, -1), mask=blocks < max_blocks)


def max_padded_len(numel: int, block_size: int, num_experts: int) -> int:
    """The longest sorted_token_ids can need: every pair, plus block_size - 1 padding for each expert
    that can receive pairs (at most min(num_experts, numel) of them)."""
    return numel + min(num_experts, numel) * (block_size - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of topk_ids [T, k] (int32 or int64) by expert, each expert's group
    padded to a multiple of block_size. A pair is named by its flat index t * k + j.

    Returns (sorted_token_ids, expert_ids, num_tokens_post_padded), all int32 on topk_ids' device:
    - sorted_token_ids [max_padded_len(T * k, block_size, num_experts)]: expert 0's pairs, then expert
      1's, ..., each expert's in ascending flat index and followed by the sentinel T * k up to a
      multiple of block_size; the sentinel fills the rest of the buffer too;
    - expert_ids [cdiv(len(sorted_token_ids), block_size)]: the expert of block b (entries
      [b * block_size, (b + 1) * block_size) of sorted_token_ids), -1 past the last block;
    - num_tokens_post_padded [1]: the padded length used (a multiple of block_size).
    Pairs whose id is outside [0, num_experts) (-1: an expert held by another rank) appear nowhere;
    an expert with no pairs gets no block. Consumers read only the first num_tokens_post_padded
    entries (the buffers are sized for the worst case, so no host sync is needed)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be a [T, k] int32/int64 tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if block_size < 1 or num_experts < 1:
        raise ValueError(f"block_size ({block_size}) and num_experts ({num_experts}) must be positive")
    device = topk_ids.device
    numel = topk_ids.numel()
    max_len = max_padded_len(numel, block_size, num_experts)
    max_blocks = triton.cdiv(max_len, block_size)
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.zeros(1, dtype=torch.int32, device=device)
    if numel == 0:
        return sorted_ids, expert_ids, num_post

    ids = topk_ids.reshape(-1).contiguous()
    e_pad = triton.next_power_of_2(num_experts)
    tile = SMALL_TILE if numel <= SMALL_INPUT else LARGE_TILE
    num_chunks = min(triton.cdiv(numel, tile), MAX_CHUNKS)
    chunk = triton.cdiv(triton.cdiv(numel, num_chunks), tile) * tile
    num_chunks = triton.cdiv(numel, chunk)
    one_tile = numel <= tile
    ranks = torch.empty(0 if one_tile else numel, dtype=torch.int32, device=device)
    counts = torch.empty(0 if one_tile else num_chunks, e_pad, dtype=torch.int32, device=device)
    if not one_tile:
        _moe_align_count_kernel[(num_chunks,)](
            ids, ranks, counts, numel, chunk, E=num_experts, E_PAD=e_pad, BLOCK_T=tile, num_warps=NUM_WARPS
        )
    # More programs than chunks where the padding is long (many experts, few pairs each).
    programs = max(num_chunks, min(triton.cdiv(max_len, tile), MAX_PROGRAMS))
    _moe_align_scatter_kernel[(programs,)](
        ids,
        ranks,
        counts,
        sorted_ids,
        expert_ids,
        num_post,
        numel,
        chunk,
        num_chunks,
        max_len,
        max_blocks,
        block_size,
        E=num_experts,
        E_PAD=e_pad,
        BLOCK_T=tile,
        BLOCK_C=BLOCK_C,
        BLOCK_P=tile,
        ONE_TILE=one_tile,
        num_warps=NUM_WARPS,
    )
    return sorted_ids, expert_ids, num_post
