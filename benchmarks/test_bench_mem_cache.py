"""Microbenchmarks of the per-step memory paths: radix match/insert on a large tree, and the page
allocator at batch sizes 1 / 64 / 256. Run: pytest benchmarks -m microbench --benchmark-enable"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from labkit.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator

pytestmark = pytest.mark.microbench

SYSTEM, SUFFIXES, SYS_LEN, SUFFIX_LEN = 100, 100, 208, 96  # 10,000 cached sequences of 304 tokens


def _build_tree(page: int) -> tuple[RadixCache, list[list[int]]]:
    rng = random.Random(0)
    size = (SYSTEM * SYS_LEN + SYSTEM * SUFFIXES * SUFFIX_LEN) * 2
    alloc = TokenToKVPoolAllocator(size, page)
    cache = RadixCache(ReqToTokenPool(1, 1), alloc, page)
    seqs = []
    for _ in range(SYSTEM):
        system = [rng.randrange(32000) for _ in range(SYS_LEN)]
        for _ in range(SUFFIXES):
            key = system + [rng.randrange(32000) for _ in range(SUFFIX_LEN)]
            value = alloc.alloc_extend([0], [len(key)], [-1])
            assert value is not None
            alloc.free(value[: cache.insert(key, value)])
            seqs.append(key)
    return cache, seqs


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def tree(request: pytest.FixtureRequest) -> tuple[RadixCache, list[list[int]]]:
    return _build_tree(request.param)


def test_match_prefix_hit(benchmark, tree) -> None:
    cache, seqs = tree
    keys = itertools.cycle(random.Random(1).sample(seqs, 1000))
    # A new request: a cached sequence plus a fresh question.
    benchmark(lambda: cache.match_prefix(next(keys) + [1, 2, 3, 4] * 8))


def test_match_prefix_system_only(benchmark, tree) -> None:
    cache, seqs = tree
    keys = itertools.cycle([s[:SYS_LEN] + [7] * 96 for s in seqs[::SUFFIXES]])
    benchmark(lambda: cache.match_prefix(next(keys)))


def test_insert_new_suffix(benchmark, tree) -> None:
    cache, seqs = tree
    page = cache.page_size
    counter = itertools.count()
    systems = itertools.cycle([s[:SYS_LEN] for s in seqs[::SUFFIXES]])
    value = torch.arange(page, page + SYS_LEN + SUFFIX_LEN, dtype=torch.int64)  # slots are not checked

    def insert() -> int:
        i = next(counter)
        key = next(systems) + [40000 + i] * page + [i % 7] * (SUFFIX_LEN - page)
        return cache.insert(key, value)

    benchmark(insert)


def test_insert_existing(benchmark, tree) -> None:
    cache, seqs = tree
    keys = itertools.cycle(random.Random(2).sample(seqs, 1000))
    value = torch.zeros(SYS_LEN + SUFFIX_LEN, dtype=torch.int64)
    benchmark(lambda: cache.insert(next(keys), value))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("bs", [1, 64, 256])
def test_alloc_extend_free(benchmark, bs: int, page: int) -> None:
    """A prefill batch: requests with page-aligned cached prefixes extend by 100..400 tokens."""
    alloc = TokenToKVPoolAllocator(1 << 20, page)
    rng = random.Random(0)
    prefix = [rng.randrange(0, 512) // page * page for _ in range(bs)]
    seq = [p + rng.randrange(100, 400) for p in prefix]
    last = [-1] * bs

    def step() -> None:
        out = alloc.alloc_extend(prefix, seq, last)
        assert out is not None
        alloc.free(out)

    benchmark(step)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("bs", [1, 64, 256])
def test_alloc_decode(benchmark, bs: int, page: int) -> None:
    """One decode step of a batch of running requests at mixed lengths (some open a page)."""
    alloc = TokenToKVPoolAllocator(1 << 20, page)
    rng = random.Random(0)
    seq = [rng.randrange(2, 2000) for _ in range(bs)]
    first = alloc.alloc_extend([0] * bs, [s - 1 for s in seq], [-1] * bs)
    assert first is not None
    ends = torch.cumsum(torch.tensor([s - 1 for s in seq]), 0) - 1
    last = first[ends].tolist()

    def step() -> None:
        out = alloc.alloc_decode(seq, last)
        assert out is not None
        alloc.free(out[[i for i, s in enumerate(seq) if (s - 1) % page == 0]] if page > 1 else out)

    benchmark(step)


@pytest.mark.parametrize("bs", [1, 64, 256])
def test_free_request(benchmark, bs: int) -> None:
    """Freeing the KV of bs finished requests of ~300 tokens each (page 1)."""
    alloc = TokenToKVPoolAllocator(1 << 20, 1)

    def setup() -> tuple[tuple[torch.Tensor], dict]:
        out = alloc.alloc_extend([0] * bs, [300] * bs, [-1] * bs)
        assert out is not None
        return (out,), {}

    benchmark.pedantic(alloc.free, setup=setup, rounds=200)
