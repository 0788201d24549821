"""RequestLimits: what a request must satisfy to enter the scheduler. The scheduler checks it on
add_request; the server's TokenizerManager checks the same limits before sending, so bad input is
answered with a 400 in the main process instead of travelling to the scheduler first."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int  # prompt + output tokens of one request
    max_total_tokens: int  # KV pool size

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
        return params
