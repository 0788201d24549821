"""Per-request sampling parameters (SGLang field names) and their validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from labkit.constrained.base_grammar_backend import GRAMMAR_KINDS, GrammarSpec

# OpenAI caps top_logprobs at 20; more would also make the per-step top-k costly.
MAX_TOP_LOGPROBS = 20
# Integers must fit in 64 bits, signed or not: what msgpack carries to the scheduler. The server's
# protocol takes signed 64-bit integers (OpenAI's), so that seed + choice index still fits.
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
# Below this, temperature and top_p mean "only the most likely token": dividing float32 logits by a
# smaller temperature overflows them, and a top_p that rounds to 0 in float32 drops every token.
SAMPLING_EPS = 1e-6
# SGLang's upper bound; below SAMPLING_EPS the penalty's division would overflow float32 logits.
MAX_REPETITION_PENALTY = 2.0


def _is_int(x: object) -> bool:
    # bool is a subclass of int, but `top_k=True` is a caller mistake, not a number.
    return isinstance(x, int) and not isinstance(x, bool) and INT64_MIN <= x <= UINT64_MAX


def _short(x: object) -> str:
    """repr for an error message; a huge int's digits help nobody (and past 4300 repr raises)."""
    return f"an int of {x.bit_length()} bits" if isinstance(x, int) and x.bit_length() > 64 else repr(x)[:60]


def _is_finite_number(x: object) -> bool:
    return _is_int(x) or isinstance(x, float) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` or ``top_k == 1`` means greedy (so do a temperature or top_p below
    ``SAMPLING_EPS``, once normalized). ``top_k == -1`` disables top-k.
    :meth:`verify` then :meth:`normalize` run before the request enters the scheduler
    (``RequestLimits.check``).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt logprobs (SGLang's name): with return_logprob, the logprobs of the prompt tokens from this
    # position on (the first prompt token has none: None); -1, the default, asks for none.
    logprob_start_len: int = -1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output (SGLang's names; at most one): the output must match this JSON schema (a JSON
    # string), regex or EBNF grammar (labkit.constrained).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a plain dict (the Engine/HTTP form); unknown keys raise ValueError."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for serialization across processes)."""
        return dataclasses.asdict(self)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def wants_input_logprobs(self) -> bool:
        """True when the prompt's tokens are scored (return_logprob with logprob_start_len >= 0)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must match, if any (:meth:`verify` allows at most one)."""
        return next((GrammarSpec(k, v) for k in GRAMMAR_KINDS if (v := getattr(self, k)) is not None), None)

    @property
    def stop_strs(self) -> list[str]:
        """``stop`` as a list, whether or not :meth:`normalize` has run."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def normalize(self) -> SamplingParams:
        """Canonicalize in place: ``stop`` becomes a list, ``stop_token_ids`` a list, and a temperature
        or top_p too small to compute with becomes greedy decoding, its limit. Returns self."""
        self.stop = self.stop_strs
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids is not None else []
        if self.temperature < SAMPLING_EPS or self.top_p < SAMPLING_EPS:
            self.temperature = 0.0
        return self

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError naming the offending field if any value is invalid."""
        self._verify_types()
        self._verify_grammar()
        # 0 new tokens only makes sense when the prompt itself is scored (OpenAI's echo with max_tokens 0).
        if self.max_new_tokens < 1 and not (self.max_new_tokens == 0 and self.wants_input_logprobs):
            raise ValueError(
                f"max_new_tokens must be >= 1 (0 only to score a prompt: return_logprob with "
                f"logprob_start_len >= 0), got {self.max_new_tokens}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not SAMPLING_EPS <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bounds = f"[{SAMPLING_EPS}, {MAX_REPETITION_PENALTY}]"
            raise ValueError(f"repetition_penalty must be in {bounds}, got {self.repetition_penalty}")
        for s in self.stop_strs:
            if s == "":
                raise ValueError("stop strings must be non-empty")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}")
        if self.logprob_start_len < -1:  # its upper bound, the prompt's length, is RequestLimits.check's
            raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or >= 0, got {self.logprob_start_len}")

    def _verify_grammar(self) -> None:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {_short(getattr(self, name))}")
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {' and '.join(given)}")
        # The min_new_tokens ban on EOS could leave a finished grammar no token to continue with.
        if given and self.min_new_tokens:
            raise ValueError(f"min_new_tokens cannot be combined with {given[0]}: the grammar decides where it ends")

    def _verify_types(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "top_logprobs_num", "logprob_start_len"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be a 64-bit int, got {_short(getattr(self, name))}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            v = getattr(self, name)
            if not _is_finite_number(v):
                raise ValueError(f"{name} must be a finite number, got {_short(v)}")
        for name in ("ignore_eos", "return_logprob", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be a 64-bit int or None, got {_short(self.seed)}")
        if self.stop is not None:
            items = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
                raise ValueError(f"stop_token_ids must be a list of 64-bit ints, got {_short(ids)}")
