"""The request-to-token table and the page pool, read from a live Engine.

`kv_snapshot(engine)` copies what the pools hold right now (call it between `engine.step()`s; the
copy stays valid as the engine moves on): for every live request its row of req_to_token (the KV
slot of each of its tokens), the radix tree's slots, and the allocator's free pages.
`req_to_token_table` turns it into a DataFrame (one row per request token) and `draw_kv_pool` into a
figure: the table on top (one cell per token position, its slot number inside), the page pool below
(one cell per page), coloured by owner. A slot that two or more running requests read is a shared
prefix: amber with a hatch in both views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch, Rectangle

from labkit.viz import style
from labkit.viz.run import token_text


@dataclass
class ReqRow:
    rid: str
    req_pool_idx: int
    token_ids: list[int]  # the tokens whose KV is held (all_ids[:kv_len])
    slots: list[int]  # req_to_token[req_pool_idx, :kv_len]
    state: str  # "running" | "chunked" (prefill not finished)


@dataclass
class KVSnapshot:
    step: int
    page_size: int
    num_pages: int  # usable pages (1..num_pages; page 0 is reserved)
    requests: list[ReqRow]
    tree_slots: dict[int, tuple[int, int]]  # slot -> (node id, lock_ref)
    free_pages: set[int]
    tokenizer: Any = field(default=None, repr=False)


def kv_snapshot(engine: Any) -> KVSnapshot:
    """Copy the live pools of `engine` (an Engine): request rows, tree slots, free pages."""
    sched = engine.scheduler
    table = engine.req_to_token_pool.host
    live = [(r, "running") for r in sched.running]
    if sched.chunked_req is not None:
        live.append((sched.chunked_req, "chunked"))
    rows = []
    for req, state in live:
        if req.req_pool_idx is None or not req.kv_len:
            continue
        rows.append(
            ReqRow(
                req.rid,
                req.req_pool_idx,
                list(req.all_ids[: req.kv_len]),
                table[req.req_pool_idx, : req.kv_len].tolist(),
                state,
            )
        )
    rows.sort(key=lambda r: r.req_pool_idx)
    tree_slots: dict[int, tuple[int, int]] = {}
    cache = engine.tree_cache
    if getattr(cache, "root", None) is not None:
        for node in cache.nodes():
            for slot in node.value.tolist():
                tree_slots[slot] = (node.id, node.lock_ref)
    alloc = engine.allocator
    return KVSnapshot(
        sched.step_id,
        alloc.page_size,
        alloc.num_pages,
        rows,
        tree_slots,
        set(alloc.free_pages.tolist()),
        engine.tokenizer,
    )


def req_to_token_table(snap: KVSnapshot) -> pd.DataFrame:
    """One row per (request, token position): the KV slot and page holding it, and who owns it:
    'shared' (the slot is read by two or more live requests: a shared prefix in the tree),
    'cached' (in the tree, read by this request only), 'own' (the request's private slot)."""
    readers: dict[int, int] = {}
    for r in snap.requests:
        for s in set(r.slots):
            readers[s] = readers.get(s, 0) + 1
    rows = []
    for r in snap.requests:
        for pos, (tok, slot) in enumerate(zip(r.token_ids, r.slots)):
            n = readers[slot]
            owner = "shared" if n > 1 else "cached" if slot in snap.tree_slots else "own"
            rows.append(
                {
                    "rid": r.rid,
                    "req_pool_idx": r.req_pool_idx,
                    "position": pos,
                    "token": tok,
                    "slot": slot,
                    "page": slot // snap.page_size,
                    "owner": owner,
                    "readers": n,
                    "in_tree": slot in snap.tree_slots,
                }
            )
    return pd.DataFrame(
        rows, columns=["rid", "req_pool_idx", "position", "token", "slot", "page", "owner", "readers", "in_tree"]
    )


def page_owners(snap: KVSnapshot) -> pd.DataFrame:
    """One row per usable page: its owner (free / evictable / protected / request rid / shared) and
    how many live requests read it."""
    readers: dict[int, set[str]] = {}
    for r in snap.requests:
        for s in r.slots:
            readers.setdefault(s // snap.page_size, set()).add(r.rid)
    tree_pages: dict[int, int] = {}
    for slot, (_, lock) in snap.tree_slots.items():
        p = slot // snap.page_size
        tree_pages[p] = max(tree_pages.get(p, 0), lock)
    rows = []
    for p in range(1, snap.num_pages + 1):
        who = readers.get(p, set())
        if p in snap.free_pages:
            owner = "free"
        elif len(who) > 1:
            owner = "shared"
        elif p in tree_pages:
            owner = "protected" if tree_pages[p] > 0 else "evictable"
        elif who:
            owner = next(iter(who))
        else:
            owner = "unaccounted"  # would be a leak
        rows.append({"page": p, "owner": owner, "readers": len(who), "rids": sorted(who)})
    return pd.DataFrame(rows)


SHARED_EDGE = "#7a5200"  # the outline of shared slots and pages


def draw_kv_pool(
    source: Any,
    *,
    max_positions: int = 96,
    pages_per_row: int = 64,
    max_pages: int | None = None,
    title: str | None = None,
):
    """Request-to-token table (top) and page pool (bottom) of a KVSnapshot (or a live Engine, which
    is snapshotted now). Shared slots/pages are amber with a dark outline (no hatching under their
    numbers). The pool is drawn up to the row of its last page in use (the title counts the rest).
    Returns the Figure; table cells of shared slots have gid 'shared-<rid>-<pos>'."""
    snap = source if isinstance(source, KVSnapshot) else kv_snapshot(source)
    df = req_to_token_table(snap)
    pages = page_owners(snap)
    rids = [r.rid for r in snap.requests]
    color_of = {rid: style.request_color(i) for i, rid in enumerate(rids)}
    used = pages[pages["owner"] != "free"]["page"]
    last = int(used.max()) if len(used) else 0
    cells = snap.num_pages + 1  # page 0 (reserved) .. num_pages
    if max_pages:
        shown_pages = min(max_pages, cells)
    else:  # up to the row of the last page in use; the rest is free
        shown_pages = min(cells, (last // pages_per_row + 1) * pages_per_row)
    n_rows_pool = int(np.ceil(shown_pages / pages_per_row))
    n_pos = min(max((len(r.slots) for r in snap.requests), default=1), max_positions)
    pitch = 1.45 if snap.page_size > 1 else 1.0  # room under each row for its page numbers
    table_h = max(1.0, 0.34 * pitch * max(len(rids), 1) + 0.9)
    pool_h = max(1.0, 0.22 * n_rows_pool + 0.9)
    fig = style.new_figure(13, table_h + pool_h + 0.5)
    ax_t, ax_p = fig.subplots(2, 1, height_ratios=[table_h, pool_h])

    # --- the table -------------------------------------------------------------------------------
    cell_w_in = 11.0 / max(n_pos, 1)
    fs = 6 if cell_w_in > 0.3 else 5 if cell_w_in > 0.2 else 0
    for k, r in enumerate(snap.requests):
        i = k * pitch
        sub = df[df["rid"] == r.rid].head(n_pos)
        for _, c in sub.iterrows():
            pos = int(c["position"])
            edge, lw = "white", 0.5
            if c["owner"] == "shared":
                face, edge, lw, gid = style.PROTECTED, SHARED_EDGE, 1.2, f"shared-{r.rid}-{pos}"
            elif c["owner"] == "cached":
                face, gid = "#ffe8a3", f"cached-{r.rid}-{pos}"
            else:
                face, gid = color_of[r.rid], f"own-{r.rid}-{pos}"
            ax_t.add_patch(Rectangle((pos, i - 0.42), 1, 0.84, facecolor=face, edgecolor=edge, lw=lw, gid=gid))
            if fs:
                ax_t.text(
                    pos + 0.5,
                    i,
                    str(int(c["slot"])),
                    ha="center",
                    va="center",
                    fontsize=fs,
                    color="black" if c["owner"] != "own" else "white",
                )
        if len(r.slots) > n_pos:
            ax_t.text(n_pos + 0.3, i, f"… {len(r.slots)} tokens", va="center", fontsize=7)
    if snap.page_size > 1:  # page boundaries of the positions, and each page's number
        P = snap.page_size
        for b in range(0, n_pos + 1, P):
            ax_t.axvline(b, color="#333333", lw=0.6, alpha=0.6)
        if P * cell_w_in > 0.45:
            for k, r in enumerate(snap.requests):
                for b in range(0, min(len(r.slots), n_pos), P):
                    mid = b + min(P, n_pos - b, len(r.slots) - b) / 2
                    ax_t.text(
                        mid,
                        k * pitch + 0.47,
                        f"page {r.slots[b] // P}",
                        ha="center",
                        va="top",
                        fontsize=6.5,
                        color="#222222",
                    )
    labels = [f"slot {r.req_pool_idx}: {r.rid}" + (" (chunked)" if r.state == "chunked" else "") for r in snap.requests]
    ax_t.set_yticks([k * pitch for k in range(len(rids))], labels, fontsize=8)
    for tick, rid in zip(ax_t.get_yticklabels(), rids):
        tick.set_color(color_of[rid])
    ax_t.set_xlim(0, n_pos + (4 if any(len(r.slots) > n_pos for r in snap.requests) else 0))
    ax_t.set_ylim((max(len(rids), 1) - 1) * pitch + (0.5 if pitch == 1 else 0.75), -0.5)
    ax_t.set_xlabel(
        "token position in the request"
        + (f"  (lines: page boundaries, page_size {snap.page_size})" if snap.page_size > 1 else ""),
        fontsize=8,
    )
    ax_t.tick_params(axis="x", labelsize=7)
    for side in ("top", "right"):
        ax_t.spines[side].set_visible(False)
    ax_t.set_title(
        title or f"Request-to-token table after step {snap.step}: the KV slot of every token (number in the cell)",
        loc="left",
        fontsize=10,
        weight="bold",
    )
    if not rids:
        ax_t.text(0.5, 0.5, "no running requests", ha="center", va="center", transform=ax_t.transAxes)
    handles = [
        Patch(facecolor=style.PROTECTED, edgecolor=SHARED_EDGE, lw=1.2, label="shared prefix (read by 2+ requests)"),
        Patch(facecolor="#ffe8a3", label="in the radix tree, read by this request only"),
        Patch(facecolor=style.REQUEST_PALETTE[0], label="the request's own slots (colour per request)"),
    ]
    ax_t.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7.5, frameon=False)

    # --- the page pool ---------------------------------------------------------------------------
    kinds = ["reserved", "free", "evictable", "protected", "shared", "unaccounted", *rids]
    colors = [
        style.RESERVED,
        style.FREE,
        style.EVICTABLE,
        style.PROTECTED,
        style.PROTECTED,
        "black",
        *[color_of[r] for r in rids],
    ]
    code = {k: i for i, k in enumerate(kinds)}
    grid = np.full(n_rows_pool * pages_per_row, np.nan)
    grid[0] = code["reserved"]
    for _, p in pages.iterrows():
        if p["page"] < len(grid):
            grid[p["page"]] = code[p["owner"]]
    grid = grid.reshape(n_rows_pool, pages_per_row)
    ax_p.imshow(
        np.ma.masked_invalid(grid),
        cmap=ListedColormap(colors),
        vmin=-0.5,
        vmax=len(kinds) - 0.5,
        aspect="auto",
        interpolation="nearest",
    )
    for _, p in pages[pages["owner"] == "shared"].iterrows():
        if p["page"] < len(grid.flat):
            r, c = divmod(int(p["page"]), pages_per_row)
            outline = dict(fill=False, edgecolor=SHARED_EDGE, lw=1.2, gid=f"shared-page-{p['page']}")
            ax_p.add_patch(Rectangle((c - 0.45, r - 0.45), 0.9, 0.9, **outline))
            if pages_per_row <= 64:
                ax_p.text(c, r, f"×{p['readers']}", ha="center", va="center", fontsize=5.5)
    ax_p.set_xticks(np.arange(-0.5, pages_per_row, 1), minor=True)
    ax_p.set_yticks(np.arange(-0.5, n_rows_pool, 1), minor=True)
    ax_p.grid(which="minor", color="white", lw=0.5)
    ax_p.tick_params(which="minor", length=0)
    ax_p.set_yticks(range(n_rows_pool), [f"page {i * pages_per_row}" for i in range(n_rows_pool)], fontsize=7)
    ax_p.set_xticks(range(0, pages_per_row, 8), [f"+{i}" for i in range(0, pages_per_row, 8)], fontsize=7)
    rest = cells - shown_pages
    counts = pages["owner"].value_counts()
    ax_p.set_title(
        f"Page pool ({snap.num_pages} pages of {snap.page_size} slot{'s' if snap.page_size > 1 else ''}"
        f"; {counts.get('free', 0)} free"
        + (f"; {_pages_range(shown_pages, cells - 1)} not shown, all free" if rest > 0 else "")
        + ")",
        loc="left",
        fontsize=10,
        weight="bold",
    )
    handles = [
        Patch(color=style.RESERVED, label="page 0: reserved"),
        Patch(color=style.FREE, label="free"),
        Patch(color=style.EVICTABLE, label="tree, evictable"),
        Patch(color=style.PROTECTED, label="tree, protected"),
        Patch(facecolor=style.PROTECTED, edgecolor=SHARED_EDGE, lw=1.2, label="shared by running requests (×readers)"),
    ]
    handles += [Patch(color=color_of[r], label=f"own: {r}") for r in rids[:8]]
    ax_p.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7.5, frameon=False)
    fig.labkit_snapshot = snap
    return fig


def describe_request(snap: KVSnapshot, rid: str, limit: int = 24) -> pd.DataFrame:
    """Token by token for one request: position, token text, KV slot, page, owner."""
    df = req_to_token_table(snap)
    df = df[df["rid"] == rid].head(limit).copy()
    df["text"] = [token_text(snap.tokenizer, [int(t)]) for t in df["token"]]
    return df[["position", "token", "text", "slot", "page", "owner"]]


def fragmentation(snap: KVSnapshot) -> pd.DataFrame:
    """Per live request: tokens held, pages its tokens touch, and the slots of those pages no token of
    it fills (internal fragmentation: only the partly filled last page wastes, at most page_size-1)."""
    P = snap.page_size
    rows = []
    for r in snap.requests:
        pages = {s // P for s in r.slots}
        rows.append(
            {
                "rid": r.rid,
                "tokens": len(r.slots),
                "pages": len(pages),
                "slots_in_pages": len(pages) * P,
                "unused_slots": len(pages) * P - len(r.slots),
            }
        )
    return pd.DataFrame(rows, columns=["rid", "tokens", "pages", "slots_in_pages", "unused_slots"])


def _pages_range(first: int, last: int) -> str:
    return f"page {first}" if first == last else f"pages {first}-{last}"
