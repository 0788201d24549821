"""The n-gram drafter (prompt lookup): the tokens that followed an earlier occurrence of the
context's last n tokens, longest n first. Free to run and right exactly where outputs copy their
input: rewriting, quoting, editing code, continuing a list.

Which occurrence: the latest, unless the request's output has been copying from somewhere (its
anchor: where the copy stands in the ids). Then the first occurrence at or after the anchor, so that
after a small edit (a comma the copy adds, a word it replaces) a short n-gram such as "it" finds its
place in the text being copied rather than its latest use anywhere."""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from labkit.speculative.base import Drafter, DraftReq, register_drafter

if TYPE_CHECKING:
    from labkit.config import EngineConfig
    from labkit.model_executor.model_runner import ModelRunner

SHARED_CONTEXTS = 64  # finished requests' ids kept for --speculative-ngram-share (newest first)


@dataclass
class NgramIndex:
    """For one token sequence: where each n-gram (min_n <= n <= max_n) ended, indexed as the
    sequence grows. `lookup` never matches the sequence's own suffix with itself."""

    min_n: int
    max_n: int
    ids: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> its ends, ascending

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append `new_ids` to the sequence and index what they complete (O(new ids) per call)."""
        start = len(self.ids)
        self.ids += new_ids
        # Index n-grams ending before the newest position only: the newest one is the query.
        for end in range(max(start, 1), len(self.ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(self.ids[end - n : end]), []).append(end)

    def lookup(self, suffix: Sequence[int], k: int, anchor: int | None = None) -> tuple[list[int], int]:
        """k tokens that followed an earlier occurrence of the longest matching tail of `suffix`, and
        where they start in the ids; ([], -1) when none of its tails occurred. The occurrence is the
        first ending at or after `anchor`, else the latest. Where the continuation reaches the end
        of the ids, it goes on with its own first tokens: the text repeats with the period it showed
        (a loop of p tokens drafts k, not the p - 1 it has seen)."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            ends = self.ends.get(tuple(suffix[len(suffix) - n :]))
            if ends:
                at = bisect_left(ends, anchor) if anchor is not None else len(ends)
                end = ends[at] if at < len(ends) else ends[-1]
                out = self.ids[end : end + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(self.ids) - end)])
                return out, end
        return [], -1


@dataclass
class Copying:
    """Where a request's output copies from: its last draft, where that draft was taken from in the
    request's ids, how long the ids were then, and the anchor it left."""

    draft: list[int] = field(default_factory=list)
    source: int = -1
    drafted_at: int = 0
    anchor: int | None = None

    def follow(self, ids: Sequence[int]) -> int | None:
        """The anchor after the tokens the request gained since its last draft: the source position
        of the first draft token it did not keep, when it kept some; else where it was."""
        gained = ids[self.drafted_at :]
        kept = next(
            (i for i, (g, d) in enumerate(zip(gained, self.draft)) if g != d), min(len(gained), len(self.draft))
        )
        if kept and self.source >= 0:
            self.anchor = self.source + kept
        return self.anchor


@register_drafter("ngram")
class NgramDrafter(Drafter):
    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        super().__init__(config, target)
        if not 1 <= config.speculative_ngram_min_n <= config.speculative_ngram_max_n:
            raise ValueError(
                "need 1 <= speculative_ngram_min_n <= speculative_ngram_max_n, got "
                f"{config.speculative_ngram_min_n} and {config.speculative_ngram_max_n}"
            )
        self.min_n, self.max_n = config.speculative_ngram_min_n, config.speculative_ngram_max_n
        self.share = config.speculative_ngram_share
        self.indexes: dict[str, NgramIndex] = {}  # rid -> its context's index
        self.copying: dict[str, Copying] = {}  # rid -> where its output copies from
        self.shared: OrderedDict[str, NgramIndex] = OrderedDict()  # finished requests' (share only)

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for req, k in zip(reqs, budgets):
            if k <= 0:
                drafts.append([])
                continue
            index = self._synced(req)
            copying = self.copying.setdefault(req.rid, Copying())
            suffix = index.ids[-self.max_n :]
            draft, source = index.lookup(suffix, k, copying.follow(index.ids))
            for other in reversed(self.shared.values()) if self.share and not draft else ():
                draft, _ = other.lookup(suffix, k)
                if draft:
                    break
            copying.draft, copying.source, copying.drafted_at = draft, source, len(index.ids)
            drafts.append(draft)
        return drafts

    def _synced(self, req: DraftReq) -> NgramIndex:
        """The request's index, extended by the ids it gained since the last call."""
        index = self.indexes.setdefault(req.rid, NgramIndex(self.min_n, self.max_n))
        prompt = req.origin_input_ids
        if len(index.ids) < len(prompt):
            index.extend(prompt[len(index.ids) :])
        index.extend(req.output_ids[len(index.ids) - len(prompt) :])
        return index

    def release(self, req: DraftReq) -> None:
        if self.share and req.rid in self.indexes:
            self.shared[req.rid] = self._synced(req)
            self.shared.move_to_end(req.rid)
            while len(self.shared) > SHARED_CONTEXTS:
                self.shared.popitem(last=False)
        self.indexes.pop(req.rid, None)
        self.copying.pop(req.rid, None)

    def idle(self) -> bool:
        return not self.indexes
