"""One request's journey (labkit.viz.journey) from a recorded Engine run: latency numbers that agree
with the engine's own timestamps, and a figure with a row per station and a mark per token."""

from __future__ import annotations

from labkit.trace import Station
from labkit.viz import draw_journey, journey_latency
from labkit.viz.journey import HIGHLIGHT, STATION_TITLES, request_events


def _finished_rid(run):
    return next(rid for rid in run.rids if rid in run.results)


def test_latency_counts_every_token_and_agrees_with_the_engine(tiny_run):
    rid = _finished_rid(tiny_run)
    meta = tiny_run.results[rid]["meta_info"]
    lat = journey_latency(tiny_run, rid)
    assert lat["tokens"] == meta["completion_tokens"]
    assert len(lat["token_ms"]) == lat["tokens"] - 1 and min(lat["token_ms"]) >= 0
    # From tokenization to the first token's detokenization, and to the last record: never less than
    # the engine's TTFT (arrival to sampled) and end-to-end latency (arrival to finished).
    assert lat["ttft_ms"] >= meta["ttft"] * 1e3
    assert lat["e2e_ms"] >= meta["e2e_latency"] * 1e3


def test_journey_figure_has_a_row_per_station_and_a_mark_per_token(tiny_run):
    rid = _finished_rid(tiny_run)
    events = request_events(tiny_run, rid)
    fig = draw_journey(tiny_run, rid, highlight=2)
    ax = fig.axes[0]
    stations = sorted({e.station for e in events})
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:-1] == [STATION_TITLES[s] for s in stations] and Station.DETOKENIZE in stations
    token_marks = [ln for ln in ax.get_lines() if ln.get_marker() == "v"]
    assert len(token_marks) == tiny_run.results[rid]["meta_info"]["completion_tokens"]
    red = [p for p in ax.patches if p.get_facecolor()[:3] == _rgb(HIGHLIGHT)]
    assert len(red) == 1
    ttft = journey_latency(tiny_run, rid)["ttft_ms"]
    assert any(f"TTFT {ttft:.0f} ms" in t.get_text() for t in ax.texts)


def _rgb(hex_color: str) -> tuple[float, float, float]:
    return tuple(int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))
