"""The mixture-of-experts computation in plain torch: the MoE layer's path off CUDA, and the
reference labkit.kernels.fused_moe is tested against (kernels/reference.py re-exports it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The mixture of experts in plain torch (the CPU path of the MoE layer, and the reference that
    labkit.kernels.fused_moe is tested against): hidden [T, H], w13 [E, 2I, H] (gate rows, then up rows),
    w2 [E, H, I], topk_weights and topk_ids [T, k] -> out [T, H] in hidden's dtype with
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), [g | u] = w13[e] @ hidden[t],
    e = topk_ids[t, j]; slots with an id outside [0, E) (-1: another rank's expert) add nothing.

    Fast enough to be a CPU path, not only a test oracle: one iteration per expert that received
    pairs (one host sync for the counts, no per-token loop), each running that expert's two matmuls
    on all its tokens at once in the weights' dtype (torch accumulates them in float32), silu * up in
    float32 rounded to hidden's dtype (as silu_and_mul does), and the weighted sum in float32."""
    num_experts, k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat[valid], minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1).float()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        gate, up = F.linear(hidden[tokens], w13[expert]).float().chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(hidden.dtype)
        out.index_add_(0, tokens, F.linear(act, w2[expert]).float() * weights[pairs, None])
    return out.to(hidden.dtype)
