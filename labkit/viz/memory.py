"""KV memory over a run: the pool split into free / evictable / protected / request-owned slots after
every step (StepRecord.pool), with evictions (from the step's TreeEvents) and retractions marked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from labkit.viz import style
from labkit.viz.run import Run

CATEGORIES = ("request_owned", "protected", "evictable", "free")  # bottom to top
LABELS = {
    "request_owned": "request-owned (running requests, not in the tree)",
    "protected": "protected (in the tree, locked)",
    "evictable": "evictable (in the tree, unlocked)",
    "free": "free",
}
COLORS = {
    "request_owned": style.REQUEST_OWNED,
    "protected": style.PROTECTED,
    "evictable": style.EVICTABLE,
    "free": style.FREE,
}


def memory_frame(source: Any) -> pd.DataFrame:
    """One row per step: the four categories (slots), total, evicted tokens and retracted rids."""
    run = Run.of(source)
    rows = []
    for s in run.steps:
        evicted = sum(e.num_tokens for e in run.tree_events(s.step) if e.kind == "evict")
        rows.append(
            {
                "step": s.step,
                "time": s.end - run.t0,
                **{c: getattr(s.pool, c) for c in CATEGORIES},
                "total": s.pool.total,
                "evicted_tokens": evicted,
                "retracted": list(s.retracted),
                "forward_mode": s.forward_mode,
            }
        )
    return pd.DataFrame(
        rows, columns=["step", "time", *CATEGORIES, "total", "evicted_tokens", "retracted", "forward_mode"]
    )


def draw_memory(
    source: Any, *, ax=None, title: str | None = None, highlight_step: int | None = None, show_free: bool = True
):
    """Stacked KV pool use per step. Returns the Figure; the stacked layers are in ax.collections
    with gids 'mem-<category>'."""
    run = Run.of(source)
    df = memory_frame(run)
    if ax is None:
        fig = style.new_figure(11, 3.6)
        ax = fig.subplots()
    fig = ax.figure
    if df.empty:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", transform=ax.transAxes)
        return fig
    # Each step holds its values from step-0.5 to step+0.5 (a bar-like step function).
    xs = np.repeat(df["step"].to_numpy(dtype=float), 2) + np.tile([-0.5, 0.5], len(df))
    base = np.zeros(len(xs))
    cats = CATEGORIES if show_free else CATEGORIES[:-1]
    for c in cats:
        ys = np.repeat(df[c].to_numpy(dtype=float), 2)
        ax.fill_between(xs, base, base + ys, color=COLORS[c], lw=0, gid=f"mem-{c}", label=LABELS[c])
        base = base + ys
    total = int(df["total"].iloc[0])
    ax.axhline(total, color="#333333", lw=0.8, ls="--")
    ax.text(xs[0], total, f" pool: {total} slots", va="bottom", fontsize=8)
    top = total * 1.22
    last_label, level = None, 0
    for _, row in df.iterrows():
        if row["evicted_tokens"]:
            ax.plot(row["step"], total * 1.035, marker="v", color=style.EVICTED, ms=7)
            # neighbouring labels alternate between two heights so they do not overlap
            level = 1 - level if last_label is not None and row["step"] - last_label < 0.025 * len(df) + 2 else 0
            ax.text(
                row["step"],
                total * (1.065 + 0.045 * level),
                f"-{row['evicted_tokens']}",
                ha="center",
                fontsize=7,
                color=style.EVICTED,
            )
            last_label = row["step"]
        if row["retracted"]:
            ax.axvline(row["step"], color="black", lw=1.2)
            ax.text(
                row["step"],
                total * 1.175,
                " retract " + ", ".join(row["retracted"]),
                fontsize=7.5,
                ha="left",
                va="center",
                weight="bold",
            )
    ax.set_ylim(0, top)
    ax.set_xlim(xs[0], xs[-1])
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("KV slots")
    handles = [Patch(color=COLORS[c], label=LABELS[c]) for c in reversed(cats)]
    handles += [
        ax.plot([], [], marker="v", color=style.EVICTED, ls="none", label="eviction (-tokens evicted)")[0],
        ax.plot([], [], color="black", lw=1.2, label="retraction")[0],
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    if highlight_step is not None:
        ax.axvline(highlight_step, color="black", lw=1.2, ls=":")
    ax.set_title(
        title or "KV memory after each step" + (f": {run.label}" if run.label else ""),
        loc="left",
        fontsize=11,
        weight="bold",
    )
    return fig
