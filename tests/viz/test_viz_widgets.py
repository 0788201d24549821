"""The widgets build and update without a front-end, and fall back to static output."""

from __future__ import annotations

import pytest

from labkit.trace import Station
from labkit.viz import RunReplayer, StationStepper, widget_frontend
from labkit.viz.widgets import _WithFallback, describe_event

pytest.importorskip("ipywidgets")


def test_no_frontend_outside_a_kernel(monkeypatch):
    assert not widget_frontend()
    monkeypatch.setenv("LABKIT_VIZ_STATIC", "1")
    assert not widget_frontend()


def test_station_stepper_builds_and_steps(tiny_run):
    rid = next(s.retracted[0] for s in tiny_run.steps if s.retracted)
    stepper = StationStepper(tiny_run, rid)
    stations = [e.station for e in stepper.events]
    assert stations[:2] == [Station.TOKENIZE, Station.ENQUEUE]
    assert {Station.BATCH, Station.FORWARD, Station.SAMPLE, Station.DETOKENIZE} <= set(stations)
    assert [e.start for e in stepper.events] == sorted(e.start for e in stepper.events)
    table = stepper.table()
    assert len(table) == len(stepper.events) and {"station", "in", "out"} <= set(table.columns)
    for e in stepper.events[:8]:
        ins, outs = describe_event(e)
        assert outs, e.station
    box = stepper.widget()
    slider, info, image = box.labkit["slider"], box.labkit["info"], box.labkit["image"]
    first = image.value
    assert slider.max == len(stepper.events) - 1 and "3 tokenize" in info.value
    slider.value = 3
    assert "event 4 of" in info.value and image.value != first
    bundle = _WithFallback(box, image.value, "text")._repr_mimebundle_()
    assert {"application/vnd.jupyter.widget-view+json", "image/png", "text/plain"} <= set(bundle)


def test_run_replayer_builds_and_moves_all_views(tiny_run):
    replayer = RunReplayer(tiny_run)
    assert replayer.steps == tiny_run.step_ids and replayer.has_tree
    box = replayer.widget(step=replayer.steps[0])
    slider, over, tree = box.labkit["slider"], box.labkit["overview"], box.labkit["tree"]
    before = (over.value, tree.value)
    retract = next(s.step for s in tiny_run.steps if s.retracted)
    slider.value = retract
    assert over.value != before[0] and tree.value != before[1]
    figs = replayer.figures(retract)
    assert len(figs) == 2  # the tree, and memory + timeline + waiting
    assert len(figs[1].axes) >= 4


def test_show_without_a_frontend_returns_static_views(tiny_run, monkeypatch):
    monkeypatch.setenv("LABKIT_VIZ_STATIC", "1")
    shown = []
    monkeypatch.setattr("labkit.viz.widgets._display", shown.append)
    RunReplayer(tiny_run).show(step=tiny_run.step_ids[2])
    StationStepper(tiny_run).show()
    kinds = [type(x).__name__ for x in shown]
    assert kinds == ["Figure", "Figure", "DataFrame", "Figure"]


def test_figures_render_at_twice_the_pixels_of_their_display_width():
    from matplotlib.figure import Figure

    from labkit.viz import _figure_png, style

    fig = Figure(figsize=(6, 2))
    fig.add_subplot().plot([0, 1], [1, 0])
    png, meta = _figure_png(fig)
    pixels = int.from_bytes(png[16:20], "big")
    assert pixels == 6 * style.DISPLAY_DPI * style.PIXEL_DENSITY and style.PIXEL_DENSITY >= 2
    assert meta == {"width": 6 * style.DISPLAY_DPI}


def test_widget_images_show_at_their_display_width(tiny_run):
    from labkit.viz import style

    box = RunReplayer(tiny_run).widget()
    for image in (box.labkit["overview"], box.labkit["tree"]):
        pixels = int.from_bytes(image.value[16:20], "big")
        assert abs(int(image.width) * style.PIXEL_DENSITY - pixels) <= style.PIXEL_DENSITY / 2
