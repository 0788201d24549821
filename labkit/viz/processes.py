"""Where the server's time goes: the station visits of several requests at once, in one panel per
server process (main, scheduler, detokenizer), one row per request, one bar per visit coloured by
station. Drawn from a server trace (`python -m labkit.server --trace-file`, read back with
labkit.trace.from_perfetto) or any other run with station records.
"""

from __future__ import annotations

from typing import Any

from matplotlib.patches import Patch

from labkit.trace.events import Station
from labkit.viz import style
from labkit.viz.journey import STATION_TITLES
from labkit.viz.run import Run

# Which process of `python -m labkit.server` runs each station.
PROCESS_OF_STATION = {
    Station.HTTP_RECEIVE: "main", Station.PARSE_VALIDATE: "main", Station.TOKENIZE: "main",
    Station.ZMQ_SEND: "main", Station.ENQUEUE: "scheduler", Station.BATCH: "scheduler",
    Station.FORWARD: "scheduler", Station.SAMPLE: "scheduler", Station.DETOKENIZE: "detokenizer",
    Station.RESPOND: "main",
}  # fmt: skip
PROCESS_TITLES = {
    "main": "main process: FastAPI + TokenizerManager",
    "scheduler": "scheduler process: Scheduler + ModelRunner",
    "detokenizer": "detokenizer process: DetokenizerManager",
}
MIN_WIDTH = 0.003  # of the time axis: shorter visits (station 6 takes no time at all) are drawn this wide


def draw_stations_by_process(
    source: Any,
    rids: list[str] | None = None,
    *,
    window: tuple[float, float] | None = None,
    labels: dict[str, str] | None = None,
    title: str | None = None,
):
    """Station visits of `rids` (default: every request), one row each in order of arrival, in ms
    since the first of their records; `window` (ms, ms) zooms in. Each bar is a PolyCollection with gid
    "<rid>|<station number>". Visits shorter than MIN_WIDTH of the axis are widened to it, so
    every one stays visible. `labels` names the rows (default: the rids). Returns the Figure."""
    run = Run.of(source)
    wanted = None if rids is None else set(rids)
    events = sorted((e for e in run.tracer.events if wanted is None or e.rid in wanted), key=lambda e: e.start)
    if not events:
        raise ValueError("no station events to draw")
    order = list(dict.fromkeys(e.rid for e in events))  # by arrival
    row_of = {rid: i for i, rid in enumerate(order)}
    t0 = events[0].start
    lo, hi = window if window is not None else (0.0, (max(e.end for e in events) - t0) * 1e3 * 1.01)
    min_w = MIN_WIDTH * (hi - lo)
    spans: dict[tuple[str, Station], list[tuple[float, float]]] = {}
    for e in events:
        x0, x1 = (e.start - t0) * 1e3, (e.end - t0) * 1e3
        if x1 >= lo and x0 <= hi:
            spans.setdefault((e.rid, e.station), []).append((x0, max(x1 - x0, min_w)))
    fig = style.new_figure(11, 1.0 + 3 * (0.7 + 0.24 * len(order)))
    axes = fig.subplots(3, 1, sharex=True)
    for ax, process in zip(axes, PROCESS_TITLES):
        stations = [s for s in Station if PROCESS_OF_STATION[s] == process]
        for (rid, station), xranges in spans.items():
            if station in stations:
                y = row_of[rid]
                ax.broken_barh(
                    xranges, (y - 0.35, 0.7), facecolors=style.STATION_COLORS[station], gid=f"{rid}|{int(station)}"
                )
        ax.set_yticks(range(len(order)), [(labels or {}).get(r, r) for r in order], fontsize=8)
        ax.set_ylim(len(order) - 0.5, -0.5)
        ax.set_title(PROCESS_TITLES[process], loc="left", fontsize=9)
        ax.grid(axis="x", color="#eeeeee")
        ax.set_axisbelow(True)
        ax.legend(
            handles=[Patch(color=style.STATION_COLORS[s], label=STATION_TITLES[s]) for s in stations],
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=8,
            frameon=False,
        )
    axes[-1].set_xlim(lo, hi)
    axes[-1].set_xlabel(f"ms since the first record drawn ({STATION_TITLES[events[0].station]})")
    style.figure_title(fig, title or "Station visits by process")
    return fig
