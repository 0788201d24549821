"""Scheduling-policy comparison plots from a bench_policies(...) table."""

from __future__ import annotations

import numpy as np
import pandas as pd

from labkit.viz import style

METRICS = [
    ("total_tok_s", "throughput (prompt + output tokens / s)", "higher is better"),
    ("cache_hit_rate", "cache hit rate (cached / prompt tokens)", "higher is better"),
    ("ttft_mean_s", "mean time to first token (s)", "lower is better"),
    ("e2e_mean_s", "mean end-to-end latency (s)", "lower is better"),
]
WORKLOAD_COLORS = ["#457b9d", "#e76f51", "#2a9d8f", "#8338ec"]


def draw_policy_comparison(df: pd.DataFrame, metrics=METRICS, title: str | None = None):
    """Grouped bars: one panel per metric, policies on x, one bar per workload. Returns the Figure."""
    workloads = list(dict.fromkeys(df["workload"]))
    policies = list(dict.fromkeys(df["policy"]))
    fig = style.new_figure(12, 6.2)
    axes = fig.subplots(2, 2).flat
    width = 0.8 / len(workloads)
    x = np.arange(len(policies))
    for ax, (col, label, better) in zip(axes, metrics):
        for i, w in enumerate(workloads):
            sub = df[df["workload"] == w].set_index("policy").reindex(policies)
            bars = ax.bar(
                x + (i - (len(workloads) - 1) / 2) * width,
                sub[col],
                width=width,
                color=WORKLOAD_COLORS[i % len(WORKLOAD_COLORS)],
                label=w,
            )
            fmt = "{:.0%}" if col == "cache_hit_rate" else "{:.2f}" if sub[col].max() < 10 else "{:.0f}"
            for b, v in zip(bars, sub[col]):
                if not np.isnan(v):
                    ax.text(
                        b.get_x() + b.get_width() / 2,
                        b.get_height(),
                        fmt.format(v),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(x, policies)
        ax.set_title(f"{label}\n({better})", fontsize=9.5, loc="left")
        ax.margins(y=0.15)
        ax.grid(axis="y", color="#eeeeee")
        ax.set_axisbelow(True)
    axes = fig.axes
    axes[0].legend(title="workload", fontsize=8, title_fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=12, weight="bold")
    return fig
