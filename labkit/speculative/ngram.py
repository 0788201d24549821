"""The n-gram drafter (prompt lookup): the tokens that followed an earlier occurrence of the
context's last n tokens, longest n first. Free to run and right exactly where outputs copy their
input: rewriting, quoting, editing code, continuing a list.

Which occurrence: the latest, unless the request's output has been copying from somewhere (its
anchor: where the copy left the text it copies, the first draft token it did not keep). Then the copy
is resumed near the anchor after a small edit (a comma the copy adds, a word it replaces): first an
occurrence that ends no further past the anchor than the tokens gained since it (plus a few: a
replaced word may be shorter), so that a short n-gram such as ", the" finds its place in the text
being copied rather than its use anywhere; failing that, right after a single token that differed,
the copy goes on from the anchor itself (the token was inserted); failing both, the first occurrence
at or after the anchor, else the latest.

A draft is proposed only where at least speculative_ngram_min_match tokens before its source equal
the context's last ones. A copy resumed right after an edit has none, and a one-token match has one:
in verify steps of 32 drafts on the copy workload (the embedded model on CPU), such drafts kept
nothing in 44 of 56 and 23 of 51 verify steps, against 1 of 16 with two (docs/benchmarks.md).
Withheld, such a draft costs one plain decode step when it would have been kept (the next token
confirms it, and the next step drafts the rest); verified, it costs a verify step (on an H200 at
batch 1 about three decode steps) when it keeps nothing."""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from labkit.model_executor.future_map import FutureMap
from labkit.speculative.base import Drafter, DraftReq, register_drafter

if TYPE_CHECKING:
    from labkit.config import EngineConfig
    from labkit.model_executor.model_runner import ModelRunner

SHARED_CONTEXTS = 64  # finished requests' ids kept for --speculative-ngram-share (newest first)
RESUME_SLACK = 4  # text tokens a resumed copy may have skipped beyond those it gained (a replaced word)
SHADOW_HITS = 2  # a paused request's tokens predicted in a row before it drafts again (copying_again)


def _on_its_way(output_ids: Sequence[int]) -> int:
    """1 when the output ends with a token still on the device (a future token: drafted ahead), else 0."""
    return int(bool(output_ids) and FutureMap.is_future(output_ids[-1]))


def _agreement(ids: Sequence[int], source: int, most: int) -> int:
    """How many of the tokens before position `source` equal the ids' last ones, up to `most`: how
    much of the context confirms a draft taken from there."""
    m = 0
    while m < most and source - 1 - m >= 0 and ids[source - 1 - m] == ids[len(ids) - 1 - m]:
        m += 1
    return m


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

    def lookup(
        self, suffix: Sequence[int], k: int, anchor: int | None = None, upto: int | None = None
    ) -> tuple[list[int], int]:
        """k tokens that followed an earlier occurrence of the longest matching tail of `suffix`, and
        where they start in the ids; ([], -1) when none of its tails occurred. The occurrence is the
        first ending at or after `anchor`, else the latest; with `upto`, only one ending in
        [anchor, upto] counts."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            ends = self.ends.get(tuple(suffix[len(suffix) - n :]))
            if not ends:
                continue
            at = bisect_left(ends, anchor) if anchor is not None else len(ends)
            if upto is None:
                end = ends[at] if at < len(ends) else ends[-1]
            elif at < len(ends) and ends[at] <= upto:
                end = ends[at]
            else:
                continue
            return self.continuation(end, k), end
        return [], -1

    def continuation(self, start: int, k: int) -> list[int]:
        """k tokens from position `start` (< len(ids)). Where they reach the end of the ids, they go
        on with their own first tokens: the text repeats with the period it showed (a loop of p
        tokens drafts k, not the p - 1 it has seen)."""
        out = self.ids[start : start + k]
        while len(out) < k:
            out.append(out[len(out) - (len(self.ids) - start)])
        return out


@dataclass
class Copying:
    """Where a request's output copies from: its last draft, where that draft was taken from in the
    request's ids, how long the ids were then, the anchor it left and how long the ids were there."""

    draft: list[int] = field(default_factory=list)
    source: int = -1
    drafted_at: int = 0
    anchor: int | None = None
    left_at: int = 0

    def follow(self, ids: Sequence[int]) -> int | None:
        """The anchor after the tokens the request gained since its last draft: the source position
        of the first draft token it did not keep, when it kept some; else where it was."""
        gained = ids[self.drafted_at :]
        kept = next(
            (i for i, (g, d) in enumerate(zip(gained, self.draft)) if g != d), min(len(gained), len(self.draft))
        )
        if kept and self.source >= 0:
            self.anchor, self.left_at = self.source + kept, self.drafted_at + kept
        return self.anchor

    def resume(self, index: NgramIndex, suffix: Sequence[int], k: int) -> tuple[list[int], int]:
        """The copy resumed near the anchor (the module's docstring); ([], -1) when it is not."""
        if self.anchor is None:
            return [], -1
        since = len(index.ids) - self.left_at  # tokens gained since the copy left the text
        draft, source = index.lookup(suffix, k, self.anchor, self.anchor + since + RESUME_SLACK)
        if not draft and since == 1 and self.anchor < len(index.ids):
            return index.continuation(self.anchor, k), self.anchor
        return draft, source


