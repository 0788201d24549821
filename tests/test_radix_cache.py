"""RadixCache: named behaviours, and a stateful property test of the whole request protocol against
the allocator and the request pool (every KV slot accounted for exactly once after every step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.mem_cache import ReqToTokenPool, TokenToKVPoolAllocator
from labkit.mem_cache.radix_cache import RadixCache, TreeNode
from labkit.trace.events import TreeEvent


@dataclass
class FakeReq:
    """The attributes of the scheduler's Req that the cache reads and writes."""

    req_pool_idx: int
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None

    @property
    def ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


def make(
    page: int = 1, size: int = 64, on_event: Any = None
) -> tuple[RadixCache, TokenToKVPoolAllocator, ReqToTokenPool]:
    alloc = TokenToKVPoolAllocator(size, page)
    pool = ReqToTokenPool(8, 64)
    return RadixCache(pool, alloc, page, on_event=on_event), alloc, pool


def insert_fresh(cache: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> torch.Tensor:
    """Insert key with newly allocated slots; free the duplicates like a request would."""
    value = alloc.alloc_extend([0], [len(key)], [-1])
    assert value is not None
    already = cache.insert(key, value)
    alloc.free(value[:already])
    return value


def path_keys(cache: RadixCache) -> dict[int, list[int]]:
    return {n.id: _path(n) for n in cache.nodes()}


def _path(node: TreeNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def _path_values(node: TreeNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.value.tolist())
        node = node.parent
    return [s for part in reversed(parts) for s in part]


# ---- named behaviours ----


def test_split_on_partial_match() -> None:
    cache, alloc, _ = make()
    v = insert_fresh(cache, alloc, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == v[:3].tolist()
    assert m.last_node.key == [1, 2, 3] and list(m.last_node.children.values())[0].key == [4, 5]
    assert cache.total_size() == 5 and len(list(cache.nodes())) == 3
    assert cache.insert([1, 2, 3, 7, 7], torch.tensor([90, 91, 92, 93, 94])) == 3
    assert sorted(len(c.key) for c in m.last_node.children.values()) == [2, 2]


def test_match_whole_and_empty() -> None:
    cache, alloc, _ = make()
    assert cache.match_prefix([1, 2]).device_indices.numel() == 0
    v = insert_fresh(cache, alloc, [1, 2])
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.tolist() == v.tolist() and m.last_node.key == [1, 2]
    assert cache.match_prefix([]).last_node is cache.root


def test_page_aligned_matches() -> None:
    cache, alloc, _ = make(page=4)
    v = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_indices.tolist() == v[:4].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 8]).device_indices.tolist() == v[:4].tolist()
    assert cache.match_prefix([1, 2, 3, 9]).device_indices.numel() == 0  # differs inside page 1
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([4, 5, 6]))
    # A sibling that shares 6 tokens shares only the first page.
    w = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6, 0, 0])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0]).device_indices.tolist() == v[:4].tolist() + w[4:].tolist()
    assert all(len(n.key) % 4 == 0 for n in cache.nodes())


def test_lru_eviction_order() -> None:
    cache, alloc, _ = make()
    a = insert_fresh(cache, alloc, [1, 1])
    insert_fresh(cache, alloc, [2, 2])
    insert_fresh(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # [2, 2] is now the oldest
    free_before = alloc.available_size()
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1]).device_indices.tolist() == a.tolist()
    assert alloc.available_size() == free_before + 2
    assert cache.evict(3) == 4  # [3, 3] then [1, 1]: whole leaves, may overshoot
    assert cache.total_size() == 0


def test_parent_becomes_candidate_after_children() -> None:
    cache, alloc, _ = make()
    insert_fresh(cache, alloc, [1, 2, 3])
    insert_fresh(cache, alloc, [1, 2, 4])  # splits: [1, 2] -> {[3], [4]}
    assert cache.evict(100) == 4 and cache.total_size() == 0
    assert alloc.available_size() == alloc.size


