"""A drafter for tests: right and wrong at random, so verification accepts runs of every length."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from labkit.model_executor.future_map import FutureMap
from labkit.speculative.base import DRAFTERS, Drafter, DraftReq, register_drafter

NOISY = "test-noisy"
# The rule by which a batch drafts, fixed (as it was before step times were measured): a test that
# asserts that speculation happened must not depend on this machine's step times under load.
FIXED_GAIN = {"speculative_min_batch_gain": 1.0}
# A prompt whose continuation copies it: n-gram drafts are accepted in runs.
COPY = (
    "Copy this text exactly: The quick brown fox jumps over the lazy dog. The five boxing wizards "
    "jump quickly. Pack my box with five dozen liquor jugs.\nCopy: The quick brown fox"
)


class NoisyDrafter(Drafter):
    """Drafts the request's last token again (what a random-weight tiny model's greedy output does)
    with probability RIGHT, else a random token; seeded by the request's tokens (not its rid, a random
    uuid), so a run is reproducible. With RIGHT = 0 it is wrong (nearly) always. It drafts ahead: behind
    a token still on the device it drafts one token more and drops the first, its guess for that one."""

    RIGHT = 0.7
    drafts_ahead = True

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(reqs, budgets):
            ids = req.origin_input_ids + req.output_ids
            guess = int(FutureMap.is_future(ids[-1]))
            ids = ids[: len(ids) - guess]
            rng = random.Random(zlib.crc32(repr(ids).encode()))
            draft = [ids[-1] if rng.random() < self.RIGHT else rng.randrange(self.vocab_size) for _ in range(k + guess)]
            drafts.append(draft[guess:])
        return drafts

    def release(self, req: DraftReq) -> None:
        pass  # it keeps nothing


class WrongDrafter(NoisyDrafter):
    RIGHT = 0.0


class EmptyDrafter(NoisyDrafter):
    """Never finds anything to draft."""

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        return [[] for _ in reqs]


if NOISY not in DRAFTERS:
    register_drafter(NOISY)(NoisyDrafter)
    register_drafter("test-wrong")(WrongDrafter)
    register_drafter("test-empty")(EmptyDrafter)