@register_drafter("ngram")
class NgramDrafter(Drafter):
    drafts_ahead = True  # behind a token on its way, the lookup's first token is the guess for it

    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        super().__init__(config, target)
        if not 1 <= config.speculative_ngram_min_n <= config.speculative_ngram_max_n:
            raise ValueError(
                "need 1 <= speculative_ngram_min_n <= speculative_ngram_max_n, got "
                f"{config.speculative_ngram_min_n} and {config.speculative_ngram_max_n}"
            )
        self.min_n, self.max_n = config.speculative_ngram_min_n, config.speculative_ngram_max_n
        self.share = config.speculative_ngram_share
        self.min_match = config.speculative_ngram_min_match
        self.indexes: dict[str, NgramIndex] = {}  # rid -> its context's index
        self.copying: dict[str, Copying] = {}  # rid -> where its output copies from
        self.shared: OrderedDict[str, NgramIndex] = OrderedDict()  # finished requests' (share only)
        self.shadow: dict[str, tuple[int, int, int]] = {}  # paused rid -> (position, predicted token, hits)

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for req, k in zip(reqs, budgets):
            if k <= 0:
                drafts.append([])
                continue
            self.shadow.pop(req.rid, None)
            index = self._synced(req)
            guess = _on_its_way(req.output_ids)
            copying = self.copying.setdefault(req.rid, Copying())
            draft, source = self._lookup(index, copying, k + guess)
            # Remembered even when withheld: the tokens that confirm it move the copy's anchor on.
            copying.draft, copying.source, copying.drafted_at = draft, source, len(index.ids)
            if draft and _agreement(index.ids, source, self.min_match) < self.min_match:
                drafts.append([])  # unconfirmed: asked again after the next token
                continue
            for other in reversed(self.shared.values()) if self.share and not draft else ():
                draft, _ = other.lookup(index.ids[-self.max_n :], k + guess)
                if draft:
                    break
            drafts.append(draft[guess:])
        return drafts

    def copying_again(self, req: DraftReq) -> bool:
        """Each call predicts the request's next token as a one-token draft would, and checks the
        prediction of the call before: SHADOW_HITS right in a row say the output copies again."""
        index = self._synced(req)
        at, token, hits = self.shadow.get(req.rid, (-1, -1, 0))
        if at >= len(index.ids):  # no new token since the last prediction
            return hits >= SHADOW_HITS
        hits = hits + 1 if at >= 0 and index.ids[at] == token else 0
        guess, _ = self._lookup(index, self.copying.setdefault(req.rid, Copying()), 1)
        self.shadow[req.rid] = (len(index.ids), guess[0] if guess else -1, hits)
        return hits >= SHADOW_HITS

    def _lookup(self, index: NgramIndex, copying: Copying, k: int) -> tuple[list[int], int]:
        """k tokens to follow the ids: the copy resumed near its anchor, else the index's lookup."""
        suffix = index.ids[-self.max_n :]
        anchor = copying.follow(index.ids)
        draft, source = copying.resume(index, suffix, k)
        return (draft, source) if draft else index.lookup(suffix, k, anchor)

    def _synced(self, req: DraftReq) -> NgramIndex:
        """The request's index, extended by the ids it gained since the last call (not a token still
        on its way)."""
        index = self.indexes.setdefault(req.rid, NgramIndex(self.min_n, self.max_n))
        prompt, out = req.origin_input_ids, req.output_ids
        if len(index.ids) < len(prompt):
            index.extend(prompt[len(index.ids) :])
        known = len(out) - _on_its_way(out)
        index.extend(out[len(index.ids) - len(prompt) : known])
        return index

    def release(self, req: DraftReq) -> None:
        if self.share and req.rid in self.indexes:
            self.shared[req.rid] = self._synced(req)
            self.shared.move_to_end(req.rid)
            while len(self.shared) > SHARED_CONTEXTS:
                self.shared.popitem(last=False)
        self.indexes.pop(req.rid, None)
        self.copying.pop(req.rid, None)
        self.shadow.pop(req.rid, None)

    def idle(self) -> bool:
        return not self.indexes
