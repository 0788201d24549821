"""Scheduling-policy views (notebook 05): the comparison of a bench_policies(...) table (medians and
spread of repeated runs beside the deterministic counts), each policy's order of one waiting queue,
and the KV memory of several runs on shared axes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labkit.viz import style
from labkit.viz.memory import draw_memory
from labkit.viz.run import Run

# (column, panel title, how to read it). The top row is counted: it follows from the scheduling
# decisions alone (the same in every repeat). The bottom row is timed: it varies from run to run, so
# a summary of repeats draws its median and spread.
METRICS = [
    ("prefill_tokens", "prompt tokens computed (prefill)", "lower is better; counted"),
    ("cache_hit_rate", "cache hit rate (cached / prompt tokens)", "higher is better; counted"),
    ("forward_passes", "forward passes (steps that ran a batch)", "lower is better; counted"),
    ("total_tok_s", "throughput (prompt + output tokens / s)", "higher is better; timed"),
    ("ttft_mean_s", "mean time to first token (s)", "lower is better; timed"),
    ("e2e_mean_s", "mean end-to-end latency (s)", "lower is better; timed"),
]
WORKLOAD_COLORS = ["#457b9d", "#e76f51", "#2a9d8f", "#8338ec"]


def group_colors(groups: dict[str, Any]) -> dict[Any, str]:
    """A colour per group (rid -> group; None: no group), in sorted order of the group names."""
    names = sorted({g for g in groups.values() if g is not None}, key=str)
    return {g: style.request_color(i) for i, g in enumerate(names)}


def _label(col: str, v: float, top: float) -> str:
    if col == "cache_hit_rate":
        return f"{v:.0%}"
    return f"{v:.2f}" if top < 10 else f"{v:.0f}"


def draw_policy_comparison(df: pd.DataFrame, metrics=METRICS, title: str | None = None) -> Figure:
    """Grouped bars: one panel per metric (three per row), policies on x, one bar per workload.
    `df` is a bench_policies(...) table with one run per (workload, policy), or a
    policy_summary(...) of repeated runs: then a timed metric's bar is the median of the repeats
    and its whisker spans their min to max (columns `<metric>_min`, `<metric>_max`). Metrics
    missing from `df` are left out. Returns the Figure."""
    metrics = [m for m in metrics if m[0] in df]
    workloads = list(dict.fromkeys(df["workload"]))
    policies = list(dict.fromkeys(df["policy"]))
    cols = 3 if len(metrics) > 4 else 2
    rows = math.ceil(len(metrics) / cols)
    fig = style.new_figure(4.4 * cols, 3.0 * rows + 0.4)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    width = 0.8 / len(workloads)
    x = np.arange(len(policies))
    repeats = f"{int(df['repeats'].max())} runs" if "repeats" in df else "the runs"
    for ax, (col, label, better) in zip(axes, metrics):
        spread = f"{col}_min" in df and f"{col}_max" in df
        for i, w in enumerate(workloads):
            sub = df[df["workload"] == w].set_index("policy").reindex(policies)
            values = sub[col].to_numpy(dtype=float)
            yerr = None
            if spread:
                lo, hi = sub[f"{col}_min"].to_numpy(dtype=float), sub[f"{col}_max"].to_numpy(dtype=float)
                yerr = np.vstack([values - lo, hi - values])
            bars = ax.bar(
                x + (i - (len(workloads) - 1) / 2) * width,
                values,
                width=width,
                color=WORKLOAD_COLORS[i % len(WORKLOAD_COLORS)],
                label=w,
                yerr=yerr,
                error_kw={"ecolor": "#333333", "elinewidth": 1, "capsize": 2.5},
                gid=f"bars-{col}-{w}",
            )
            top = float(np.nanmax(values)) if len(values) else 0.0
            for j, (b, v) in enumerate(zip(bars, values)):
                if np.isnan(v):
                    continue
                y = v + (yerr[1][j] if yerr is not None else 0.0)  # above the whisker
                ax.text(b.get_x() + b.get_width() / 2, y, _label(col, v, top), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, policies, fontsize=8)
        note = f"\nbar: median of {repeats}, whisker: min to max" if spread else ""
        ax.set_title(f"{label}\n({better}){note}", fontsize=9, loc="left")
        ax.margins(y=0.15)
        ax.grid(axis="y", color="#eeeeee")
        ax.set_axisbelow(True)
    for ax in axes[len(metrics) :]:  # panels left over
        ax.set_visible(False)
    axes[0].legend(title="workload", fontsize=8, title_fontsize=8, frameon=False)
    if title:
        style.figure_title(fig, title, fontsize=12)
    return fig


def draw_policy_orders(orders: pd.DataFrame, groups: dict[str, Any], title: str | None = None) -> Figure:
    """One column per policy of a policy_orders(...) table, its requests top (taken first) to
    bottom, each cell coloured by the request's group (`groups`: rid -> group) and labelled with the
    rid and its cached prefix length. A policy that keeps a group together shows as a block of one
    colour. Returns the Figure; each cell is a Rectangle with gid 'order-<policy>-<position>'."""
    color = group_colors(groups)
    n_rows, n_cols = len(orders), len(orders.columns)
    fig = style.new_figure(1.55 * n_cols + 1.9, 0.3 * n_rows + 1.1)
    ax = fig.subplots()
    for c, policy in enumerate(orders.columns):
        for r, cell in enumerate(orders[policy]):
            rid, _, rest = str(cell).partition(" (")
            group = groups.get(rid)
            face = color.get(group, "#bbbbbb")
            ax.add_patch(Rectangle((c + 0.04, r + 0.06), 0.92, 0.88, color=face, lw=0, gid=f"order-{policy}-{r}"))
            cached = rest.rstrip(")")
            text = f"{rid}  ({cached})" if cached else rid
            ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=8, color="white", weight="bold")
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_xticks(np.arange(n_cols) + 0.5, list(orders.columns), fontsize=9)
    ax.xaxis.tick_top()
    ax.set_yticks(np.arange(n_rows) + 0.5, [str(i) for i in range(n_rows)], fontsize=8)
    ax.set_ylabel("position in the order (0: taken first)", fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [Patch(color=c, label=str(g)) for g, c in color.items()]
    ax.legend(
        handles=handles,
        title="group\n(number: cached\nprefix tokens)",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title_fontsize=8,
        frameon=False,
    )
    ax.set_title(title or "The order each policy takes the waiting queue in", loc="left", fontsize=11, weight="bold")
    return fig


def draw_memories(sources: list[Any], titles: list[str] | None = None) -> Figure:
    """draw_memory for several runs, one above the other on one x scale (scheduler steps) and one y
    scale (KV slots), so a run that ends sooner or evicts more shows it. Returns the Figure."""
    runs = [Run.of(s) for s in sources]
    titles = titles or [f"KV memory: {r.label}" if r.label else f"run {i}" for i, r in enumerate(runs)]
    fig = style.new_figure(11, 3.0 * len(runs) + 0.4)
    axes = fig.subplots(len(runs), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for run, ax, t in zip(runs, axes, titles):
        draw_memory(run, ax=ax, title=t)
    # draw_memory set each run's own range; the shared axes take the widest (the pools may differ)
    steps = [s.step for r in runs for s in r.steps] or [1]
    axes[0].set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    axes[0].set_ylim(0, 1.22 * max((s.pool.total for r in runs for s in r.steps), default=1))
    for ax in axes[:-1]:
        ax.set_xlabel("")
    for ax in axes[1:]:
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
    return fig


def mark_groups(fig: Figure, groups: dict[str, Any]) -> Figure:
    """Colour every y tick label that is a rid in `groups` (rid -> group) by its group, with the
    colours of draw_policy_orders: on a timeline in schedule order (draw_timelines(...,
    row_order="schedule")), a policy that keeps a group together shows as a block of one colour.
    Returns the same Figure."""
    color = group_colors(groups)
    for ax in fig.axes:
        for tick in ax.get_yticklabels():
            group = groups.get(tick.get_text())
            if group in color:
                tick.set_color(color[group])
                tick.set_fontweight("bold")
    return fig
