"""Req (one request inside the scheduler) and ScheduleBatch (the requests of one step, CPU side).

KV bookkeeping of a Req, the one thing to keep in mind when reading the scheduler:
all_ids = origin_input_ids + output_ids, and req_to_token[req_pool_idx, :kv_len] holds the KV slots
of all_ids[:kv_len]. Of those, the first len(prefix_indices) are the prefix the request holds at the
start of its next extend (shared tree slots first). A decoding request has kv_len == len(all_ids) - 1:
its last sampled token is the next input.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from labkit.constrained.base_grammar_backend import BaseGrammarObject
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, held_row
from labkit.model_executor.forward_batch import ForwardMode
from labkit.model_executor.future_map import FutureMap
from labkit.reprs import Summarized
from labkit.sampling.sampling_params import SamplingParams
from labkit.speculative.verify import SpecState
from labkit.tokenizer.detokenizer import find_stop

EMPTY_INDICES = torch.empty((0,), dtype=torch.int64)


class Tokenizer(Protocol):
    """What the scheduler asks of a tokenizer (a Hugging Face one): text, to look for stop strings."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the EOS / stop token id or the stop string
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "matched": self.matched, "message": self.message}


@dataclass(eq=False, repr=False)
class Req(Summarized):
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    worker: int = 0  # the server's tokenizer worker that sent it, where its outputs go
    output_ids: list[int] = field(default_factory=list)
    # Memory (see module docstring)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = EMPTY_INDICES
    last_node: Any = None
    host_prefix_len: int = 0  # its last match went on for this many tokens in the host or disk tier (HiRadixCache)
    kv_len: int = 0
    # This round's extend: all_ids[len(prefix_indices) : len(prefix_indices) + extend_input_len]
    extend_input_len: int = 0
    finished_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    is_chunked: bool = False  # its prompt is being prefilled chunk by chunk, not done yet
    retract_count: int = 0
    detokenize_params_sent: bool = False  # they go with its first output (Scheduler.stream_output)
    # Logprobs, when asked for
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt logprobs (logprob_start_len >= 0): entry k is prompt token logprob_start_len + k's (None
    # for the prompt's first token, which nothing predicts); filled chunk by chunk as it is prefilled.
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # perf_counter timestamps: arrival, first_scheduled, first_token, finished
    times: dict[str, float] = field(default_factory=dict)
    # Structured output: the request's matcher (labkit.constrained), advanced as each token is committed
    # (Scheduler.process_batch_result). A retracted request keeps its output_ids, so it keeps its matcher.
    grammar: BaseGrammarObject | None = None
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding's counts and pauses

    def __post_init__(self) -> None:
        self.times.setdefault("arrival", time.perf_counter())
        if self.sampling_params.wants_input_logprobs and self.sampling_params.logprob_start_len == 0:
            self.add_input_logprobs([None], [None])

    def summary(self) -> dict[str, object]:
        if self.finished_reason is not None:
            state = f"finished ({self.finished_reason.type})"
        elif self.req_pool_idx is None:
            state = "waiting"
        else:
            state = "prefilling in chunks" if self.is_chunked else "running"
        out = {"rid": self.rid, "state": state, "prompt_tokens": len(self.origin_input_ids)}
        out |= {"output_tokens": len(self.output_ids), "cached_tokens": self.cached_tokens}
        out |= {"kv_len": self.kv_len, "req_pool_idx": self.req_pool_idx, "retractions": self.retract_count}
        return out

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def init_next_round_input(self, tree_cache: BasePrefixCache, load_back: bool = False) -> None:
        """Match the cached prefix of what still has to be computed (waiting requests only); with
        load_back (right before admission), bring what a tiered cache holds below the device up."""
        ids = self.all_ids
        # Keep at least one token to compute: its logits give the next token. A prompt still to be
        # scored matches no further than its first scoring position: cached KV has no hidden states to
        # score from (SGLang does the same), so those tokens are computed again.
        limit = len(ids) - 1
        to_score = self.input_logprob_positions(0, limit)
        key = ids[: min(limit, to_score.start) if to_score else limit]
        match = tree_cache.match_prefix(key)
        if load_back:
            match = tree_cache.load_back(key, match)
        self.prefix_indices, self.last_node = match.device_indices, match.last_node
        self.host_prefix_len = match.host_hit_length
        self.extend_input_len = len(ids) - len(self.prefix_indices)

    def input_logprob_positions(self, start: int, end: int) -> range:
        """The positions in [start, end) whose logits score a prompt token still without its logprob
        (position j scores prompt token j + 1); empty when the request asks for no prompt logprobs."""
        if not self.sampling_params.wants_input_logprobs:
            return range(0)
        first = self.sampling_params.logprob_start_len + len(self.input_token_logprobs) - 1
        return range(max(start, first), min(end, len(self.origin_input_ids) - 1))

    def add_input_logprobs(
        self, logprobs: Sequence[float | None], top_logprobs: Sequence[list[tuple[int, float]] | None]
    ) -> None:
        """Append the next prompt tokens' logprobs (and their top alternatives, kept when asked for)."""
        self.input_token_logprobs += logprobs
        if self.sampling_params.top_logprobs_num:
            self.input_top_logprobs += top_logprobs

    def input_token_logprob_pairs(self) -> list[tuple[float | None, int]]:
        """(logprob, token id) of each prompt token scored so far (SGLang's input_token_logprobs)."""
        return list(zip(self.input_token_logprobs, self.origin_input_ids[self.sampling_params.logprob_start_len :]))

    def drop_placeholder(self) -> None:
        """Finished with a token still on its way (overlap): that token is not part of the output."""
        if self.output_ids and FutureMap.is_future(self.output_ids[-1]):
            self.output_ids.pop()

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.prefix_indices = EMPTY_INDICES
        self.last_node = None
        self.kv_len = 0
        self.extend_input_len = 0
        self.is_chunked = False
        self.retract_count += 1

    def check_finished(self, eos_token_ids: set[int], tokenizer: Tokenizer | None, max_len: int) -> None:
        """Finish on max_new_tokens, the context limit, EOS / stop token ids, a stop string, or a
        grammar that accepted its stop token."""
        if self.finished_reason is not None:
            return
        params = self.sampling_params
        if len(self.output_ids) >= params.min_new_tokens:
            reason = self._stop_reason(eos_token_ids, tokenizer)
            if reason is not None:
                self.finished_reason = FinishReason("stop", reason)
                return
        if len(self.output_ids) >= params.max_new_tokens or self.seqlen >= max_len:
            self.finished_reason = FinishReason("length", len(self.output_ids))

    def _stop_reason(self, eos_token_ids: set[int], tokenizer: Tokenizer | None) -> int | str | None:
        params = self.sampling_params
        last = self.output_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated():  # even with ignore_eos (as SGLang)
            return last
        if params.stop_token_ids and last in params.stop_token_ids:
            return last
        if not params.ignore_eos and last in eos_token_ids:
            return last
        if params.stop and tokenizer is not None:
            # Decode just the tail: long enough to hold any stop string plus the newest token.
            window = max(len(s) for s in params.stop) + 8
            tail = tokenizer.decode(self.output_ids[-window:], skip_special_tokens=params.skip_special_tokens)
            found = find_stop(tail, params.stop)  # the same choice the detokenizer makes
            if found is not None:
                return found[1]
        return None


