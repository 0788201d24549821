"""gemv_qkv_rope_store: a decoder layer's qkv_proj for one token, with everything between it and
attention in the same kernel: the norm before it (gemv_rmsnorm's prologue), then, per head, the q/k
RMSNorm (Qwen3), rotary, and the new token's K and V written into the KV pool.

Unfused, a batch-1 decode layer launches the GEMV, the rotary kernel and store_kv one after another,
and the last two cost their launch, not their few KB. Here the GEMV's tiles stay BLOCK_N outputs
wide (hundreds of programs stream the weight, as in gemv), and a head's work is done by the last of
its tiles to finish, counted by a per-head semaphore as split-K counts its pieces:
- a V tile writes its outputs straight into the pool row of the token's slot;
- a Q or K tile writes its outputs to Y; the head's last tile reads the whole head back (from L2,
  where the other programs wrote it), normalizes and rotates it exactly as rotary_embedding does
  (kernels/rotary.py's rope_heads), and writes q in place in Y and k into the pool.
The values are bit-identical to gemv_rmsnorm, then rotary_embedding, then store_kv (in float32 the
q/k norm's sum may be reduced in another order on a GPU: q within a few ulps).
LABKIT_DISABLE_FUSED_QKV=1 in the environment (read at import) turns it off (fuses_qkv says no), for
an A/B against the three kernels in one install."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from labkit.kernels.decode import num_sms
from labkit.kernels.gemv import RMSNORM, Split, default_tiles, gemv_outputs, gemv_sums, launch_args, normed_row
from labkit.kernels.kv_cache import fp8_max, quantize_fp8, stores_into
from labkit.kernels.rotary import rope_heads

ENABLED = os.environ.get("LABKIT_DISABLE_FUSED_QKV", "0") != "1"
# Under PDL decode attention, the next kernel, launches once this kernel's weights are summed, not at
# its wait as after a plain GEMV: it can do little before its own wait, and its programs, launched
# early and resident, cost about 1 us a layer (docs/benchmarks.md). A constant for batch1_ab's A/B.
LAUNCH_ATTENTION_EARLY = False


@triton.jit
def _rope_head(X, Xo, W, eps, cos, sin, scale, FP8_MAX: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """rope_heads on one head of HEAD_DIM at X (written by other programs: read from L2) to Xo."""
    half: tl.constexpr = HEAD_DIM // 2
    rope_heads(X, Xo, W, eps, 0, 0, 0, 0, 0, cos, sin, 1, half, 1, half, HAS_NORM, True, scale, FP8_MAX)


@triton.jit
def _gemv_qkv_kernel(
    X,
    W,
    B,
    Y,
    R,
    NW,
    RES_OUT,
    Partial,
    Sq,
    Semaphores,
    N,
    K,
    k_per_split,
    stride_wn,
    eps,
    Table,
    QW,
    KW,
    head_eps,
    K_buf,
    V_buf,
    Loc,
    k_scale,
    v_scale,
    Head_semaphores,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_HEAD_NORM: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    LAUNCH_EARLY: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: a float8 pool, K and V stored divided by their scales (store_kv's rule)
):
    acc, sq_sum, done = gemv_sums(
        X,
        W,
        R,
        NW,
        RES_OUT,
        Partial,
        Sq,
        Semaphores,
        N,
        K,
        k_per_split,
        stride_wn,
        1,
        HAS_RESIDUAL,
        SPLIT_K,
        BLOCK_N,
        BLOCK_K,
        PDL,
        LAUNCH_EARLY,
    )
    if done:
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # N is a whole number of heads, of tiles
        y = gemv_outputs(acc, sq_sum, B, offs_n, offs_n < N, K, eps, HAS_BIAS, 1).to(Y.dtype.element_ty)
        head = pid * BLOCK_N // HEAD_DIM
        slot = tl.load(Loc).to(tl.int64)
        if head >= NUM_Q + NUM_KV:  # V: as it is, into the pool
            v_row = V_buf + slot * NUM_KV * HEAD_DIM - (NUM_Q + NUM_KV) * HEAD_DIM
            if FP8_MAX > 0:
                tl.store(v_row + offs_n, quantize_fp8(y, v_scale, FP8_MAX).to(V_buf.dtype.element_ty))
            else:
                tl.store(v_row + offs_n, y)
        else:
            tl.store(Y + offs_n, y)
            tl.debug_barrier()  # every thread's outputs are written before the count goes up
            if tl.atomic_add(Head_semaphores + head, 1) == HEAD_DIM // BLOCK_N - 1:  # the head's last tile
                tl.store(Head_semaphores + head, 0)  # left at zero for the next launch
                half_d = tl.arange(0, HEAD_DIM // 2)
                cos = tl.load(Table + half_d)[None, :]  # the rope table's row 0: this token's position
                sin = tl.load(Table + HEAD_DIM // 2 + half_d)[None, :]
                x_head = Y + head * HEAD_DIM
                if head < NUM_Q:  # q in place in Y
                    _rope_head(x_head, x_head, QW, head_eps, cos, sin, 1.0, 0.0, HEAD_DIM, HAS_HEAD_NORM)
                else:  # k into the pool
                    k_row = K_buf + (slot * NUM_KV + head - NUM_Q) * HEAD_DIM
                    _rope_head(x_head, k_row, KW, head_eps, cos, sin, k_scale, FP8_MAX, HEAD_DIM, HAS_HEAD_NORM)


@dataclass(frozen=True)
class QKVHeads:
    """The fused kernel's view of a layer: its q / KV head counts (this rank's) and head size, the
    q/k norm weights (Qwen3; None: no per-head norm) and their eps, and the int32 semaphores it
    counts a head's tiles in (num_q + num_kv of them, zero, left zero by every launch; a caller
    that launches often keeps its own, as for Split)."""

    num_q: int
    num_kv: int
    head_dim: int
    semaphores: torch.Tensor
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None
    norm_eps: float = 1e-6  # rotary_embedding's default


def fuses_qkv(heads: QKVHeads, k_buffer: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether gemv_qkv_rope_store takes this layer: a head of a power-of-two size made of whole
    tiles, and a pool that stores the model's dtype or float8; never with LABKIT_DISABLE_FUSED_QKV=1."""
    d = heads.head_dim
    n = (heads.num_q + 2 * heads.num_kv) * d
    return (
        ENABLED
        and d & (d - 1) == 0
        and d % default_tiles(n, x.shape[-1], num_sms(x.device)).block_n == 0
        and stores_into(k_buffer.dtype, x.dtype)
    )


