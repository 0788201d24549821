"""The vocabulary bitmask of one step: built on the host from the batch's matchers, applied to the
logits by the sampler. One int32 word holds 32 tokens (xgrammar's and llguidance's layout), so a
row of the 49,152-token embedded vocabulary is 6 KiB."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from labkit.constrained.base_grammar_backend import BaseGrammarObject

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-zero (nothing allowed) int32 bitmask of `rows` rows on the host."""
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)


@dataclass
class VocabMask:
    """The allowed tokens of the batch rows that have a grammar; the other rows are left alone."""

    rows: torch.Tensor  # [n] int64: batch rows
    bitmask: torch.Tensor  # [n, ceil(vocab / 32)] int32

    def to(self, device: torch.device) -> VocabMask:
        return VocabMask(self.rows.to(device, non_blocking=True), self.bitmask.to(device, non_blocking=True))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with every disallowed token of the masked rows at -inf (a new tensor)."""
        bits = (self.bitmask.unsqueeze(-1) >> _SHIFTS.to(self.bitmask.device)) & 1
        allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
        masked = logits[self.rows].masked_fill(~allowed, float("-inf"))
        return logits.index_put((self.rows,), masked)


def build_vocab_mask(
    grammars: Sequence[BaseGrammarObject | None], vocab_size: int, stop_token_ids: Iterable[int]
) -> VocabMask | None:
    """The mask of a batch whose row i has matcher `grammars[i]` (None: unconstrained), or None when no
    row is constrained. Terminated matchers (their request finished; its token is discarded) are
    skipped. A row whose grammar allows nothing gets the stop tokens, so the sampler never draws
    from an all -inf row; the matcher then rejects that token and the request ends."""
    live = [(i, g) for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
    if not live:
        return None
    bitmask = allocate_token_bitmask(len(live), vocab_size)
    for j, (_, grammar) in enumerate(live):
        grammar.fill_vocab_mask(bitmask, j)
    empty = (bitmask == 0).all(dim=1).nonzero().flatten().tolist()
    for j in empty:
        for token in stop_token_ids:
            word, bit = divmod(token, 32)
            bitmask[j, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign
    return VocabMask(torch.tensor([i for i, _ in live], dtype=torch.int64), bitmask)
