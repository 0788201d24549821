"""One request's journey through the ten stations, from its station records: when it was at each
station, its time to first token (TTFT) and the time each later token took. Works on Engine runs
(stations 3 and 5-9) and on server runs (all ten: the tracer of an InProcessServer, or of
`python -m labkit.server --trace-file`).
"""

from __future__ import annotations

import itertools
from typing import Any

from matplotlib.patches import Patch

from labkit.trace.events import Station, StationEvent
from labkit.viz import style
from labkit.viz.run import Run

STATION_TITLES = {
    Station.HTTP_RECEIVE: "1 HTTP receive", Station.PARSE_VALIDATE: "2 parse / validate",
    Station.TOKENIZE: "3 tokenize", Station.ZMQ_SEND: "4 ZMQ send", Station.ENQUEUE: "5 enqueue (prefix match)",
    Station.BATCH: "6 batch", Station.FORWARD: "7 forward", Station.SAMPLE: "8 sample (+ finish check)",
    Station.DETOKENIZE: "9 detokenize", Station.RESPOND: "10 respond",
}  # fmt: skip
OTHER_STATION = "#8d99ae"
HIGHLIGHT = "#e63946"
LABEL_SPACING = 0.06  # of the time axis: tokens closer than this to the last labelled one get no label


def request_events(run: Run, rid: str) -> list[StationEvent]:
    """The station visits of `rid`, in time order."""
    events = sorted((e for e in run.tracer.events if e.rid == rid), key=lambda e: (e.start, e.station))
    if not events:
        raise ValueError(f"no station events for {rid!r}")
    return events


def is_token_event(e: StationEvent) -> bool:
    """A station-9 record that carried an output token (when that token was ready)."""
    return e.station == Station.DETOKENIZE and e.detail.get("token") is not None


def _token_events(events: list[StationEvent]) -> list[StationEvent]:
    return [e for e in events if is_token_event(e)]


def journey_latency(source: Any, rid: str) -> dict[str, Any]:
    """Latency of `rid` in ms, from its station records. TTFT runs from its first record (1 HTTP
    receive on the server, 3 tokenize in the Engine) to the end of station 9 for its first token;
    each later token's time (token_ms) is the gap between two station-9 ends; e2e ends with its
    last record (10 respond on the server)."""
    events = request_events(Run.of(source), rid)
    t0 = events[0].start
    ends = [e.end for e in _token_events(events)]
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(ends)]
    return {
        "tokens": len(ends),
        "ttft_ms": (ends[0] - t0) * 1e3 if ends else None,
        "token_ms": gaps,
        "mean_token_ms": sum(gaps) / len(gaps) if gaps else None,
        "e2e_ms": (max(e.end for e in events) - t0) * 1e3,
    }


def draw_journey(source: Any, rid: str, *, highlight: int | None = None, ax=None, title: str | None = None):
    """One row per station the request visited, a bar (and a dot at its start) per visit, in ms since
    its first record; stations 6-8 coloured by the step's forward mode. A last row shows the output
    tokens as they left station 9 (text above, ms since the previous token below, for tokens not too
    close to the last labelled one) and a dashed line the TTFT. `highlight` is an index into
    request_events(run, rid), drawn in red. Returns the Figure."""
    run = Run.of(source)
    events = request_events(run, rid)
    t0 = events[0].start
    stations = sorted({e.station for e in events})
    row = {s: k for k, s in enumerate(stations)}
    if ax is None:
        ax = style.new_figure(11, 0.36 * len(stations) + 2.0).subplots()
    modes = {s.step: s.forward_mode for s in run.steps}
    for k, e in enumerate(events):
        color = HIGHLIGHT if k == highlight else style.MODE_COLORS.get(modes.get(e.step), OTHER_STATION)
        x0 = (e.start - t0) * 1e3
        ax.barh(row[e.station], max((e.end - e.start) * 1e3, 0.0), left=x0, height=0.6, color=color)
        ax.plot(x0, row[e.station], marker="o", ms=8 if k == highlight else 4, color=color)
    span = (max(e.end for e in events) - t0) * 1e3
    for s in run.steps:  # retractions: the request went back to the waiting queue
        if rid in s.retracted:  # decided at the start of the step, before its batch
            x = (s.start - t0) * 1e3
            ax.axvline(x, color="black", lw=1.2, ls="--")
            left = x < span / 2  # the label on the side with room
            ax.text(
                x,
                -0.45,
                f" retracted (step {s.step}): back to the queue ",
                fontsize=7.5,
                va="top",
                ha="left" if left else "right",
            )
    y_tok = len(stations)
    tokens = _token_events(events)
    min_label_gap = LABEL_SPACING * span
    labelled = float("-inf")
    for i, e in enumerate(tokens):
        x = (e.end - t0) * 1e3
        ax.plot(x, y_tok, marker="v", ms=7, color="black")
        if x - labelled < min_label_gap:  # too close to the last labelled token: a mark only
            continue
        labelled = x
        ax.text(x, y_tok - 0.3, repr(e.detail.get("piece", "")), ha="center", va="bottom", fontsize=7.5)
        if i:
            ax.text(
                x,
                y_tok + 0.3,
                f"+{(e.end - tokens[i - 1].end) * 1e3:.0f}",
                ha="center",
                va="top",
                fontsize=7,
                color="#555555",
            )
    if tokens:
        ttft = (tokens[0].end - t0) * 1e3
        ax.axvline(ttft, color="black", lw=1, ls="--")
        ax.text(
            ttft,
            0,
            f" TTFT {ttft:.0f} ms",
            fontsize=8.5,
            weight="bold",
            va="center",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
        )
    ax.set_yticks(
        range(len(stations) + 1),
        [STATION_TITLES[s] for s in stations] + ["output tokens\n(+ms since the previous)"],
        fontsize=8,
    )
    ax.set_ylim(len(stations) + 0.6, -0.6)
    ax.set_xlabel(f"ms since {STATION_TITLES[events[0].station]}")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    used = [m for m in style.MODE_COLORS if m in {modes.get(e.step) for e in events}]
    handles = [Patch(color=style.MODE_COLORS[m], label=f"in a {m} step") for m in used]
    handles.append(Patch(color=OTHER_STATION, label="outside the steps"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(
        title or f"The journey of {rid}" + (" (red: the current station)" if highlight is not None else ""),
        loc="left",
        fontsize=10,
        weight="bold",
    )
    return ax.figure
