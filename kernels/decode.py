"""decode_attention: one query token per request over the paged KV pool (split-KV flash decoding).

Stage 1 cuts each request's KV into `num_kv_splits[b]` contiguous ranges and runs one program per
(request, KV head, split): the query heads that share the KV head form the rows of a [BLOCK_H, D]
tile, so Q K^T and P V are matrix products (tensor cores on a GPU) and each K/V row is read once for
the whole group. A program streams its range in BLOCK_N-token blocks (slots looked up through
req_to_token, so any page size works) with an online softmax, and writes its partial output
(normalized) and log-sum-exp. The last split of a (request, KV head) to finish, which a semaphore
counts, merges them: out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse), every
split's partial loaded at once and summed in a fixed order. A second kernel for the merge would
cost a launch per layer, about 4 us of a batch-1 step's few hundred (docs/benchmarks.md). When the
bound on splits is 1 (large batches fill the GPU without splitting), each program writes the output
itself.

A step's attention lasts until its last program ends, and a batch's requests differ in length. So
the grid's first axis is the (KV head, head block), the second the request: a request's programs
launch together, and where the grid takes more than one wave of programs, decode_order puts the
longest requests first (the last wave then holds the shortest). On an H200, 128 requests of 100-2048
tokens went from 3.55 to 4.17 TB/s (bf16 KV) and from 2.37 to 2.70 (float8) (docs/benchmarks.md).

At batch 1 (PREFETCH_MAX_BATCH) a program loads its first block's slots and the K/V rows that earlier
steps stored before its PDL wait, and only q and the new token's row after it: a split is often a
single block, so the wait is then followed by arithmetic, not by two dependent trips to memory (slot,
then row). On an H200 that took 0.03 ms off a Qwen3-0.6B decode step (docs/benchmarks.md).

A float8 pool (--kv-cache-dtype fp8_*) is loaded as float8 and dequantized in the kernel: the K
scale is folded into the score scale (q.(s k) = s (q.k)), the V scale multiplies each split's output
(every value of a split has the same scale). Under a 16-bit q, K, V and q are cast to float16 and the
products run in float16: float8 converts to float16 in one instruction per pair of values, to
bfloat16 through a longer sequence; on an H200 (256 x 1024 tokens, 8 KV heads) the bfloat16 products
took 0.27-0.28 ms a call, the float16 ones 0.23 ms (bf16 KV: 0.25 ms). Reading half the bytes, a
float8 program has twice the tokens to multiply per byte, and 4 warps of them wait on each other's
barriers; so a float8 pool's programs are one warp each (FP8_ONE_WARP), with more splits. From
BALANCED_MIN_BATCH requests those programs take a balanced partition instead of splits: the batch's
tokens in equal ranges, one program a range, all in one wave (kernels/decode_balanced.py)."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from labkit.kernels.decode_balanced import decode_balanced
from labkit.kernels.decode_merge import store_split
from labkit.kernels.flash import LOG2E, load_query, online_softmax_step, paged_block_step
from labkit.kernels.pdl import pdl_options, pdl_wait
from labkit.mem_cache.memory_pool import is_fp8

DEFAULT_MAX_KV_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 64  # never cut a request into splits shorter than this (heuristic below)
PROGRAMS_PER_SM = 2  # 4-warp stage-1 programs the split heuristic aims for, per multiprocessor
MIN_BLOCK_H = 16  # rows of a tl.dot operand must be >= 16
MAX_BLOCK_H = 64
# Prefetching holds a block of K and V in registers across the PDL wait. At small batches a GPU has a
# few programs per multiprocessor and the wait is the decode step's critical path; large batches
# keep the registers for occupancy (bf16 stage 1 runs there at the HBM copy rate). Timed at batch 1
# only (labkit.bench.batch1_ab); batches of 2-8 may gain too, untimed.
PREFETCH_MAX_BATCH = 1
# The 4-warp float8 program (FP8_ONE_WARP None) waits on memory more than bf16's (its 247-255
# registers leave two programs a multiprocessor): a sweep of that kernel on an H200 (256 x 1024
# tokens) took 0.189 ms with 5 stages against 0.217 with 3. ptxas (sm_90a): 75 KB of shared memory,
# 254 registers, no spills; up to 198 KB for a float32 q with 64 query heads a KV head. So 5 only
# where a block may have Hopper's 227 KB.
FP8_NUM_STAGES = 5
FP8_DEEP_MIN_SHARED = 227 * 1024
MERGE_FLOATS_PER_THREAD = 64  # float32 partials the merge loads at once, per thread (registers)
MAX_GRID_Y = 65535  # CUDA's bound on a grid's second axis, the requests'
# Whether decode_order launches the longest requests' programs first; read at each call, so an A/B
# (labkit.bench.offline_ab) can turn it off.
LONGEST_FIRST = True
# Stage-1 programs a multiprocessor holds at once (Hopper, head dim 128): a 16-bit pool's 124 registers
# a thread leave room for 4 programs of 4 warps, a float8 pool's 254 for 2 (Nsight Compute and ptxas,
# docs/benchmarks.md).
RESIDENT_PROGRAMS = 4
FP8_RESIDENT_PROGRAMS = 2
# A float8 pool's stage 1 runs one warp a program, on blocks of 32 tokens. The 4-warp program is
# latency-bound, not bandwidth-bound: two fit a multiprocessor, and each block's products wait on
# the four warps' barriers (Nsight Compute on an H200: 0.5 instructions issued a cycle per scheduler,
# most stalls "wait" and "short scoreboard", DRAM 49% busy). One warp needs no barrier, and many fit:
# ptxas gave a scratch copy of the loop 168 registers and 21 KB of shared memory, about 10 a
# multiprocessor (FP8_ONE_WARP_RESIDENT, for decode_order). That copy read 256 x 1024 tokens at 3.41
# TB/s against 2.97. The programs being small, the splits aim at FP8_PROGRAMS_PER_SM of them: 12 gave
# the offline run's attention 2.57 s on an H200 against 2.76 for 8 and 2.63 for 16, replayed step by
# step (labkit.bench.attention_replay); offline, in one process, one warp took the run from 30,846 to
# 33,537 tok/s (medians of 3 rounds, docs/benchmarks.md). None: the 4-warp program.
FP8_ONE_WARP: dict[str, int] | None = {"BLOCK_N": 32, "num_warps": 1, "num_stages": 5}
FP8_ONE_WARP_RESIDENT = 10
FP8_PROGRAMS_PER_SM = 12
# The one-warp float8 programs take the balanced partition (kernels/decode_balanced.py) from
# BALANCED_MIN_BATCH requests: on an H200 it read the offline run's float8 KV at 3.18 TB/s against 2.98
# (2.43 s against 2.60, attention_replay), from 2.27 against 1.94 TB/s at 17-32 requests to 3.17 against
# 3.14 at 225-256; at 1-16 it read 1.14 against 1.38 (docs/benchmarks.md). Read at each call (A/B).
BALANCED = True
BALANCED_MIN_BATCH = 17
BALANCED_MAX_BATCH = 1024  # its programs hold the batch's lengths in registers


def stage1_config(head_dim: int, kv_bytes: int = 2, shared_memory: int = 0) -> dict[str, int]:
    """BLOCK_N (KV tokens per inner step), num_warps, num_stages of stage 1. Picked on an H200 (bf16,
    32 query / 8 KV heads, D=128, page 16): 3 stages beat 2 by 1.2-2x (the indirect K/V loads need
    the deeper pipeline); BLOCK_N 32/64/128 and 4 or 8 warps were within noise of each other. A
    float8 pool (kv_bytes 1) takes FP8_ONE_WARP; without it, blocks of 128: 0.213 ms against 0.232
    with 64 (16 query / 8 KV heads, 256 x 1024 tokens, H200), and FP8_NUM_STAGES where a block may
    have `shared_memory` bytes of at least FP8_DEEP_MIN_SHARED."""
    if FP8_ONE_WARP is not None and one_warp(kv_bytes, head_dim):
        return dict(FP8_ONE_WARP)
    if head_dim <= 128 and kv_bytes == 1:
        stages = FP8_NUM_STAGES if shared_memory >= FP8_DEEP_MIN_SHARED else 3
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": stages}
    if head_dim <= 128:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


def one_warp(kv_bytes: int, head_dim: int) -> bool:
    """Whether stage 1 runs FP8_ONE_WARP's one-warp programs: a float8 pool, head dim up to 128."""
    return kv_bytes == 1 and head_dim <= 128 and FP8_ONE_WARP is not None


