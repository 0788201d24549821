"""The radix tree as an icicle chart: one box per node, the root at the left, each level of the tree one
column, a node's box as tall as the number of leaves below it (so shared prefixes are tall boxes and
every leaf gets one row). That stays readable for trees of a few hundred nodes, where a node-link
drawing turns into a hairball.

A box shows the start of the node's tokens as text, its token count and its lock reference; its
fill says evictable (lock_ref 0) or protected (locked by a running request); its outline marks what
the step did to it: inserted, split (the new upper node), or evicted (a dashed ghost box). With the
hierarchical cache (HiRadixCache) a node whose KV is in host memory only is filled in the host colour,
and a node on the device with a host copy has a strip of it at its right end (NodeState.tier).

The tree at step k is the TreeSnapshot the scheduler's trace hook recorded at the end of step k
(labkit.trace.snapshot); the step's TreeEvents supply the highlights and the evicted ghosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from labkit.trace.events import TreeEvent
from labkit.trace.snapshot import DEFAULT_HEAD_TOKENS, NodeState, TreeSnapshot, snapshot_tree
from labkit.viz import style
from labkit.viz.run import Run, token_text
from labkit.viz.tiers import HOST_COPY, HOST_ONLY

COL_W = 2.0  # inches per tree level
ROOT_W = 0.55
GAP = 0.18
ROW_H = 0.42  # inches per leaf row (shrunk for big trees, see max_height)
STRIP_W = 0.14  # inches: the host-copy strip at a device+host node's right end
# Tags for what a step did to a node's tiers (HiRadixCache's TreeEvents), later kinds winning.
TIER_TAGS = {"offload": "OFFLOADED ", "load_back": "LOADED ", "disk_read": "FROM DISK "}


@dataclass
class _Box:
    node: NodeState
    depth: int
    row0: float
    row1: float
    kind: str  # "node" | "ghost"


def _layout(nodes: list[NodeState], root_id: int) -> tuple[dict[int, _Box], int]:
    children: dict[int, list[NodeState]] = {}
    by_id = {n.id: n for n in nodes}
    for n in nodes:
        if n.parent is not None:
            children.setdefault(n.parent, []).append(n)
    for kids in children.values():
        kids.sort(key=lambda n: n.id)
    boxes: dict[int, _Box] = {}
    next_row = 0

    def place(node_id: int, depth: int) -> tuple[int, int]:
        nonlocal next_row
        kids = children.get(node_id, [])
        if not kids:
            r0 = next_row
            next_row += 1
            boxes[node_id] = _Box(by_id[node_id], depth, r0, r0 + 1, "node")
            return r0, r0 + 1
        spans = [place(k.id, depth + 1) for k in kids]
        boxes[node_id] = _Box(by_id[node_id], depth, spans[0][0], spans[-1][1], "node")
        return spans[0][0], spans[-1][1]

    # iterative depth would be nicer, but radix trees here are at most a few dozen levels deep
    place(root_id, 0)
    return boxes, max(next_row, 1)


def _changes(events: list[TreeEvent]) -> tuple[set[int], set[int], list[TreeEvent]]:
    """(inserted node ids, split node ids, evict events) of a step."""
    inserted = {e.node_id for e in events if e.kind == "insert"}
    split = {e.node_id for e in events if e.kind == "split"}
    return inserted, split, [e for e in events if e.kind == "evict"]


def resolve_tree(source: Any, step: int | None = None) -> tuple[TreeSnapshot, list[TreeEvent], Any, str]:
    """(snapshot, the step's tree events, tokenizer, title) for an Engine / Run / Tracer / RadixCache /
    TreeSnapshot. With an Engine and step=None: the live tree now (and the last step's changes)."""
    if isinstance(source, TreeSnapshot):
        return source, [], None, f"Radix tree after step {source.step}"
    tree_cache = getattr(source, "tree_cache", None)
    if step is None and tree_cache is not None:  # a live Engine: snapshot it now
        step_id = source.scheduler.step_id
        snap = snapshot_tree(tree_cache, step_id)
        if snap is None:
            raise ValueError("this engine has no radix cache (disable_radix_cache=True)")
        events = Run.of(source).tree_events(step_id) if getattr(source, "tracer", None) else []
        return snap, events, getattr(source, "tokenizer", None), f"Radix tree now (after step {step_id})"
    if hasattr(source, "nodes") and hasattr(source, "root"):  # a RadixCache itself
        bare = snapshot_tree(source, -1)
        assert bare is not None  # it has nodes and a root: a tree
        return bare, [], None, "Radix tree now"
    run = Run.of(source)
    if step is None:
        if not run.steps:
            raise ValueError("the run has no steps yet")
        step = run.steps[-1].step
    snap = run.tree_at(step)
    if snap is None:
        raise ValueError(f"no tree snapshot for step {step} (tracing with record_snapshots, radix cache on?)")
    return snap, run.tree_events(step), run.tokenizer, f"Radix tree after step {step}"


def draw_radix_tree(
    source: Any,
    step: int | None = None,
    *,
    tokenizer: Any = None,
    title: str | None = None,
    max_height: float = 40.0,
    label_chars: int | None = None,
):
    """Draw the radix tree of `source` (Engine: live now; Run/Tracer/Engine with `step`: as recorded
    at the end of that step). Returns a matplotlib Figure; each node's box has gid 'node-<id>',
    each evicted ghost 'evicted-<id>'."""
    snap, events, tok, default_title = resolve_tree(source, step)
    tokenizer = tokenizer if tokenizer is not None else tok
    inserted, split, evicted = _changes(events)
    moved = {e.node_id: TIER_TAGS[e.kind] for e in events if e.kind in TIER_TAGS}
    tiered = any(n.tier != "device" for n in snap.nodes) or bool(moved)
    root = snap.nodes[0]
    present = {n.id for n in snap.nodes}
    known = present | {e.node_id for e in evicted}  # an evicted node hangs below its parent, or the root
    ghost_nodes = [
        NodeState(
            e.node_id,
            e.parent_id if e.parent_id in known else root.id,
            e.num_tokens,
            0,
            0,
            tuple(t for t in e.tokens[:DEFAULT_HEAD_TOKENS] if isinstance(t, int)),  # not the recorder's "…"
        )
        for e in evicted
        if e.node_id not in present
    ]  # ids are never reused: a safety net
    boxes, rows = _layout([*snap.nodes, *ghost_nodes], root.id)
    for g in ghost_nodes:
        boxes[g.id].kind = "ghost"
    depth = max(b.depth for b in boxes.values())

    row_h = min(ROW_H, max_height / rows)
    width = ROOT_W + depth * (COL_W + GAP)
    height = rows * row_h
    top, bottom, side = 0.75, 0.55, 0.15
    ncol = 5 if width > 9 else 3
    legend_rows = -(-(7 if tiered else 5) // ncol)  # the legend's entries (see handles below), in rows
    bottom += 0.2 * max(0, legend_rows - 2)  # room for a third row (tiers, narrow tree)
    fig = style.new_figure(max(width + 2 * side, 8.0), height + top + bottom, layout="none")
    W, H = fig.get_size_inches()
    ax = fig.add_axes((side / W, bottom / H, width / W, height / H))
    ax.set_xlim(0, width)
    ax.set_ylim(rows, 0)
    ax.axis("off")

    row_pt = row_h * 72
    fs = max(5.0, min(9.0, row_pt * 0.62))
    chars = label_chars or max(6, int((COL_W - 0.1) * 72 / (fs * 0.62)))

    def x0(d: int) -> float:
        return 0.0 if d == 0 else ROOT_W + GAP + (d - 1) * (COL_W + GAP)

    patches = {}
    for nid, b in sorted(boxes.items(), key=lambda kv: kv[1].depth):
        n = b.node
        left = x0(b.depth)
        w = ROOT_W if b.depth == 0 else COL_W
        y, h = b.row0 + 0.06, (b.row1 - b.row0) - 0.12
        if b.kind == "ghost":
            rect = Rectangle(
                (left, y),
                w,
                h,
                facecolor="white",
                edgecolor=style.EVICTED,
                lw=1.6,
                ls="--",
                hatch="//",
                alpha=0.9,
                gid=f"evicted-{nid}",
            )
        else:
            fill = "#cccccc" if n.parent is None else (style.PROTECTED if n.lock_ref > 0 else style.EVICTABLE)
            if n.tier == "host":
                fill = HOST_ONLY
            edge, lw = "#555555", 0.6
            if nid in inserted:
                edge, lw = style.INSERTED, 2.6
            if nid in split:
                edge, lw = style.SPLIT, 2.6
            rect = Rectangle((left, y), w, h, facecolor=fill, edgecolor=edge, lw=lw, gid=f"node-{nid}")
        ax.add_patch(rect)
        patches[nid] = rect
        if b.kind == "node" and n.tier == "device+host":
            strip = Rectangle(
                (left + w - STRIP_W, y),
                STRIP_W,
                h,
                facecolor=HOST_COPY,
                edgecolor="#555555",
                lw=0.5,
                gid=f"host-copy-{nid}",
            )
            ax.add_patch(strip)
        if b.depth > 0:  # connector from the parent's right edge
            cy = (b.row0 + b.row1) / 2
            ax.add_line(Line2D([left - GAP, left], [cy, cy], color="#888888", lw=0.7))
        # label
        box_pt = h * row_pt
        if n.parent is None:
            if box_pt >= fs * 1.3:
                ax.text(
                    left + w / 2,
                    (b.row0 + b.row1) / 2,
                    "root",
                    ha="center",
                    va="center",
                    fontsize=fs,
                    rotation=90 if box_pt > 40 else 0,
                )
            continue
        text = token_text(tokenizer, list(n.head) + (["…"] if n.num_tokens > len(n.head) else []), chars)
        tag = {"ghost": "EVICTED "}.get(b.kind, "NEW " if nid in inserted else "SPLIT " if nid in split else "")
        tag = moved.get(nid, "") + tag if b.kind == "node" else tag
        where = " · host" if n.tier == "host" else f" · lock {n.lock_ref}"  # a host-only node is never locked
        meta = f"{tag}#{nid} · {n.num_tokens} tok" + (where if b.kind == "node" else "")
        cy = (b.row0 + b.row1) / 2
        label = None
        if box_pt >= fs * 2.6:
            label = ax.text(
                left + 0.06, cy, f"{text}\n{meta}", ha="left", va="center", fontsize=fs, linespacing=1.25, clip_on=True
            )
        elif box_pt >= fs * 1.15:
            short = token_text(tokenizer, list(n.head), max(4, chars - 10))
            label = ax.text(
                left + 0.06, cy, f"{short} ({n.num_tokens})", ha="left", va="center", fontsize=fs * 0.95, clip_on=True
            )
        if label is not None and tiered:
            label.set_clip_path(rect)  # a tier tag makes labels longer: cut them at the box, not over the next

    n_nodes = len(snap.nodes) - 1
    stats = f"{n_nodes} nodes · {snap.evictable} evictable + {snap.protected} protected tokens" + (
        f" · this step: {len(inserted)} inserted, {len(split)} split, {len(evicted)} evicted"
        if events or step is not None
        else ""
    )
    if tiered:
        stats += f" · {snap.host_only} tokens in host memory only"
    fig.text(side / W, 1 - 0.22 / H, title or default_title, fontsize=12, weight="bold", va="top")
    note = "box height = leaves below the node; text = the node's first tokens"
    if tokenizer is not None:
        note += " (« » = <|im_start|> <|im_end|>, ↵ = newline)"
    fig.text(side / W, 1 - 0.47 / H, stats + "\n" + note, fontsize=8.5, va="top", color="#333333")
    handles = [
        Patch(facecolor=style.EVICTABLE, edgecolor="#555555", label="evictable (lock 0)"),
        Patch(facecolor=style.PROTECTED, edgecolor="#555555", label="protected (locked)"),
        Patch(facecolor="white", edgecolor=style.INSERTED, lw=2.6, label="inserted this step"),
        Patch(facecolor="white", edgecolor=style.SPLIT, lw=2.6, label="split this step (new upper node)"),
        Patch(facecolor="white", edgecolor=style.EVICTED, lw=1.6, ls="--", hatch="//", label="evicted this step"),
    ]
    if tiered:
        handles[2:2] = [
            Patch(facecolor=HOST_ONLY, edgecolor="#555555", label="host only (off the device)"),
            Patch(facecolor=HOST_COPY, edgecolor="#555555", label="strip: a host copy too"),
        ]
    fig.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(side / W, 0.02 / H),
        ncol=ncol,
        fontsize=8,
        frameon=False,
    )
    fig.labkit_nodes = patches  # type: ignore[attr-defined]  # node id -> its box, for tests and interactive use
    return fig