@dataclass(repr=False)
class ScheduleBatch(Summarized):
    """The requests of one forward and what each contributes. For MIXED, `reqs` lists the prefill
    requests first, then the decoding ones."""

    reqs: list[Req]
    forward_mode: ForwardMode
    step: int = 0
    # Filled when memory is allocated for the batch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor = EMPTY_INDICES
    decoding_reqs: list[Req] = field(default_factory=list)  # MIXED: the decodes folded in
    sampled_rows: list[int] = field(default_factory=list)  # rows whose sampled token is kept (commit)
    # TARGET_VERIFY: each request's drafts, and the sampler's rows (labkit/speculative/verify.py);
    # its input_ids/positions/out_cache_loc then list each request's 1 + len(draft) rows.
    drafts: list[list[int]] = field(default_factory=list)
    sample_rows: list[Any] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {"step": self.step, "forward_mode": self.forward_mode.name}
        out |= {"requests": len(self.reqs), "tokens": len(self.input_ids)}
        if self.extend_lens:
            out["prefix + new"] = ", ".join(
                f"{r.rid}: {p} + {e}" for r, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens)
            )
        return out

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def req_pool_indices(self) -> list[int]:
        """The request slot of each request (all hold one once the batch's memory is allocated)."""
        return [held_row(r) for r in self.reqs]

    def forward_rows(self) -> tuple[list[int], list[int]]:
        """(request slot, sequence length) of each row the forward computes logits for: one per
        request, or for TARGET_VERIFY one per input token (row j of a request sees positions 0..its own)."""
        if self.forward_mode != ForwardMode.TARGET_VERIFY:
            return self.req_pool_indices, self.seq_lens
        slots = [s for s, n in zip(self.req_pool_indices, self.extend_lens) for _ in range(n)]
        return slots, [p + 1 for p in self.positions]

    def is_empty(self) -> bool:
        return not self.reqs


def needs_host_history(reqs: list[Req]) -> bool:
    """Penalties are built from the output tokens on the host, and a grammar's mask from its matcher,
    which the host advances with each token: neither can run behind a step."""
    return any(
        r.grammar is not None
        or r.sampling_params.frequency_penalty
        or r.sampling_params.presence_penalty
        or r.sampling_params.repetition_penalty != 1
        for r in reqs
    )