def balanced(batch: int, kv_bytes: int, head_dim: int) -> bool:
    """Whether decode_attention runs a batch over the balanced partition (kernels/decode_balanced.py):
    one-warp programs (one_warp), BALANCED_MIN_BATCH to BALANCED_MAX_BATCH requests, BALANCED on."""
    return BALANCED and one_warp(kv_bytes, head_dim) and BALANCED_MIN_BATCH <= batch <= BALANCED_MAX_BATCH


def default_prefetch(batch: int) -> bool:
    """decode_attention's prefetch when not given (PREFETCH_MAX_BATCH)."""
    return batch <= PREFETCH_MAX_BATCH


def takes_balanced(batch: int, kv_bytes: int, head_dim: int, prefetch: bool, room: int | None) -> bool:
    """Whether a decode_attention call runs over the balanced partition: a batch `balanced` accepts,
    not prefetching, and a workspace with room (its split axis; None: allocated by the call) for two
    splits. The one rule for the call and for a CUDA graph's replay, which then writes no split counts."""
    return balanced(batch, kv_bytes, head_dim) and not prefetch and (room is None or room >= 2)


def decode_workspace_splits(batch: int, bound: int, kv_bytes: int = 2, head_dim: int = 128) -> int:
    """Split room per (request, query head) of decode_attention's workspace (mid_o, mid_lse) for a
    batch whose split bound is `bound` (decode_kv_splits): the bound, or DEFAULT_MAX_KV_SPLITS where the
    balanced partition runs (its ranges cut a request in up to that many pieces; semaphores then too)."""
    return max(bound, DEFAULT_MAX_KV_SPLITS) if balanced(batch, kv_bytes, head_dim) else bound


