"""The n-gram drafter (prompt lookup): the tokens that followed the latest earlier occurrence of the
context's last n tokens, longest n first. Free to run and right exactly where outputs copy their
input: rewriting, quoting, editing code, continuing a list."""

from __future__ import annotations

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
    """For one token sequence: where each n-gram (min_n <= n <= max_n) last ended, indexed as the
    sequence grows. `lookup` never matches the sequence's own suffix with itself."""

    min_n: int
    max_n: int
    ids: list[int] = field(default_factory=list)
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append `new_ids` to the sequence and index what they complete (O(new ids) per call)."""
        start = len(self.ids)
        self.ids += new_ids
        # Index n-grams ending before the newest position only: the newest one is the query.
        for end in range(max(start, 1), len(self.ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last_end[tuple(self.ids[end - n : end])] = end

    def lookup(self, suffix: Sequence[int], k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest matching tail of
        `suffix` (empty when none of its tails occurred). Where that continuation reaches the end
        of the ids, it goes on with its own first tokens: the text repeats with the period it
        showed (a loop of p tokens drafts k, not the p - 1 it has seen)."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            end = self.last_end.get(tuple(suffix[len(suffix) - n :]))
            if end is not None:
                out = self.ids[end : end + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(self.ids) - end)])
                return out
        return []


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
        self.shared: OrderedDict[str, NgramIndex] = OrderedDict()  # finished requests' (share only)

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for req, k in zip(reqs, budgets):
            if k <= 0:
                drafts.append([])
                continue
            index = self._synced(req)
            suffix = index.ids[-self.max_n :]
            draft = index.lookup(suffix, k)
            for other in reversed(self.shared.values()) if self.share and not draft else ():
                draft = other.lookup(suffix, k)
                if draft:
                    break
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

    def idle(self) -> bool:
        return not self.indexes