def test_locked_nodes_never_evicted() -> None:
    cache, alloc, _ = make()
    insert_fresh(cache, alloc, [1, 2, 3])
    insert_fresh(cache, alloc, [5, 6])
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 3
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(m.last_node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    cache.reset()
    assert alloc.available_size() == alloc.size and cache.total_size() == 0


def test_split_keeps_locks() -> None:
    cache, alloc, _ = make()
    insert_fresh(cache, alloc, [1, 2, 3, 4])
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(leaf)
    upper = cache.match_prefix([1, 2]).last_node  # split above a locked node
    assert upper.lock_ref == 1 and leaf.parent is upper and cache.protected_size() == 4
    cache.dec_lock_ref(leaf)
    assert upper.lock_ref == 0 and cache.evictable_size() == 4


def test_tree_events() -> None:
    events: list[TreeEvent] = []
    cache, alloc, _ = make(on_event=events.append)
    insert_fresh(cache, alloc, [1, 2, 3])
    insert_fresh(cache, alloc, [1, 2, 3])  # nothing new: no event
    insert_fresh(cache, alloc, [1, 5])
    cache.evict(1)
    kinds = [(e.kind, e.num_tokens, e.tokens) for e in events]
    assert kinds[:3] == [("insert", 3, [1, 2, 3]), ("split", 1, [1]), ("insert", 1, [5])]
    # The split left the first node as the lower part [2, 3], untouched since the 2nd insert: LRU.
    assert kinds[3:] == [("evict", 2, [2, 3])] and events[3].node_id == events[0].node_id
    split, leaf = events[1], events[2]
    assert split.parent_id == cache.root.id and leaf.parent_id == split.node_id
    assert events[3].parent_id == split.node_id


def test_cache_finished_frees_duplicates() -> None:
    cache, alloc, pool = make(page=4, size=64)
    shared = insert_fresh(cache, alloc, [7] * 8)
    # A request that did not see the cached prefix computed the same 8 tokens and 2 more.
    idx = pool.alloc(1)[0]  # type: ignore[index]
    req = FakeReq(idx, [7] * 8 + [1, 2], last_node=cache.root)
    kv = alloc.alloc_extend([0], [10], [-1])
    assert kv is not None
    pool.req_to_token[idx, :10] = kv
    req.kv_len = 10
    cache.inc_lock_ref(req.last_node)
    cache.cache_finished_req(req)
    assert cache.total_size() == 8 and cache.match_prefix([7] * 8).device_indices.tolist() == shared.tolist()
    assert alloc.available_size() == 64 - 8 and pool.available_size() == 8


# ---- stateful property test ----

PREFIXES = [[], [0] * 8, [0, 1] * 4, [1, 1, 0, 0, 2, 2, 1, 0]]
prompts = st.builds(
    lambda p, k, tail: p[:k] + tail,
    st.sampled_from(PREFIXES),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), min_size=1, max_size=12),
)