@triton.jit
def _decode_stage1_kernel(
    Q,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Num_kv_splits,
    Order,
    Mid_o,
    Mid_lse,
    Semaphores,
    O,
    qk_scale,  # sm_scale * log2(e) * k_scale: scores are kept in base 2
    v_scale,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MERGE_H: tl.constexpr,  # query heads the merge takes at a time
    MERGE_S: tl.constexpr,  # max_kv_splits, padded to a power of two
    MERGE_HEADS: tl.constexpr,  # query heads of a program: min(BLOCK_H, GROUP)
    ONE_SPLIT: tl.constexpr,  # every request is one split: write the output, no workspace
    ORDERED: tl.constexpr,  # program row r takes request Order[r] (else request r)
    FP16_DOT: tl.constexpr,  # a float8 pool under a 16-bit q: multiply in float16
    PREFETCH: tl.constexpr,  # load the first block's slots and older K/V before the wait (see below)
    PDL: tl.constexpr,
):
    if not PREFETCH:
        pdl_wait(PDL)
    # Axis 0 is the (KV head, head block): a request's programs launch together, rows in Order.
    b = tl.program_id(1)
    if ORDERED:
        b = tl.load(Order + b)
    kv_head = tl.program_id(0) // HEAD_BLOCKS
    split = tl.program_id(2)
    offs_g = (tl.program_id(0) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)  # index in the group
    mask_h = offs_g < GROUP
    offs_h = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_lens + b)
    if ONE_SPLIT:  # no split count to read, nothing to skip: the request's whole KV
        num_splits = 1
        start = 0
        end = seq_len
    else:
        num_splits = tl.load(Num_kv_splits + b)
        if split >= num_splits:  # the grid has max_kv_splits; this request uses fewer
            return
        split_len = tl.cdiv(seq_len, num_splits)
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
    req_row = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_r2t
    if PREFETCH:
        # The kernel ahead writes q and this step's token's K/V (at seq_len - 1, the one new token of
        # a decode); everything else read here was written before it launched. So the first block's
        # slots and older rows stream in before the wait, and only the new row after it.
        offs_first = start + tl.arange(0, BLOCK_N)
        first = offs_first < end
        slots = tl.load(req_row + offs_first, mask=first, other=0, cache_modifier=".cg").to(tl.int64)
        older = first & (offs_first < seq_len - 1)
        strides = (stride_kbs, stride_kbh, stride_vbs, stride_vbh)
        k_first, v_first = _kv_rows(K_buf, V_buf, slots, older[:, None] & mask_d[None, :], kv_head, offs_d, *strides)
        pdl_wait(PDL)
        new = (first & (offs_first == seq_len - 1))[:, None] & mask_d[None, :]  # the new token's row, if here
        k_first, v_first = _kv_rows(K_buf, V_buf, slots, new, kv_head, offs_d, *strides, k_first, v_first)

    q, m_i, l_i, acc = load_query(
        Q, b, stride_qb, stride_qh, offs_h, offs_d, mask_h, mask_d, FP16_DOT, BLOCK_H, BLOCK_D
    )
    rest = start
    if PREFETCH:
        s = tl.dot(q, tl.trans(k_first.to(q.dtype)), input_precision=DOT_PRECISION)
        s = tl.where(first[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v_first.to(q.dtype), m_i, l_i, acc, qk_scale, DOT_PRECISION)
        rest = start + BLOCK_N
    for n0 in range(rest, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = paged_block_step(
            q,
            m_i,
            l_i,
            acc,
            K_buf,
            V_buf,
            req_row,
            offs_n,
            offs_n < end,
            kv_head,
            offs_d,
            mask_d,
            stride_kbs,
            stride_kbh,
            stride_vbs,
            stride_vbh,
            qk_scale,
            DOT_PRECISION,
        )

    store_split(
        acc, l_i, m_i, end > start, ONE_SPLIT, b, split, num_splits, O, Mid_o, Mid_lse, Semaphores, v_scale,
        offs_h, offs_d, mask_h, mask_d, kv_head, stride_mob, stride_moh, stride_mos, stride_mlb,
        stride_mlh, stride_ob, stride_oh, GROUP, HEAD_BLOCKS, HEAD_DIM, BLOCK_H, BLOCK_D, MERGE_H, MERGE_S,
        MERGE_HEADS,
    )  # fmt: skip


@triton.jit
def _kv_rows(
    K_buf, V_buf, slots, mask, kv_head, offs_d, stride_kbs, stride_kbh, stride_vbs, stride_vbh, k_other=0.0, v_other=0.0
):
    """The K and V [BLOCK_N, BLOCK_D] of a block's token slots where `mask`, k_other / v_other elsewhere;
    read from L2 (.cg), where every finished kernel's writes are, whatever an L1 still holds."""
    k_ptrs = K_buf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :]
    v_ptrs = V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :]
    k = tl.load(k_ptrs, mask=mask, other=k_other, cache_modifier=".cg")
    v = tl.load(v_ptrs, mask=mask, other=v_other, cache_modifier=".cg")
    return k, v


