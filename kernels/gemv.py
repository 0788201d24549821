"""gemv: y = x W^T (+ b) for a single row x, the shape of every linear layer in a batch-1 decode step.

cuBLAS picks a GEMM tile for [1, K] x [K, N] that leaves most of the GPU idle on some shapes (on an
H200, Qwen3-0.6B's o_proj, 2048 -> 1024, took 12.8 us for 4.2 MB: 0.33 TB/s). Here each program
owns BLOCK_N output features and streams their rows of W through registers, BLOCK_K columns at a
time, against the one row of x: a weight-bandwidth-bound dot product with N / BLOCK_N programs in
flight. Products and sums in float32, one rounding to the output dtype.

A tall weight (K > N: o_proj, down_proj) has too few output tiles to keep the GPU's memory system
busy, so its K is cut into split_k pieces, one program per (tile, piece) (gemv_split_k). Each piece
leaves its float32 partial sums; the last piece of a tile to finish (an atomic counter, a
semaphore, says which) adds them in piece order, so the result does not depend on timing, and
finishes the tile. On an H200 that took Qwen3-0.6B's down_proj from 7.7 to 5.6 us and Qwen2.5's
(4864 -> 896) from 11.0 to 6.5 us, ahead of cuBLAS's 8.4 (kernels/bench_gemv.py). Under PDL (below)
the weights are not cut: the next projection streams its weights while this one's last tiles finish,
which is the idle time the pieces filled, and with one piece a batch-1 decode step was faster on
every model timed (H200 and H100, docs/benchmarks.md).

Up to MAX_ROWS rows (a decode step of two requests) run as one launch with a program per row and
tile: the rows' programs read the same weight tile, from L2 after the first. On an H200, with the
weights cold in HBM, two rows took 1.5-7.3 us a projection of SmolLM2-135M and Qwen3-0.6B against
cuBLAS's 3.6-12.9 (one shape slower: Qwen3-0.6B's gate_up_proj, 7.25 against 6.04 before the norm it
fuses); from four rows on, the rereads cost more than cuBLAS on most shapes (docs/benchmarks.md).
Several rows take K whole: the split-K partials and semaphores hold one row's.

Each launch is programmatically dependent on the kernel ahead (labkit.kernels.pdl): its first
weight tile streams in before it waits for that kernel's output.

At batch 1 a decode step is a chain of a few hundred kernels of 2-8 us each, and the elementwise ones
between the projections cost their launch, not their bytes. Two of them run here, in the prologue
that makes the row x each program multiplies (every program re-reads the few KB of input, from L2):
- gemv_rmsnorm: x = rmsnorm(h + residual), the decoder layer's norm before qkv_proj and gate_up_proj
  (the first tile's programs also write the new residual stream h + residual);
- gemv_silu_and_mul: x = silu(gate) * up from gate_up_proj's output, before down_proj.
The activation rounds where labkit.kernels.silu_and_mul rounds. The norm needs the whole row's
statistic before it can scale, which would mean a pass over the row before the first weight load;
instead the products take h * norm_weight in float32 and the sum is scaled by 1 / rms(h) at the end
(one pass). That skips the two roundings to 16 bits of labkit.kernels.rmsnorm (normalized, then
scaled): the fused result is the more exact one, a few 16-bit ulps from the unfused path.
The kernel's body is gemv_sums (a tile's sums) and gemv_outputs (its finished outputs), which
kernels/gemv_qkv.py builds its own epilogue on (qkv_proj with the rotary and the KV store).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from labkit.kernels.decode import num_sms
from labkit.kernels.gemv_all_reduce import GemvAllReduce, no_all_reduce, sum_over_ranks
from labkit.kernels.pdl import pdl_launch_dependents, pdl_options, pdl_wait_only

MAX_ROWS = 2  # rows a launch takes (a program per row and tile; module docstring)


def max_rows() -> int:
    """The most rows gemv takes now (MAX_ROWS, read at each call: an A/B sets it to 1)."""
    return MAX_ROWS


MAX_SPLIT_K = 16
MIN_K_PER_SPLIT = 256  # inputs a split program streams at least (gemv_split_k)
SPLIT_PROGRAMS_PER_SM = 8  # programs per multiprocessor gemv_split_k aims for
SPLIT_UNDER_PDL = False  # cut tall weights under PDL too (batch1_ab's knob; slower where timed)
WHOLE_STEP_MAX_N = 4096  # default_tiles: weights of up to this many outputs take steps of 1024 inputs
# default_tiles for a weight in one piece: (block_n, largest block_k, warps) of a tall one with few
# tiles (None: the wide rule), and a wide one's warps; batch-1 decode was faster with both on an
# H200 (labkit.bench.batch1_ab, docs/benchmarks.md).
TALL_TILE: tuple[int, int, int] | None = (4, 2048, 8)
WIDE_WARPS = 4
PLAIN, RMSNORM, SILU_AND_MUL = 0, 1, 2  # the prologue


@triton.jit
def gemv_sums(
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
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    LAUNCH_EARLY: tl.constexpr,
):
    """This program's tile: (float32 sums of its BLOCK_N outputs, the norm's sum of squares, whether
    this program holds the whole tile's sums and must finish it: always with one split, else only
    the tile's last split to arrive). Under PDL the next kernel may launch right after the wait
    (LAUNCH_EARLY: a next projection streams its weights meanwhile) or once the weights are summed."""
    pid, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)  # the norm's statistic, gathered on the way
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # The weights are one tile ahead of the sums: the first tile streams in before the wait for the
    # kernel ahead (no kernel writes weights), each next one while the current one is summed.
    k = k_start + offs_k
    w = tl.load(rows + k[None, :], mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)
    pdl_wait_only(PDL)
    if LAUNCH_EARLY:
        pdl_launch_dependents(PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        x = tl.load(X + k, mask=k_mask, other=0.0)
        if PROLOGUE == 1:  # sum w (h * norm weight); the 1 / rms(h) that scales it comes at the end
            if HAS_RESIDUAL:  # h = x + residual, rounded like torch's x + residual
                x = (x.to(tl.float32) + tl.load(R + k, mask=k_mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
                if pid == 0:  # the first tile of each split writes its range of the new residual
                    tl.store(RES_OUT + k, x, mask=k_mask)
            hf = x.to(tl.float32)
            sq += hf * hf
            x = hf * tl.load(NW + k, mask=k_mask, other=0.0).to(tl.float32)
        if PROLOGUE == 2:  # X is [gate | up], 2K wide
            gate = x.to(tl.float32)
            up = tl.load(X + K + k, mask=k_mask, other=0.0).to(tl.float32)
            x = (gate / (1.0 + tl.exp(-gate)) * up).to(X.dtype.element_ty)
        w_next = tl.load(
            rows + (k + BLOCK_K)[None, :], mask=n_mask[:, None] & (k + BLOCK_K < k_end)[None, :], other=0.0
        )
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        w = w_next
    if not LAUNCH_EARLY:
        pdl_launch_dependents(PDL)
    sq_sum = tl.sum(sq, 0)
    done = True
    if SPLIT_K > 1:
        # Serial split-K: each split leaves its partial sums; the tile's last split to arrive (the
        # semaphore counts them) adds them in split order, so the result does not depend on timing.
        tl.store(Partial + split * N + offs_n, acc, mask=n_mask)
        tl.store(Sq + pid * SPLIT_K + split, sq_sum)
        tl.debug_barrier()  # every thread's partials are written before the count goes up
        done = tl.atomic_add(Semaphores + pid, 1) == SPLIT_K - 1  # acq_rel: the others' partials are seen
        if done:
            splits = tl.arange(0, SPLIT_K)
            parts = tl.load(
                Partial + splits[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0.0, cache_modifier=".cg"
            )
            acc = tl.sum(parts, 0)
            sq_sum = tl.sum(tl.load(Sq + pid * SPLIT_K + splits, cache_modifier=".cg"), 0)
            tl.store(Semaphores + pid, 0)  # left at zero for the next launch
    return acc, sq_sum, done


@triton.jit
def gemv_outputs(acc, sq_sum, B, offs_n, n_mask, K, eps, HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr):
    """A finished tile's outputs in float32, before their one rounding to the output dtype."""
    if PROLOGUE == 1:
        acc *= tl.rsqrt(sq_sum / K + eps)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _gemv_kernel(
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
    stride_xm,
    Buffers,
    Flags,
    Epoch,
    slot_stride,
    row_stride,
    tiles_cap,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
):
    row = tl.program_id(2).to(tl.int64)  # this program's row: its input, output and residual rows
    X += row * stride_xm
    Y += row * N
    R += row * K
    RES_OUT += row * K
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
        PROLOGUE,
        HAS_RESIDUAL,
        SPLIT_K,
        BLOCK_N,
        BLOCK_K,
        PDL,
        True,  # LAUNCH_EARLY: a projection's next kernel is mostly another one
    )
    if done:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        y = gemv_outputs(acc, sq_sum, B, offs_n, n_mask, K, eps, HAS_BIAS, PROLOGUE).to(Y.dtype.element_ty)
        if WORLD > 1:  # a row-parallel layer's partial sums: the all-reduce in the epilogue
            y = sum_over_ranks(
                y, offs_n, n_mask, Buffers, Flags, Epoch, slot_stride, row_stride, tiles_cap, RANK, WORLD
            ).to(Y.dtype.element_ty)
        tl.store(Y + offs_n, y, mask=n_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, width: int, max_rows: int) -> None:
    if x.shape[-1] != width or not 1 <= x.numel() // width <= max_rows:
        rows = "one row" if max_rows == 1 else f"1 to {max_rows} rows"
        raise ValueError(f"gemv takes {rows} of {width} features, got x of shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous")


