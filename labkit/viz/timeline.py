"""Batching timeline: a Gantt chart with one row per request (queued / prefill chunks / decode /
stalled, retractions and finishes marked) above a per-step view of the batch (prefill and decode
tokens per step, coloured by forward mode). x is the scheduler step, or wall time (x="time"), where
long prefill steps show as long bars.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.patches import Patch

from labkit.viz import style
from labkit.viz.run import PHASES, Run


def cells_frame(source: Any) -> pd.DataFrame:
    """One row per (request, step): phase, tokens, prefix, and the step's start/end in seconds from
    the run's first record."""
    run = Run.of(source)
    spans = _step_spans(run)
    rows = [
        {
            "rid": c.rid,
            "step": c.step,
            "phase": c.phase,
            "tokens": c.tokens,
            "prefix": c.prefix,
            "t_start": spans[c.step][0],
            "t_end": spans[c.step][1],
        }
        for c in run.cells
    ]
    return pd.DataFrame(rows, columns=["rid", "step", "phase", "tokens", "prefix", "t_start", "t_end"])


def batch_frame(source: Any) -> pd.DataFrame:
    """One row per step: forward mode, batch size, prefill and decode tokens, cache hits, duration."""
    run = Run.of(source)
    pre: dict[int, int] = {}
    dec: dict[int, int] = {}
    for c in run.cells:
        if c.phase == "prefill":
            pre[c.step] = pre.get(c.step, 0) + c.tokens
        elif c.phase == "decode":
            dec[c.step] = dec.get(c.step, 0) + c.tokens
    rows = [
        {
            "step": s.step,
            "forward_mode": s.forward_mode,
            "batch_size": len(s.rids),
            "prefill_tokens": pre.get(s.step, 0),
            "decode_tokens": dec.get(s.step, 0),
            "cache_hit_tokens": s.cache_hit_tokens,
            "duration_ms": (s.end - s.start) * 1e3,
            "running": s.running,
            "waiting": s.waiting,
        }
        for s in run.steps
    ]
    return pd.DataFrame(rows)


def _step_spans(run: Run) -> dict[int, tuple[float, float]]:
    """Each step's [start, end] in seconds from t0, with the gap before it folded in (bars touch)."""
    out, prev = {}, None
    for s in run.steps:
        start = (prev if prev is not None else s.start) - run.t0
        out[s.step] = (start, s.end - run.t0)
        prev = s.end
    return out


def _segments(run: Run, x: str) -> dict[str, list[tuple[float, float, str, int, int]]]:
    """rid -> merged (x0, x1, phase, tokens, n_steps) runs of equal phase (prefill chunks stay separate)."""
    spans = _step_spans(run)
    out: dict[str, list[list]] = {}
    for c in run.cells:
        x0, x1 = (c.step - 0.5, c.step + 0.5) if x == "step" else spans[c.step]
        segs = out.setdefault(c.rid, [])
        if segs and segs[-1][2] == c.phase and c.phase != "prefill" and abs(segs[-1][1] - x0) < 1e-9:
            segs[-1][1] = x1
            segs[-1][3] += c.tokens
            segs[-1][4] += 1
        else:
            segs.append([x0, x1, c.phase, c.tokens, 1])
    if x == "time":  # queued time before the first step that could take it
        for rid, segs in out.items():
            arrival = run.arrivals[rid] - run.t0
            if segs and arrival < segs[0][0]:
                if segs[0][2] == "queued":
                    segs[0][0] = arrival
                else:
                    segs.insert(0, [arrival, segs[0][0], "queued", 0, 0])
    return {rid: [tuple(s) for s in segs] for rid, segs in out.items()}