def head_block(group: int) -> int:
    """Query-head rows per stage-1 program: the whole KV group, padded to a power of two >= 16."""
    return min(max(triton.next_power_of_2(group), MIN_BLOCK_H), MAX_BLOCK_H)


def decode_semaphore_count(batch: int, num_heads: int, num_kv_heads: int) -> int:
    """Semaphores decode_attention counts split arrivals in: one per (request, KV head, head block)."""
    group = num_heads // num_kv_heads
    return batch * num_kv_heads * triton.cdiv(group, head_block(group))


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a nominal 8 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """The shared memory a CUDA block may opt into; 0 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return 0


def decode_kv_splits(
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    device_sms: int,
    max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
    min_tokens_per_split: int | None = None,
    programs_per_sm: int | None = None,
    kv_bytes: int = 2,
    head_dim: int = 128,
) -> tuple[torch.Tensor, int]:
    """(per-request split counts [B] int32, their upper bound): the counts are computed on
    seq_lens' device (no host sync), the bound on the host from the batch size alone.

    The bound gives stage 1 about programs_per_sm (default PROGRAMS_PER_SM; FP8_PROGRAMS_PER_SM for
    one-warp programs, see one_warp) programs per multiprocessor (batch x KV heads x
    head blocks programs per split), at most max_kv_splits and at least 1; a request gets the bound
    or one split per min_tokens_per_split (default MIN_TOKENS_PER_SPLIT, read at the call, as
    PROGRAMS_PER_SM) of its tokens if fewer.
    Pass the bound as decode_attention's max_kv_splits: it sizes the grid and the workspace."""
    group = num_heads // num_kv_heads
    per_split = seq_lens.shape[0] * num_kv_heads * triton.cdiv(group, head_block(group))
    default = FP8_PROGRAMS_PER_SM if one_warp(kv_bytes, head_dim) else PROGRAMS_PER_SM
    wanted = (programs_per_sm or default) * device_sms
    bound = max(1, min(max_kv_splits, math.ceil(wanted / max(per_split, 1))))
    tokens = min_tokens_per_split or MIN_TOKENS_PER_SPLIT
    by_len = torch.div(seq_lens + tokens - 1, tokens, rounding_mode="floor")
    return by_len.clamp(1, bound).to(torch.int32), bound