class RadixMachine(RuleBasedStateMachine):
    MAX_CTX = 40

    def __init__(self) -> None:
        super().__init__()
        self.cache: RadixCache | None = None
        self.live: list[FakeReq] = []
        self.content: dict[int, tuple[int, ...]] = {}  # KV slot -> the token prefix its KV encodes

    @precondition(lambda self: self.cache is None)
    @rule(page=st.sampled_from([1, 4]), pages=st.integers(10, 20))
    def init(self, page: int, pages: int) -> None:
        self.page = page
        self.alloc = TokenToKVPoolAllocator(page * pages if page > 1 else 4 * pages, page)
        self.pool = ReqToTokenPool(5, self.MAX_CTX)
        self.cache = RadixCache(self.pool, self.alloc, page)

    # helpers

    def _record(self, req: FakeReq, start: int, slots: torch.Tensor) -> None:
        self.pool.req_to_token[req.req_pool_idx, start : start + slots.numel()] = slots
        ids = req.ids
        for j, s in enumerate(slots.tolist(), start):
            self.content[s] = tuple(ids[: j + 1])

    def _retry(self, fn: Any, need: int) -> torch.Tensor | None:
        assert self.cache is not None
        out = fn()
        if out is None:
            self.cache.evict(need)
            out = fn()
        return out

    def _extend(self, req: FakeReq, n: int, data: st.DataObject) -> bool:
        n = min(n, self.MAX_CTX - req.kv_len)
        while len(req.ids) < req.kv_len + n:
            req.output_ids.append(data.draw(st.integers(0, 2)))
        last = int(self.pool.req_to_token[req.req_pool_idx, req.kv_len - 1]) if req.kv_len else -1
        out = self._retry(lambda: self.alloc.alloc_extend([req.kv_len], [req.kv_len + n], [last]), n + self.page)
        if out is None:
            return False
        self._record(req, req.kv_len, out)
        req.kv_len += n
        return True

    def _check_match_content(self, key: list[int], slots: torch.Tensor) -> None:
        assert slots.numel() % self.page == 0
        for j, s in enumerate(slots.tolist()):
            assert self.content[s] == tuple(key[: j + 1]), "cached KV slot holds another prefix"

    # rules

    @precondition(lambda self: self.cache is not None)
    @rule(prompt=prompts, chunk=st.integers(1, 16), data=st.data())
    def new_request(self, prompt: list[int], chunk: int, data: st.DataObject) -> None:
        assert self.cache is not None
        slot = self.pool.alloc(1)
        if slot is None:
            return
        m = self.cache.match_prefix(prompt)
        self._check_match_content(prompt, m.device_indices)
        self.cache.inc_lock_ref(m.last_node)
        req = FakeReq(
            slot[0], prompt, kv_len=m.device_indices.numel(), prefix_indices=m.device_indices, last_node=m.last_node
        )
        self.pool.req_to_token[slot[0], : req.kv_len] = m.device_indices
        self.live.append(req)
        if not self._extend(req, chunk, data):
            self.live.pop()
            self.cache.dec_lock_ref(req.last_node)
            self.pool.free(req.req_pool_idx)

    @precondition(lambda self: self.cache is not None and bool(self.live))
    @rule(data=st.data(), n=st.integers(1, 12), unfinished=st.booleans())
    def chunk(self, data: st.DataObject, n: int, unfinished: bool) -> None:
        assert self.cache is not None
        req = data.draw(st.sampled_from(self.live))
        if self._extend(req, n, data) and unfinished:
            self.cache.cache_unfinished_req(req)
            assert req.prefix_indices.tolist() == self.pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()

    @precondition(lambda self: self.cache is not None and bool(self.live))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        reqs = data.draw(st.lists(st.sampled_from(self.live), unique_by=id, min_size=1))
        reqs = [r for r in reqs if r.kv_len < self.MAX_CTX]
        if not reqs:
            return
        for r in reqs:
            if len(r.ids) <= r.kv_len:
                r.output_ids.append(data.draw(st.integers(0, 2)))
        seq_lens = [r.kv_len + 1 for r in reqs]
        last = [int(self.pool.req_to_token[r.req_pool_idx, r.kv_len - 1]) if r.kv_len else -1 for r in reqs]
        out = self._retry(lambda: self.alloc.alloc_decode(seq_lens, last), len(reqs) * self.page)
        if out is None:
            return
        for r, s in zip(reqs, out.view(-1, 1)):
            self._record(r, r.kv_len, s)
            r.kv_len += 1

    @precondition(lambda self: self.cache is not None and bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        assert self.cache is not None
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.cache.cache_finished_req(req)

    @precondition(lambda self: self.cache is not None)
    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        assert self.cache is not None
        before = self.cache.evictable_size()
        freed = self.cache.evict(n)
        assert freed == before - self.cache.evictable_size()
        assert freed >= n or self.cache.evictable_size() == 0

    @precondition(lambda self: self.cache is not None)
    @rule(key=prompts)
    def match(self, key: list[int]) -> None:
        assert self.cache is not None
        cached = {tuple(p[:i]) for p in path_keys(self.cache).values() for i in range(len(p) + 1)}
        best = max(i for i in range(0, len(key) + 1, self.page) if tuple(key[:i]) in cached)
        m = self.cache.match_prefix(key)
        assert m.device_indices.numel() == best
        assert _path(m.last_node) == key[:best]
        self._check_match_content(key, m.device_indices)

    # invariants

    @invariant()
    def tree_consistent(self) -> None:
        if self.cache is None:
            return
        c, P = self.cache, self.page
        total = evictable = 0
        locks = {n.id: 0 for n in c.nodes()}
        for r in self.live:
            n = r.last_node
            while n.parent is not None:
                locks[n.id] += 1
                n = n.parent
        for n in c.nodes():
            for child in n.children.values():
                assert child.parent is n
            if n.parent is None:
                assert n.lock_ref == 0
                continue
            assert len(n.key) > 0 and len(n.key) % P == 0 and n.value.numel() == len(n.key)
            assert n.parent.children[n.key[0] if P == 1 else tuple(n.key[:P])] is n
            assert n.lock_ref == locks[n.id]
            pages = n.value.view(-1, P)
            assert torch.equal(pages, pages[:, :1] + torch.arange(P)) and bool((pages[:, 0] % P == 0).all())
            total += len(n.key)
            evictable += len(n.key) if n.lock_ref == 0 else 0
        assert c.total_size() == total and c.evictable_size() == evictable
        assert c.evictable_size() + c.protected_size() == c.total_size()

    @invariant()
    def every_slot_once(self) -> None:
        if self.cache is None:
            return
        P = self.page
        owners: list[int] = self.alloc.free_pages.tolist()
        paths = path_keys(self.cache)
        for n in self.cache.nodes():
            owners += (n.value[::P] // P).tolist()
            for j, s in enumerate(n.value.tolist(), len(paths[n.id]) - len(n.key)):
                assert self.content[s] == tuple(paths[n.id][: j + 1])
        for r in self.live:
            row = self.pool.req_to_token[r.req_pool_idx, : r.kv_len]
            shared = len(_path(r.last_node))
            assert _path_values(r.last_node) == row[:shared].tolist()
            assert r.prefix_indices.tolist() == row[: r.prefix_indices.numel()].tolist()
            owners += sorted({s // P for s in row[shared:].tolist()})
            for j, s in enumerate(row.tolist()):
                assert self.content[s] == tuple(r.ids[: j + 1])
        assert sorted(owners) == list(range(1, self.alloc.num_pages + 1)), "a KV page is lost or held twice"

    def teardown(self) -> None:
        if self.cache is None:
            return
        for r in self.live:
            self.cache.cache_finished_req(r)
        self.live.clear()
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.size
        assert self.pool.available_size() == self.pool.size
        assert self.cache.total_size() == 0 and len(list(self.cache.nodes())) == 1


RadixMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_radix_machine = RadixMachine.TestCase