@dataclass(frozen=True)
class Tiles:
    """A launch's shape: output features per program, inputs per inner step, warps per program."""

    block_n: int
    block_k: int
    num_warps: int


def block_n(n: int) -> int:
    """Output features per program: the sizes that won on an H200 (docs/benchmarks.md)."""
    return 16 if n >= 8192 else 8


def default_tiles(n: int, k: int, sms: int, split_k: int = 1) -> Tiles:
    """The tiles for an N x K weight cut into split_k pieces on a GPU of `sms` multiprocessors, from
    sweeps on an H200 (docs/benchmarks.md). Whole (one piece, as under PDL): a tall weight (K > N)
    whose block_n(n) tiles are fewer than the multiprocessors takes TALL_TILE, narrow tiles of long
    steps (Qwen3-0.6B's and Qwen2.5-0.5B's o_proj and down_proj; Llama-3-8B's down_proj, 512 tiles,
    was slower with it); a wide one block_n(n) outputs, up to 1024 inputs a step where N is at most
    WHOLE_STEP_MAX_N (up to 512 beyond, where the many tiles keep the GPU busy anyway), and
    WIDE_WARPS warps. Pieces (split-K, without PDL): the wide rule, 8 warps for steps of 1024 or more."""
    k_split = triton.cdiv(k, split_k)
    if split_k == 1 and k > n and semaphore_count(n) < sms and TALL_TILE is not None:
        tile_n, max_k, warps = TALL_TILE
        return Tiles(tile_n, min(max_k, triton.next_power_of_2(k)), warps)
    block_k = min(1024 if n <= WHOLE_STEP_MAX_N else 512, triton.next_power_of_2(k_split))
    if split_k == 1:
        return Tiles(block_n(n), block_k, WIDE_WARPS)
    return Tiles(block_n(n), block_k, 8 if block_k >= 1024 or k_split >= 2048 else 4)


