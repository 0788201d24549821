"""Why is this request still waiting? Per step and per waiting request: the limit that held it back
(StepRecord.blocked, the PrefillAdder's verdict) and the prefix it matched in the radix cache (the
step's snapshot of the waiting queue)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.patches import Patch

from labkit.viz import style
from labkit.viz.run import Run

_PREFIXES = [
    ("running-request cap", "running-request cap"),
    ("prefill token budget", "prefill token budget"),
    ("chunk budget", "chunk budget"),
    ("kv memory", "KV memory"),
    ("a request is being chunk-prefilled", "chunked prefill in progress"),
    ("queued behind", "queued behind another"),
]


def block_category(reason: str | None) -> str:
    """The budget a PrefillAdder reason string names (see style.BLOCK_COLORS)."""
    if reason is None:
        return "retracted this step"
    for prefix, cat in _PREFIXES:
        if reason.startswith(prefix):
            return cat
    return "other"


def waiting_frame(source: Any) -> pd.DataFrame:
    """One row per (step, waiting request): why it waited after that step and its prefix match (on
    the device: prefix_len; below it in the host or disk tier: host_prefix_len).
    Requests with a reason come from StepRecord.blocked; a request that sits in the queue without one
    was put back by a retraction during the step."""
    run = Run.of(source)
    rows = []
    for s in run.steps:
        snap = run.snapshot(s.step)
        states = {w.rid: w for w in snap.waiting} if snap is not None else {}
        for rid in [*s.blocked, *[r for r in states if r not in s.blocked]]:
            w = states.get(rid)
            reason = s.blocked.get(rid)
            rows.append(
                {
                    "step": s.step,
                    "rid": rid,
                    "category": block_category(reason),
                    "reason": reason if reason is not None else "retracted: back in the queue",
                    "prefix_len": w.prefix_len if w is not None else None,
                    "host_prefix_len": w.host_prefix_len if w is not None else None,
                    "input_len": w.input_len if w is not None else None,
                    "retractions": w.retract_count if w is not None else None,
                }
            )
    columns = ["step", "rid", "category", "reason", "prefix_len", "host_prefix_len", "input_len", "retractions"]
    df = pd.DataFrame(rows, columns=columns)
    df["prefix_len"] = df["prefix_len"].astype("Int64")
    df["host_prefix_len"] = df["host_prefix_len"].astype("Int64")
    df["input_len"] = df["input_len"].astype("Int64")
    return df


def waiting_table(source: Any, step: int) -> pd.DataFrame:
    """The waiting requests after `step`, why each waits, and how much of it the cache holds."""
    df = waiting_frame(source)
    df = df[df["step"] == step].drop(columns=["step"]).reset_index(drop=True)

    def match(row) -> str:
        if pd.isna(row["prefix_len"]):
            return "not matched yet" if not pd.isna(row["input_len"]) else ""
        host = row["host_prefix_len"]
        below = f" (+{host} in the host or disk tier)" if not pd.isna(host) and host else ""
        return f"{row['prefix_len']} of {row['input_len']} tokens cached{below}"

    df["prefix_match"] = [match(r) for _, r in df.iterrows()]
    return df[["rid", "category", "reason", "prefix_match", "retractions"]]


def draw_waiting(source: Any, *, ax=None, title: str | None = None, highlight_step: int | None = None):
    """Requests (rows) x steps (columns): the colour of a cell is the limit that kept the request
    waiting after that step; a thin line marks the steps where it was in the batch."""
    run = Run.of(source)
    df = waiting_frame(run)
    waiting_rids = set(df["rid"])
    rids = [r for r in run.rids if r in waiting_rids] or run.rids
    row_of = {rid: i for i, rid in enumerate(rids)}
    if ax is None:
        fig = style.new_figure(11, max(2.0, 0.27 * len(rids) + 1.1))
        ax = fig.subplots()
    fig = ax.figure
    for _, r in df.iterrows():
        if r["rid"] in row_of:
            ax.barh(
                row_of[r["rid"]],
                1,
                left=r["step"] - 0.5,
                height=0.78,
                color=style.BLOCK_COLORS[r["category"]],
                gid=f"wait-{r['step']}-{r['rid']}",
            )
    for c in run.cells:
        if c.rid in row_of and c.phase in ("prefill", "decode"):
            ax.plot([c.step - 0.5, c.step + 0.5], [row_of[c.rid]] * 2, color=style.PHASE_COLORS[c.phase], lw=2)
    ax.set_yticks(range(len(rids)), rids, fontsize=8)
    ax.set_ylim(len(rids) - 0.4, -0.6)
    if run.steps:
        ax.set_xlim(run.steps[0].step - 0.5, run.steps[-1].step + 0.5)
    ax.set_xlabel("scheduler step")
    ax.grid(axis="x", color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)
    present = set(df["category"])
    cats = [c for c in style.BLOCK_COLORS if c in present]
    handles = [Patch(color=style.BLOCK_COLORS[c], label=c) for c in cats]
    handles += [
        ax.plot([], [], color=style.PHASE_COLORS["prefill"], lw=2, label="in the batch: prefill")[0],
        ax.plot([], [], color=style.PHASE_COLORS["decode"], lw=2, label="in the batch: decode")[0],
    ]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
        title="held back by",
        title_fontsize=8,
        alignment="left",
    )
    if highlight_step is not None:
        ax.axvline(highlight_step, color="black", lw=1.2, ls=":")
    ax.set_title(
        title or "Why is this request still waiting?" + (f" ({run.label})" if run.label else ""),
        loc="left",
        fontsize=11,
        weight="bold",
    )
    return fig
