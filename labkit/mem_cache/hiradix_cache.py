"""HiRadixCache: the radix tree over three tiers of KV memory: device pool, host pool, disk.

A node's KV lives on the device (`value` non-empty), in the host pool (`host_value`), or both; a
node in the tree always has it in at least one of the two. Device-resident nodes form the upper part
of the tree (a node on the device has its parent on the device): the device tier evicts leaves of
that part first, as RadixCache does, but writes them back to the host (write_back) instead of
dropping them, or drops only the device copy when the host already has one (write_through copies
every new node at once). The host tier keeps its own LRU: it drops the host copy of device-resident
nodes, or removes host-only leaves from the tree. A prefix match that goes on into host-only nodes
reports them, and the disk blocks that continue it (MatchResult.host_hit_length); `load_back`, once
the request is admitted, copies them into fresh device slots.

The disk tier (optional, a HiCacheStorage) is written through: each complete block of
`storage_block` tokens of a cached prefix is written once, keyed by the hash of its whole token
prefix, so a restarted server (same model, same KV layout: the namespace) finds it. `load_back` reads
the blocks that continue a match after the tree, and a failed read is a miss. With tensor
parallelism every rank has its own files (its heads' KV); the ranks agree on each count of blocks
found or read (the smallest), so a block missing or unreadable on one rank is a miss on all.

Sizes (evictable_size, protected_size) count device tokens, as the scheduler's memory accounting
needs; `tier_usage` reports the host tier.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import EventHook, MatchResult
from labkit.mem_cache.host_pool import HostKVPool
from labkit.mem_cache.memory_pool import ReqToTokenPool
from labkit.mem_cache.radix_cache import RadixCache, TreeNode
from labkit.mem_cache.storage import HiCacheStorage, block_keys
from labkit.trace.events import TierUsage

WRITE_POLICIES = ("write_back", "write_through")


def on_device(node: TreeNode) -> bool:
    return node.parent is None or node.value.numel() > 0


@dataclass
class TierStats:
    """Tokens moved between the tiers since the cache was built."""

    written_to_host: int = 0
    loaded_back: int = 0
    written_to_disk: int = 0
    read_from_disk: int = 0


class HiRadixCache(RadixCache):
    loads_back = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        host_pool: HostKVPool,
        write_policy: str = "write_back",
        storage: HiCacheStorage | None = None,
        storage_block: int = 64,
        storage_namespace: str = "",
        on_event: EventHook | None = None,
        agree: Callable[[int], int] = lambda n: n,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if storage is not None and (storage_block < page_size or storage_block % page_size):
            raise ValueError(f"hicache_storage_block {storage_block} must be a multiple of page_size {page_size}")
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.storage = storage
        self.storage_block = storage_block
        self.storage_namespace = storage_namespace
        # With tensor parallelism each rank reads its own files, and a read that fails on one rank
        # must fail on all, or their trees (and schedules) would differ: each disk count is agreed
        # on (the minimum over the ranks, TPGroup.min_int) before it is used.
        self._agree = agree
        self.stats = TierStats()
        self._pinned: set[int] = set()  # ids of nodes being loaded back: the host tier keeps them
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, on_event)

    # ---- matching and loading back -------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        key = key[: len(key) - len(key) % self.page_size]
        _, _, path = self._walk(key)
        k = next((i for i, n in enumerate(path) if not on_device(n)), len(path))
        device, host = path[:k], path[k:]
        host_len = sum(len(n.key) for n in host)
        return MatchResult(
            torch.cat([n.value for n in device]) if device else self._empty,
            device[-1] if device else self.root,
            host_len + self._disk_len(key, sum(len(n.key) for n in path)),
            host[-1] if host else None,
        )

    def _disk_len(self, key: list[int], matched: int) -> int:
        """Tokens after the first `matched` of key in blocks the disk tier has (checked by name only:
        a read can still fail, and is then a miss)."""
        if self.storage is None:
            return 0
        B = self.storage_block
        keys = block_keys(key, B, self.storage_namespace)
        first = matched // B
        if first >= len(keys):  # no whole block past the match (the same on every rank)
            return 0
        found = next((j for j in range(first, len(keys)) if not self.storage.exists(keys[j])), len(keys))
        return max(self._agree(found) * B - matched, 0)

    def load_back(self, key: list[int], match: MatchResult) -> MatchResult:
        if not match.host_hit_length:
            return match
        path: list[TreeNode] = []
        node = match.last_host_node
        while node is not None and node is not match.last_node:
            path.append(node)
            node = node.parent
        path.reverse()
        # The matched device prefix must survive the evictions that make room below it.
        self.inc_lock_ref(match.last_node)
        self._pinned = {n.id for n in path}
        try:
            loaded = self._load_nodes(path)
            last = top = loaded[-1] if loaded else match.last_node
            if len(loaded) == len(path) and self.storage is not None:
                self.inc_lock_ref(top)  # making room for the disk blocks must not evict what was loaded
                try:
                    last = self._read_storage(key[: len(key) - len(key) % self.page_size], top)
                finally:
                    self.dec_lock_ref(top)
        finally:
            self._pinned = set()
            self.dec_lock_ref(match.last_node)
        return self.match_prefix(key[: self._depth(last)])

    def _device_room(self, wanted: int) -> torch.Tensor | None:
        """Device slots for `wanted` tokens (whole pages), evicting what it must; None if it cannot."""
        short = wanted - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        return self.allocator.alloc_extend([0], [wanted], [-1])

    def _load_nodes(self, path: list[TreeNode]) -> list[TreeNode]:
        """Copy the host KV of the first nodes of path (as many as the device can take) to the device."""
        room = self.allocator.available_size() + self.evictable_size()
        take, n = [], 0
        for node in path:
            if n + len(node.key) > room:
                break
            take.append(node)
            n += len(node.key)
        slots = self._device_room(n) if take else None
        if slots is None:
            return []
        host = [nd.host_value for nd in take]
        self.host_pool.load(slots, torch.cat([h for h in host if h is not None]))
        offset = 0
        for nd in take:
            nd.value = slots[offset : offset + len(nd.key)]
            offset += len(nd.key)
            self._evictable += len(nd.key)
            if self.on_event is not None:
                self._emit("load_back", nd, nd.parent)
        self.stats.loaded_back += n
        return take

    # ---- inserting: adopt device slots for host-only nodes, write through --------------------------
    def _claim(self, path: list[TreeNode], value: torch.Tensor) -> int:
        """Path nodes that are off the device adopt the caller's slots for their tokens (their host copy
        stays): only the device-resident prefix stays the caller's."""
        offset, device_prefix = 0, None
        for node in path:
            if not on_device(node):
                device_prefix = offset if device_prefix is None else device_prefix
                node.value = value[offset : offset + len(node.key)].to(torch.int64).clone()
                self._evictable += len(node.key)
            offset += len(node.key)
        return offset if device_prefix is None else device_prefix

    def _on_insert(self, leaf: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._write_host([leaf])
        if self.storage is not None:
            self._write_storage(leaf)

    # ---- the device tier's eviction ------------------------------------------------------------
    def _device_leaf(self, node: TreeNode, leaving: set[int]) -> bool:
        return (
            node.parent is not None
            and node.lock_ref == 0
            and on_device(node)
            and not any(on_device(c) and c.id not in leaving for c in node.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        """Free device slots of unlocked device leaves, LRU first; their KV moves to the host (or stays
        there), and only what the host cannot take leaves the tree."""
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        leaving: set[int] = set()
        heap = [n for n in self.nodes() if self._device_leaf(n, leaving)]
        heapq.heapify(heap)
        victims, freed = [], 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            victims.append(leaf)
            leaving.add(leaf.id)
            freed += len(leaf.key)
            parent = leaf.parent
            if parent is not None and self._device_leaf(parent, leaving):
                heapq.heappush(heap, parent)
        self._write_host([v for v in victims if v.host_value is None])
        dead = []
        for v in victims:  # leaves before their parents
            dead.append(v.value)
            if v.host_value is not None:
                v.value = self._empty
                if self.on_event is not None:
                    self._emit("offload", v, v.parent)
            else:
                self._delete_subtree(v)
        self.allocator.free(torch.cat(dead))
        self._evictable -= freed
        return freed

    def _write_host(self, nodes: list[TreeNode]) -> None:
        """Back these device nodes up to the host, as many as it can take (LRU host data goes first)."""
        need = sum(len(n.key) for n in nodes)
        if need > self.host_pool.available_size():
            self._evict_host(need - self.host_pool.available_size())
        fits, n = [], 0
        for node in nodes:
            if n + len(node.key) <= self.host_pool.available_size():
                fits.append(node)
                n += len(node.key)
        slots = self.host_pool.alloc(n) if fits else None
        if slots is None:
            return
        self.host_pool.backup(torch.cat([nd.value for nd in fits]), slots)
        offset = 0
        for nd in fits:
            nd.host_value = slots[offset : offset + len(nd.key)]
            offset += len(nd.key)
            if self.on_event is not None:
                self._emit("write_host", nd, nd.parent)
        self.stats.written_to_host += n

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove node and everything below it from the tree (their device slots are the caller's to
        free: none below a device leaf, the node's own collected by evict), freeing host copies."""
        assert node.parent is not None  # internal: the root is never deleted
        del node.parent.children[self._child_key(node.key, 0)]
        stack, host = [node], []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.host_value is not None:
                host.append(n.host_value)
            if self.on_event is not None:
                self._emit("evict", n, n.parent)
        if host:
            self.host_pool.free(torch.cat(host))

    # ---- the host tier's eviction --------------------------------------------------------------
    def _host_candidate(self, node: TreeNode) -> bool:
        return node.host_value is not None and node.id not in self._pinned and (on_device(node) or not node.children)

    def _evict_host(self, num_tokens: int) -> None:
        """Free host slots, LRU first: drop the host copy of device-resident nodes, remove host-only
        leaves from the tree (a parent left a host-only leaf becomes a candidate)."""
        heap = [n for n in self.nodes() if n.parent is not None and self._host_candidate(n)]
        heapq.heapify(heap)
        freed, dead = 0, []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            assert node.host_value is not None and node.parent is not None  # internal: candidates only
            dead.append(node.host_value)
            freed += len(node.key)
            node.host_value = None
            if on_device(node):
                if self.on_event is not None:
                    self._emit("drop_host", node, node.parent)
                continue
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            if self.on_event is not None:
                self._emit("evict", node, parent)
            if parent.parent is not None and not on_device(parent) and self._host_candidate(parent):
                heapq.heappush(heap, parent)
        if dead:
            self.host_pool.free(torch.cat(dead))

    # ---- the disk tier -------------------------------------------------------------------------
    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _path_kv(self, path: list[TreeNode], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens [start, end) of the path, from whichever tier each node is in."""
        ks, vs, offset = [], [], 0
        for node in path:
            lo, hi = max(start - offset, 0), min(end - offset, len(node.key))
            offset += len(node.key)
            if lo >= hi:
                continue
            if on_device(node):
                k, v = self.host_pool.read_device(node.value[lo:hi])
            else:
                assert node.host_value is not None  # internal: a node off the device is on the host
                k, v = self.host_pool.read_host(node.host_value[lo:hi])
            ks.append(k)
            vs.append(v)
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def _write_storage(self, leaf: TreeNode) -> None:
        """Write the blocks that end inside the new leaf and are not on disk yet."""
        assert self.storage is not None  # internal: called only with a disk tier
        path = self._path(leaf)
        tokens = [t for n in path for t in n.key]
        B = self.storage_block
        first = (len(tokens) - len(leaf.key)) // B + 1  # 1-based index of the first block ending in the leaf
        keys = block_keys(tokens, B, self.storage_namespace)
        for j in range(first, len(keys) + 1):
            key = keys[j - 1]
            if self.storage.exists(key):
                continue
            k, v = self._path_kv(path, (j - 1) * B, j * B)
            if self.storage.set(key, tokens[(j - 1) * B : j * B], k, v):
                self.stats.written_to_disk += B

    def _read_storage(self, key: list[int], last: TreeNode) -> TreeNode:
        """Read the disk blocks that continue key after node `last` (at depth m), up to the first miss,
        into device slots under a new node. Returns the new node, or `last` when none was read."""
        assert self.storage is not None  # internal: called only with a disk tier
        m, B = self._depth(last), self.storage_block
        keys = block_keys(key, B, self.storage_namespace)
        ks, vs = [], []
        room = self.allocator.available_size() + self.evictable_size()
        for j in range(m // B, len(keys)):
            if (j + 1) * B - m > room:
                break
            got = self.storage.get(keys[j], key[j * B : (j + 1) * B])
            if got is None:
                break
            skip = max(m - j * B, 0)
            ks.append(got[0][:, skip:])
            vs.append(got[1][:, skip:])
        read = self._agree(len(ks))  # blocks every rank could read
        ks, vs = ks[:read], vs[:read]
        end = (m // B + read) * B if read else m
        slots = self._device_room(end - m) if end > m else None
        if slots is None:
            return last
        self.host_pool.write_device(slots, torch.cat(ks, dim=1), torch.cat(vs, dim=1))
        node = TreeNode(next(self._ids), last, key[m:end], slots, last.last_access_time)
        last.children[self._child_key(node.key, 0)] = node
        self._evictable += len(node.key)
        self.stats.read_from_disk += end - m
        if self.on_event is not None:
            self._emit("disk_read", node, last)
        return node

    # ---- sizes and lifecycle -------------------------------------------------------------------
    def tier_usage(self) -> TierUsage:
        """Host slots by owner, counted from the tree (a leak shows as a sum that is off)."""
        host_only = backed_up = 0
        for n in self.nodes():
            if n.host_value is not None:
                if on_device(n):
                    backed_up += len(n.key)
                else:
                    host_only += len(n.key)
        return TierUsage(self.host_pool.size, self.host_pool.available_size(), host_only, backed_up)

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError("reset() while requests hold locks on the cache")
        nodes = [n for n in self.nodes() if n.parent is not None]
        device = [n.value for n in nodes if on_device(n)]
        host = [n.host_value for n in nodes if n.host_value is not None]
        if device:
            self.allocator.free(torch.cat(device))
        if host:
            self.host_pool.free(torch.cat(host))
        self._new_tree()

    def summary(self) -> dict[str, object]:
        out = super().summary()
        out["host"] = self.host_pool.summary() | {"write_policy": self.write_policy}
        if self.storage is not None:
            out["disk"] = self.storage.summary()
        return out