def semaphore_count(n: int) -> int:
    """Semaphores a split-K launch over N output features needs (one per tile of block_n(n))."""
    return triton.cdiv(n, block_n(n))


def gemv_split_k(n: int, k: int, sms: int, pdl: bool = False) -> int:
    """K splits for an N x K weight on a GPU of `sms` multiprocessors, launched with PDL or not. A
    tall weight (K > N: o_proj, down_proj) launched without PDL has few output tiles for its bytes:
    cut it into the fewest pieces (a power of two) that put SPLIT_PROGRAMS_PER_SM programs on each
    multiprocessor, keeping at least MIN_K_PER_SPLIT inputs a piece. Under PDL the next kernel's
    weight loads fill that idle time, and one piece was faster (module docstring). A wide one is
    one piece: its tiles already fill the GPU, and on an H200 every cut of one made it slower
    (docs/benchmarks.md)."""
    split, tiles = 1, semaphore_count(n)
    if k <= n or (pdl and not SPLIT_UNDER_PDL):
        return split
    while split < MAX_SPLIT_K and tiles * split < SPLIT_PROGRAMS_PER_SM * sms and k >= 2 * split * MIN_K_PER_SPLIT:
        split *= 2
    return split


def launch_args(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    split: Split,
    prologue: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    res_out: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[tuple[int, int], list[Any], dict[str, Any]]:
    """The grid (tiles, splits), arguments and keyword arguments (constexprs, launch options) of a
    GEMV launch over rows [M, K]: _gemv_kernel's, which a kernel built on gemv_sums starts its own
    with. Several rows take K whole (the split-K partials and semaphores hold one row's)."""
    n, k = weight.shape
    pdl, sms = pdl_options(rows.device, rows.shape[0]), num_sms(rows.device)
    split_k = 1 if rows.shape[0] > 1 else split.split_k or gemv_split_k(n, k, sms, pdl["PDL"])
    if split_k & (split_k - 1) or not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k must be a power of two in [1, {MAX_SPLIT_K}], got {split_k}")
    shape = split.tiles or default_tiles(n, k, sms, split_k)
    tiles = triton.cdiv(n, shape.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), shape.block_k) * shape.block_k
    partial = sq = semaphores = rows  # never read with one split
    if split_k > 1:
        partial = torch.empty(split_k, n, dtype=torch.float32, device=rows.device)
        sq = torch.empty(tiles * split_k, dtype=torch.float32, device=rows.device)
        semaphores = split.semaphores
        if semaphores is None:
            semaphores = torch.zeros(tiles, dtype=torch.int32, device=rows.device)
        elif semaphores.numel() < tiles or semaphores.dtype != torch.int32:
            raise ValueError(f"split-K needs {tiles} int32 semaphores, got {semaphores.numel()} {semaphores.dtype}")
    args = [
        rows,
        weight,
        bias if bias is not None else rows,  # never read without HAS_BIAS
        out,
        residual if residual is not None else rows,  # nor these without their prologue
        norm_weight if norm_weight is not None else rows,
        res_out if res_out is not None else rows,
        partial,
        sq,
        semaphores,
        n,
        k,
        k_per_split,
        weight.stride(0),
        eps,
    ]
    options = dict(
        HAS_BIAS=bias is not None,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        SPLIT_K=split_k,
        BLOCK_N=shape.block_n,
        BLOCK_K=shape.block_k,
        num_warps=shape.num_warps,
        **pdl,
    )
    return (tiles, split_k), args, options


