"""The prefix cache interface shared by RadixCache (prefix sharing) and ChunkCache (none).

Ownership of KV slots: every usable slot is at any time in exactly one of three places: the
allocator's free list, the cache (a tree node's value), or a running request (its own slots, past
the part it shares with the cache). The methods below move slots between these places and never
lose or duplicate one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from labkit.reprs import Summarized
from labkit.trace.events import TierUsage, TreeEvent

EventHook = Callable[[TreeEvent], None]


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix, one per token
    last_node: Any  # deepest node of the match: the one to lock (None for ChunkCache)
    # HiRadixCache: the match goes on below last_node for this many tokens whose KV is in the host
    # pool only (down to last_host_node), then in blocks on disk; load_back brings them to the device.
    host_hit_length: int = 0
    last_host_node: Any = None


class CacheableReq(Protocol):
    """What cache_finished_req / cache_unfinished_req read and write on a scheduler request."""

    origin_input_ids: list[int]
    output_ids: list[int]
    kv_len: int  # tokens of origin_input_ids + output_ids whose KV is in req_to_token[idx, :kv_len]
    prefix_indices: torch.Tensor  # slots the request holds as a prefix: cache-shared part first
    last_node: Any  # node the request holds a lock on

    # Read-only, so the scheduler's `int | None` field fits (None: the request holds no row).
    @property
    def req_pool_idx(self) -> int | None: ...


def held_row(req: CacheableReq) -> int:
    """The request's req_to_token row, which it holds whenever a cache method is called with it."""
    if req.req_pool_idx is None:
        raise RuntimeError("the request holds no request slot")
    return req.req_pool_idx


class BasePrefixCache(Summarized, ABC):
    """Contract for prefix caches.

    Sizes count tokens held by the cache: evictable_size() + protected_size() == total_size() at
    all times, each O(1). A node's tokens are protected while its lock_ref > 0; locking a node
    locks all its ancestors (the root is not counted in any size).
    """

    page_size: int
    root: Any  # the tree's root node (None for a cache that keeps no tree)
    loads_back: bool = False  # load_back can make more of a match device-resident (a tiered cache)

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of key whose length is a multiple of page_size, with its KV slots
        and the node that ends exactly at the match (a node is split if the match ends inside it).
        Marks the matched path as recently used. Transfers no ownership."""

    def load_back(self, key: list[int], match: MatchResult) -> MatchResult:
        """Make more of key's cached prefix device-resident, right before a request that matched it
        (`match`, from match_prefix(key)) is admitted: a tiered cache copies its host (and disk) KV
        into freshly allocated device slots, which the tree then owns. Returns the match as it is
        now (device part only); with nothing below the device (the default) that is `match`."""
        return match

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache key (length a multiple of page_size) with KV slots value (same length). Returns
        the length of the prefix that was already cached: value[:result] stays the caller's (it
        duplicates cached slots, or is the cached slots themselves), value[result:] now belongs to
        the cache."""

    @abstractmethod
    def cache_finished_req(self, req: CacheableReq) -> None:
        """The request finished: hand its KV to the cache (or free it), free its duplicates, its
        unaligned tail and its request slot, and unlock req.last_node. Afterwards it owns nothing."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """After a prefill chunk: cache what the request computed so far, point its req_to_token
        row and req.prefix_indices at the cached slots (then its own remaining ones, up to kv_len)
        and move its lock to the new last node. The request keeps its request slot."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Lock node and its ancestors: their tokens become protected and cannot be evicted."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref(node). Raises RuntimeError if node is not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free the KV of unlocked leaves, least recently used first (a parent left as an unlocked
        leaf becomes a candidate), until num_tokens are freed or nothing is evictable. Returns the
        number of tokens freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def tier_usage(self) -> TierUsage | None:
        """The host tier's slots by owner; None for a cache with no tier below the device."""
        return None

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def summary(self) -> dict[str, object]:
        return {
            "nodes": sum(1 for n in self.nodes() if n.parent is not None),
            "tokens": self.total_size(),
            "evictable": self.evictable_size(),
            "protected": self.protected_size(),
            "page_size": self.page_size,
        }

    @abstractmethod
    def reset(self) -> None:
        """Free all cached KV to the allocator and empty the cache. RuntimeError if a node is locked."""

    @abstractmethod
    def nodes(self) -> Iterator[Any]:
        """Every node, root first, for visualizers (nodes expose id, parent, children, key, value,
        lock_ref, last_access_time)."""