def draw_timeline(
    source: Any,
    x: str = "step",
    *,
    ax=None,
    batch_ax=None,
    title: str | None = None,
    show_batch: bool = True,
    highlight_step: int | None = None,
    label_chunks: bool = True,
    row_order: str = "arrival",
):
    """Gantt chart of a recorded run, one row per request, plus (show_batch) the tokens of each step.
    Rows (y tick labels: the rids) are in arrival order, or with row_order="schedule" in the order
    the scheduler first ran them (a policy's reordering shows as a staircase).
    Returns the Figure."""
    if x not in ("step", "time"):
        raise ValueError("x must be 'step' or 'time'")
    run = Run.of(source)
    rids = _ordered_rids(run, row_order)
    segs = _segments(run, x)
    spans = _step_spans(run)
    if ax is None:
        h = max(2.2, 0.28 * len(rids) + 1.0)
        fig = style.new_figure(11, h + (1.9 if show_batch else 0))
        if show_batch:
            ax, batch_ax = fig.subplots(2, 1, sharex=True, height_ratios=[h, 1.9])
        else:
            ax = fig.subplots()
    fig = ax.figure
    row_of = {rid: i for i, rid in enumerate(rids)}
    for rid, ss in segs.items():
        y = row_of[rid]
        for x0, x1, phase, tokens, _ in ss:
            ax.barh(
                y,
                x1 - x0,
                left=x0,
                height=0.72,
                color=style.PHASE_COLORS[phase],
                edgecolor="white" if phase == "prefill" else "none",
                lw=0.8,
                gid=f"cell-{rid}",
            )
            if label_chunks and phase == "prefill" and tokens:
                _defer_label(ax, x0, x1, y, str(tokens), "center", "white")
    # cached prefix at a request's (re)admission, written just left of its first prefill chunk
    for rid, ss in segs.items():
        for i, (x0, _, phase, _, _) in enumerate(ss):
            if phase != "prefill" or i == 0 or ss[i - 1][2] != "queued":
                continue
            cached = next(
                (
                    c.prefix
                    for c in run.cells_of(rid)
                    if c.phase == "prefill" and abs(((c.step - 0.5) if x == "step" else spans[c.step][0]) - x0) < 1e-9
                ),
                0,
            )
            q0 = ss[i - 1][0]
            if cached:
                _defer_label(ax, q0, x0, row_of[rid], f"cached {cached}", "right", "#333333")
    # markers: retractions and finishes
    for s in run.steps:
        xs = s.step if x == "step" else spans[s.step][1]
        for rid in s.retracted:
            ax.plot(xs, row_of[rid], marker="x", color="black", ms=7, mew=2)
        for rid in s.finished:
            if rid in row_of:
                ax.plot(xs + (0.5 if x == "step" else 0), row_of[rid], marker="|", color="black", ms=11, mew=2)
    ax.set_yticks(range(len(rids)), rids, fontsize=8)
    ax.set_ylim(len(rids) - 0.4, -0.6)
    ax.grid(axis="x", color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)
    phase_labels = (
        "queued (waiting; 'cached n' = prefix\nfound in the radix cache on admission)",
        "prefill chunk (number = tokens)",
        "decode",
        "stalled (running, not in this batch)",
    )
    handles = [Patch(color=style.PHASE_COLORS[p], label=lbl) for p, lbl in zip(PHASES, phase_labels)]
    handles += [
        ax.plot([], [], marker="x", color="black", ls="none", mew=2, label="retracted")[0],
        ax.plot([], [], marker="|", color="black", ls="none", ms=11, mew=2, label="finished")[0],
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    if title is None:
        title = "Batching timeline" + (f": {run.label}" if run.label else "")
    ax.set_title(title, loc="left", fontsize=11, weight="bold")
    if highlight_step is not None:
        for a in (ax, batch_ax):
            if a is not None:
                xs = highlight_step if x == "step" else sum(spans[highlight_step]) / 2
                a.axvline(xs, color="black", lw=1.2, ls=":")
    if batch_ax is not None:
        _draw_batch(run, batch_ax, x, spans)
    else:
        ax.set_xlabel("scheduler step" if x == "step" else "seconds since the first record")
    place_labels(ax)
    return fig


def _ordered_rids(run: Run, row_order: str) -> list[str]:
    if row_order == "arrival":
        return run.rids
    if row_order == "schedule":
        computing = ("prefill", "decode")
        first = {
            rid: min((c.step for c in run.cells_of(rid) if c.phase in computing), default=1 << 30) for rid in run.rids
        }
        return sorted(run.rids, key=lambda rid: first[rid])  # stable: arrival order among ties
    raise ValueError(f"row_order must be 'arrival' or 'schedule', got {row_order!r}")


def _defer_label(ax, x0: float, x1: float, y: float, text: str, align: str, color: str) -> None:
    """Remember a label for the bar [x0, x1]; place_labels writes it once the x range is final."""
    if not hasattr(ax, "_labkit_labels"):
        ax._labkit_labels = []
    ax._labkit_labels.append((x0, x1, y, text, align, color))


def place_labels(ax, fontsize: float = 7) -> None:
    """Write the deferred bar labels that fit inside their bar at the axes' current x scale."""
    labels = getattr(ax, "_labkit_labels", [])
    for t in getattr(ax, "_labkit_label_artists", []):
        t.remove()
    layout = ax.figure.get_layout_engine()
    if layout is not None:
        layout.execute(ax.figure)  # the final axes width, so the fit test below is right
    lo, hi = ax.get_xlim()
    width_in = ax.get_position().width * ax.figure.get_figwidth()
    per_in = (hi - lo) / max(width_in, 1e-9)
    artists = []
    for x0, x1, y, text, align, color in labels:
        need = (len(text) * fontsize * 0.62 / 72 + 0.08) * per_in  # text width in data units
        if x1 - x0 < need:
            continue
        if align == "center":
            artists.append(ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=fontsize, color=color))
        else:
            artists.append(
                ax.text(x1 - 0.04 * per_in, y, text, ha="right", va="center", fontsize=fontsize, color=color)
            )
    ax._labkit_label_artists = artists


