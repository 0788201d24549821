"""Pieces shared by the attention kernels (decode.py, extend.py): one block of scores against K/V
read from the paged pool, and the online-softmax update. The running max is kept in base 2 (the
callers fold log2(e) into qk_scale), so exp2 replaces exp."""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """Fold one block of raw scores s [M, N] (q.k; -inf = masked) and values v [N, D] into (m, l, acc),
    m in base 2 (qk_scale includes log2(e)). m must start finite (-1e30, not -inf): a block whose
    scores are all masked then leaves the state unchanged, with no guard in the loop. The scale is
    applied inside the exponent's argument (one multiply-add per score) and the P.V product
    accumulates into the rescaled acc (no second accumulator, no separate add)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_query(
    Q, b, stride_qb, stride_qh, offs_h, offs_d, mask_h, mask_d,
    FP16_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Request b's query rows offs_h [BLOCK_H, BLOCK_D] (in float16 for FP16_DOT: a float8 pool's
    products) and an empty online-softmax state (m, l, acc) to fold its KV blocks into."""
    q = tl.load(
        Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if FP16_DOT:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: online_softmax_step's contract
    return q, m_i, tl.zeros([BLOCK_H], tl.float32), tl.zeros([BLOCK_H, BLOCK_D], tl.float32)


@triton.jit
def paged_block_step(
    q,
    m_i,
    l_i,
    acc,
    K_buf,
    V_buf,
    req_row,
    offs_n,
    mask_n,
    kv_head,
    offs_d,
    mask_d,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
):
    """Attend q [M, D] to the tokens offs_n (mask_n: which exist) of one request, whose KV slots are
    looked up in its req_to_token row, and fold the block into the online softmax state."""
    slots = tl.load(req_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K_buf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    s = tl.where(mask_n[None, :], s, float("-inf"))
    v = tl.load(V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :], mask=kv_mask, other=0.0)
    return online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, qk_scale, DOT_PRECISION)