def _launch(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *rest: Any,
    all_reduce: GemvAllReduce | None = None,
) -> None:
    """_gemv_kernel over contiguous rows [M, K] (or [M, 2K]) into out [M, N]: a program per tile,
    split and row; with `all_reduce`, out is the sum over its ranks (the bias must then be added after)."""
    (tiles, split_k), args, options = launch_args(rows, weight, bias, out, *rest)
    if all_reduce is None:
        reduce_args, reduce_options = no_all_reduce(rows)
    elif bias is not None:
        raise ValueError("a GEMV summed over the ranks takes no bias (each rank would add it)")
    else:
        reduce_args, reduce_options = all_reduce.launch_args(rows.shape[0], weight.shape[0], tiles)
    grid = (tiles, split_k, rows.shape[0])
    _gemv_kernel[grid](*args, rows.stride(0), *reduce_args, **options, **reduce_options)


@dataclass(frozen=True)
class Split:
    """How a launch cuts K: split_k (None: gemv_split_k's choice for the device) and the int32
    semaphores a split launch counts arrivals in (at least semaphore_count(N), all zero; the kernel
    leaves them zero; None: allocated per call). A caller that launches often (a linear layer) keeps
    its own, so a launch costs no memset; launches sharing them must not run concurrently."""

    split_k: int | None = None
    semaphores: torch.Tensor | None = None
    tiles: Tiles | None = None  # None: default_tiles (another for tuning: kernels/bench_gemv.py --sweep)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    split: Split = Split(),
    all_reduce: GemvAllReduce | None = None,
) -> torch.Tensor:
    """x [..., K] holding 1 to MAX_ROWS rows, weight [N, K] with unit stride along K, bias [N] or
    None -> [..., N] in x's dtype, equal to F.linear(x, weight, bias) up to float32 summation order.
    With `all_reduce` (no bias), the sum of that over the group's ranks (kernels/gemv_all_reduce.py)."""
    n, k = weight.shape
    _check(x, weight, k, MAX_ROWS)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(x.reshape(-1, k).contiguous(), weight, bias, out, split, all_reduce=all_reduce)
    return out


def normed_row(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """gemv_rmsnorm's inputs checked (1 to max_rows rows): (x's rows [M, K], the residual's or None,
    new rows for the new residual or None)."""
    k = weight.shape[1]
    _check(x, weight, k, max_rows)
    if norm_weight.shape != (k,):
        raise ValueError(f"norm weight of shape {tuple(norm_weight.shape)} for {k} features")
    rows = x.reshape(-1, k).contiguous()
    if residual is None:
        return rows, None, None
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("the residual must have x's shape and dtype")
    # Not in place: other programs still read the residual.
    return rows, residual.reshape(-1, k).contiguous(), torch.empty_like(rows)


def gemv_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    split: Split = Split(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rmsnorm(h, norm_weight, eps), weight, bias), h) with h = x + residual (residual None:
    h = x, returned as is): labkit.kernels.fused_add_rmsnorm (or rmsnorm) then gemv, in one kernel.
    x and residual [..., K] hold 1 to MAX_ROWS rows of one dtype; the new residual is a new tensor."""
    row, res, res_out = normed_row(x, residual, norm_weight, weight, MAX_ROWS)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(row, weight, bias, out, split, RMSNORM, res, norm_weight.contiguous(), res_out, eps)
    return out, x if res_out is None else res_out.view(x.shape)


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    split: Split = Split(),
    all_reduce: GemvAllReduce | None = None,
) -> torch.Tensor:
    """gemv(silu_and_mul(x), weight, bias, split, all_reduce) in one kernel: x [..., 2K] = [gate |
    up] holding 1 to MAX_ROWS rows, weight [N, K] -> [..., N] in x's dtype."""
    n, k = weight.shape
    _check(x, weight, 2 * k, MAX_ROWS)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(x.reshape(-1, 2 * k).contiguous(), weight, bias, out, split, SILU_AND_MUL, all_reduce=all_reduce)
    return out
