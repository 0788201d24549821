"""The logits step: pick each request's last new token and project it onto the vocabulary; score
the prompt rows a ForwardBatch asks logprobs for (labkit/model_executor/input_logprobs.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from labkit.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from labkit.model_executor.forward_batch import ForwardBatch
    from labkit.model_executor.input_logprobs import InputLogprobs

# Prompt rows scored per pass: bounds the [rows, vocab] float32 temporaries (a 2048-token chunk at a
# 150k vocabulary would be 1.2 GB at once).
PROMPT_ROWS_PER_PASS = 512


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
    vocabularies and batch 256 a measurable share of a decode step); the sampler upcasts as it needs.
    With tensor parallelism the logits are this rank's vocabulary range (the model gathers them).
    When `forward_batch.input_logprobs` is set, it first fills it from the prompt rows' hidden states."""

    def forward(self, hidden: torch.Tensor, head: VocabParallelEmbedding, forward_batch: ForwardBatch) -> torch.Tensor:
        if forward_batch.input_logprobs is not None:
            score_prompt(hidden, head, forward_batch.input_logprobs)
        idx = last_token_indices(forward_batch, hidden.device)
        if idx is not None:
            hidden = hidden.index_select(0, idx)
        return torch.matmul(hidden, head.weight.t())


def score_prompt(hidden: torch.Tensor, head: VocabParallelEmbedding, spec: InputLogprobs) -> None:
    """Fill `spec` with its rows' logprobs of their targets (and top alternatives): each row projected
    onto the full vocabulary (gathered over the ranks, a collective every rank runs alike) and
    log-softmaxed in float32, as the sampler does with output logprobs."""
    k = spec.top_k
    chosen, top_values, top_ids = [], [], []
    for rows, targets in zip(spec.rows.split(PROMPT_ROWS_PER_PASS), spec.targets.split(PROMPT_ROWS_PER_PASS)):
        logits = head.gather_logits(torch.matmul(hidden.index_select(0, rows), head.weight.t()))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen.append(logprobs.gather(1, targets.unsqueeze(1)).squeeze(1))
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            top_values.append(top.values)
            top_ids.append(top.indices)
    spec.logprobs = torch.cat(chosen)
    if k:
        spec.top_values, spec.top_ids = torch.cat(top_values), torch.cat(top_ids)
