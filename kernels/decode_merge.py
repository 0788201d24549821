"""The end of decode attention's stage-1 programs (kernels/decode.py, kernels/decode_balanced.py):
a request's output written directly when one program covered it, else each program's normalized
partial and log-sum-exp, merged by the last to arrive: out = sum_s w_s o_s / sum_s w_s with
w_s = exp(lse_s - max lse), in a fixed order. A semaphore per (request, head block) counts the
arrivals; the merging program leaves it at zero for the next launch."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_split(
    acc, l_i, m_i, nonempty, direct, b, split, num_splits, O, Mid_o, Mid_lse, Semaphores, v_scale,
    offs_h, offs_d, mask_h, mask_d, kv_head, stride_mob, stride_moh, stride_mos, stride_mlb,
    stride_mlh, stride_ob, stride_oh, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_H: tl.constexpr, MERGE_S: tl.constexpr,
    MERGE_HEADS: tl.constexpr, STREAM: tl.constexpr = False,
):  # fmt: skip
    """A stage-1 program's end for request b: its normalized output written as the request's (direct:
    the only split), or as partial `split` of num_splits with its log-sum-exp, the last of the
    (request, head block)'s splits to arrive merging them all (merge_splits; STREAM its mode)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part = tl.where(nonempty, acc / l_safe[:, None], 0.0) * v_scale
    if direct:
        tl.store(
            O + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
            part.to(O.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(
            Mid_o + b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
            part,
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(Mid_lse + b * stride_mlb + offs_h * stride_mlh + split, lse, mask=mask_h)
        # The last split of this (request, head block) to arrive merges them all (the semaphore
        # counts arrivals; acq_rel makes the others' partials visible) and leaves it at zero.
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        semaphore = Semaphores + b * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(semaphore, 1) == num_splits - 1:
            tl.store(semaphore, 0)
            merge_splits(
                Mid_o + b * stride_mob,
                Mid_lse + b * stride_mlb,
                num_splits,
                O + b * stride_ob,
                kv_head * GROUP,
                (tl.program_id(0) % HEAD_BLOCKS) * BLOCK_H,
                stride_moh,
                stride_mos,
                stride_mlh,
                stride_oh,
                GROUP,
                HEAD_DIM,
                BLOCK_D,
                MERGE_H,
                MERGE_S,
                MERGE_HEADS,
                STREAM,
            )


@triton.jit
def merge_splits(
    Mid_o,
    Mid_lse,
    num_splits,
    O,
    head0,  # the KV head's first query head
    g0,  # this program's first head in the group
    stride_moh,
    stride_mos,
    stride_mlh,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_H: tl.constexpr,
    MERGE_S: tl.constexpr,
    MERGE_HEADS: tl.constexpr,
    STREAM: tl.constexpr = False,
):
    """Query heads g0 .. g0 + MERGE_HEADS of the group from their splits' partials: MERGE_H heads at a
    time, every split's partial loaded at once ([MERGE_H, MERGE_S, D]: one round trip to memory,
    not one per split), or with STREAM one split's [MERGE_H, D] at a time (fewer registers, a round
    trip per split), summed in a fixed order either way. The loads skip L1: other multiprocessors
    wrote them during this launch."""
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_sd = (offs_s < num_splits)[:, None] & (offs_d < HEAD_DIM)[None, :]
    for c in tl.static_range(0, MERGE_HEADS, MERGE_H):
        offs_g = g0 + c + tl.arange(0, MERGE_H)
        mask_h = offs_g < GROUP
        offs_h = head0 + offs_g
        lse = tl.load(
            Mid_lse + offs_h[:, None] * stride_mlh + offs_s[None, :],
            mask=mask_h[:, None] & (offs_s < num_splits)[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        m = tl.max(lse, 1)  # empty splits have lse -inf (and a zero partial): weight 0
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])
        l_sum = tl.sum(w, 1)
        if STREAM:  # one split's partial at a time: [MERGE_H, D] registers, a round trip per split
            out = tl.zeros([MERGE_H, BLOCK_D], tl.float32)
            for s in range(0, num_splits):
                part = tl.load(
                    Mid_o + offs_h[:, None] * stride_moh + s * stride_mos + offs_d[None, :],
                    mask=mask_h[:, None] & (offs_d < HEAD_DIM)[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                out += tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)[:, None] * part
        else:
            part = tl.load(
                Mid_o + offs_h[:, None, None] * stride_moh + offs_s[None, :, None] * stride_mos + offs_d[None, None, :],
                mask=mask_h[:, None, None] & mask_sd[None, :, :],
                other=0.0,
                cache_modifier=".cg",
            )
            out = tl.sum(w[:, :, None] * part, 1)
        out = out / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            O + offs_h[:, None] * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=mask_h[:, None] & (offs_d < HEAD_DIM)[None, :],
        )
