"""Notebook 02's Build-it: check_eviction passes the given answer and labkit's own RadixCache, and
rejects eviction rules that break the contract (random insert / lock / unlock / evict sequences)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from labkit.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from tests.notebook_cells import run_cells


@pytest.fixture(scope="module")
def notebook():
    names = {
        "random": random,
        "torch": torch,
        "RadixCache": RadixCache,
        "ReqToTokenPool": ReqToTokenPool,
        "TokenToKVPoolAllocator": TokenToKVPoolAllocator,
    }
    return run_cells("02_radix_cache", "build-evict-answer", "build-evict-check", **names)


def test_the_notebooks_answer_and_labkits_cache_pass(notebook):
    notebook["check_eviction"](notebook["PlainLRU"])
    notebook["check_eviction"](RadixCache)


def _leaves(cache, locked_too=False):
    return [n for n in cache.nodes() if n.parent is not None and not n.children and (locked_too or n.lock_ref == 0)]


def _drop(cache, victim, free=True, count=True):
    del victim.parent.children[cache._child_key(victim.key, 0)]
    if free:
        cache.allocator.free(victim.value)
    if count:
        cache._evictable -= len(victim.key)


class EvictsLockedLeaves(RadixCache):
    def evict(self, num_tokens):
        freed = 0
        while freed < num_tokens and _leaves(self, locked_too=True):
            victim = min(_leaves(self, locked_too=True), key=lambda n: n.last_access_time)
            _drop(self, victim, count=victim.lock_ref == 0)
            freed += len(victim.key)
        return freed


class LeaksKV(RadixCache):
    def evict(self, num_tokens):
        freed = 0
        while freed < num_tokens and _leaves(self):
            victim = min(_leaves(self), key=lambda n: n.last_access_time)
            _drop(self, victim, free=False)
            freed += len(victim.key)
        return freed


class FreesTwice(RadixCache):
    def evict(self, num_tokens):
        freed = 0
        while freed < num_tokens and _leaves(self):
            victim = min(_leaves(self), key=lambda n: n.last_access_time)
            _drop(self, victim)
            self.allocator.free(victim.value)
            freed += len(victim.key)
        return freed


class ForgetsTheCount(RadixCache):
    def evict(self, num_tokens):
        freed = 0
        while freed < num_tokens and _leaves(self):
            victim = min(_leaves(self), key=lambda n: n.last_access_time)
            _drop(self, victim, count=False)
            freed += len(victim.key)
        return freed


class EvictsEverything(RadixCache):
    def evict(self, num_tokens):
        freed = 0
        while num_tokens > 0 and _leaves(self):
            victim = _leaves(self)[0]
            _drop(self, victim)
            freed += len(victim.key)
        return freed


class OnePassOverTheLeaves(RadixCache):
    """Never considers a parent that its evicted children leave as a leaf."""

    def evict(self, num_tokens):
        freed = 0
        for victim in sorted(_leaves(self), key=lambda n: n.last_access_time):
            if freed >= num_tokens:
                break
            _drop(self, victim)
            freed += len(victim.key)
        return freed


class MiscountsWhatItFreed(RadixCache):
    def evict(self, num_tokens):
        return min(super().evict(num_tokens), num_tokens)


@pytest.mark.parametrize(
    ("wrong", "complaint"),
    [
        (EvictsLockedLeaves, "evicted a locked node"),
        (LeaksKV, "the allocator got 0 slots back"),
        (FreesTwice, "double free"),
        (ForgetsTheCount, "evictable_size()"),
        (EvictsEverything, "went on after freeing enough"),
        (OnePassOverTheLeaves, "were evictable"),
        (MiscountsWhatItFreed, "tokens left the tree"),
    ],
)
def test_check_eviction_rejects_a_rule_that_breaks_the_contract(notebook, wrong, complaint):
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        notebook["check_eviction"](wrong)