def decode_order(
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    max_kv_splits: int,
    device_sms: int,
    kv_bytes: int = 2,
    head_dim: int = 128,
) -> torch.Tensor | None:
    """decode_attention's `order` for this batch: [B] int32, its rows from the longest KV to the
    shortest (ties in batch order), computed on seq_lens' device (no host sync); None (batch order)
    where stage 1's grid fits the device at once, the balanced partition runs (its programs are
    equal) or LONGEST_FIRST is off.

    A step's attention lasts until its last program ends. When the programs come in several waves,
    launching the longest first leaves the shortest for the end (longest-processing-time-first). When
    they all fit at once (resident_programs a multiprocessor), the order only decides which land on the
    same multiprocessor, and longest-first put a long request's heads together there: on an H200, 64
    ragged requests of bf16 KV ran at 2.86 TB/s in that order and 3.35 in batch order."""
    # decode_semaphore_count: one per (request, KV head, head block), a split's programs
    programs = decode_semaphore_count(seq_lens.shape[0], num_heads, num_kv_heads) * max_kv_splits
    resident = resident_programs(kv_bytes, head_dim)
    if not LONGEST_FIRST or programs <= resident * device_sms or balanced(seq_lens.shape[0], kv_bytes, head_dim):
        return None
    return longest_first(seq_lens)


