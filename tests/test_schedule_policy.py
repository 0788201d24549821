"""Waiting-queue orders of the prefix-aware policies on a real radix tree."""

from __future__ import annotations

import torch

from labkit.mem_cache import ReqToTokenPool, TokenToKVPoolAllocator
from labkit.mem_cache.radix_cache import RadixCache
from labkit.sampling.sampling_params import SamplingParams
from labkit.scheduler.schedule_batch import Req
from labkit.scheduler.schedule_policy import make_policy


def _queue_over_tree() -> tuple[list[Req], RadixCache]:
    """Group A (3 requests) and group B (2) share cached prefixes; two requests match nothing."""
    cache = RadixCache(ReqToTokenPool(4, 64), TokenToKVPoolAllocator(256, 1), 1)
    for slot, prefix in ((1, [1, 2, 3, 4]), (5, [7, 8, 9, 10])):
        cache.insert(prefix, torch.arange(slot, slot + len(prefix)))  # KV slots: never freed here
    prompts = {
        "none-0": [50, 51],
        "b-0": [7, 8, 9, 10, 20],
        "a-0": [1, 2, 3, 4, 30],
        "none-1": [60, 61],
        "a-1": [1, 2, 3, 4, 31],
        "b-1": [7, 8, 9, 10, 21],
        "a-2": [1, 2, 3, 4, 32],
    }
    waiting = [Req(rid, ids, SamplingParams()) for rid, ids in prompts.items()]
    for req in waiting:
        req.init_next_round_input(cache)
    return waiting, cache


def test_dfs_weight_takes_heavier_shared_groups_first_and_unmatched_requests_last():
    waiting, cache = _queue_over_tree()
    make_policy("dfs-weight", 0).sort(waiting, cache)
    assert [r.rid for r in waiting] == ["a-0", "a-1", "a-2", "b-0", "b-1", "none-0", "none-1"]


def test_lpm_takes_longest_prefix_first_keeping_arrival_order_among_equals():
    waiting, cache = _queue_over_tree()
    make_policy("lpm", 0).sort(waiting, cache)
    assert [r.rid for r in waiting] == ["b-0", "a-0", "a-1", "b-1", "a-2", "none-0", "none-1"]
