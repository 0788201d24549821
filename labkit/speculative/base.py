"""The drafter interface of speculative decoding, and its registry.

A decode step with speculation: the drafter proposes up to k tokens per request; the target model
runs one TARGET_VERIFY forward over each request's last token and its drafts (labkit.speculative.
verify); the sampler picks the target's token at every row; the longest run of drafts that agree is
kept, plus the target's own token after it. Whatever a drafter proposes, the output is what the
target alone would have produced: drafts only change how many tokens one forward yields.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from labkit.config import EngineConfig
    from labkit.model_executor.model_runner import ModelRunner


class DraftReq(Protocol):
    """What a drafter may read of a scheduler request (labkit's Req satisfies it). For a drafter that
    drafts ahead, output_ids may end with a future token (negative: sampled on the device, not yet
    known to the host; labkit.model_executor.future_map)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]


class Drafter(ABC):
    """Proposes draft tokens for decoding requests.

    An implementation must guarantee: `propose` returns one list per request, of at most that
    request's budget of token ids, each a valid id of the target's vocabulary; it never changes a
    request (ids, KV and slots belong to the scheduler); state it keeps for a request (an index, its
    own KV) is given up in `release`, after which the request may come back as new (a retracted one
    does). Drafts are one-hot: a token, no distribution (rejection sampling against a one-hot draft
    is what verify does for sampled rows).

    `drafts_ahead`: the drafter can draft behind a token still on the device (output_ids ending
    with a future token), guessing it; the drafts then follow the guess, and a wrong guess only costs
    them. With overlap scheduling such a verify step does not wait for the step before it."""

    drafts_ahead = False

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        self.config = config
        self.vocab_size = target.vocab_size

    @abstractmethod
    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        """Up to budgets[i] draft tokens to follow reqs[i]'s ids (origin_input_ids + output_ids)."""

    @abstractmethod
    def release(self, req: DraftReq) -> None:
        """The request finished, was aborted or was retracted: drop what is kept for it."""

    def copying_again(self, req: DraftReq) -> bool:
        """Asked once per decode step for a request whose drafting is paused (its recent drafts
        failed): True when its latest tokens say that drafts would be kept again now, so that it
        drafts before the pause runs out. It may keep state for the request (released in
        `release`). The default never says so."""
        return False

    def idle(self) -> bool:
        """True when no request holds anything of the drafter's (its memory is all free)."""
        return True


class LeaderDrafts(Drafter):
    """A tensor-parallel follower rank's drafter: the leader's drafts reach it by broadcast
    (Scheduler.propose), so it runs no drafter and keeps nothing."""

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        raise RuntimeError("a follower rank takes the leader's drafts; it does not draft")

    def release(self, req: DraftReq) -> None:
        pass


DRAFTERS: dict[str, type[Drafter]] = {}
# Drafters load on first use, so importing labkit loads no second model.
LAZY_DRAFTERS = {"ngram": "labkit.speculative.ngram", "draft": "labkit.speculative.draft_model"}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    def wrap(cls: type[Drafter]) -> type[Drafter]:
        DRAFTERS[name] = cls
        return cls

    return wrap


def drafter_names() -> list[str]:
    return sorted(DRAFTERS.keys() | LAZY_DRAFTERS.keys())


def get_drafter(name: str) -> type[Drafter]:
    """The drafter registered as `name`; ValueError if there is none."""
    if name not in DRAFTERS and name in LAZY_DRAFTERS:
        importlib.import_module(LAZY_DRAFTERS[name])
    if name not in DRAFTERS:
        raise ValueError(f"unknown speculative algorithm {name!r}; choose one of {drafter_names()}")
    return DRAFTERS[name]