def resident_programs(kv_bytes: int, head_dim: int = 128) -> int:
    """Stage-1 programs a multiprocessor holds at once, for stage1_config's choice (Hopper, D=128)."""
    if one_warp(kv_bytes, head_dim):
        return FP8_ONE_WARP_RESIDENT
    return FP8_RESIDENT_PROGRAMS if kv_bytes == 1 else RESIDENT_PROGRAMS


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] int32: the rows of seq_lens from the longest to the shortest, ties in batch order."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    num_kv_splits: torch.Tensor | None = None,
    max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    semaphores: torch.Tensor | None = None,
    prefetch: bool | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its KV in the pool; returns out [B, H, D].

    q: [B, H, D] (float32/float16/bfloat16; strides free on the first two dims, last dim contiguous).
    k_buffer, v_buffer: [num_slots, H_kv, D] pool buffers (cast to q's dtype when read); float8 ones
    hold K / k_scale and V / v_scale (TokenToKVPool), which the kernel dequantizes.
    req_to_token: [R, max_ctx] slot table; request b reads slots req_to_token[req_pool_indices[b], :seq_lens[b]]
    (seq_lens[b] >= 1, its new token included: store_kv it first). H must be a multiple of H_kv
    (query head h reads KV head h // (H / H_kv)). num_kv_splits: [B] int32 with values in
    [1, max_kv_splits]; max_kv_splits sizes the grid's split axis (default for both: decode_kv_splits,
    capped at the given max_kv_splits). mid_o [B, H, >= max_kv_splits, D] and mid_lse
    [B, H, >= max_kv_splits] float32 are the stage-1 workspace (allocated when not given), and
    semaphores >= decode_semaphore_count(B, H, H_kv) int32 zeros, left zero, count the splits that
    are done (allocated when not given and max_kv_splits > 1; launches sharing them must not run
    concurrently).
    float32 inputs use full-precision (IEEE) matrix products; 16-bit ones accumulate in float32.
    k_scale, v_scale: the layer's scales of a float8 pool (ignored for other buffers, as store_kv).
    prefetch (default: batch <= PREFETCH_MAX_BATCH): each program loads its first block's slots and
    the K/V rows before seq_len - 1 ahead of its PDL wait, so only q and the new token's row, which
    the kernel ahead writes, come after it; the outputs are the same either way.
    order: [B] int32, a permutation of the batch (decode_order's): the requests' programs launch in
    that order instead of the batch's; the outputs are the same either way.
    A call `takes_balanced` accepts (a batch `balanced` accepts, unless prefetching or given a
    workspace with room for one split) runs over the balanced partition (kernels/decode_balanced.py):
    num_kv_splits and order are then not read, the semaphores are used whatever max_kv_splits, and
    a workspace allocated here has decode_workspace_splits' room."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0 and k_buffer.shape[2] == head_dim
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    if out is None:
        out = q.new_empty(batch, num_heads, head_dim)
    if batch == 0:
        return out
    if batch > MAX_GRID_Y:
        raise ValueError(f"decode_attention takes at most {MAX_GRID_Y} requests a call, got {batch}")
    prefetch = default_prefetch(batch) if prefetch is None else prefetch
    use_balanced = takes_balanced(
        batch, k_buffer.element_size(), head_dim, prefetch, None if mid_o is None else mid_o.shape[2]
    )
    if num_kv_splits is None and not use_balanced:  # the balanced partition reads no split counts
        num_kv_splits, max_kv_splits = decode_kv_splits(
            seq_lens, num_heads, num_kv_heads, num_sms(q.device), max_kv_splits,
            kv_bytes=k_buffer.element_size(), head_dim=head_dim,
        )  # fmt: skip
    room = max_kv_splits if mid_o is None else mid_o.shape[2]
    if use_balanced:
        room = decode_workspace_splits(batch, room, k_buffer.element_size(), head_dim)
    if mid_o is None:
        mid_o = torch.empty(batch, num_heads, room, head_dim, dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty(batch, num_heads, room, dtype=torch.float32, device=q.device)
    one_split = max_kv_splits == 1 and not use_balanced
    count = decode_semaphore_count(batch, num_heads, num_kv_heads)
    if one_split:  # no merge, nothing to count
        semaphores = None
    elif semaphores is None:
        semaphores = torch.zeros(count, dtype=torch.int32, device=q.device)
    elif semaphores.numel() < count:
        raise ValueError(f"decode_attention's merge needs {count} semaphores, got {semaphores.numel()}")
    assert mid_o.stride(3) == 1 and mid_lse.stride(2) == 1 and out.stride(2) == 1

    group = num_heads // num_kv_heads
    block_h = head_block(group)
    block_d = triton.next_power_of_2(head_dim)
    config = stage1_config(head_dim, k_buffer.element_size(), shared_memory_per_block(q.device))
    if not is_fp8(k_buffer.dtype):
        k_scale = v_scale = 1.0
    constexprs = dict(
        GROUP=group,
        HEAD_BLOCKS=triton.cdiv(group, block_h),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        MERGE_HEADS=min(block_h, group),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_DOT=is_fp8(k_buffer.dtype) and q.dtype != torch.float32,
        **config,
        **pdl_options(q.device, batch),
    )
    qk_scale = sm_scale * LOG2E * k_scale
    if use_balanced:
        assert semaphores is not None
        guess = resident_programs(k_buffer.element_size(), head_dim)
        decode_balanced(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out, mid_o, mid_lse, semaphores,
            qk_scale, v_scale, num_sms(q.device), guess, MIN_TOKENS_PER_SPLIT, constexprs,
        )  # fmt: skip
        return out
    assert num_kv_splits is not None
    merge_s = triton.next_power_of_2(max_kv_splits)
    merge_tile = MERGE_FLOATS_PER_THREAD * 32 * config["num_warps"]
    merge_h = min(block_h, triton.next_power_of_2(group), max(1, merge_tile // (merge_s * block_d)))
    _decode_stage1_kernel[(num_kv_heads * constexprs["HEAD_BLOCKS"], batch, max_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        num_kv_splits,
        num_kv_splits if order is None else order,  # never read without an order
        mid_o,
        mid_lse,
        semaphores if semaphores is not None else num_kv_splits,  # never touched with one split
        out,
        qk_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        MERGE_H=merge_h,
        MERGE_S=merge_s,
        ONE_SPLIT=one_split,
        ORDERED=order is not None,
        PREFETCH=prefetch,
        **constexprs,
    )
    return out
