"""Figures of a recorded packed step (labkit.viz.packed.PackedStep):

draw_packed_batch(step, tokenizer)    # the packed row, and a padded batch of the same requests
draw_req_to_token(step)               # each request's req_to_token row: cached prefix, new slots
draw_attention_mask(step)             # query tokens x KV slots: block-diagonal, causal per request
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labkit.viz import style
from labkit.viz.packed import PackedStep
from labkit.viz.run import token_text

PAD = "#d9d9d9"  # a padded batch's pad tokens
NOT_READ = "#ffffff"
PREFIX_ALPHA = 0.3  # a request's cached prefix: its colour, lightened
OWN_EDGE = "#111111"  # the query token's own KV slot (its out_cache_loc)
SHARED_TEXT = "#d08c00"  # the number of a slot two requests read (a shared prefix), in amber


def _color(step: PackedStep, i: int) -> str:
    return style.request_color(step.req_pool_indices[i])


def _bounds(lens: Sequence[int]) -> list[int]:
    return [int(x) for x in np.cumsum([0, *lens])]


def draw_packed_batch(step: PackedStep, tokenizer: Any = None, *, title: str | None = None) -> Figure:
    """Top: the forward's input as the model sees it, one row of `num_tokens` cells (Rectangle gid
    "token:<t>"), coloured by request, with each token's position and out_cache_loc below. Bottom: a
    padded batch of the same requests, one row per request padded to the longest (gid "pad:<i>:<k>"
    for a pad cell)."""
    T, bs, longest = step.num_tokens, step.batch_size, max(step.extend_lens)
    cell = min(0.62, 10.5 / max(T, 1))
    fig = style.new_figure(2.0 + T * cell, 1.9 + 0.42 * bs)
    ax = fig.subplots()
    fs = 7 if cell > 0.45 else 5.5
    rows = step.token_rows
    show_text = cell >= 0.3
    rotation = 90 if cell < 0.45 else 0

    def label(t: int, x: float, y: float) -> None:
        if show_text:
            text = token_text(tokenizer, [step.input_ids[t]], limit=7)
            ax.text(x, y, text, ha="center", va="center", fontsize=fs, color="white", rotation=rotation)

    for t in range(T):
        ax.add_patch(
            Rectangle((t, 0), 1, 1, facecolor=_color(step, rows[t]), edgecolor="white", lw=1, gid=f"token:{t}")
        )
        label(t, t + 0.5, 0.5)
        ax.text(t + 0.5, -0.35, str(step.positions[t]), ha="center", va="center", fontsize=fs)
        ax.text(t + 0.5, -0.8, str(step.out_cache_loc[t]), ha="center", va="center", fontsize=fs)
    for name, y in (("input_ids", 0.5), ("positions", -0.35), ("out_cache_loc", -0.8)):
        ax.text(-0.2, y, name, ha="right", va="center", fontsize=8)
    bounds = _bounds(step.extend_lens)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        ax.plot([a + 0.08, b - 0.08], [1.15, 1.15], color=_color(step, i), lw=2)
        ax.text((a + b) / 2, 1.25, step.rids[i], ha="center", va="bottom", fontsize=7.5, color=_color(step, i))
    ax.text(0, 1.75, f"packed: {T} tokens in one row, no padding", fontsize=9, weight="bold", va="bottom")
    top = -1.8  # the padded batch below
    pads = bs * longest - T
    ax.text(0, top + 0.25, f"padded: {bs} rows x {longest} = {bs * longest} tokens, {pads} of them padding",
            fontsize=9, weight="bold", va="bottom")  # fmt: skip
    for i in range(bs):
        y = top - (i + 1) * 0.8
        for k in range(longest):
            real = k < step.extend_lens[i]
            ax.add_patch(
                Rectangle(
                    (k, y), 1, 0.7, facecolor=_color(step, i) if real else PAD, edgecolor="white", lw=1,
                    hatch=None if real else "///", gid=None if real else f"pad:{i}:{k}",
                )
            )  # fmt: skip
            if real:
                label(bounds[i] + k, k + 0.5, y + 0.35)
        ax.text(-0.2, y + 0.35, step.rids[i], ha="right", va="center", fontsize=8, color=_color(step, i))
    ax.set_xlim(-3.2, T + 0.1)
    ax.set_ylim(top - bs * 0.8 - 0.2, 2.3)
    ax.axis("off")
    ax.set_title(title or f"A {step.forward_mode} forward's input", loc="left", fontsize=10, weight="bold")
    return fig


def draw_req_to_token(step: PackedStep, *, title: str | None = None) -> Figure:
    """Each batch row's row of req_to_token as the forward read it: one cell per position, the KV slot
    number inside; the cached prefix light (gid "prefix:<i>:<pos>"), the slots this forward writes
    (out_cache_loc) in full colour (gid "new:<i>:<pos>")."""
    longest = max(step.seq_lens)
    cell = min(0.34, 11.0 / longest)
    fig = style.new_figure(1.8 + longest * cell, 0.9 + 0.36 * step.batch_size)
    ax = fig.subplots()
    fs = 6 if cell >= 0.26 else 5
    for i, row in enumerate(step.req_to_token):
        color = _color(step, i)
        for pos, slot in enumerate(row):
            new = pos >= step.prefix_lens[i]
            face = color if new else to_rgba(color, PREFIX_ALPHA)
            kind = "new" if new else "prefix"
            ax.add_patch(
                Rectangle((pos, i), 1, 0.9, facecolor=face, edgecolor="white", lw=0.6, gid=f"{kind}:{i}:{pos}")
            )
            ax.text(pos + 0.5, i + 0.45, str(slot), ha="center", va="center", fontsize=fs,
                    color="white" if new else "black", rotation=90 if cell < 0.2 else 0)  # fmt: skip
    ax.set_yticks([i + 0.45 for i in range(step.batch_size)])
    ax.set_yticklabels([f"{rid}: row {p}" for rid, p in zip(step.rids, step.req_pool_indices)], fontsize=8)
    for i, tick in enumerate(ax.get_yticklabels()):
        tick.set_color(_color(step, i))
    ax.set_xlim(0, longest)
    ax.set_ylim(step.batch_size, -0.1)
    ticks = range(0, longest, 5)
    ax.set_xticks([p + 0.5 for p in ticks], [str(p) for p in ticks], fontsize=7)
    ax.set_xlabel("position in the request", fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    grey = "#777777"
    handles = [
        Patch(facecolor=to_rgba(grey, PREFIX_ALPHA), label="prefix: KV already in the pool"),
        Patch(facecolor=grey, label="new: written by this forward (out_cache_loc)"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.18 - 0.3 / step.batch_size), ncol=2,
              fontsize=7.5, frameon=False)  # fmt: skip
    ax.set_title(title or f"req_to_token rows of a {step.forward_mode} forward: the KV slot of every position",
                 loc="left", fontsize=10, weight="bold")  # fmt: skip
    return fig


COLUMNS = ("rows", "slots", "sorted")


def draw_attention_mask(
    step: PackedStep, tokenizer: Any = None, *, columns: str = "rows", title: str | None = None
) -> Figure:
    """The attention of one forward as a mask: a row per packed query token, a column per KV slot
    read. `columns`: "rows" lays the requests' req_to_token rows side by side (a slot in two rows
    appears in both), "slots" lists every slot once in that order, "sorted" once by slot number; a
    slot in two requests' rows has its number in amber. A cell is coloured when the query reads that column: its
    request's colour, light for a slot of the cached prefix, full for a slot this forward writes;
    the query's own slot (its out_cache_loc) is outlined (gid "own:<t>"). `fig.labkit_mask` is the
    bool mask drawn, [num_tokens, columns]."""
    if columns not in COLUMNS:
        raise ValueError(f"columns must be one of {COLUMNS}, got {columns!r}")
    rows = step.token_rows
    if columns == "rows":  # column j: (slot, request, position)
        cols = [(s, i, pos) for i, row in enumerate(step.req_to_token) for pos, s in enumerate(row)]
        mask = torch.tensor(
            [[i == rows[t] and pos <= step.positions[t] for _, i, pos in cols] for t in range(step.num_tokens)]
        )
        own = [next(j for j, (_, i, pos) in enumerate(cols) if i == rows[t] and pos == step.positions[t])
               for t in range(step.num_tokens)]  # fmt: skip
        slots = [s for s, _, _ in cols]
    else:
        slots = sorted(step.kv_slots) if columns == "sorted" else step.kv_slots
        mask = step.mask(slots)
        own = [slots.index(s) for s in step.out_cache_loc]
    T, S = mask.shape
    new_slots = set(step.out_cache_loc)
    image = np.ones((T, S, 4))
    for t in range(T):
        color = _color(step, rows[t])
        for c in mask[t].nonzero().flatten().tolist():
            image[t, c] = to_rgba(color, 1.0 if slots[c] in new_slots else PREFIX_ALPHA)
    cw = min(0.16, 10.5 / S)
    rh = min(0.2, max(0.12, 6.0 / T))
    fig = style.new_figure(2.6 + S * cw, 1.9 + T * rh)
    ax = fig.subplots()
    ax.imshow(image, aspect="auto", interpolation="nearest")
    for t, c in enumerate(own):
        ax.add_patch(Rectangle((c - 0.5, t - 0.5), 1, 1, fill=False, edgecolor=OWN_EDGE, lw=0.9, gid=f"own:{t}"))
    for b in _bounds(step.extend_lens)[1:-1]:
        ax.axhline(b - 0.5, color="#555555", lw=0.8)
    if columns == "rows":
        for b in _bounds(step.seq_lens)[1:-1]:
            ax.axvline(b - 0.5, color="#555555", lw=0.8)
    ax.set_xticks(np.arange(-0.5, S, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, T, 1), minor=True)
    ax.grid(which="minor", color="#e6e6e6", lw=0.4)
    ax.tick_params(which="minor", length=0)
    every = max(1, int(np.ceil(S / 110)))
    ax.set_xticks(range(0, S, every), [str(slots[c]) for c in range(0, S, every)], fontsize=5, rotation=90)
    readers = [s for row in step.req_to_token for s in set(row)]
    shared = {s for s in set(readers) if readers.count(s) > 1}
    for tick, c in zip(ax.get_xticklabels(), range(0, S, every)):
        if slots[c] in shared:
            tick.set_color(SHARED_TEXT)
            tick.set_fontweight("bold")
    labels = [
        f"{step.rids[rows[t]]} {step.positions[t]:>3} {token_text(tokenizer, [step.input_ids[t]], limit=10)!r}"
        for t in range(T)
    ]
    ax.set_yticks(range(T), labels, fontsize=6.5 if rh >= 0.15 else 5.5)
    for t, tick in enumerate(ax.get_yticklabels()):
        tick.set_color(_color(step, rows[t]))
    order = {
        "rows": "the requests' req_to_token rows side by side",
        "slots": "each once, in the order of the req_to_token rows",
        "sorted": "each once, sorted by slot number",
    }[columns]
    ax.set_xlabel(f"KV slot read ({S} columns: {order})", fontsize=8)
    ax.set_ylabel("query token: request, position, text", fontsize=8)
    grey = "#777777"
    handles = [
        Patch(facecolor=to_rgba(grey, PREFIX_ALPHA), label="reads a slot of the cached prefix"),
        Patch(facecolor=grey, label="reads a slot this forward writes"),
        Patch(facecolor=NOT_READ, edgecolor="#999999", label="does not read"),
        Patch(facecolor="none", edgecolor=OWN_EDGE, label="the query's own slot (out_cache_loc)"),
    ]
    if shared:
        handles.append(Patch(facecolor=SHARED_TEXT, label="slot number in amber: read by two requests"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=5, fontsize=7, frameon=False)
    ax.set_title(
        title or f"{step.forward_mode} forward: {T} query tokens x {S} KV columns, {int(mask.sum())} pairs attended",
        loc="left", fontsize=10, weight="bold", pad=18,
    )  # fmt: skip
    fig.labkit_mask = mask  # type: ignore[attr-defined]  # a plain attribute for tests, as kvpool does
    return fig
