"""Data-parallel routing: which of `dp_size` engine replicas serves a new request.

The controller owns the bookkeeping (which rid is on which replica, per-replica load); a
`LoadBalancePolicy` owns whatever extra state it needs to choose (a counter, prefix trees). Adding a
policy is one class under `@register_policy("name")`; `sorted(LOAD_BALANCE_POLICIES)` lists them.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar


@dataclass
class ReplicaLoad:
    """What the controller knows about one replica: requests routed to it and not yet finished."""

    in_flight: int = 0
    in_flight_tokens: int = 0  # prompt tokens of those requests


class LoadBalancePolicy(ABC):
    """Chooses a replica for each new request.

    An implementation must guarantee: `select` returns an index in `range(dp_size)`, is deterministic
    given its arguments and the policy's own state, and does not change that state (the controller
    may call it only to look). State changes happen in the hooks: right after each `select` the
    controller calls `on_routed(replica, input_ids)` with the replica it used, and `on_finished(replica,
    rid)` once when that request finishes or is aborted. A policy never mutates the loads it is given.
    """

    name: ClassVar[str]

    def __init__(self, dp_size: int):
        self.dp_size = dp_size

    @abstractmethod
    def select(self, input_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int: ...

    def on_routed(self, replica: int, input_ids: Sequence[int]) -> None:
        return None

    def on_finished(self, replica: int, rid: str) -> None:
        return None


LOAD_BALANCE_POLICIES: dict[str, type[LoadBalancePolicy]] = {}


def register_policy(name: str) -> Callable[[type[LoadBalancePolicy]], type[LoadBalancePolicy]]:
    def wrap(cls: type[LoadBalancePolicy]) -> type[LoadBalancePolicy]:
        if LOAD_BALANCE_POLICIES.get(name, cls) is not cls:  # a silent overwrite would hide a typo
            raise ValueError(f"load-balance policy {name!r} is already registered")
        cls.name = name
        LOAD_BALANCE_POLICIES[name] = cls
        return cls

    return wrap


def make_load_balance_policy(name: str, dp_size: int, **options: Any) -> LoadBalancePolicy:
    """Build a registered policy; `options` go to its constructor (e.g. cache_aware's thresholds)."""
    if name not in LOAD_BALANCE_POLICIES:
        raise ValueError(f"unknown load-balance policy {name!r}; choose one of {sorted(LOAD_BALANCE_POLICIES)}")
    return LOAD_BALANCE_POLICIES[name](dp_size, **options)


def shortest_queue(loads: Sequence[ReplicaLoad], among: Iterable[int] | None = None) -> int:
    """Fewest requests in flight, then fewest prompt tokens in flight, then the lowest index."""
    among = range(len(loads)) if among is None else among
    return min(among, key=lambda i: (loads[i].in_flight, loads[i].in_flight_tokens, i))


@register_policy("round_robin")
class RoundRobinPolicy(LoadBalancePolicy):
    def __init__(self, dp_size: int):
        super().__init__(dp_size)
        self._next = 0

    def select(self, input_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        return self._next

    def on_routed(self, replica: int, input_ids: Sequence[int]) -> None:
        self._next = (replica + 1) % self.dp_size  # advance here so select stays a pure look


@register_policy("shortest_queue")
class ShortestQueuePolicy(LoadBalancePolicy):
    def select(self, input_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        return shortest_queue(loads)


class _Node:
    __slots__ = ("key", "parent", "children", "last_access")

    def __init__(self, key: list[int], parent: _Node | None, last_access: int):
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.last_access = last_access

    def __lt__(self, other: _Node) -> bool:  # heap order for eviction: least recently used first
        return self.last_access < other.last_access


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (both lists), at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ApproxPrefixTree:
    """A token radix tree of the prompts routed to one replica: a guess at what its KV cache holds.

    It is approximate on purpose: the replica evicts by its own rules and we never hear about it, so
    we only bound the tree (`max_tokens`, least recently used leaves go first) and accept misses.
    """

    def __init__(self, max_tokens: int = 1_000_000):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.root = _Node([], None, 0)
        self.total_tokens = 0  # sum of len(node.key) over all nodes
        self._clock = 0  # logical time, so equal inputs give equal trees

    def match_prefix(self, input_ids: Sequence[int]) -> int:
        """Length of the longest prefix of `input_ids` in the tree. Read-only (no LRU touch)."""
        node, i = self.root, 0
        while i < len(input_ids) and (child := node.children.get(input_ids[i])) is not None:
            c = _common_len(child.key, input_ids[i : i + len(child.key)])
            i += c
            if c < len(child.key):
                break
            node = child
        return i

    def insert(self, input_ids: Sequence[int]) -> None:
        """Add `input_ids`, mark its path most recently used, then evict down to `max_tokens`."""
        self._clock += 1
        node, i = self.root, 0
        while i < len(input_ids):
            child = node.children.get(input_ids[i])
            if child is None:
                leaf = _Node(list(input_ids[i:]), node, self._clock)
                node.children[input_ids[i]] = leaf
                self.total_tokens += len(leaf.key)
                break
            c = _common_len(child.key, input_ids[i : i + len(child.key)])
            if c < len(child.key):  # split: the shared head becomes a new inner node
                mid = _Node(child.key[:c], node, self._clock)
                child.key, child.parent = child.key[c:], mid
                mid.children[child.key[0]] = child
                node.children[mid.key[0]] = mid
                child = mid
            child.last_access = self._clock
            node, i = child, i + c
        self._evict()

    def _evict(self) -> None:
        excess = self.total_tokens - self.max_tokens
        if excess <= 0:
            return
        # A parent is touched whenever a child is, so it is never older: once its last child is gone
        # it can join the heap in LRU order.
        heap, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children:
                heap.append(node)
        heapq.heapify(heap)
        while excess > 0:
            leaf = heapq.heappop(heap)
            if len(leaf.key) > excess:  # trim its tail: the head is the part a later prompt can reuse
                del leaf.key[len(leaf.key) - excess :]
                self.total_tokens -= excess
                return
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.total_tokens -= len(leaf.key)
            excess -= len(leaf.key)
            if not parent.children and parent is not self.root:
                heapq.heappush(heap, parent)


@register_policy("cache_aware")
class CacheAwarePolicy(LoadBalancePolicy):
    """Send a request where its prefix is most likely cached, unless that would overload a replica.

    If the best replica's matched prefix covers at least `cache_threshold` of the prompt, go there
    (ties: shortest queue); otherwise, or when the loads are imbalanced (max - min in_flight >
    `balance_abs_threshold` and max > `balance_rel_threshold` x min), go to the shortest queue.
    """

    def __init__(
        self,
        dp_size: int,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1_000_000,
    ):
        super().__init__(dp_size)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees = [ApproxPrefixTree(max_tree_tokens) for _ in range(dp_size)]

    def is_imbalanced(self, loads: Sequence[ReplicaLoad]) -> bool:
        hi, lo = max(x.in_flight for x in loads), min(x.in_flight for x in loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def select(self, input_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        if not input_ids or self.is_imbalanced(loads):  # checked first: it also skips the tree walks
            return shortest_queue(loads)
        matched = [tree.match_prefix(input_ids) for tree in self.trees]
        best = max(matched)
        if best / len(input_ids) < self.cache_threshold:
            return shortest_queue(loads)
        return shortest_queue(loads, (i for i in range(len(loads)) if matched[i] == best))

    def on_routed(self, replica: int, input_ids: Sequence[int]) -> None:
        # Kept after the request finishes too: the replica's radix cache keeps the prefix until it evicts.
        self.trees[replica].insert(input_ids)


class DataParallelController:
    """Routes requests (by rid) to `dp_size` replicas and tracks their in-flight load."""

    def __init__(self, dp_size: int, policy: str | LoadBalancePolicy = "round_robin"):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if isinstance(policy, str):
            policy = make_load_balance_policy(policy, dp_size)
        elif policy.dp_size != dp_size:
            raise ValueError(f"policy was built for dp_size={policy.dp_size}, controller has {dp_size}")
        self.dp_size = dp_size
        self.policy = policy
        self._loads = [ReplicaLoad() for _ in range(dp_size)]
        self._routed_counts = [0] * dp_size
        self._in_flight: dict[str, tuple[int, int]] = {}  # rid -> (replica, prompt tokens)

    def route(self, rid: str, input_ids: Sequence[int]) -> int:
        """Pick a replica for `rid`, record it and charge its load; ValueError if rid is in flight."""
        if rid in self._in_flight:
            raise ValueError(f"request {rid!r} is already in flight on replica {self._in_flight[rid][0]}")
        replica = self.policy.select(input_ids, self.loads)  # copies: a policy cannot touch our loads
        if not 0 <= replica < self.dp_size:
            raise RuntimeError(f"{type(self.policy).__name__} chose replica {replica}, not in [0, {self.dp_size})")
        self._in_flight[rid] = (replica, len(input_ids))
        self._loads[replica].in_flight += 1
        self._loads[replica].in_flight_tokens += len(input_ids)
        self._routed_counts[replica] += 1
        self.policy.on_routed(replica, input_ids)
        return replica

    def finish(self, rid: str) -> int | None:
        """`rid` finished or was aborted: release its load. Its replica, or None if not in flight."""
        entry = self._in_flight.pop(rid, None)
        if entry is None:  # unknown or already finished: finish is idempotent
            return None
        replica, num_tokens = entry
        self._loads[replica].in_flight -= 1
        self._loads[replica].in_flight_tokens -= num_tokens
        self.policy.on_finished(replica, rid)
        return replica

    def replica_of(self, rid: str) -> int | None:
        entry = self._in_flight.get(rid)
        return None if entry is None else entry[0]

    @property
    def loads(self) -> list[ReplicaLoad]:
        return [replace(load) for load in self._loads]

    @property
    def routed_counts(self) -> list[int]:
        return list(self._routed_counts)
