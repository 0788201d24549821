"""Dense causal GQA attention in plain PyTorch: the reference the attention kernels and backends are
tested against (labkit.kernels.reference, tests/test_attention_torch_native.py). Slow and simple on
purpose; importing it imports no Triton."""

from __future__ import annotations

import torch


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: int,
    sm_scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.., k, v [L, H_kv, D] at 0..L-1; query i sees keys
    0..first_pos+i. Computed and returned in `dtype`, [n, H, D]."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    kh = k.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    vh = v.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.to(dtype).transpose(0, 1) @ kh.transpose(1, 2) * sm_scale  # [H, n, L]
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= (
        torch.arange(n, device=q.device)[:, None] + first_pos
    )
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1)
