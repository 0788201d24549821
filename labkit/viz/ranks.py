"""Tensor parallelism, step by step: one row per rank, one bar per scheduler step (every rank runs
every step), coloured by forward mode, with the part of the step spent in collectives (all-reduce,
all-gather) drawn dark at the bar's end. Drawn from a traced Engine(tp_size=N, enable_trace=True)
or a server trace. The collective time is the step's total, measured where collectives block (gloo
on CPU); it is not placed where the collectives happened inside the step.
"""

from __future__ import annotations

from typing import Any

from matplotlib.patches import Patch

from labkit.trace.events import StepRecord
from labkit.viz import style
from labkit.viz.run import Run

COMM_COLOR = "#222222"


def rank_steps(source: Any) -> dict[int, list[StepRecord]]:
    """Every rank's step records, by rank (rank 0 first)."""
    tracer = Run.of(source).tracer
    out: dict[int, list[StepRecord]] = {}
    for record in [*tracer.steps, *tracer.rank_steps]:
        out.setdefault(record.rank, []).append(record)
    return dict(sorted(out.items()))


def draw_rank_timeline(source: Any, steps: tuple[int, int] | None = None, title: str | None = None):
    """Steps `steps` (first, last; default all) of every rank against time, in ms since the first
    drawn. Each step bar is a PolyCollection with gid "rank<r>|<step>"; its collective part
    "rank<r>|<step>|comm". Returns the Figure."""
    by_rank = rank_steps(source)
    if steps is not None:
        by_rank = {r: [s for s in recs if steps[0] <= s.step <= steps[1]] for r, recs in by_rank.items()}
    records = [s for recs in by_rank.values() for s in recs]
    if not records:
        raise ValueError("no step records to draw (trace a run: enable_trace=True)")
    t0 = min(s.start for s in records)
    fig = style.new_figure(11, 1.2 + 0.55 * len(by_rank))
    ax = fig.subplots()
    for row, (rank, recs) in enumerate(by_rank.items()):
        for s in recs:
            x0, width = (s.start - t0) * 1e3, (s.end - s.start) * 1e3
            color = style.MODE_COLORS.get(s.forward_mode, style.MODE_COLORS["IDLE"])
            ax.broken_barh([(x0, width)], (row - 0.35, 0.7), facecolors=color, gid=f"rank{rank}|{s.step}")
            comm = min(s.comm_seconds * 1e3, width)
            if comm > 0:
                ax.broken_barh(
                    [(x0 + width - comm, comm)],
                    (row - 0.35, 0.7),
                    facecolors=COMM_COLOR,
                    gid=f"rank{rank}|{s.step}|comm",
                )
    ax.set_yticks(range(len(by_rank)), [f"rank {r}" for r in by_rank])
    ax.set_ylim(len(by_rank) - 0.5, -0.5)
    ax.set_xlabel("ms since the first step drawn")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    modes = sorted({s.forward_mode for s in records})
    handles = [Patch(color=style.MODE_COLORS.get(m, style.MODE_COLORS["IDLE"]), label=m.lower()) for m in modes]
    handles.append(Patch(color=COMM_COLOR, label="in collectives"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    share = sum(s.comm_seconds for s in records) / max(sum(s.end - s.start for s in records), 1e-12)
    style.figure_title(fig, title or f"Steps by tensor-parallel rank ({share:.0%} of step time in collectives)")
    return fig
