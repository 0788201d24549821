"""Batching timeline: a Gantt chart with one row per request (queued / prefill chunks / decode /
stalled, retractions and finishes marked, a tick wherever the request got an output token) above a
per-step view of the batch (prefill and decode tokens per step; a MIXED step is labelled with its
decode count, which is too few tokens to see as a bar). x is the scheduler step, or wall time
(x="time"), where long steps show as long bars: the ticks tell a slow decode (ticks far apart) from
a stalled one (no ticks).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from labkit.viz import style
from labkit.viz.run import PHASES, Run

TOKEN_TICK = "#173f2c"  # an output token on the timeline: a dark green, the colour of decode darkened
COLUMNS = ["rid", "step", "phase", "tokens", "prefix", "tokens_out", "t_start", "t_end"]


def cells_frame(source: Any) -> pd.DataFrame:
    """One row per (request, step): phase, tokens computed, prefix, output tokens the request got
    from the step (tokens_out, see output_tokens), and the step's start/end in seconds from the run's
    first record."""
    run = Run.of(source)
    spans = _step_spans(run)
    out = output_tokens(run)
    rows = [
        {
            "rid": c.rid,
            "step": c.step,
            "phase": c.phase,
            "tokens": c.tokens,
            "prefix": c.prefix,
            "tokens_out": out.get((c.rid, c.step), 0),
            "t_start": spans[c.step][0],
            "t_end": spans[c.step][1],
        }
        for c in run.cells
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def output_tokens(source: Any) -> dict[tuple[str, int], int]:
    """(rid, step) -> output tokens the request got from that step's forward, for the steps that gave
    it any: a decode gives 1 (a TARGET_VERIFY step 1 + its accepted drafts), a prefill chunk gives 1
    when it completes the prompt (the last chunk; the first token is sampled right after the prompt)
    and 0 when more chunks follow."""
    run = Run.of(source)
    step_of = {s.step: s for s in run.steps}
    out: dict[tuple[str, int], int] = {}
    for c in run.cells:
        s = step_of[c.step]
        if c.phase == "decode":
            out[(c.rid, c.step)] = 1 + s.accepted.get(c.rid, 0)
        elif c.phase == "prefill" and c.rid != s.chunked_rid:
            out[(c.rid, c.step)] = 1
    return out


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


def _segments(run: Run, x: str) -> dict[str, list[tuple[float, float, str, int, int, int]]]:
    """rid -> merged (x0, x1, phase, tokens, n_steps, first step) runs of equal phase (prefill chunks
    stay separate)."""
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
            segs.append([x0, x1, c.phase, c.tokens, 1, c.step])
    if x == "time":  # queued time before the first step that could take it
        for rid, segs in out.items():
            arrival = run.arrivals[rid] - run.t0
            if segs and arrival < segs[0][0]:
                if segs[0][2] == "queued":
                    segs[0][0] = arrival
                else:
                    segs.insert(0, [arrival, segs[0][0], "queued", 0, 0, segs[0][5]])
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
    show_tokens: bool = True,
):
    """Gantt chart of a recorded run, one row per request, plus (show_batch) the tokens of each step.
    Rows (y tick labels: the rids) are in arrival order, or with row_order="schedule" in the order
    the scheduler first ran them (a policy's reordering shows as a staircase). With show_tokens, a
    tick at the end of every step that gave a request output tokens (output_tokens). A prefill chunk
    is labelled with its tokens, and in a MIXED step with the decodes that rode along ("128 + 3 dec")
    where the bar is wide enough. Returns the Figure."""
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
    decodes = _decode_rows(run)
    mixed_steps = {s.step for s in run.steps if s.forward_mode == "MIXED"}
    for rid, ss in segs.items():
        y = row_of[rid]
        for x0, x1, phase, tokens, _, step in ss:
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
                d = decodes.get(step, 0) if step in mixed_steps else 0
                texts = (f"{tokens} + {d} dec", f"{tokens}+{d}", str(tokens)) if d else (str(tokens),)
                _defer_label(ax, x0, x1, y, texts, "center", "white", group="chunks")
    # cached prefix at a request's (re)admission, written just left of its first prefill chunk
    for rid, ss in segs.items():
        for i, (x0, _, phase, _, _, step) in enumerate(ss):
            if phase != "prefill" or i == 0 or ss[i - 1][2] != "queued":
                continue
            cached = next((c.prefix for c in run.cells_of(rid) if c.phase == "prefill" and c.step == step), 0)
            if cached:
                _defer_label(ax, ss[i - 1][0], x0, row_of[rid], (f"cached {cached}",), "right", "#333333")
    if show_tokens:
        ticks = output_tokens(run)
        tick_x = [(step + 0.5 if x == "step" else spans[step][1]) for _, step in ticks]
        tick_y = [row_of[rid] for rid, _ in ticks]
        ax._labkit_ticks = ax.vlines(
            tick_x, [y - 0.24 for y in tick_y], [y + 0.24 for y in tick_y], colors=TOKEN_TICK, lw=1, gid="tokens"
        )
        ax._labkit_tick_gap = _typical_gap(tick_x, tick_y)
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
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _gantt_legend(ax, bool(mixed_steps), show_tokens)
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
    if batch_ax is not None:
        place_labels(batch_ax)
    return fig


def _typical_gap(xs: list[float], ys: list[int]) -> float:
    """The median distance between a request's consecutive ticks (x units; inf with fewer than two)."""
    by_row: dict[int, list[float]] = {}
    for x, y in zip(xs, ys):
        by_row.setdefault(y, []).append(x)
    gaps = [b - a for row in by_row.values() for a, b in zip(sorted(row), sorted(row)[1:]) if b > a]
    return float(pd.Series(gaps).median()) if gaps else float("inf")


def _gantt_legend(ax, mixed: bool, show_tokens: bool) -> None:
    """The Gantt chart's legend; the '+n' of a chunk label is explained where a run has MIXED steps."""
    phase_labels = (
        "queued (waiting; 'cached n' = prefix\nfound in the radix cache on admission)",
        "prefill chunk (number = tokens; '+n':\nn decodes rode along, a MIXED step)"
        if mixed
        else "prefill chunk (number = tokens)",
        "decode",
        "stalled (running, not in this batch)",
    )
    handles: list[Artist] = [Patch(color=style.PHASE_COLORS[p], label=lbl) for p, lbl in zip(PHASES, phase_labels)]
    if show_tokens:
        handles.append(
            Line2D(
                [], [], marker="|", color=TOKEN_TICK, ls="none", ms=6, mew=1.2, label="output token (end of its step)"
            )
        )
    handles += [
        Line2D([], [], marker="x", color="black", ls="none", mew=2, label="retracted"),
        Line2D([], [], marker="|", color="black", ls="none", ms=11, mew=2, label="finished"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def _decode_rows(run: Run) -> dict[int, int]:
    """step -> requests that decoded in it (a MIXED step's decodes ride on its prefill chunk)."""
    out: dict[int, int] = {}
    for c in run.cells:
        if c.phase == "decode":
            out[c.step] = out.get(c.step, 0) + 1
    return out


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


def _defer_label(
    ax, x0: float, x1: float, y: float, texts: tuple[str, ...], align: str, color: str, group: str | None = None
) -> None:
    """Remember a label for the bar [x0, x1]; place_labels writes it once the x range is final.
    texts: the longest form first, then shorter ones; labels of one group take forms of the same
    rank, so that all chunk labels of a figure read alike. align: "center" (inside the bar), "right"
    (inside, at its right end) or "above" (centred over the bar, y its top)."""
    if not hasattr(ax, "_labkit_labels"):
        ax._labkit_labels = []
    ax._labkit_labels.append((x0, x1, y, texts, align, color, group))


def place_labels(ax, fontsize: float = 7) -> None:
    """Write the deferred bar labels that fit inside their bar at the axes' current x scale, and
    thin the token ticks where they stand close together."""
    labels = getattr(ax, "_labkit_labels", [])
    for t in getattr(ax, "_labkit_label_artists", []):
        t.remove()
    layout = ax.figure.get_layout_engine()
    if layout is not None:
        layout.execute(ax.figure)  # the final axes width, so the fit test below is right
    lo, hi = ax.get_xlim()
    width_in = ax.get_position().width * ax.figure.get_figwidth()
    per_in = (hi - lo) / max(width_in, 1e-9)

    def fits(x0: float, x1: float, text: str) -> bool:  # about 0.62 em per character, plus a margin
        return x1 - x0 >= (len(text) * fontsize * 0.62 / 72 + 0.08) * per_in

    # A group's rank: the first at which every label of it that fits in some form fits.
    ranks: dict[str, int] = {}
    for x0, x1, _, texts, _, _, group in labels:
        if group is not None and any(fits(x0, x1, t) for t in texts):
            first = next(i for i, t in enumerate(texts) if fits(x0, x1, t))
            ranks[group] = max(ranks.get(group, 0), first)
    artists = []
    for x0, x1, y, texts, align, color, group in labels:
        start = min(ranks.get(group, 0), len(texts) - 1) if group is not None else 0
        text = next((t for t in texts[start:] if fits(x0, x1, t)), None)
        if text is None:
            continue
        if align == "center":
            artists.append(ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=fontsize, color=color))
        elif align == "above":
            artists.append(ax.text((x0 + x1) / 2, y, text, ha="center", va="bottom", fontsize=fontsize, color=color))
        else:
            artists.append(
                ax.text(x1 - 0.04 * per_in, y, text, ha="right", va="center", fontsize=fontsize, color=color)
            )
    ax._labkit_label_artists = artists
    ticks = getattr(ax, "_labkit_ticks", None)
    if ticks is not None:  # ticks closer than ~0.1 inch would make a dark comb: draw them finer and lighter
        dense = ax._labkit_tick_gap / per_in < 0.1
        ticks.set_linewidth(0.6 if dense else 1.0)
        ticks.set_alpha(0.55 if dense else 1.0)


def _draw_batch(run: Run, ax, x: str, spans) -> None:
    df = batch_frame(run)
    if x == "step":
        left, width = list(df["step"] - 0.4), [0.8] * len(df)
    else:
        left = [spans[s][0] for s in df["step"]]
        width = [spans[s][1] - spans[s][0] for s in df["step"]]
    # In time, steps touch: a thin white edge keeps consecutive steps apart.
    edge = {"edgecolor": "white", "lw": 0.5} if x == "time" else {}
    ax.bar(
        left,
        df["prefill_tokens"],
        width=width,
        align="edge",
        color=style.PHASE_COLORS["prefill"],
        label="prefill tokens",
        **edge,
    )
    ax.bar(
        left,
        df["decode_tokens"],
        width=width,
        bottom=df["prefill_tokens"],
        align="edge",
        color=style.PHASE_COLORS["decode"],
        label="decode tokens",
        **edge,
    )
    # A MIXED step's few decode tokens are a sliver on top of its chunk: write their count over it.
    mixed = df[df["forward_mode"] == "MIXED"]
    for x0, w, top, d in zip(
        [left[i] for i in mixed.index],
        [width[i] for i in mixed.index],
        mixed["prefill_tokens"] + mixed["decode_tokens"],
        mixed["decode_tokens"],
    ):
        _defer_label(ax, x0, x0 + w, top, (f"+{d} dec", f"+{d}"), "above", TOKEN_TICK, group="mixed")
    if len(mixed):
        ax.set_ylim(0, (df["prefill_tokens"] + df["decode_tokens"]).max() * 1.25)
    ax.set_ylabel("tokens\nin batch", fontsize=8)
    ax.set_xlabel("scheduler step" if x == "step" else "seconds since the first record")
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)
    handles = [
        Patch(color=style.PHASE_COLORS["prefill"], label="prefill tokens"),
        Patch(color=style.PHASE_COLORS["decode"], label="decode tokens"),
    ]
    if len(mixed):
        handles.append(Patch(color="none", label="+n over a bar: a MIXED step,\nits chunk and n decodes"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def draw_timelines(
    sources: list[Any],
    titles: list[str] | None = None,
    x: str = "time",
    row_order: str = "arrival",
    show_tokens: bool = True,
):
    """Several runs of the same requests one above the other, on one x scale (e.g. static vs
    continuous batching); row_order and show_tokens as in draw_timeline. Returns the Figure."""
    runs = [Run.of(s) for s in sources]
    titles = titles or [r.label or f"run {i}" for i, r in enumerate(runs)]
    heights = [max(1.8, 0.26 * len(r.rids) + 0.9) for r in runs]
    fig = style.new_figure(11, sum(heights) + 0.3)
    axes = fig.subplots(len(runs), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    for run, ax, t in zip(runs, axes, titles):
        draw_timeline(run, x=x, ax=ax, show_batch=False, title=t, row_order=row_order, show_tokens=show_tokens)
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
    # One legend, at the top, explaining what any of the runs shows.
    _gantt_legend(axes[0], any(s.forward_mode == "MIXED" for r in runs for s in r.steps), show_tokens)
    return fig
