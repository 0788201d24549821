"""ChunkCache: no sharing; chunked prefill keeps the request's own KV; finishing frees everything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.mem_cache import ChunkCache, ReqToTokenPool, TokenToKVPoolAllocator


@dataclass
class FakeReq:
    req_pool_idx: int
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def test_chunked_request_lifecycle() -> None:
    for page in (1, 4):
        alloc = TokenToKVPoolAllocator(64, page)
        pool = ReqToTokenPool(4, 32)
        cache = ChunkCache(pool, alloc, page)
        m = cache.match_prefix([1, 2, 3, 4, 5, 6])
        assert m.device_indices.numel() == 0 and m.last_node is None
        cache.inc_lock_ref(m.last_node)
        idx = pool.alloc(1)[0]  # type: ignore[index]
        req = FakeReq(idx, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], last_node=m.last_node)
        first = alloc.alloc_extend([0], [5], [-1])
        assert first is not None
        pool.req_to_token[idx, :5] = first
        req.kv_len = 5
        cache.cache_unfinished_req(req)
        assert req.prefix_indices.tolist() == first.tolist()
        second = alloc.alloc_extend([5], [10], [int(first[-1])])
        assert second is not None
        pool.req_to_token[idx, 5:10] = second
        req.kv_len = 10
        assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
        assert cache.evict(100) == 0
        cache.cache_finished_req(req)
        assert alloc.available_size() == 64 and pool.available_size() == 4
        assert list(cache.nodes()) == [] and cache.root is None


def test_insert_keeps_nothing() -> None:
    alloc = TokenToKVPoolAllocator(16, 1)
    cache = ChunkCache(ReqToTokenPool(1, 8), alloc, 1)
    v = alloc.alloc_extend([0], [3], [-1])
    assert v is not None
    assert cache.insert([1, 2, 3], v) == 0
    assert alloc.available_size() == 16 and cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    cache.reset()
    assert torch.equal(cache.match_prefix([]).device_indices, torch.empty(0, dtype=torch.int64))
