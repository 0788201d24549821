"""extend_attention: prefill / chunked prefill / mixed batches over the paged KV pool.

One program per (tile, KV head), a tile being consecutive new tokens of one request (the tile list
is planned once per forward, so a batch of one long prompt and many one-token requests launches no
idle programs). The program's query rows are the tile's tokens for every query head of its KV head
(GQA packed), so each K/V block is read once for the whole group and the matrix products get taller.
A program runs flash attention in phases with one online softmax:
the request's cached prefix, read through req_to_token (every prefix token is visible to every new
token), then the new tokens' own K/V from the k, v arguments: unmasked blocks before the tile, then
the tile's diagonal blocks with the causal mask.

A float8 pool (--kv-cache-dtype fp8_*) is loaded as float8 and dequantized in the kernel: phase 1's
K scale is folded into its score scale, and its V scale multiplies the accumulator once phase 1 is
done (the new tokens' K/V of phases 2 and 3 are not quantized)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from labkit.kernels.flash import LOG2E, online_softmax_step, paged_block_step
from labkit.mem_cache.memory_pool import is_fp8


@triton.jit
def _load_rows(ptrs, mask_d, EVEN_D: tl.constexpr):
    """Whole rows of K or V [N, BLOCK_D]: unmasked when the head dim fills the block (EVEN_D), so the
    loads need no predicate."""
    if EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return x


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_start,
    Tile_req,
    Tile_start,
    qk_scale,  # sm_scale * log2(e)
    k_scale,  # the pool's scales (1.0 unless it stores float8)
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows: TILE tokens x GROUP heads
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOT: tl.constexpr,  # a float8 pool under a 16-bit q: phase 1 multiplies in float16 (decode.py)
    INT32_ROWS: tl.constexpr,  # every row offset of q / k / v / o fits in int32
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(Tile_req + tile)
    m0 = tl.load(Tile_start + tile)
    prefix_len = tl.load(Prefix_lens + b)
    extend_len = tl.load(Extend_lens + b)
    row0 = tl.load(Extend_start + b)  # first row of this request in q / k / v / o
    if INT32_ROWS:  # 32-bit address arithmetic, cheaper than 64-bit in the inner loops
        extend_len = extend_len.to(tl.int32)
        row0 = row0.to(tl.int32)
    req_row = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_r2t

    # Row r is token m0 + r // GROUP of query head kv_head * GROUP + r % GROUP: the heads sharing a KV
    # head read each K/V block once. Rows past TILE * GROUP (a GROUP that is not a power of two) idle.
    TILE: tl.constexpr = BLOCK_M // GROUP
    offs_r = tl.arange(0, BLOCK_M)
    tok = m0 + offs_r // GROUP
    head = kv_head * GROUP + offs_r % GROUP
    mask_m = (offs_r < TILE * GROUP) & (tok < extend_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (row0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    # A finite start: a block whose scores are all masked then leaves the state as it was.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: the cached prefix, from the pool.
    prefix_qk_scale = qk_scale * k_scale
    if FP16_DOT:
        q_prefix = q.to(tl.float16)
    else:
        q_prefix = q
    for n0 in range(0, prefix_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = paged_block_step(
            q_prefix,
            m_i,
            l_i,
            acc,
            K_buf,
            V_buf,
            req_row,
            offs_n,
            offs_n < prefix_len,
            kv_head,
            offs_d,
            mask_d,
            stride_kbs,
            stride_kbh,
            stride_vbs,
            stride_vbh,
            prefix_qk_scale,
            DOT_PRECISION,
        )
    # acc sums softmax weights times stored V: one multiply dequantizes all of it (the online
    # softmax's later rescaling is linear).
    acc = acc * v_scale

    # Phase 2: whole blocks of new tokens before the tile, visible to all its rows (they end at or
    # before m0 < extend_len: no mask).
    diagonal = (m0 // BLOCK_N) * BLOCK_N
    for n0 in range(0, diagonal, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(
            K + (row0 + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
            mask_d,
            BLOCK_D == HEAD_DIM,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        v = _load_rows(
            V + (row0 + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask_d,
            BLOCK_D == HEAD_DIM,
        )
        m_i, l_i, acc = online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, qk_scale, DOT_PRECISION)

    # Phase 3: the blocks the tile's tokens reach into, causal.
    for n0 in range(diagonal, tl.minimum(extend_len, m0 + TILE), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < extend_len
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + (row0 + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= tok[:, None]), s, float("-inf"))
        v = tl.load(
            V + (row0 + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        m_i, l_i, acc = online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, qk_scale, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        O + (row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@dataclass(frozen=True)
class ExtendBlocks:
    """The launch shape of extend_attention for one (head dim, GQA group, dtype)."""

    rows: int  # BLOCK_M: query rows per program, tile_tokens x group heads (padded to a power of two)
    block_n: int
    num_warps: int
    num_stages: int
    group: int  # query heads per KV head

    @property
    def tile_tokens(self) -> int:
        return self.rows // self.group


def extend_blocks(head_dim: int, group: int, dtype: torch.dtype) -> ExtendBlocks:
    """Picked on an H200 (bf16, 32 query / 8 KV heads, D=128, 8 x 2048 new tokens; docs/benchmarks.md):
    128 rows of 8 warps over blocks of 64 keys, 3 stages. In a sweep of a scratch version, 64 rows of
    4 warps and 256 rows came within 1% of it, 2 stages or blocks of 128 keys lost 10-20%. Float32
    (tests, CPU) and D > 128: smaller tiles so that the stages fit in shared memory."""
    if head_dim <= 128 and dtype.itemsize <= 2:
        rows, block_n, num_warps, num_stages = 128, 64, 8, 3
    else:
        rows, block_n, num_warps, num_stages = 64, 32, 4, 2
    return ExtendBlocks(max(rows, triton.next_power_of_2(group)), block_n, num_warps, num_stages, group)


@dataclass
class ExtendPlan:
    """The (request, first new-token index) of every tile of blocks.tile_tokens new tokens, longest
    reach first (the causal tail's short tiles then fill the last wave); build once per forward."""

    tile_req: torch.Tensor  # [num_tiles] int32: batch index of the tile's request
    tile_start: torch.Tensor  # [num_tiles] int32: index of its first token among the request's new ones
    blocks: ExtendBlocks

    @classmethod
    def build(cls, extend_lens_cpu: list[int], blocks: ExtendBlocks, device: torch.device | str) -> ExtendPlan:
        tiles = cls.tiles(extend_lens_cpu, blocks)
        both = torch.tensor(tiles, dtype=torch.int32).reshape(2, -1).to(device, non_blocking=True)
        return cls(both[0], both[1], blocks)

    @staticmethod
    def tiles(extend_lens_cpu: list[int], blocks: ExtendBlocks, num_tiles: int | None = None) -> list[int]:
        """The plan on the host: the tiles' requests, then their first new-token indices (2 x
        num_tiles values). num_tiles pads the list with idle tiles, which point at the last request:
        it must then have no new tokens (and no prefix), so those programs do nothing (CUDA graphs
        launch a fixed grid of max_tiles)."""
        n = blocks.tile_tokens
        tiles = sorted(
            ((m0, b) for b, length in enumerate(extend_lens_cpu) for m0 in range(0, length, n)), reverse=True
        )
        if num_tiles is not None:
            if len(tiles) > num_tiles or extend_lens_cpu[-1] != 0:
                raise ValueError(f"{len(tiles)} tiles for {num_tiles} programs, or no idle last request")
            tiles += [(0, len(extend_lens_cpu) - 1)] * (num_tiles - len(tiles))
        return [b for _, b in tiles] + [m0 for m0, _ in tiles]

    @staticmethod
    def max_tiles(num_tokens: int, num_reqs: int, blocks: ExtendBlocks) -> int:
        """A bound on the tiles of any batch of at most num_reqs requests and num_tokens new tokens:
        ceil(l / t) <= floor(l / t) + 1 for each request, and the floors sum to at most floor(T / t)."""
        return num_tokens // blocks.tile_tokens + num_reqs

    @classmethod
    def one_token_each(cls, batch_size: int, blocks: ExtendBlocks, device: torch.device | str) -> ExtendPlan:
        """The plan of a batch whose requests all have one new token, made on the device (no copy)."""
        tile_req = torch.arange(batch_size, dtype=torch.int32, device=device)
        return cls(tile_req, torch.zeros_like(tile_req), blocks)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    plan: ExtendPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the new tokens of each request; returns out [T, H, D].

    q [T, H, D], k, v [T, H_kv, D]: the new tokens, request b's at rows extend_start_loc[b] +
    [0, extend_lens[b]) (strides free on the first two dims, last dim contiguous). Request b also sees
    its cached prefix: slots req_to_token[req_pool_indices[b], :prefix_lens[b]] of k_buffer, v_buffer
    [num_slots, H_kv, D] (cast to q's dtype). New token i of request b attends to the whole prefix and
    to new tokens 0..i. The new tokens' K/V come from k, v, so they need not be in the pool yet.
    extend_lens[b] >= 1. plan: ExtendPlan.build(extend_lens as a list, extend_blocks(D, H // H_kv,
    q.dtype), device) (built here when not given, at the cost of a host sync). float32 uses IEEE matrix
    products; 16-bit accumulates in float32. Float8 buffers hold K / k_scale and V / v_scale
    (TokenToKVPool), which the kernel dequantizes; other buffers ignore the scales (as store_kv)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    if out is None:
        out = q.new_empty(num_tokens, num_heads, head_dim)
    blocks = extend_blocks(head_dim, num_heads // num_kv_heads, q.dtype)
    if plan is None:
        plan = ExtendPlan.build(extend_lens.tolist(), blocks, q.device)
    assert plan.blocks == blocks, f"the plan was built for {plan.blocks}, this call needs {blocks}"
    num_tiles = plan.tile_req.shape[0]
    if num_tiles == 0:
        return out
    if not is_fp8(k_buffer.dtype):
        k_scale = v_scale = 1.0
    _extend_kernel[(num_tiles, num_kv_heads)](
        q,
        k,
        v,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        plan.tile_req,
        plan.tile_start,
        sm_scale * LOG2E,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=blocks.rows,
        BLOCK_N=blocks.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_DOT=is_fp8(k_buffer.dtype) and q.dtype != torch.float32,
        INT32_ROWS=num_tokens * max(t.stride(0) for t in (q, k, v, out)) < 2**31,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out
