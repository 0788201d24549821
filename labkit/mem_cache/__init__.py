"""KV memory: the pools, the page allocator and the prefix caches (radix tree or none)."""

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult
from labkit.mem_cache.chunk_cache import ChunkCache
from labkit.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from labkit.mem_cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "CacheableReq",
    "ChunkCache",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
]
