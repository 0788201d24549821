"""fused_moe: a mixture-of-experts MLP as two grouped GEMMs over expert-homogeneous blocks of pairs.

A pair is one (token, slot) of the routing. Each program of the grouped GEMM takes one (block,
column tile): it gathers its block's rows of A, multiplies them by a column tile of the block's
expert's weight and scatters the result to the pairs' rows; padding rows are masked out. The first
GEMM computes silu(gate) * up per pair in its epilogue: a program's column tile n of the
intermediate dim multiplies the same loads of A by the gate rows n and the up rows I + n of w13[e]
into two float32 accumulators, and stores silu(gate) * up rounded once ([pairs, I]; [gate | up] is
never written). The second GEMM multiplies by w2[e]^T and by the pair's routing weight, and a last
kernel sums each token's k rows in float32: three kernels (plus moe_align_block_size's if SORTED).

The blocks: moe_align_block_size's (SORTED 1: the pairs grouped by expert, BLOCK_SIZE_M to a block,
so a block reads its expert's weights once for all its pairs; blocks past the padded length end at
once), or one pair per block (SORTED 0: nothing to sort, for decode batches where pairs hardly share
experts). Every grid is sized from the shapes alone, so the whole forward can be captured in a CUDA
graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.decode import shared_memory_per_block
from labkit.kernels.moe_align import moe_align_block_size

CONFIG_KEYS = ("SORTED", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


# Up to max tokens: SORTED, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages.
_CONFIGS = (
    (8, 0, 16, 64, 128, 64, 4, 4),
    (64, 1, 16, 64, 128, 1, 4, 4),
    (512, 1, 32, 64, 128, 4, 4, 4),
    (2048, 1, 64, 128, 64, 8, 4, 4),
    (None, 1, 128, 128, 64, 8, 8, 3),
)


def default_config(num_tokens: int) -> dict[str, int]:
    """The tile config for a batch of num_tokens tokens, chosen for Hopper (H100/H200) with 16-bit
    weights at Qwen3-30B-A3B-like shapes (128 experts, top-8, H 2048, I 768); measured on an H100.

    Decode batches are bound by reading the active experts' weights, and their fixed costs are
    launches. Up to 8 tokens, SORTED 0: no moe_align_block_size (a launch less; 1 token: 35 us, 1.4x
    the floor, against 42 us sorted) and one pair per block; GROUP_SIZE_M 64 runs every pair of a
    column tile together, so pairs that share an expert read its tile from L2. From 16 tokens on,
    pairs share experts enough that sorting pays (16 tokens: 265 us sorted, 324 us not): a block of
    BLOCK_SIZE_M 16 (the smallest tensor-core tile) holds the few pairs an expert gets. BLOCK_SIZE_N
    64 and 128-deep K steps over 4 stages keep ~64 KiB of weight loads in flight per program; the
    decode timings moved by under 10% over N 16-128, K 64-256, 2-8 warps and 3-6 stages. From a few
    hundred tokens on, experts get tens of pairs: taller blocks read a weight tile for more rows, and
    GROUP_SIZE_M runs an expert's neighbouring blocks together so its weights come from L2.

    These timings and choices were measured on an H100 before silu_and_mul was fused into the first
    GEMM. Since then BLOCK_SIZE_N is, in the first GEMM, a tile of the intermediate dim for which a
    program reads both the gate and the up rows: twice the weight rows (and shared memory per stage)
    of a program of the second GEMM, and half as many programs as before. The values are unchanged;
    re-measure them (python -m labkit.kernels.bench_moe --tune) before reading the numbers above as
    the current kernel's."""
    values = next(row[1:] for row in _CONFIGS if row[0] is None or num_tokens <= row[0])
    return dict(zip(CONFIG_KEYS, values))