def _draw_batch(run: Run, ax, x: str, spans) -> None:
    df = batch_frame(run)
    if x == "step":
        left, width = list(df["step"] - 0.4), [0.8] * len(df)
    else:
        left = [spans[s][0] for s in df["step"]]
        width = [spans[s][1] - spans[s][0] for s in df["step"]]
    ax.bar(
        left,
        df["prefill_tokens"],
        width=width,
        align="edge",
        color=style.PHASE_COLORS["prefill"],
        label="prefill tokens",
    )
    ax.bar(
        left,
        df["decode_tokens"],
        width=width,
        bottom=df["prefill_tokens"],
        align="edge",
        color=style.PHASE_COLORS["decode"],
        label="decode tokens",
    )
    ax.set_ylabel("tokens\nin batch", fontsize=8)
    ax.set_xlabel("scheduler step" if x == "step" else "seconds since the first record")
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)
    handles = [
        Patch(color=style.PHASE_COLORS["prefill"], label="prefill tokens"),
        Patch(color=style.PHASE_COLORS["decode"], label="decode tokens"),
        Patch(color="none", label="(a bar with both colours\n is a MIXED step)"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def draw_timelines(sources: list[Any], titles: list[str] | None = None, x: str = "time", row_order: str = "arrival"):
    """Several runs of the same requests one above the other, on one x scale (e.g. static vs
    continuous batching); row_order as in draw_timeline. Returns the Figure."""
    runs = [Run.of(s) for s in sources]
    titles = titles or [r.label or f"run {i}" for i, r in enumerate(runs)]
    heights = [max(1.8, 0.26 * len(r.rids) + 0.9) for r in runs]
    fig = style.new_figure(11, sum(heights) + 0.3)
    axes = fig.subplots(len(runs), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    for run, ax, t in zip(runs, axes, titles):
        draw_timeline(run, x=x, ax=ax, show_batch=False, title=t, row_order=row_order)
        ax.set_xlabel("")
        end = max((e for _, e in _step_spans(run).values()), default=0) if x == "time" else len(run.steps)
        ax.axvline(end, color="#333333", lw=1, ls="--")
    axes[-1].set_xlabel("scheduler step" if x == "step" else "seconds since the first record")
    for ax in axes:  # the shared x range is final now
        place_labels(ax)
    for ax in axes[1:]:
        leg = ax.get_legend()
        if leg is not None:
            leg.remove()
    return fig
