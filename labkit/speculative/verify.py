"""Verification: the rows of a TARGET_VERIFY forward, and which drafted tokens survive it.

A request with last token t and drafts d1..dn contributes n + 1 rows at positions kv_len..kv_len+n
(inputs t, d1, ..., dn). Each row attends like a decode row (its prefix and the drafts before it), so
row j's logits are exactly those a plain decode step would compute after t, d1..dj. The sampler then
picks the target's token x_j at every row as that decode step would: row j sees the request's
output with d1..dj appended (penalties, min_new_tokens, and a seeded request's per-step noise). The
request keeps d1..da while d_{j+1} == x_j, then x_a: a + 1 tokens, all of them the tokens plain
decoding would have produced. For a sampled row that is rejection sampling against a one-hot draft:
d is accepted with probability p(d) and otherwise x comes from p without d, renormalized; a seeded
request's output is the same with or without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from labkit.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from labkit.scheduler.schedule_batch import Req

PAUSE_STEPS = 8  # a request whose drafts keep failing drafts nothing for this many steps, doubling
MAX_PAUSE_STEPS = 256
RATE_WEIGHT = 0.25  # weight of the newest verify step in a request's recent acceptance rate
# The recent rate a request resumes with after a pause: a second chance, not full trust (alone it
# does not make a large batch draft: Scheduler.worth_drafting).
RESUME_RATE = 0.5


@dataclass
class DraftRow:
    """A verify row as the sampler sees it: the request with its first drafts appended. The output
    list is built only when asked for (penalties, a seed's step): most batches never need it."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    base_output: list[int]
    drafts: list[int]
    grammar: Any = None  # requests with a grammar never draft: their rows are the requests themselves

    @property
    def output_ids(self) -> list[int]:
        return self.base_output + self.drafts


def verify_rows(reqs: Sequence[Req], drafts: Sequence[list[int]]) -> list[Any]:
    """The sampler's rows of a verify batch, request by request: the request itself (row 0), then
    one DraftRow per draft."""
    rows: list[Any] = []
    for req, draft in zip(reqs, drafts):
        rows.append(req)
        rows += [
            DraftRow(req.sampling_params, req.origin_input_ids, req.output_ids, draft[:j])
            for j in range(1, len(draft) + 1)
        ]
    return rows


def accept(drafts: Sequence[list[int]], target_ids: Sequence[int]) -> list[list[int]]:
    """Per request, the tokens verification gives it: its drafts up to the first that differs from the
    target's token at that row, then the target's token there. `target_ids` holds the rows of request
    i consecutively, len(drafts[i]) + 1 of them."""
    out, row = [], 0
    for draft in drafts:
        kept = []
        for j in range(len(draft) + 1):
            kept.append(target_ids[row + j])
            if j == len(draft) or target_ids[row + j] != draft[j]:
                break
        out.append(kept)
        row += len(draft) + 1
    return out


@dataclass
class SpecState:
    """One request's speculation: counts for meta_info and metrics, and whether it drafts now."""

    verify_ct: int = 0  # verify steps it drafted in
    draft_tokens: int = 0
    accepted_tokens: int = 0
    recent_rate: float = 1.0  # acceptance rate, weighted towards its latest verify steps
    paused_until: int = 0  # the scheduler step from which it drafts again
    pause: int = PAUSE_STEPS  # the next pause's length

    def drafting(self, step: int) -> bool:
        return step >= self.paused_until

    def resume(self, step: int) -> None:
        """End the pause now (the drafter saw the request copying again)."""
        self.paused_until = step

    def count(self, drafted: int, accepted: int) -> None:
        """One verify step's drafts and accepted drafts, into the totals."""
        self.verify_ct += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def record(self, drafted: int, accepted: int, step: int, min_rate: float) -> None:
        """Count one verify step's outcome; pause drafting when the recent rate falls below min_rate
        (each pause twice the last, so a hopeless request soon costs almost nothing; a success
        resets it)."""
        self.count(drafted, accepted)
        self._update(accepted / drafted, step, min_rate)

    def miss(self, step: int, min_rate: float) -> None:
        """The drafter had nothing to propose. Half the weight of a rejected verify step: it wastes
        no forward, only the overlap of a plain decode step; and a copying request often has a few
        such steps before its copy starts."""
        self._update(0.0, step, min_rate, RATE_WEIGHT / 2)

    def _update(self, rate: float, step: int, min_rate: float, weight: float = RATE_WEIGHT) -> None:
        self.recent_rate = weight * rate + (1 - weight) * self.recent_rate
        if rate > 0:
            self.pause = PAUSE_STEPS
        if self.recent_rate < min_rate:
            self.paused_until = step + 1 + self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE_STEPS)
            self.recent_rate = RESUME_RATE

    def meta_info(self) -> dict[str, int]:
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
        }
