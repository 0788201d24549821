"""The stations-by-process view, on hand-made station records with known times."""

from __future__ import annotations

import pytest

from labkit.trace import Station, Tracer
from labkit.viz import draw_stations_by_process
from labkit.viz.processes import MIN_WIDTH, PROCESS_OF_STATION

T = 50.0  # an arbitrary perf_counter origin


def journey(tr: Tracer, rid: str, at: float) -> None:
    """All ten stations of a two-token request starting at `at` seconds after T; 6 takes no time."""
    t = T + at
    for station, ms in [(1, 1), (2, 0.5), (3, 2), (4, 0.5), (5, 10)]:
        tr.station(rid, Station(station), t, t + ms / 1e3)
        t += ms / 1e3
    for step in (0, 1):
        tr.station(rid, Station.BATCH, t, t, step=step)
        tr.station(rid, Station.FORWARD, t, t + 0.1, step=step)
        tr.station(rid, Station.SAMPLE, t + 0.1, t + 0.101, step=step)
        tr.station(rid, Station.DETOKENIZE, t + 0.102, t + 0.103)
        t += 0.11
    tr.station(rid, Station.RESPOND, t, t + 0.002)


def bars(fig) -> dict[tuple[int, str, int], list[tuple[float, float]]]:
    """(panel, rid, station) -> [(x, width)] of every bar drawn."""
    out = {}
    for k, ax in enumerate(fig.axes):
        for coll in ax.collections:
            rid, station = coll.get_gid().split("|")
            xs = [(p.vertices[:, 0].min(), p.vertices[:, 0].max() - p.vertices[:, 0].min()) for p in coll.get_paths()]
            out[(k, rid, int(station))] = xs
    return out


def test_each_visit_is_a_bar_in_its_process_panel_at_its_time():
    tr = Tracer()
    journey(tr, "a", 0.0)
    journey(tr, "b", 0.005)
    fig = draw_stations_by_process(tr, ["b", "a"])
    drawn = bars(fig)
    panels = ["main", "scheduler", "detokenizer"]
    assert {(k, rid, s) for k, rid, s in drawn} == {
        (panels.index(PROCESS_OF_STATION[s]), rid, int(s)) for rid in "ab" for s in Station
    }
    for e in tr.events:
        panel = panels.index(PROCESS_OF_STATION[e.station])
        assert any(x == pytest.approx((e.start - T) * 1e3) for x, _ in drawn[(panel, e.rid, int(e.station))])
    assert len(drawn[(1, "a", int(Station.FORWARD))]) == 2  # one bar per step
    span = fig.axes[-1].get_xlim()[1]
    assert all(w == pytest.approx(span * MIN_WIDTH) for _, w in drawn[(1, "b", int(Station.BATCH))])
    assert all(w == pytest.approx(100) for _, w in drawn[(1, "b", int(Station.FORWARD))])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["a", "b"]  # in order of arrival


def test_rids_labels_and_window_select_what_is_drawn():
    tr = Tracer()
    journey(tr, "a", 0.0)
    journey(tr, "b", 0.005)
    fig = draw_stations_by_process(tr, ["b"], window=(0.0, 12.0), labels={"b": "second"})
    drawn = bars(fig)
    assert {rid for _, rid, _ in drawn} == {"b"}
    # Times count from b's first record; only its first five stations start within 12 ms.
    assert {s for _, _, s in drawn} == {1, 2, 3, 4, 5}
    assert drawn[(0, "b", 1)] == [(pytest.approx(0.0), pytest.approx(1.0))]
    assert fig.axes[-1].get_xlim() == (0.0, 12.0)
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == ["second"]
    with pytest.raises(ValueError, match="no station events"):
        draw_stations_by_process(tr, ["nobody"])


def test_no_station_takes_the_colour_of_a_phase_or_mode():
    from labkit.viz import style

    phases = set(style.PHASE_COLORS.values()) | set(style.MODE_COLORS.values())
    assert not {s: c for s, c in style.STATION_COLORS.items() if c in phases}
    assert len(set(style.STATION_COLORS.values())) == len(style.STATION_COLORS)
