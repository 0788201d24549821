"""The step's vocabulary bitmask (labkit.constrained.bitmask) and the sampler applying it: constrained
rows get exactly the allowed tokens, the other rows are untouched, and no row is ever left empty."""

from __future__ import annotations

import pytest
import torch

from labkit.constrained import BaseGrammarObject, GrammarSpec, build_vocab_mask
from labkit.sampling import Sampler, SamplingBatchInfo, SamplingParams

VOCAB = 70  # not a multiple of 32: the last word is partly padding
EOS = {3}


class FixedGrammar(BaseGrammarObject):
    """Allows a fixed set of tokens."""

    def __init__(self, allowed: set[int], terminated: bool = False):
        self.allowed, self.terminated = allowed, terminated

    def accept_token(self, token_id: int) -> bool:
        return token_id in self.allowed

    def fill_vocab_mask(self, bitmask: torch.Tensor, row: int) -> None:
        for t in self.allowed:
            word, bit = divmod(t, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)

    def is_terminated(self) -> bool:
        return self.terminated

    def copy(self) -> FixedGrammar:
        return FixedGrammar(self.allowed, self.terminated)


class Req:
    def __init__(self, **params):
        self.sampling_params = SamplingParams(**params).normalize()
        self.origin_input_ids, self.output_ids = [1], []


def test_the_mask_allows_exactly_the_grammar_s_tokens_and_leaves_other_rows_alone():
    grammars = [None, FixedGrammar({0, 31, 32, 69}), None, FixedGrammar(set()), FixedGrammar({5}, terminated=True)]
    mask = build_vocab_mask(grammars, VOCAB, EOS)
    assert mask is not None and mask.rows.tolist() == [1, 3]  # the terminated row's token is discarded anyway
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    masked = mask.apply(logits)
    assert torch.equal(masked[[0, 2, 4]], logits[[0, 2, 4]])  # bit for bit
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.isfinite(masked[3]).nonzero().flatten().tolist() == sorted(EOS)  # empty: the stop tokens
    assert build_vocab_mask([None, None], VOCAB, EOS) is None


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "seed": 1}])
def test_the_sampler_draws_only_allowed_tokens_and_keeps_the_other_rows(params):
    reqs = [Req(**params) for _ in range(4)]
    grammars = [FixedGrammar({7, 40}), None, FixedGrammar({66}), None]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    plain = Sampler(seed=0)(logits, SamplingBatchInfo.from_requests(reqs, VOCAB, "cpu", EOS))
    mask = build_vocab_mask(grammars, VOCAB, EOS)
    out = Sampler(seed=0)(logits, SamplingBatchInfo.from_requests(reqs, VOCAB, "cpu", EOS, mask))
    assert out.next_token_ids[0].item() in (7, 40) and out.next_token_ids[2].item() == 66
    assert out.next_token_ids[[1, 3]].tolist() == plain.next_token_ids[[1, 3]].tolist()


def test_grammar_spec_comes_from_at_most_one_sampling_param():
    assert SamplingParams(regex="a+").grammar == GrammarSpec("regex", "a+")
    assert SamplingParams().grammar is None
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(json_schema="{}", ebnf='root ::= "a"').verify(VOCAB)
