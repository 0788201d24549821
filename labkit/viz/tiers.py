"""The KV cache's tiers over a run (--enable-hierarchical-cache): the device pool and the host pool
after every step (StepRecord.pool, StepRecord.host_pool), and the tokens that moved between them in
each step, from the step's TreeEvents (offload: device copy freed, host copy kept; load_back: host to
device; disk_read: disk to device; evict: gone from the tree; write_host: a device node copied to the
host; drop_host: a host copy freed).

The host tier's colours live here: the radix tree (labkit.viz.tree) draws host-only nodes and host
copies with them too."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from labkit.viz import style
from labkit.viz.memory import CATEGORIES as DEVICE_CATEGORIES
from labkit.viz.memory import COLORS as DEVICE_COLORS
from labkit.viz.memory import LABELS as DEVICE_LABELS
from labkit.viz.run import Run

HOST_ONLY = "#9d8ec7"  # KV in host memory only (the node is off the device)
HOST_COPY = "#d9d0ee"  # a host copy of a node that is on the device too
DISK = "#8d6e63"  # KV read back from the disk tier

HOST_CATEGORIES = ("backed_up", "host_only", "free")  # bottom to top
HOST_LABELS = {
    "backed_up": "host copies of device nodes",
    "host_only": "host only (off the device)",
    "free": "free",
}
HOST_COLORS = {"backed_up": HOST_COPY, "host_only": HOST_ONLY, "free": style.FREE}

# Tokens moved in a step, by TreeEvent kind (the frame's columns).
MOVES = {
    "write_host": "written_to_host",
    "offload": "offloaded",
    "load_back": "loaded_back",
    "disk_read": "read_from_disk",
    "evict": "evicted",
    "drop_host": "dropped_from_host",
}


def tier_frame(source: Any) -> pd.DataFrame:
    """One row per step: the device pool's categories (slots), the host pool's (`host_` columns), and
    the tokens each kind of move took in the step (columns of MOVES). ValueError for a run without
    a host tier."""
    run = Run.of(source)
    if run.steps and all(s.host_pool is None for s in run.steps):
        raise ValueError("no host tier in this run: Engine(enable_hierarchical_cache=True, enable_trace=True)")
    rows = []
    for s in run.steps:
        moved = dict.fromkeys(MOVES.values(), 0)
        for e in run.tree_events(s.step):
            if e.kind in MOVES:
                moved[MOVES[e.kind]] += e.num_tokens
        host = s.host_pool
        rows.append(
            {
                "step": s.step,
                "forward_mode": s.forward_mode,
                **{c: getattr(s.pool, c) for c in DEVICE_CATEGORIES},
                "total": s.pool.total,
                **{f"host_{c}": getattr(host, c) if host else 0 for c in HOST_CATEGORIES},
                "host_total": host.total if host else 0,
                **moved,
            }
        )
    columns = ["step", "forward_mode", *DEVICE_CATEGORIES, "total"]
    columns += [*(f"host_{c}" for c in HOST_CATEGORIES), "host_total", *MOVES.values()]
    return pd.DataFrame(rows, columns=columns)


def _stack(ax, steps: np.ndarray, layers: list[tuple[np.ndarray, str, str, str]]) -> None:
    """Stacked step functions: each step holds its values from step-0.5 to step+0.5."""
    xs = np.repeat(steps.astype(float), 2) + np.tile([-0.5, 0.5], len(steps))
    base = np.zeros(len(xs))
    for values, color, gid, label in layers:
        ys = np.repeat(values.astype(float), 2)
        ax.fill_between(xs, base, base + ys, color=color, lw=0, gid=gid, label=label)
        base = base + ys


def _marks(ax, df: pd.DataFrame, top: float) -> None:
    """Triangles above the device pool at each step that offloaded (to the host) or evicted (gone)."""
    for col, color, level in (("offloaded", HOST_ONLY, 0), ("evicted", style.EVICTED, 1)):
        for step, tokens in zip(df["step"], df[col]):
            if tokens:
                y = top * (1.04 + 0.07 * level)
                ax.plot(step, y, marker="v", color=color, ms=7, ls="none", gid=f"mark-{col}")
                ax.text(step + 0.35, y, f"−{tokens}", ha="left", va="center", fontsize=7, color=color)


def draw_tiers(source: Any, *, title: str | None = None):
    """Three panels over the steps of a run: the device pool (as draw_memory) with a mark at each
    offload (device copy freed, the host keeps the KV) and each eviction (gone from the tree); the
    KV copied between the tiers in each step (up: to the device, loaded back from the host or read
    from disk; down: written to the host); the host pool. Returns the Figure; the stacked layers have
    gids 'device-<category>' and 'host-<category>', the bars 'copy-<column>', the marks 'mark-<column>'."""
    run = Run.of(source)
    df = tier_frame(run)
    fig = style.new_figure(11, 6.6)
    dev, copies, host = fig.subplots(3, 1, sharex=True, height_ratios=[3, 1.6, 2.2])
    if df.empty:
        dev.text(0.5, 0.5, "no steps recorded", ha="center", transform=dev.transAxes)
        return fig
    steps = df["step"].to_numpy()

    layers = [(df[c].to_numpy(), DEVICE_COLORS[c], f"device-{c}", DEVICE_LABELS[c]) for c in DEVICE_CATEGORIES]
    _stack(dev, steps, layers)
    total = int(df["total"].iloc[0])
    dev.axhline(total, color="#333333", lw=0.8, ls="--")
    _marks(dev, df, total)
    dev.set_ylim(0, total * 1.2)
    dev.text(steps[0] - 0.5, total, f" device pool: {total} slots", va="bottom", fontsize=8)
    dev.set_ylabel("device KV slots")
    handles = [Patch(color=DEVICE_COLORS[c], label=DEVICE_LABELS[c]) for c in reversed(DEVICE_CATEGORIES)]
    handles += [
        dev.plot([], [], marker="v", color=HOST_ONLY, ls="none", label="offloaded to host (−tokens freed)")[0],
        dev.plot([], [], marker="v", color=style.EVICTED, ls="none", label="evicted from the tree (−tokens)")[0],
    ]
    dev.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)

    # Copies: to the device above zero (stacked), to the host below; a bar only where tokens moved.
    sides = [
        (1, [("loaded_back", HOST_ONLY, "loaded back from host"), ("read_from_disk", DISK, "read from disk")]),
        (-1, [("written_to_host", HOST_COPY, "written to host")]),
    ]
    for sign, cols in sides:
        base = np.zeros(len(df))
        for col, color, _ in cols:
            values = df[col].to_numpy(dtype=float)
            some = values > 0
            copies.bar(
                steps[some],
                sign * values[some],
                bottom=sign * base[some],
                width=0.8,
                color=color,
                edgecolor="#555555",
                lw=0.5,
                gid=f"copy-{col}",
            )
            base = base + values
    copies.axhline(0, color="#333333", lw=0.6)
    peak = max(1.0, float(df[["loaded_back", "read_from_disk"]].sum(axis=1).max()))
    trough = max(1.0, float(df["written_to_host"].max()))
    copies.set_ylim(-trough * 1.15, peak * 1.15)
    copies.set_ylabel("KV copied (tokens)\n+ to device, − to host")
    handles = [Patch(facecolor=c, edgecolor="#555555", lw=0.5, label=lab) for _, cols in sides for _, c, lab in cols]
    copies.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)

    layers = [(df[f"host_{c}"].to_numpy(), HOST_COLORS[c], f"host-{c}", HOST_LABELS[c]) for c in HOST_CATEGORIES]
    _stack(host, steps, layers)
    host_total = int(df["host_total"].max())
    host.axhline(host_total, color="#333333", lw=0.8, ls="--")
    host.set_ylim(0, max(host_total, 1) * 1.12)
    host.text(steps[0] - 0.5, host_total, f" host pool: {host_total} slots", va="bottom", fontsize=8)
    host.set_ylabel("host KV slots")
    handles = [Patch(color=HOST_COLORS[c], label=HOST_LABELS[c]) for c in reversed(HOST_CATEGORIES)]
    host.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    host.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    host.set_xlabel("scheduler step")
    moved = f"{int(df['written_to_host'].sum())} tokens written to the host, {int(df['loaded_back'].sum())} loaded back"
    if df["read_from_disk"].any():
        moved += f", {int(df['read_from_disk'].sum())} read from disk"
    label = f": {run.label}" if run.label else ""
    style.figure_title(fig, title or f"KV tiers after each step{label} ({moved})")
    return fig
