"""RadixCache: a radix tree over token ids whose nodes own the KV slots of their tokens.

Children are keyed by the first page of the child's key (the first token when page_size is 1), so
with page_size > 1 every key, match and split is page-aligned: two sequences that differ inside a
page share nothing of that page.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from html import escape

import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, EventHook, MatchResult, held_row
from labkit.mem_cache.memory_pool import ReqToTokenPool
from labkit.trace.events import TreeEvent

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("id", "parent", "children", "key", "value", "host_value", "lock_ref", "last_access_time")

    def __init__(
        self, node_id: int, parent: TreeNode | None, key: list[int], value: torch.Tensor, last_access_time: int
    ):
        self.id = node_id
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.key = key
        self.value = value  # int64 KV slots, one per token of key (empty: not on the device, see HiRadixCache)
        self.host_value: torch.Tensor | None = None  # host pool slots (HiRadixCache only)
        self.lock_ref = 0
        self.last_access_time = last_access_time  # logical clock: larger is more recent

    def __lt__(self, other: TreeNode) -> bool:  # heap order for eviction: LRU first, then id
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        on_event: EventHook | None = None,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.on_event = on_event
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._empty = _EMPTY.to(token_to_kv_pool_allocator.device)
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = TreeNode(next(self._ids), None, [], self._empty, 0)
        self._evictable = 0
        self._protected = 0

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

    def _emit(self, kind: str, node: TreeNode, parent: TreeNode | None) -> None:
        assert self.on_event is not None  # internal: callers check first, so tracing off is free
        self.on_event(
            TreeEvent(
                kind,
                time.perf_counter(),
                node.id,
                parent.id if parent is not None else None,
                len(node.key),
                list(node.key),
            )
        )

    # ---- lookup / insert ----

    def _walk(self, key: list[int]) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow key (page-aligned) down the tree, marking the path as used and splitting the node
        the match ends inside. Returns the deepest node reached, the matched length and the matched
        nodes, root excluded."""
        now = next(self._clock)
        node, pos, path = self.root, 0, []
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            # n >= page_size: the child was found by its first page.
            n = _common_len(child.key, key[pos : pos + len(child.key)])
            n -= n % self.page_size
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)  # the unmatched lower part keeps its access time
            child.last_access_time = now
            path.append(child)
            node, pos = child, pos + n
            if partial:
                break
        return node, pos, path

    def match_prefix(self, key: list[int]) -> MatchResult:
        key = key[: len(key) - len(key) % self.page_size]
        node, _, path = self._walk(key)
        return MatchResult(torch.cat([n.value for n in path]) if path else self._empty, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        if len(key) % self.page_size:
            raise ValueError(f"key length {len(key)} is not a multiple of page_size {self.page_size}")
        if len(key) != value.numel():
            raise ValueError(f"key has {len(key)} tokens but value has {value.numel()} slots")
        node, pos, path = self._walk(key)
        already = self._claim(path, value)
        if pos < len(key):
            # Own copy: callers pass views of req_to_token rows, which are rewritten later.
            leaf = TreeNode(
                next(self._ids), node, key[pos:], value[pos:].to(torch.int64).clone(), node.last_access_time
            )
            node.children[self._child_key(key, pos)] = leaf
            self._evictable += len(leaf.key)
            if self.on_event is not None:
                self._emit("insert", leaf, node)
            self._on_insert(leaf)
        return already

    def _claim(self, path: list[TreeNode], value: torch.Tensor) -> int:
        """The length of the inserted key's prefix that stays the caller's (insert's result), given the
        matched path and the caller's slots: all of the match here (HiRadixCache adopts slots for nodes
        that are off the device)."""
        return sum(len(n.key) for n in path)

    def _on_insert(self, leaf: TreeNode) -> None:
        """Called for each new leaf (HiRadixCache writes it to the host and disk tiers here)."""

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after its first n tokens; the new upper node takes child's place and locks."""
        parent = child.parent
        assert parent is not None  # internal: the root is never split
        upper = TreeNode(next(self._ids), parent, child.key[:n], child.value[:n], child.last_access_time)
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        upper.children[self._child_key(child.key, 0)] = child
        if self.on_event is not None:
            self._emit("split", upper, parent)
        return upper

    # ---- requests ----

    @staticmethod
    def _depth(node: TreeNode) -> int:
        n = 0
        while node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n

    def _insert_req(self, req: CacheableReq) -> tuple[torch.Tensor, int]:
        """Insert the page-aligned part of the request's computed tokens and free the request's own
        slots that duplicate cached ones. Returns its KV slots (a copy) and the aligned length."""
        kv_len = req.kv_len
        kv = self.req_to_token_pool.host[held_row(req), :kv_len].clone()
        aligned = kv_len - kv_len % self.page_size
        ids = (req.origin_input_ids + req.output_ids)[:aligned]
        # Slots [0, shared) are the tree's own (the locked path); the request owns the rest.
        shared = self._depth(req.last_node)
        already = self.insert(ids, kv[:aligned])
        if already > shared:
            self.allocator.free(kv[shared:already])
        return kv, aligned

    def cache_finished_req(self, req: CacheableReq) -> None:
        kv, aligned = self._insert_req(req)
        self.allocator.free(kv[aligned:])
        self.req_to_token_pool.free(held_row(req))
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        kv, aligned = self._insert_req(req)
        ids = (req.origin_input_ids + req.output_ids)[:aligned]
        match = self.match_prefix(ids)
        shared = match.device_indices
        self.req_to_token_pool.write_row(held_row(req), 0, shared)
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat((shared, kv[shared.numel() :]))
        req.last_node = match.last_node

    # ---- locks and sizes ----

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        # lock_ref never decreases towards the root, so checking the start node suffices.
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked node {node.id}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # ---- eviction ----

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [n for n in self.nodes() if not n.children and n.lock_ref == 0 and n.parent is not None]
        heapq.heapify(heap)
        freed, dead = 0, []
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # internal: the root is never a candidate
            dead.append(leaf.value)
            freed += len(leaf.key)
            del parent.children[self._child_key(leaf.key, 0)]
            if self.on_event is not None:
                self._emit("evict", leaf, parent)
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, parent)
        if dead:
            self.allocator.free(torch.cat(dead))
        self._evictable -= freed
        return freed

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError("reset() while requests hold locks on the cache")
        values = [n.value for n in self.nodes() if n.parent is not None]
        if values:
            self.allocator.free(torch.cat(values))
        self._new_tree()

    def html_details(self, max_lines: int = 40) -> str:
        """The tree, one node per line: id, token count, first token ids, lock count."""
        lines: list[str] = []
        stack = [(child, 0) for child in sorted(self.root.children.values(), key=lambda n: -n.id)]
        while stack and len(lines) < max_lines:
            node, depth = stack.pop()
            head = " ".join(map(str, node.key[:6])) + (" ..." if len(node.key) > 6 else "")
            lock = f", locked by {node.lock_ref}" if node.lock_ref else ""
            lines.append(f"{'  ' * depth}#{node.id}: {len(node.key)} tokens [{head}]{lock}")
            stack.extend((c, depth + 1) for c in sorted(node.children.values(), key=lambda n: -n.id))
        if stack:
            lines.append("...")
        text = "\n".join(lines) or "(empty)"
        return f"<pre>{escape(text)}</pre>"

    def nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
