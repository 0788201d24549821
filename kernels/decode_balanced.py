"""decode_attention over a balanced partition: every program of the launch the same number of tokens.

The split kernel (kernels/decode.py) runs a program per (request, KV head, split), its splits equal
within a request. The batch's requests differ in length, so its programs do too: a step's attention
lasts until the longest of them ends, and where the grid takes more waves than one, the last wave
runs partly empty. Here the batch's KV, its requests laid end to end (per KV head), is cut into as
many equal ranges of `chunk` tokens as the device holds programs at once, so they all run in one
wave and end together. A program walks its range request by request: a request inside it gets its
output directly, one cut between programs is merged by the last of them to finish (decode_merge).
So a request spans at most cdiv(len, chunk) + 1 ranges; chunk is at least len / (MAX_SPLITS - 1)
for the longest request (the workspace's room) and at least MIN_CHUNK tokens.

The number of programs is the device's occupancy for the compiled kernel (the CUDA driver's
cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory and threads), asked before its
first launch, times the multiprocessors. A launch beyond it would start a second wave of equal programs:
on an H200, the float8 one-warp kernel (255 registers, 8 a multiprocessor) took the offline run's
attention from 2.43 s with 8 to 3.63 with 10 (docs/benchmarks.md). The loop over a range's requests
is what costs those registers: without it (one request a program) ptxas gives the same code 168, as
the split kernel, which holds 10.

Programs compute chunk and their first request from seq_lens themselves (a cumulative sum over the
batch, held in registers: at most decode.BALANCED_MAX_BATCH requests), so a CUDA graph replays the
launch with any lengths, no host work, no metadata kernel."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from labkit.kernels.decode_merge import store_split
from labkit.kernels.flash import load_query, paged_block_step
from labkit.kernels.pdl import pdl_wait


@triton.jit
def _decode_balanced_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Mid_o, Mid_lse, Semaphores, O,
    qk_scale, v_scale, batch, stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MIN_CHUNK: tl.constexpr,
    MAX_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, MERGE_H: tl.constexpr, MERGE_S: tl.constexpr,
    MERGE_HEADS: tl.constexpr, FP16_DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (KV head block, p): range p of the batch's tokens laid end to end, request by request."""
    pdl_wait(PDL)
    kv_head = tl.program_id(0) // HEAD_BLOCKS
    offs_g = (tl.program_id(0) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(Seq_lens + offs_b, mask=offs_b < batch, other=0)
    total = tl.sum(lens, 0)
    # A request spans at most cdiv(len, chunk) + 1 ranges: MAX_SPLITS with chunk >= len / (MAX_SPLITS - 1).
    chunk = tl.maximum(
        tl.maximum(tl.cdiv(total, tl.num_programs(1)), MIN_CHUNK), tl.cdiv(tl.max(lens, 0), MAX_SPLITS - 1)
    )
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, total)
    ends = tl.cumsum(lens, 0)
    b = tl.sum((ends <= lo).to(tl.int32), 0)  # the request range p starts in
    begin = tl.sum(tl.where(offs_b < b, lens, 0), 0)  # its first token's place in the partition
    while lo < hi:
        seq_len = tl.load(Seq_lens + b)
        start = lo - begin
        end = tl.minimum(hi - begin, seq_len)
        req_row = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_r2t
        q, m_i, l_i, acc = load_query(
            Q, b, stride_qb, stride_qh, offs_h, offs_d, mask_h, mask_d, FP16_DOT, BLOCK_H, BLOCK_D
        )
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = paged_block_step(
                q, m_i, l_i, acc, K_buf, V_buf, req_row, offs_n, offs_n < end, kv_head, offs_d, mask_d,
                stride_kbs, stride_kbh, stride_vbs, stride_vbh, qk_scale, DOT_PRECISION,
            )  # fmt: skip
        first = begin // chunk  # the range the request starts in
        num_splits = (begin + seq_len - 1) // chunk - first + 1
        store_split(
            acc, l_i, m_i, end > start, num_splits == 1, b, tl.program_id(1) - first, num_splits, O, Mid_o,
            Mid_lse, Semaphores, v_scale, offs_h, offs_d, mask_h, mask_d, kv_head, stride_mob, stride_moh,
            stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, GROUP, HEAD_BLOCKS, HEAD_DIM, BLOCK_H,
            BLOCK_D, MERGE_H, MERGE_S, MERGE_HEADS, True,  # streamed: 155 registers against 194 (bf16 pool)
        )  # fmt: skip
        lo = begin + end
        begin += seq_len
        b += 1


# Programs a multiprocessor holds, per compiled variant (device, dtypes, constexprs): the driver's
# occupancy, asked before the variant's first launch.
_PROGRAMS_PER_SM: dict[tuple, int] = {}


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def multiprocessor_occupancy(compiled: Any) -> int | None:
    """Programs of a compiled Triton kernel (launched, or from `warmup`: its binary is loaded here)
    that one multiprocessor holds at once (the CUDA driver's cuOccupancyMaxActiveBlocksPerMultiprocessor
    for its registers, shared memory and threads); None where that cannot be asked (no driver, the
    interpreter)."""
    if getattr(compiled, "function", None) is None and hasattr(compiled, "_init_handles"):
        compiled._init_handles()  # a warmed-up kernel loads its binary at its first launch otherwise
    function = getattr(compiled, "function", None)
    if function is None:
        return None
    try:
        cuda = _libcuda()
    except OSError:
        return None
    blocks = ctypes.c_int()
    status = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks),
        ctypes.c_void_p(function),
        ctypes.c_int(32 * compiled.metadata.num_warps),
        ctypes.c_size_t(compiled.metadata.shared),
    )
    return blocks.value if status == 0 and blocks.value > 0 else None


def decode_balanced(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    semaphores: torch.Tensor,
    qk_scale: float,
    v_scale: float,
    device_sms: int,
    guess_per_sm: int,
    min_chunk: int,
    constexprs: dict[str, Any],
) -> None:
    """Stage 1 and the merge over the balanced partition, into out (decode_attention's arguments;
    mid_o / mid_lse with room for at least 2 splits, their room bounding a request's ranges;
    constexprs: the split kernel's shared ones, GROUP to PDL). guess_per_sm: the programs a
    multiprocessor holds where the driver cannot say (no driver, the interpreter)."""
    batch, heads = q.shape[0], k_buffer.shape[1] * constexprs["HEAD_BLOCKS"]
    max_splits = mid_o.shape[2]
    constexprs = dict(
        constexprs,
        BLOCK_B=triton.next_power_of_2(batch),
        MIN_CHUNK=min_chunk,
        MAX_SPLITS=max_splits,
        MERGE_H=min(constexprs["BLOCK_H"], triton.next_power_of_2(constexprs["GROUP"])),
        MERGE_S=triton.next_power_of_2(max_splits),
    )
    args = (
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, semaphores, out,
        qk_scale, v_scale, batch, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1),
        mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    key = (q.device, q.dtype, k_buffer.dtype, out.dtype, tuple(sorted(constexprs.items())))
    if key not in _PROGRAMS_PER_SM:  # asked before the first launch: every launch then cuts the same ranges
        compiled = _decode_balanced_kernel.warmup(*args, grid=(heads, 1), **constexprs) if q.is_cuda else None
        occupancy = multiprocessor_occupancy(compiled)
        _PROGRAMS_PER_SM[key] = occupancy if occupancy is not None else guess_per_sm
    programs = max(1, _PROGRAMS_PER_SM[key] * device_sms // heads)
    _decode_balanced_kernel[(heads, programs)](*args, **constexprs)
