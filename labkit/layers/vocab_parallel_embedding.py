"""The vocabulary split over the ranks: the embedding table and the LM head each hold a contiguous
range of token ids (padded so every rank holds the same number of rows).

Embedding: each rank looks up the ids in its range (zeros elsewhere) and an all-reduce sums the
ranks' rows. LM head: each rank scores its range; an all-gather puts the full logits on every rank
before sampling, so all ranks sample from the same distribution."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.distributed.parallel_state import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows_per_rank) of the [vocab, hidden] table; pad rows are zero."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.valid_rows = max(0, min(self.rows_per_rank, vocab_size - self.start))
        self.full_shape = (vocab_size, hidden)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.valid_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def load(self, param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
        if full.shape[0] != self.vocab_size or full.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding: checkpoint shape {tuple(full.shape)} != {self.full_shape}")
        param.data.zero_()
        param.data[: self.valid_rows].copy_(full.narrow(0, self.start, self.valid_rows))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[bs, rows_per_rank] on each rank -> [bs, vocab] on every rank (pad columns dropped)."""
        if self.tp.size == 1:
            return local_logits
        return self.tp.all_gather(local_logits, dim=-1)[:, : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split like the embedding (a tied head is the embedding itself)."""
