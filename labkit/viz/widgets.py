"""ipywidgets that replay a recorded run: the station stepper (one request, station by station) and
the run replayer (one slider over scheduler steps driving the radix tree, memory, timeline and
waiting views together).

Every view is a PNG rendered by matplotlib from the run's records, shown in an ipywidgets.Image, so
the widgets need no interactive matplotlib backend. Where no widget front-end can render them
(`python` scripts, nbclient/nbconvert executing headless, `LABKIT_VIZ_STATIC=1`), `show()` falls
back to static output: displaying a widget sends a bundle that also carries the current view as
image/png, which a front-end without widget support shows instead, and with no kernel at all
`show()` displays (or returns) the static figures and tables.
"""

from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

import pandas as pd

from labkit.trace.events import Station, StationEvent
from labkit.viz import style
from labkit.viz.journey import STATION_TITLES, draw_journey, request_events
from labkit.viz.memory import draw_memory
from labkit.viz.run import Run, token_text
from labkit.viz.timeline import draw_timeline
from labkit.viz.tree import draw_radix_tree
from labkit.viz.waiting import draw_waiting, waiting_table


def widget_frontend() -> bool:
    """True inside a Jupyter kernel with ipywidgets installed (the front-end may still lack widget
    support: the display bundle carries a PNG fallback for that). LABKIT_VIZ_STATIC=1 forces False."""
    if os.environ.get("LABKIT_VIZ_STATIC", "") not in ("", "0"):
        return False
    try:
        import ipywidgets  # noqa: F401 (only whether it is installed matters here)
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def fig_png(fig, dpi: int = style.DISPLAY_DPI * style.PIXEL_DENSITY) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def display_width(png: bytes) -> int:
    """The CSS width a fig_png image shows at: its pixel width (from the PNG header) over PIXEL_DENSITY."""
    return round(int.from_bytes(png[16:20], "big") / style.PIXEL_DENSITY)


def _show(image, png: bytes) -> None:
    """Put a fig_png image into an ipywidgets Image at its display width."""
    image.value, image.width = png, str(display_width(png))


class _WithFallback:
    """Displays as the widget where widgets render, else as the PNG (and text) given."""

    def __init__(self, widget, png: bytes, text: str):
        self.widget, self.png, self.text = widget, png, text

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.widget._repr_mimebundle_() or {}
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data = dict(data)
        data["image/png"] = base64.b64encode(self.png).decode("ascii")
        data["text/plain"] = self.text
        return data


def _stack_pngs(pngs) -> bytes:
    """PNGs one above the other, in one PNG (the static stand-in for a widget of several images)."""
    from PIL import Image

    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs if p is not None]
    out = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    y = 0
    for i in images:
        out.paste(i, (0, y))
        y += i.height
    buf = io.BytesIO()
    out.save(buf, format="PNG")
    return buf.getvalue()


def _display(obj) -> None:
    from IPython.display import display

    display(obj)


# ---- station stepper ---------------------------------------------------------------------------
def _fmt_tokens(tokenizer, ids, limit: int = 24) -> str:
    ids = list(ids)
    shown = [t for t in ids if isinstance(t, int)][:limit]
    pieces = " | ".join(token_text(tokenizer, [t], compact=False) for t in shown) if tokenizer is not None else ""
    more = " …" if len(shown) < len(ids) else ""  # cut here, or by the recorder (its length marker)
    out = f"{shown}{more}"
    return out + (f"\n→ {pieces}{more}" if pieces else "")


