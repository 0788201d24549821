"""The logits step: pick each request's last new token and project it onto the vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


def last_token_indices(forward_batch: ForwardBatch, device: torch.device) -> torch.Tensor | None:
    """Row of each request's last new token in the flat token dimension; None when every token is
    the last one of its request (decode, or an extend where all requests add one token)."""
    lens = forward_batch.extend_seq_lens_cpu
    if forward_batch.forward_mode.is_decode() or all(n == 1 for n in lens):
        return None
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total - 1)
    return torch.tensor(ends, dtype=torch.int64).to(device, non_blocking=True)


class LogitsProcessor(nn.Module):
    """hidden [T, hidden] -> logits [bs, vocab] for the last token of each request, in the model's
    dtype as the product makes them (bf16 on GPU: half the bytes of a float32 copy, at 150k-token
    vocabularies and batch 256 a measurable share of a decode step); the sampler upcasts as it needs."""

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        idx = last_token_indices(forward_batch, hidden.device)
        if idx is not None:
            hidden = hidden.index_select(0, idx)
        return torch.matmul(hidden, lm_head_weight.t())