def gemv_qkv_rope_store(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    split: Split,
    heads: QKVHeads,
    rope_table: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one token: qkv = gemv_rmsnorm(x, residual, norm_weight, eps, weight, bias); q and k get
    rotary_embedding (after the per-head norm where heads.norm_weights); k and v go to the pool rows
    k_buffer[loc[0]], v_buffer[loc[0]] ([num_slots, num_kv, head_dim] each, contiguous; x's dtype,
    or float8 holding k / k_scale and v / v_scale as store_kv quantizes them). rope_table:
    the float32 cos | sin row of the token's position, [1, head_dim] (RotaryEmbedding.kernel_inputs).
    Returns (q [1, num_q, head_dim], the new residual as gemv_rmsnorm returns it)."""
    n, d = weight.shape[0], heads.head_dim
    row, res, res_out = normed_row(x, residual, norm_weight, weight, 1)
    if n != (heads.num_q + 2 * heads.num_kv) * d or d & (d - 1):
        raise ValueError(f"gemv_qkv_rope_store does not take a weight of {tuple(weight.shape)} for {heads}")
    if heads.semaphores.numel() < heads.num_q + heads.num_kv or heads.semaphores.dtype != torch.int32:
        raise ValueError(f"{heads.num_q + heads.num_kv} int32 head semaphores needed")
    for buf in (k_buffer, v_buffer):
        if buf.shape[1:] != (heads.num_kv, d) or not buf.is_contiguous() or not stores_into(buf.dtype, x.dtype):
            raise ValueError(f"a pool buffer of shape {tuple(buf.shape)} for {heads.num_kv} heads of {d}")
    if rope_table.shape != (1, d) or rope_table.dtype != torch.float32:
        raise ValueError(f"the rope table must be one float32 row of {d}, got {tuple(rope_table.shape)}")
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    grid, args, options = launch_args(row, weight, bias, y, split, RMSNORM, res, norm_weight.contiguous(), res_out, eps)
    if d % options["BLOCK_N"]:
        raise ValueError(f"tiles of {options['BLOCK_N']} outputs do not divide heads of {d}")
    del options["PROLOGUE"]  # always the norm
    q_w, k_w = heads.norm_weights if heads.norm_weights is not None else (norm_weight, norm_weight)  # unread
    _gemv_qkv_kernel[grid](
        *args,
        rope_table,
        q_w,
        k_w,
        heads.norm_eps,
        k_buffer,
        v_buffer,
        loc,
        k_scale,
        v_scale,
        heads.semaphores,
        NUM_Q=heads.num_q,
        NUM_KV=heads.num_kv,
        HEAD_DIM=d,
        HAS_HEAD_NORM=heads.norm_weights is not None,
        LAUNCH_EARLY=LAUNCH_ATTENTION_EARLY,
        FP8_MAX=fp8_max(k_buffer.dtype),
        **options,
    )
    q = y[: heads.num_q * d].view(1, heads.num_q, d)
    return q, x if res_out is None else res_out.view(x.shape)
