"""KV memory: the pools, the page allocator, the prefix caches (radix tree or none) and the tiers
below the device (host pool, disk)."""

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult
from labkit.mem_cache.chunk_cache import ChunkCache
from labkit.mem_cache.hiradix_cache import HiRadixCache
from labkit.mem_cache.host_pool import HostKVPool
from labkit.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from labkit.mem_cache.radix_cache import RadixCache, TreeNode
from labkit.mem_cache.storage import STORAGE_BACKENDS, HiCacheFile, HiCacheStorage, block_keys

__all__ = [
    "STORAGE_BACKENDS",
    "BasePrefixCache",
    "CacheableReq",
    "ChunkCache",
    "HiCacheFile",
    "HiCacheStorage",
    "HiRadixCache",
    "HostKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "block_keys",
]