@triton.jit
def _moe_gemm_kernel(
    A,
    B,
    C,
    Topk_weights,
    Sorted_ids,
    Expert_ids,
    Num_post_padded,
    Topk_ids,
    N,
    K,
    num_pairs,
    num_experts,
    num_blocks_m,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when A has one row per token, 1 for one row per pair
    GATED: tl.constexpr,  # B is [E, 2N, K] (gate rows, then up rows): C = silu(A @ gate^T) * (A @ up^T)
    MUL_ROUTING_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr,  # blocks from moe_align_block_size, else one pair per block
    DOT_PRECISION: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # Grouped order: GROUP_SIZE_M consecutive blocks run each column tile together, so the blocks that
    # read one expert's tile (an expert spanning several sorted blocks, or unsorted pairs sharing an
    # expert) run side by side and all but the first find it in L2.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    per_group = GROUP_SIZE_M * num_pid_n
    first_m = (pid // per_group) * GROUP_SIZE_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if SORTED:
        if pid_m * BLOCK_SIZE_M >= tl.load(Num_post_padded):
            return  # a block past the padded length (the grid is sized for the worst case)
        # num_post_padded is a multiple of BLOCK_SIZE_M, so a used block lies wholly inside the buffer.
        pairs = tl.load(Sorted_ids + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M))
        expert = tl.load(Expert_ids + pid_m).to(tl.int64)
    else:
        # Block m is pair m alone (row 0; the other rows are padding): no sorting needed.
        expert = tl.load(Topk_ids + pid_m).to(tl.int64)
        if (expert < 0) | (expert >= num_experts):
            return  # another rank's expert
        pairs = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pid_m, num_pairs)
    row_mask = pairs < num_pairs  # padding holds the sentinel num_pairs
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = A + (pairs // PAIRS_PER_A_ROW).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    if GATED:
        # The up rows N + offs_n of the same expert, multiplied by the same loads of A.
        up_ptrs = B + expert * stride_be + (offs_n + N)[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
        acc_up = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_SIZE_K * stride_bk
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    if GATED:
        # silu(gate) * up in float32, as silu_and_mul computes it (padding rows hold zeros: no overflow).
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTING_WEIGHT:
        acc *= tl.load(Topk_weights + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_sum_kernel(
    Y, Topk_ids, Out, H, stride_o, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_H: tl.constexpr
):
    # Y [T * k, H] float32: rows of slots whose expert is not here were never written, so skip them.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(Topk_ids + t * TOP_K + j)
        width = tl.where((e >= 0) & (e < NUM_EXPERTS), H, 0)  # an absent expert's row: read nothing
        acc += tl.load(Y + (t * TOP_K + j) * H + offs, mask=offs < width, other=0.0)
    tl.store(Out + t * stride_o + offs, acc.to(Out.dtype.element_ty), mask=offs < H)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    ids: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    pairs_per_a_row: int,
    config: dict[str, int],
    gated: bool = False,
) -> None:
    """c[pair] = a[pair // pairs_per_a_row] @ b[e]^T (* topk_weights[pair]), b [E, N, K], e = ids[pair],
    for every pair whose expert is here. gated: b is [E, 2N, K] (gate rows, then up rows) and
    c[pair] = silu(x @ gate[e]^T) * (x @ up[e]^T), x = a[pair // pairs_per_a_row], in float32 and
    rounded once to c's dtype. blocks: moe_align_block_size's output, or None for one pair per block
    (no sorting)."""
    n, k = b.shape[1] // 2 if gated else b.shape[1], b.shape[2]
    assert c.shape[1] == n and a.shape[1] == k
    tiles = {key: value for key, value in config.items() if key != "SORTED"}
    tiles["num_stages"] = _stages_that_fit(tiles, a.element_size(), gated, a.device)
    sorted_ids, expert_ids, num_post = blocks if blocks is not None else (ids, ids, ids)  # unread if None
    num_blocks_m = expert_ids.shape[0] if blocks is not None else ids.shape[0]
    grid = (num_blocks_m * triton.cdiv(n, config["BLOCK_SIZE_N"]),)
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        topk_weights if topk_weights is not None else c,  # unread without MUL_ROUTING_WEIGHT
        sorted_ids,
        expert_ids,
        num_post,
        ids,
        n,
        k,
        c.shape[0],
        b.shape[0],
        num_blocks_m,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        GATED=gated,
        MUL_ROUTING_WEIGHT=topk_weights is not None,
        SORTED=blocks is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **tiles,
    )


def _stages_that_fit(tiles: dict[str, int], element_size: int, gated: bool, device: torch.device) -> int:
    """The config's pipeline depth, lowered until the stages' A and B tiles fit the device's shared
    memory: the gated GEMM holds two B tiles, and float32 doubles every tile, so a depth chosen for
    16-bit weights can exceed it (Hopper's 227 KiB: a 64x128x64 float32 gated tile, 3 stages)."""
    stages = tiles.get("num_stages", 3)
    if device.type != "cuda":
        return stages
    limit = shared_memory_per_block(device)
    m, n, k = tiles["BLOCK_SIZE_M"], tiles["BLOCK_SIZE_N"], tiles["BLOCK_SIZE_K"]
    per_stage = (m * k + (2 if gated else 1) * n * k) * element_size
    return max(1, min(stages, limit // per_stage))


def _check(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """Raise ValueError unless the arguments fit fused_moe's contract."""
    shapes = f"hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    if (
        hidden.dim() != 2
        or w13.dim() != 3
        or w13.shape[1] % 2
        or w13.shape[2] != hidden.shape[1]
        or tuple(w2.shape) != (w13.shape[0], hidden.shape[1], w13.shape[1] // 2)
    ):
        raise ValueError(f"fused_moe: want hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {shapes}")
    routing = f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}"
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: want topk_weights and topk_ids [T={hidden.shape[0]}, k]; got {routing}")
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16) or {w13.dtype, w2.dtype} != {hidden.dtype}:
        raise ValueError(
            f"fused_moe: want hidden and weights of one float dtype; got {hidden.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if not topk_weights.is_floating_point() or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"fused_moe: want float topk_weights, int32/int64 topk_ids; got {topk_weights.dtype}, {topk_ids.dtype}"
        )
    if len({x.device for x in (hidden, w13, w2, topk_weights, topk_ids)}) != 1:
        raise ValueError("fused_moe: all tensors must be on one device")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The routed experts' MLP: hidden [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights [T, k] (float), topk_ids [T, k] (int32/int64) -> out [T, H] in hidden's dtype, with
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), [g | u] = w13[e] @ hidden[t],
    e = topk_ids[t, j]. Slots whose id is outside [0, E) (-1: an expert held by another rank) add
    nothing; a token with no such slot gets zeros. float32, float16 or bfloat16 (hidden and weights
    alike; any strides). Products accumulate in float32; silu(g) * u is computed from the float32
    g and u and rounded once to hidden's dtype, the weighted sum is kept in float32 and rounded once.
    float32 inputs use full-precision (IEEE) matrix products.

    config: tile settings (keys from CONFIG_KEYS) that override default_config(T). No host sync: the
    call can be captured in a CUDA graph."""
    _check(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    unknown = set(config or {}) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"fused_moe: unknown config keys {sorted(unknown)} (known: {CONFIG_KEYS})")
    config = {**default_config(num_tokens), **(config or {})}
    weights, ids = topk_weights.reshape(-1).contiguous(), topk_ids.reshape(-1).contiguous()
    num_experts, inter = w13.shape[0], w2.shape[2]
    num_pairs = num_tokens * top_k
    blocks = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts) if config["SORTED"] else None
    # Rows of pairs whose expert is not here are never written in act or y, and nothing reads them.
    act = hidden.new_empty(num_pairs, inter)
    _grouped_gemm(hidden, w13, act, None, ids, blocks, top_k, config, gated=True)
    y = torch.empty(num_pairs, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    _grouped_gemm(act, w2, y, weights, ids, blocks, 1, config)
    block_h = min(1024, triton.next_power_of_2(hidden.shape[1]))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden.shape[1], block_h))](
        y,
        ids,
        out,
        hidden.shape[1],
        out.stride(0),
        TOP_K=top_k,
        NUM_EXPERTS=num_experts,
        BLOCK_H=block_h,
    )
    return out
