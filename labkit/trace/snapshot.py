"""Per-step snapshots: the radix tree and the waiting queue as a scheduler step left them.

Why snapshots and not a replay of TreeEvents: the events say which nodes were inserted, split or
evicted, but not how lock references change (every admission, chunk and finish moves them), and a
split node keeps its id while its key is cut. To draw "the tree at step k" with its locks
(evictable vs protected), the scheduler's trace hook records one compact TreeSnapshot per step.
Unchanged nodes share one NodeState object between consecutive snapshots, so a run of a few hundred
steps over a few hundred nodes stays small. The TreeEvents of a step (see Tracer.tree_events, which
carry times inside the step's [start, end]) then say which nodes were new, split or evicted in it.

Like every trace record, snapshots are only made when a tracer is attached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_HEAD_TOKENS = 16  # tokens of each node's key kept for labels


@dataclass(frozen=True)
class NodeState:
    """One radix-tree node at the end of a step."""

    id: int
    parent: int | None  # None for the root
    num_tokens: int  # length of the node's key (its own tokens, not the prefix above it)
    lock_ref: int  # > 0: protected (a running request uses it); 0: evictable
    last_access: int  # the cache's logical LRU clock (larger = more recent)
    head: tuple[int, ...]  # the first tokens of the key, for labels
    tier: str = "device"  # where its KV is: "device", "host" or "device+host" (HiRadixCache)


@dataclass
class TreeSnapshot:
    step: int
    page_size: int
    nodes: tuple[NodeState, ...]  # root first, then depth first

    def by_id(self) -> dict[int, NodeState]:
        return {n.id: n for n in self.nodes}

    @property
    def evictable(self) -> int:
        """Device tokens no running request uses."""
        return sum(n.num_tokens for n in self.nodes if n.parent is not None and n.lock_ref == 0 and n.tier != "host")

    @property
    def host_only(self) -> int:
        """Tokens whose KV is in the host tier only."""
        return sum(n.num_tokens for n in self.nodes if n.tier == "host")

    @property
    def protected(self) -> int:
        return sum(n.num_tokens for n in self.nodes if n.parent is not None and n.lock_ref > 0)


@dataclass(frozen=True)
class WaitingState:
    """A request left in the waiting queue at the end of a step, with its last prefix match."""

    rid: str
    input_len: int  # tokens it has to hold: prompt (+ outputs, after a retraction)
    prefix_len: int | None  # cached tokens at its last match; None: not matched since it (re)entered
    retract_count: int = 0
    host_prefix_len: int = 0  # and below them, tokens of the match in the host or disk tier (loaded at admission)


@dataclass
class StepSnapshot:
    step: int
    tree: TreeSnapshot | None  # None without a radix cache (ChunkCache)
    waiting: list[WaitingState] = field(default_factory=list)


def snapshot_tree(
    tree_cache: Any, step: int, head_tokens: int = DEFAULT_HEAD_TOKENS, previous: dict[int, NodeState] | None = None
) -> TreeSnapshot | None:
    """A TreeSnapshot of a RadixCache (anything with a root and whose nodes() expose id, parent, key,
    lock_ref, last_access_time). `previous` (node id -> NodeState) lets unchanged nodes be shared
    with the last snapshot. Reads only: no LRU touch, no split."""
    if getattr(tree_cache, "root", None) is None:
        return None
    previous = previous or {}
    out: list[NodeState] = []
    for node in tree_cache.nodes():  # root first, then depth first
        parent = node.parent.id if node.parent is not None else None
        n = len(node.key)
        tier = _tier(node)
        old = previous.get(node.id)
        # A node's key only changes by a split, which gives it a new (upper) parent and a shorter key.
        if (
            old is not None
            and old.parent == parent
            and old.num_tokens == n
            and old.lock_ref == node.lock_ref
            and old.last_access == node.last_access_time
            and old.tier == tier
        ):
            out.append(old)
        else:
            out.append(
                NodeState(node.id, parent, n, node.lock_ref, node.last_access_time, tuple(node.key[:head_tokens]), tier)
            )
    return TreeSnapshot(step, getattr(tree_cache, "page_size", 1), tuple(out))


def _tier(node: Any) -> str:
    on_host = getattr(node, "host_value", None) is not None
    if node.parent is not None and not len(node.value):
        return "host"
    return "device+host" if on_host else "device"


def snapshot_waiting(waiting_queue: list[Any]) -> list[WaitingState]:
    return [
        WaitingState(
            r.rid,
            len(r.origin_input_ids) + len(r.output_ids),
            len(r.prefix_indices) if r.last_node is not None else None,
            r.retract_count,
            r.host_prefix_len,
        )
        for r in waiting_queue
    ]
