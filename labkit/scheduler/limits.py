"""RequestLimits: what a request must satisfy to enter the scheduler. The scheduler checks it on
add_request; the server's TokenizerManager checks the same limits before sending, so bad input is
answered with a 400 in the main process instead of travelling to the scheduler first."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.constrained.base_grammar_backend import NO_GRAMMAR_BACKEND, get_grammar_backend
from labkit.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int  # prompt + output tokens of one request
    max_total_tokens: int  # KV pool size
    grammar_backend: str = NO_GRAMMAR_BACKEND  # what checks json_schema / regex / ebnf (labkit.constrained)
    has_tokenizer: bool = False  # grammars are compiled against the tokenizer's vocabulary

    def check(self, input_ids: list[int], params: dict | SamplingParams | None) -> SamplingParams:
        """Validate a prompt and its sampling parameters; return the normalized SamplingParams.
        Raises ValueError naming the problem."""
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        params.verify(self.vocab_size)
        params.normalize()
        n = len(input_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.context_len:
            raise ValueError(f"the prompt has {n} tokens; this model's context length is {self.context_len}")
        if n + 1 > self.max_total_tokens:
            raise ValueError(f"the prompt has {n} tokens; the KV pool holds {self.max_total_tokens}")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise ValueError(f"input_ids must be in [0, {self.vocab_size})")
        if params.stop and not self.has_tokenizer:  # they are matched on decoded text
            raise ValueError("stop strings need a tokenizer; this server has none (use stop_token_ids)")
        grammar = params.grammar
        if grammar is not None:
            if not self.has_tokenizer:
                raise ValueError(f"{grammar.kind} needs a tokenizer; this server has none (give tokenizer_path)")
            get_grammar_backend(self.grammar_backend).check(grammar)
        if params.logprob_start_len >= n:
            raise ValueError(f"logprob_start_len must be < the prompt's {n} tokens, got {params.logprob_start_len}")
        return params