def describe_event(e: StationEvent, tokenizer=None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(inputs, outputs) of one station visit, as (name, value) pairs for people."""
    d = e.detail
    tt = lambda ids: _fmt_tokens(tokenizer, ids)  # noqa: E731 (a one-line local shorthand)
    if e.station == Station.TOKENIZE:
        ids = d.get("input_ids", [])
        n = next((int(str(x).split("<")[1].split()[0]) for x in ids if isinstance(x, str)), len(ids))
        return [("text", repr(d.get("text")))], [("input_ids", f"{n} tokens: " + tt(ids))]
    if e.station == Station.ENQUEUE:
        return (
            [("prompt tokens", str(d.get("input_len")))],
            [
                ("prefix found in the radix cache", f"{d.get('prefix_len')} tokens"),
                ("waited in the queue", f"{(e.end - e.start) * 1e3:.1f} ms"),
            ],
        )
    if e.station == Station.BATCH:
        return (
            [("scheduler step", str(e.step)), ("forward mode", str(d.get("mode")))],
            [
                ("batch size", str(d.get("batch_size"))),
                ("prefix already in KV", str(d.get("prefix_len"))),
                ("new tokens this step", str(d.get("extend_len"))),
            ],
        )
    if e.station == Station.FORWARD:
        return (
            [
                ("input_ids", tt(d.get("input_ids", []))),
                ("positions", _short(d.get("positions", []))),
                ("KV slots written (out_cache_loc)", _short(d.get("out_cache_loc", []))),
                ("request slot (req_pool_idx)", str(d.get("req_pool_idx"))),
            ],
            [
                ("logits", "one row of vocabulary scores for the last position (top 5 at station 8)"),
                ("forward time", f"{(e.end - e.start) * 1e3:.1f} ms (the whole batch)"),
            ],
        )
    if e.station == Station.SAMPLE:
        top = list(zip(d.get("top_ids", []), d.get("top_logits", [])))
        rows = [f"{token_text(tokenizer, [t], compact=False)!r}: {v:.2f}" for t, v in top]
        out = [("token", f"{d.get('token')} = {token_text(tokenizer, [d.get('token')], compact=False)!r}")]
        if d.get("discarded"):
            out.append(("discarded", "yes: a prefill chunk that is not the last; no token is emitted"))
        return [("top logits", "\n".join(rows))], out
    if e.station == Station.DETOKENIZE:
        fin = d.get("finish_reason")
        out = [("text piece", repr(d.get("piece")))]
        out.append(("finished", f"{fin['type']} ({fin.get('matched')})" if fin else "no"))
        tok = d.get("token")
        return [("token", f"{tok} = {token_text(tokenizer, [tok], compact=False)!r}" if tok is not None else "-")], out
    return [], [(k, _short(v) if isinstance(v, list) else str(v)) for k, v in d.items()]


def _short(values, limit: int = 16) -> str:
    values = list(values)
    return str(values[:limit]) + (" …" if len(values) > limit else "")


def _html_rows(pairs: list[tuple[str, str]]) -> str:
    return "".join(
        f"<tr><td><b>{html.escape(k)}</b></td><td style='font-family:monospace'>"
        f"{html.escape(v).replace(chr(10), '<br>')}</td></tr>"
        for k, v in pairs
    )


class StationStepper:
    """Step through one request's station events in time order, each with what entered and left."""

    def __init__(self, source: Any, rid: str | None = None):
        self.run = Run.of(source)
        self.rid = rid if rid is not None else self.run.rids[0]
        self.events = request_events(self.run, self.rid)

    def table(self) -> pd.DataFrame:
        """Every station visit of the request: time, station, step, in and out (one line each)."""
        t0 = self.events[0].start
        rows = []
        for e in self.events:
            ins, outs = describe_event(e, self.run.tokenizer)
            rows.append(
                {
                    "t_ms": round((e.start - t0) * 1e3, 2),
                    "station": STATION_TITLES.get(e.station, e.station.name),
                    "step": e.step,
                    "in": "; ".join(f"{k}: {v}".replace("\n", " ") for k, v in ins)[:120],
                    "out": "; ".join(f"{k}: {v}".replace("\n", " ") for k, v in outs)[:120],
                }
            )
        return pd.DataFrame(rows)

    def html(self, i: int) -> str:
        e = self.events[i]
        ins, outs = describe_event(e, self.run.tokenizer)
        rows, rows_out = _html_rows(ins), _html_rows(outs)
        step = f" · scheduler step {e.step}" if e.step is not None else ""
        return (
            f"<h4>{self.rid}: station {STATION_TITLES.get(e.station, e.station.name)}{step} "
            f"(event {i + 1} of {len(self.events)})</h4>"
            f"<table><tr><th align=left>in</th><th></th></tr>{rows}"
            f"<tr><th align=left>out</th><th></th></tr>{rows_out}</table>"
        )

    def figure(self, i: int | None = None):
        """The request's journey (labkit.viz.journey.draw_journey), event i highlighted."""
        return draw_journey(self.run, self.rid, highlight=i)

    def widget(self):
        import ipywidgets as w

        slider = w.IntSlider(
            0, 0, len(self.events) - 1, description="event", continuous_update=False, layout=w.Layout(width="60%")
        )
        prev, nxt = w.Button(description="◀ prev"), w.Button(description="next ▶")
        info = w.HTML(self.html(0))
        image = w.Image(format="png")
        _show(image, fig_png(self.figure(0)))

        def update(change=None):
            info.value = self.html(slider.value)
            _show(image, fig_png(self.figure(slider.value)))

        slider.observe(update, names="value")
        prev.on_click(lambda _: setattr(slider, "value", max(slider.value - 1, 0)))
        nxt.on_click(lambda _: setattr(slider, "value", min(slider.value + 1, slider.max)))
        box = w.VBox([w.HBox([prev, nxt, slider]), info, image])
        box.labkit = {"slider": slider, "info": info, "image": image}
        return box

    def show(self):
        """Display the stepper widget (with a static fallback), or the static table and figure."""
        if widget_frontend():
            box = self.widget()
            _display(_WithFallback(box, box.labkit["image"].value, self.table().to_string()))
            return None
        try:
            _display(self.table())
            _display(self.figure())
        except ImportError:
            return self.table()
        return None


# ---- run replayer ------------------------------------------------------------------------------
class RunReplayer:
    """One slider over the scheduler steps of a recorded run; the radix tree, the KV memory, the
    batching timeline and the waiting view all show that step."""

    def __init__(self, source: Any, x: str = "step"):
        self.run = Run.of(source)
        if not self.run.steps:
            raise ValueError("the run has no steps")
        self.x = x
        self.has_tree = any(s.tree is not None for s in self.run.tracer.snapshots)
        self._cache: dict[int, tuple[bytes | None, bytes]] = {}

    @property
    def steps(self) -> list[int]:
        return self.run.step_ids

    def tree_figure(self, step: int):
        return draw_radix_tree(self.run, step, max_height=18)

    def overview_figure(self, step: int):
        """Memory, timeline and waiting views of the run with step `step` marked, and the waiting list."""
        run = self.run
        n = len(run.rids)
        h_tl = max(1.6, 0.2 * n + 0.8)
        fig = style.new_figure(13, 2.6 + h_tl + h_tl + 0.6)
        gs = fig.add_gridspec(3, 2, width_ratios=[3.2, 1.3], height_ratios=[2.6, h_tl, h_tl])
        ax_m = fig.add_subplot(gs[0, 0])
        ax_t = fig.add_subplot(gs[1, 0], sharex=ax_m)
        ax_w = fig.add_subplot(gs[2, 0], sharex=ax_m)
        ax_txt = fig.add_subplot(gs[:, 1])
        draw_memory(run, ax=ax_m, highlight_step=step, title="KV memory after each step")
        draw_timeline(
            run, x="step", ax=ax_t, show_batch=False, highlight_step=step, label_chunks=False, title="Batching timeline"
        )
        draw_waiting(run, ax=ax_w, highlight_step=step, title="Why is this request still waiting?")
        for a in (ax_m, ax_t):
            a.set_xlabel("")
            a.tick_params(labelbottom=False)
        s = run.step_record(step)
        lines = [
            f"step {step}: {s.forward_mode}, {len(s.rids)} request(s), {s.num_tokens} tokens",
            f"running {s.running}, waiting {s.waiting}",
            f"pool: free {s.pool.free}, evictable {s.pool.evictable},",
            f"      protected {s.pool.protected}, request-owned {s.pool.request_owned}",
        ]
        if s.finished:
            lines.append("finished: " + ", ".join(s.finished))
        if s.retracted:
            lines.append("retracted: " + ", ".join(s.retracted))
        lines += ["", f"Waiting after step {step}:"]
        table = waiting_table(run, step)
        if table.empty:
            lines.append("  nobody")
        for _, r in table.head(12).iterrows():
            lines.append(f"  {r['rid']}: {r['category']}")
            if r["prefix_match"]:
                lines.append(f"    prefix: {r['prefix_match']}")
        if len(table) > 12:
            lines.append(f"  ... and {len(table) - 12} more")
        ax_txt.axis("off")
        ax_txt.text(0, 1.0, "\n".join(lines), va="top", fontsize=8.5, family="monospace", transform=ax_txt.transAxes)
        style.figure_title(fig, f"Replay of {run.label or 'the run'} at step {step} (dotted line)", fontsize=12)
        return fig

    def figures(self, step: int) -> list:
        figs = [self.overview_figure(step)]
        if self.has_tree:
            figs.insert(0, self.tree_figure(step))
        return figs

    def _pngs(self, step: int) -> tuple[bytes | None, bytes]:
        if step not in self._cache:
            tree = fig_png(self.tree_figure(step)) if self.has_tree else None
            self._cache[step] = (tree, fig_png(self.overview_figure(step)))
        return self._cache[step]

    def widget(self, step: int | None = None):
        import ipywidgets as w

        steps = self.steps
        start = step if step is not None else steps[-1]
        slider = w.SelectionSlider(
            options=steps, value=start, description="step", continuous_update=False, layout=w.Layout(width="80%")
        )
        tree_png, over_png = self._pngs(start)
        over = w.Image(format="png")
        _show(over, over_png)
        children = [slider, over]
        tree = None
        if tree_png is not None:
            tree = w.Image(format="png")
            _show(tree, tree_png)
            children.append(tree)

        def update(change=None):
            t, o = self._pngs(slider.value)
            _show(over, o)
            if tree is not None and t is not None:
                _show(tree, t)

        slider.observe(update, names="value")
        box = w.VBox(children)
        box.labkit = {"slider": slider, "overview": over, "tree": tree}
        return box

    def show(self, step: int | None = None):
        """Display the replayer widget at `step` (default: the last), with a static fallback."""
        step = step if step is not None else self.steps[-1]
        if widget_frontend():
            box = self.widget(step)
            _display(_WithFallback(box, _stack_pngs(self._pngs(step)), f"RunReplayer at step {step}"))
            return None
        figs = self.figures(step)
        try:
            for f in figs:
                _display(f)
        except ImportError:
            return figs
        return None
