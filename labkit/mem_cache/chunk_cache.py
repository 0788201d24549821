"""ChunkCache: the prefix cache interface with no sharing (--disable-radix-cache). Every request
keeps its own KV until it finishes; chunked prefill still works because cache_unfinished_req
records the chunks computed so far as the request's prefix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult, held_row
from labkit.mem_cache.memory_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    """Caches nothing: matches are empty, sizes are 0, locks are no-ops, last_node is None."""

    root = None

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator, page_size: int
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self._empty = torch.empty(0, dtype=torch.int64, device=token_to_kv_pool_allocator.device)

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(self._empty, None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Nothing is kept: the slots the cache would own are freed at once."""
        self.allocator.free(value)
        return 0

    def cache_finished_req(self, req: CacheableReq) -> None:
        row = held_row(req)
        self.allocator.free(self.req_to_token_pool.host[row, : req.kv_len])
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        req.prefix_indices = self.req_to_token_pool.host[held_row(req), : req.kv_len].clone()

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def nodes(self) -> Iterator[Any]:
        return iter(())
