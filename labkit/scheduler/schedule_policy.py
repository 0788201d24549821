"""Scheduling policies (order of the waiting queue) and the PrefillAdder (who fits in this prefill).

Adding a policy is one registered class:

    @register_policy("my-policy")
    class MyPolicy(SchedulePolicy):
        def sort(self, waiting, tree_cache): waiting.sort(key=...)
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache
from labkit.scheduler.batch_memory import new_slots_needed
from labkit.scheduler.schedule_batch import Req


class SchedulePolicy(ABC):
    """Orders the waiting queue before each prefill round.

    An implementation must only reorder `waiting` in place (never drop or add requests), must not
    change the cache (no locks, inserts or evictions; match_prefix's LRU touch is allowed), and must
    be deterministic given the queue, the cache and its own seed. If `needs_prefix_match` is True,
    the scheduler has called `req.init_next_round_input(tree_cache)` on every waiting request first,
    so `len(req.prefix_indices)` and `req.last_node` are current.
    """

    name: ClassVar[str]
    needs_prefix_match: ClassVar[bool] = False

    def __init__(self, seed: int = 0):
        self.seed = seed

    @abstractmethod
    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None: ...


POLICIES: dict[str, type[SchedulePolicy]] = {}


def register_policy(name: str) -> Callable[[type[SchedulePolicy]], type[SchedulePolicy]]:
    def wrap(cls: type[SchedulePolicy]) -> type[SchedulePolicy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap


def make_policy(name: str, seed: int = 0) -> SchedulePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](seed)


@register_policy("fcfs")
class FCFSPolicy(SchedulePolicy):
    """First come, first served: arrival order (retracted requests were put back at the front)."""

    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None:
        return None


@register_policy("lof")
class LongestOutputFirstPolicy(SchedulePolicy):
    """Longest max_new_tokens first."""

    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None:
        waiting.sort(key=lambda r: -r.sampling_params.max_new_tokens)


@register_policy("random")
class RandomPolicy(SchedulePolicy):
    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.rng = random.Random(seed)

    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None:
        self.rng.shuffle(waiting)


@register_policy("lpm")
class LongestPrefixMatchPolicy(SchedulePolicy):
    """Longest cached prefix first: requests that reuse the most KV run while it is still cached."""

    needs_prefix_match = True

    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None:
        waiting.sort(key=lambda r: -len(r.prefix_indices))


@register_policy("dfs-weight")
class DFSWeightPolicy(SchedulePolicy):
    """Walk the radix tree depth first, heavier subtrees (more waiting requests) first, and take the
    requests in that order: requests sharing a prefix run together, so the prefix stays cached."""

    needs_prefix_match = True

    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None:
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for req in waiting:
            node = req.last_node
            by_node[id(node)].append(req)
            while node is not None:  # every ancestor's weight counts this request
                weight[id(node)] += 1
                node = node.parent
        root = tree_cache.root
        if not weight.get(id(root)):  # no tree (chunk cache): keep arrival order
            return
        # Post-order, as SGLang: a node's subtrees (heaviest first; of equal weights, the child added
        # to the tree last) before the requests that stop at the node itself, so requests matching
        # nothing (at the root) do not jump ahead of a group.
        order: list[Req] = []
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.extend(by_node.get(id(node), ()))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            kids.sort(key=lambda c: weight[id(c)])  # popped last = heaviest first
            stack.extend((c, False) for c in kids)
        waiting[:] = order


CLIP_MAX_NEW_TOKENS = 4096  # cap on what one request may reserve for its future decode tokens


class PrefillAdder:
    """Decides which waiting requests join this prefill batch, under three budgets:

    - KV memory: free + evictable slots, minus what running requests are expected to still need
      (their remaining max_new_tokens times new_token_ratio), minus what admitted requests need;
    - the prefill token budget (max_prefill_tokens) for this forward;
    - the chunk budget (chunked_prefill_size): a prompt longer than what is left is cut into chunks.
    Every request it turns away gets a reason in `blocked`, which the trace records.
    """

    def __init__(
        self,
        tree_cache: BasePrefixCache,
        allocator: TokenToKVPoolAllocator,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        page_size: int,
        mixed_decode_tokens: int = 0,
    ):
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.page_size = page_size
        self.new_token_ratio = new_token_ratio
        self.reserved = sum(self._future_tokens(r) for r in running) + mixed_decode_tokens
        self.idle = not running
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.blocked: dict[str, str] = {}

    def _future_tokens(self, req: Req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(min(max(left, 0), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    def _new_slots(self, req: Req) -> int:
        prefix = len(req.prefix_indices)
        return new_slots_needed(prefix, prefix + req.extend_input_len, self.page_size)

    def rem_total_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved

    def add_chunked_req(self, req: Req) -> bool:
        """Continue the request being prefilled in chunks; it goes first, and may use all memory that
        is free or evictable now (it already holds part of its KV). False: not even one page fits."""
        prefix = len(req.prefix_indices)
        room = self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved
        # Up to the end of its partly filled last page, plus as many whole pages as fit.
        fits = -(-prefix // self.page_size) * self.page_size + max(room, 0) // self.page_size * self.page_size - prefix
        if fits <= 0:
            self.blocked[req.rid] = f"kv memory: the next chunk needs a page, {room} slots reclaimable"
            return False
        self._admit(req, self._future_tokens(req), mem_cap=fits)
        return True

    def add_one_req(self, req: Req) -> bool:
        """Try to admit a waiting request (prefix already matched). False: stop adding."""
        # Lock first: the request's own prefix must not count as evictable memory it could use.
        self.tree_cache.inc_lock_ref(req.last_node)
        reason = self._admission_blocker(req)
        if reason is None and req.host_prefix_len:
            # It fits with its host-tier part counted as tokens to compute: bring that part up
            # instead (the same device slots). Only now, so a request that waits copies nothing.
            self.tree_cache.dec_lock_ref(req.last_node)
            req.init_next_round_input(self.tree_cache, load_back=True)
            self.tree_cache.inc_lock_ref(req.last_node)
            reason = self._admission_blocker(req)
        if reason is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
            self.blocked[req.rid] = reason
            return False
        self._admit(req, self._future_tokens(req))
        return True

    def _admission_blocker(self, req: Req) -> str | None:
        now, future, rem = self._new_slots(req), self._future_tokens(req), self.rem_total_tokens()
        # With nothing else running, admit whatever fits now: retraction and the length limit
        # handle the rest, and waiting would never make more memory free.
        alone = self.idle and not self.can_run and now <= rem
        if now + future > rem and not alone:
            return f"kv memory: needs {now + future} slots, free+evictable-reserved is {rem}"
        if self.can_run and req.extend_input_len > self.rem_input_tokens:
            return f"prefill token budget: needs {req.extend_input_len}, {self.rem_input_tokens} left this step"
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return "chunk budget used up this step"
        return None

    def _admit(self, req: Req, future: int, mem_cap: int | None = None) -> None:
        caps = [c for c in (self.rem_chunk_tokens, mem_cap) if c is not None]
        cap = min(caps) if caps else None
        if cap is not None and req.extend_input_len > cap:
            # Cut at a page boundary of the sequence so the tree can take the chunk's KV.
            prefix = len(req.prefix_indices)
            end = (prefix + cap) // self.page_size * self.page_size
            req.extend_input_len = end - prefix if end > prefix else cap
            req.is_chunked = True
            self.new_chunked_req = req
        else:
            req.is_chunked = False
        self.can_run.append(req)
        self.reserved += self._new_slots(req) + future
        self.rem_input_tokens -= req.extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.extend_input_len
