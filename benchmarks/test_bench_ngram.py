"""CPU cost of the n-gram drafter's index: catching a request's index up with its whole context (a
request's first draft, or its first after a long pause: a batch's probe pays this for each request),
one step's new token (a paused request's `copying_again` and a drafting one's `propose` extend by a
token or a few each step), and one step's lookup.

    .venv/bin/python -m pytest benchmarks -m microbench --benchmark-enable -k ngram
"""

from __future__ import annotations

import random

import pytest

from labkit.speculative.ngram import NgramIndex

pytestmark = pytest.mark.microbench


def _context(n: int, seed: int = 0) -> list[int]:
    """Token ids with a chat answer's repetition: words drawn from a small vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(2000) if rng.random() < 0.3 else rng.randrange(50) for _ in range(n)]


@pytest.mark.parametrize("tokens", [256, 1024])
def test_ngram_index_catch_up(benchmark, tokens):
    ids = _context(tokens)

    def catch_up() -> NgramIndex:
        index = NgramIndex(1, 4)
        index.extend(ids)
        return index

    index = benchmark.pedantic(catch_up, rounds=50, warmup_rounds=2)
    assert len(index.ids) == tokens


def test_ngram_index_extend_one_token(benchmark):
    ids = _context(8192)
    index = NgramIndex(1, 4)
    index.extend(ids[:256])

    def one_token() -> None:
        index.extend(ids[len(index.ids) : len(index.ids) + 1])

    benchmark.pedantic(one_token, rounds=5000, warmup_rounds=10)
    assert index.ids == ids[: 256 + 5010]


def test_ngram_index_lookup(benchmark):
    ids = _context(1024)
    index = NgramIndex(1, 4)
    index.extend(ids)
    draft, _ = benchmark.pedantic(lambda: index.lookup(ids[-4:], 32), rounds=2000, warmup_rounds=10)
    assert len(draft) == 32
