"""Plain-PyTorch references for every kernel in labkit.kernels: same arguments, same results (up to
rounding). Slow and simple on purpose; the tests compare each Triton kernel with its reference here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.attention.reference import dense_attention
from labkit.layers.moe.torch_path import fused_moe_torch
from labkit.mem_cache.memory_pool import dequantize_kv, quantize_kv


def reference_store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_buffer[loc] = k, v_buffer[loc] = v (cast to the buffer dtype; a float8 buffer gets k / k_scale
    and v / v_scale, saturated: quantize_kv)."""
    k_buffer[loc] = quantize_kv(k, k_scale, k_buffer.dtype)
    v_buffer[loc] = quantize_kv(v, v_scale, v_buffer.dtype)


def reference_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, H, D]; request b attends to the KV slots req_to_token[req_pool_indices[b], :seq_lens[b]]
    (a float8 pool's values dequantized with k_scale, v_scale into float32 first: dequantize_kv).
    Returns [B, H, D] in q's dtype."""
    out = torch.empty_like(q)
    for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[r, :n]
        ks = dequantize_kv(k_buffer[slots], k_scale, torch.float32)
        vs = dequantize_kv(v_buffer[slots], v_scale, torch.float32)
        out[b] = dense_attention(q[b : b + 1], ks, vs, n - 1, sm_scale)[0].to(q.dtype)
    return out


def reference_extend_attention(
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, H, D], k, v [T, H_kv, D]: the new tokens of each request, rows extend_start_loc[b] +
    [0, extend_lens[b]). They attend to the prefix (pool slots req_to_token[r, :prefix_lens[b]],
    dequantized with k_scale, v_scale if the pool is float8) and causally to the request's new
    tokens. Returns [T, H, D] in q's dtype."""
    out = torch.empty_like(q)
    for b, r in enumerate(req_pool_indices.tolist()):
        p, n, s = int(prefix_lens[b]), int(extend_lens[b]), int(extend_start_loc[b])
        slots = req_to_token[r, :p]
        ks = torch.cat([dequantize_kv(k_buffer[slots], k_scale, torch.float32), k[s : s + n].float()])
        vs = torch.cat([dequantize_kv(v_buffer[slots], v_scale, torch.float32), v[s : s + n].float()])
        out[s : s + n] = dense_attention(q[s : s + n], ks, vs, p, sm_scale).to(q.dtype)
    return out


def reference_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim: normalized in float32, cast to x's dtype, then scaled
    (Hugging Face's order, and labkit.layers.RMSNorm's)."""
    normed = F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def reference_fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), the sum rounded to x's dtype first."""
    s = x + residual
    return reference_rmsnorm(s, weight, eps), s


def cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """[max_position, 2 * len(inv_freq)] float32: cos of position * inv_freq in the first half, sin in
    the second (the table rotary_embedding reads)."""
    freqs = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def reference_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rope (rotate halves) on q [T, H, D] and k [T, H_kv, D], computed in float32; with
    norm_weights (q's, k's), each head is reference_rmsnorm-ed first."""
    if norm_weights is not None:
        q, k = reference_rmsnorm(q, norm_weights[0], eps), reference_rmsnorm(k, norm_weights[1], eps)
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions, :half][:, None, :], cos_sin[positions, half:][:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rope(q), rope(k)


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = cat(gate, up) -> silu(gate) * up [..., d], computed in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def reference_moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_block_size's three buffers, equal to its entry for entry: the pairs (flat indices of
    topk_ids) with an id in [0, num_experts) sorted by expert, ascending flat index within an expert,
    each expert's group padded to a multiple of block_size with the sentinel T * k, which also fills
    the buffer's tail; expert_ids names each block's expert, -1 past the last."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = padded.cumsum(0) - padded
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)[: int(valid.sum())]
    experts = flat[order]
    rank = torch.arange(order.numel(), device=flat.device) - (counts.cumsum(0) - counts)[experts]
    max_len = numel + min(num_experts, numel) * (block_size - 1)  # the kernel's worst case
    sorted_ids = torch.full((max_len,), numel, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[experts] + rank] = order.to(torch.int32)
    expert_ids = torch.full((-(-max_len // block_size),), -1, dtype=torch.int32, device=flat.device)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_size)
    expert_ids[: blocks.numel()] = blocks.to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


# The MoE layer's path off CUDA is plain torch already: it is fused_moe's reference.
reference_fused_moe = fused_moe_torch
