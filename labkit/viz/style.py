"""One palette for every labkit figure, so a colour means the same thing in each view."""

from __future__ import annotations

from matplotlib.figure import Figure

# Figures show at DISPLAY_DPI CSS pixels per inch, rendered with PIXEL_DENSITY image pixels per CSS
# pixel: small labels stay sharp on high-density screens and when zoomed (at 90 dpi they blurred).
DISPLAY_DPI = 90
PIXEL_DENSITY = 2

# KV memory owners (memory chart, page pool, radix tree)
FREE = "#eeeeee"
EVICTABLE = "#8ecae6"  # cached in the tree, no running request uses it
PROTECTED = "#ffb703"  # cached in the tree, locked by a running request
REQUEST_OWNED = "#e76f51"  # held by a running request, not (yet) in the tree
RESERVED = "#444444"

# Tree change highlights
INSERTED = "#2a9d8f"
SPLIT = "#9b5de5"
EVICTED = "#e63946"

# Request phases (timeline)
PHASE_COLORS = {
    "queued": "#d9d9d9",
    "prefill": "#457b9d",
    "decode": "#52b788",
    "stalled": "#ffd166",
}
MODE_COLORS = {"EXTEND": "#457b9d", "DECODE": "#52b788", "MIXED": "#8d6cab", "IDLE": "#bbbbbb"}

# The ten stations, by number; 5 (waiting for a batch) is grey like "queued" above. No other station
# takes a phase's or mode's colour: blue means a prefill (extend) and green a decode in every view.
STATION_COLORS = {
    1: "#1d3557", 2: "#6d597a", 3: "#b56576", 4: "#e9c46a", 5: "#c8c8c8",
    6: "#222222", 7: "#7f5539", 8: "#e76f51", 9: "#bc6c25", 10: "#2a9d8f",
}  # fmt: skip

# Why a request waits (categories of StepRecord.blocked)
BLOCK_COLORS = {
    "running-request cap": "#6d597a",
    "prefill token budget": "#b56576",
    "chunk budget": "#e56b6f",
    "KV memory": "#d62828",
    "chunked prefill in progress": "#eaac8b",
    "queued behind another": "#adb5bd",
    "retracted this step": "#000000",
    "other": "#8d99ae",
}

# Distinct colours for requests (page pool, req-to-token table)
REQUEST_PALETTE = [
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f00",
    "#1f3a93",
    "#ff7f0e",
    "#006d5b",
    "#c51b7d",
    "#5e3c99",
]


def new_figure(width: float, height: float, **kwargs) -> Figure:
    """A figure not registered with pyplot: returned, displayed by the notebook, never leaked."""
    return Figure(figsize=(width, height), layout=kwargs.pop("layout", "constrained"), **kwargs)


def figure_title(fig: Figure, text: str, fontsize: float = 10, weight: str = "bold") -> None:
    """The figure's title, at its top left like every figure of labkit.viz."""
    fig.suptitle(text, x=0.01, ha="left", fontsize=fontsize, weight=weight)


def request_color(i: int) -> str:
    return REQUEST_PALETTE[i % len(REQUEST_PALETTE)]
