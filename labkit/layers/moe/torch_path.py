"""The mixture-of-experts computation in plain torch: the CPU path of the MoE layer and the reference
the fused Triton kernel (labkit.kernels.fused_moe) is tested against."""

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
    """hidden [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights [T, k],
    topk_ids [T, k] (-1 = an expert held by another rank: contributes nothing) -> [T, H] in hidden's
    dtype: out[t] = sum_j w[t, j] * w2[e] @ (silu(g) * u), [g | u] = w13[e] @ hidden[t], e = ids[t, j].

    One loop iteration per expert that received tokens (no per-token loop); each expert's matmuls run
    in the weights' dtype, the weighted sum accumulates in float32."""
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=w13.shape[0]).tolist()
    start = int((flat_ids < 0).sum())  # the -1 pairs sort first
    k = topk_ids.shape[1]
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(hidden.dtype)
