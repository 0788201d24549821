"""Overlap scheduling, from the records of a traced run (Engine(enable_trace=True), with
overlap_schedule_on_cpu=True or on a GPU, against disable_overlap_schedule=True).

What the records hold (labkit.trace.events):

- each StepRecord's `phases`: when the step scheduled its batch (`schedule`), built the ForwardBatch
  (`prepare`), ran the forward and the sampler (`forward`, `sample`) and took in a launched batch's
  tokens (`process`), and `processed_step`, the step whose batch those tokens came from: the step
  itself without overlap, the one before with it (the one-step lag);
- each request's station-7 (FORWARD) event: its input ids, where a decode row's input is a future
  token (`FutureMap.future_token(slot) = -1 - slot`) when the step before had not been taken in yet;
- its station-8 (SAMPLE) event: the token sampled for it in that step; its station-9 (DETOKENIZE)
  event: the step in which the host took that token in and turned it into text.

A request that finishes (EOS, max_new_tokens) while its next decode step is already scheduled rides
that step as an extra row: the row's token is dropped (no DETOKENIZE event follows its SAMPLE event)
and the KV slot it wrote goes into the prefix cache with the request's other slots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.model_executor.future_map import FutureMap
from labkit.trace.events import Station, StepRecord
from labkit.viz import style
from labkit.viz.run import Run

HOST_PHASES = ("schedule", "prepare", "process")
DEVICE_PHASES = ("forward", "sample")
PHASE_COLORS = {
    "schedule": style.STATION_COLORS[6],  # station 6: picked into a ScheduleBatch, KV allocated
    "prepare": "#8d99ae",
    "process": "#9b5de5",
    "sample": style.STATION_COLORS[8],
}  # the forward takes its forward mode's colour (style.MODE_COLORS)
OTHER = "#c9d6df"  # the rest of a step on the host: commit_batch, the tracer's records
BLOCKED = "#d9d9d9"  # the host inside the forward and the sampler (on a CPU it computes them)
BETWEEN = "#f1f1f1"  # between two steps: the engine streams and detokenizes, the tracer records
ARROW = "#555555"


def _phased_steps(source: Any) -> list[StepRecord]:
    steps = [s for s in Run.of(source).steps if s.phases]
    if not steps:
        raise ValueError("no step phases recorded: trace a run with Engine(enable_trace=True)")
    return steps


def step_phases(source: Any) -> pd.DataFrame:
    """One row per (step, phase) of a traced run, in time order: step, forward_mode, phase, lane
    ("host" or "device"), start and end (perf_counter seconds), ms, and processed_step (on the
    `process` rows: whose tokens the step took in)."""
    rows = [
        {
            "step": s.step,
            "forward_mode": s.forward_mode,
            "phase": name,
            "lane": "device" if name in DEVICE_PHASES else "host",
            "start": a,
            "end": b,
            "ms": (b - a) * 1e3,
            "processed_step": s.processed_step if name == "process" else None,
        }
        for s in _phased_steps(source)
        for name, (a, b) in sorted(s.phases.items(), key=lambda kv: kv[1][0])
    ]
    frame = pd.DataFrame(rows)
    frame["processed_step"] = frame["processed_step"].astype("Int64")
    return frame


def overlap_summary(source: Any, steps: tuple[int, int] | None = None) -> dict[str, float]:
    """Where a run's time went in steps `steps` (first, last; default all), from their recorded
    phases: `steps` (how many), `device_ms` (forward + sample), `host_ms`
    (the rest of each step, and the time until the next step began: scheduling, batch building,
    output processing, streaming, detokenizing, tracing), and `overlapped_ms`, the sum over steps of
    max(host, device): the time the same work would take if a separate device ran each forward while
    the host did the rest of its work. That last figure is a bound computed from these recordings,
    not a measurement: on a CPU the forward runs on the host's own cores, so nothing overlaps."""
    every = _phased_steps(source)
    host = device = overlapped = 0.0
    pairs = [(s, nxt) for s, nxt in zip(every, [*every[1:], None]) if steps is None or steps[0] <= s.step <= steps[1]]
    if not pairs:
        raise ValueError(f"no traced steps in {steps}")
    for s, nxt in pairs:
        if steps is not None and s.step == steps[1]:
            nxt = None  # the last step counted ends with its own record
        span = (nxt.start if nxt is not None else s.end) - s.start
        dev = sum(b - a for name, (a, b) in s.phases.items() if name in DEVICE_PHASES)
        host += span - dev
        device += dev
        overlapped += max(span - dev, dev)
    return {
        "steps": len(pairs),
        "device_ms": device * 1e3,
        "host_ms": host * 1e3,
        "host_share": host / max(host + device, 1e-12),
        "overlapped_ms": overlapped * 1e3,
    }


def token_frame(source: Any, rid: str | None = None) -> pd.DataFrame:
    """One row per token sampled for a request (all requests, or `rid`): rid, index (its place in the
    output), token, sampled_step (its station-8 event), taken_step (the station-9 event in which the
    host took it in; <NA>: dropped, the extra row of a request that finished while that step was
    already scheduled), lag (taken_step - sampled_step) and kept.

    Samples of prompt chunks (discarded) are left out. Meant for runs without retraction or
    speculation (a verify step samples several tokens per request); ValueError when a request's
    taken tokens do not match its sampled ones in order."""
    events = Run.of(source).tracer.events
    rids = [rid] if rid is not None else list(dict.fromkeys(e.rid for e in events if e.station == Station.SAMPLE))
    rows = []
    for r in rids:
        sampled = [
            (e.step, e.detail["token"])
            for e in events
            if e.rid == r and e.station == Station.SAMPLE and not e.detail.get("discarded") and e.step is not None
        ]
        taken = [
            (e.step, e.detail["token"])
            for e in events
            if e.rid == r
            and e.station == Station.DETOKENIZE
            and e.detail.get("token") is not None
            and e.step is not None
        ]
        if len(taken) > len(sampled) or [t for _, t in taken] != [t for _, t in sampled[: len(taken)]]:
            raise ValueError(f"{r}: the tokens taken in do not follow the tokens sampled (retraction, speculation?)")
        for i, (step, token) in enumerate(sampled):
            took = taken[i][0] if i < len(taken) else None
            rows.append((r, i, token, step, took, took - step if took is not None else None, took is not None))
    columns = ["rid", "index", "token", "sampled_step", "taken_step", "lag", "kept"]
    frame = pd.DataFrame(rows, columns=columns)
    for c in ("sampled_step", "taken_step", "lag"):
        frame[c] = frame[c].astype("Int64")
    return frame


HOST_Y, DEVICE_Y, BAR = 0.0, 1.0, 0.6  # lane centres and bar height


def draw_overlap_timeline(
    runs: Mapping[str, Any], steps: tuple[int, int] | None = None, *, title: str | None = None
) -> Figure:
    """One panel per run (label -> Run, Engine or Tracer), steps `steps` (first, last; default all)
    against time in ms since the first drawn step began, on two lanes:

    - host: schedule, prepare and process bars (gid "<label>|<step>|<phase>"), light grey while the
      forward and the sampler run (gid "<label>|<step>|blocked": a CPU computes them on the host's
      own cores), blue-grey for the rest of the step (gid "<label>|<step>|other": commit_batch, the
      tracer's records) and paler between steps (gid "<label>|<step>|between");
    - device: the forward (in its forward mode's colour) and the sampler.

    An arrow (Annotation gid "<label>|<M>-><N>") goes from the end of step M's sampling to the
    `process` of step N that took M's tokens in: N == M without overlap, N == M + 1 with it."""
    if not runs:
        raise ValueError("no runs to draw")
    fig = style.new_figure(11, 0.6 + 1.45 * len(runs))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    modes: set[str] = set()
    for ax, (label, source) in zip(axes, runs.items()):
        every = _phased_steps(source)
        drawn = [s for s in every if steps is None or steps[0] <= s.step <= steps[1]]
        if not drawn:
            raise ValueError(f"{label}: no traced steps in {steps}")
        following = {s.step: nxt.start for s, nxt in zip(every, every[1:]) if s is not drawn[-1]}
        for s in drawn:
            _draw_step(ax, label, s, drawn, following.get(s.step), drawn[0].start)
        modes |= {s.forward_mode for s in drawn}
        ax.set_yticks([HOST_Y, DEVICE_Y], ["host", "device"])
        ax.set_ylim(DEVICE_Y + 0.6, HOST_Y - 0.7)
        ax.set_title(label, loc="left", fontsize=9)
        ax.grid(axis="x", color="#eeeeee")
        ax.set_axisbelow(True)
    axes[-1].set_xlabel("ms since the first drawn step began")
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in HOST_PHASES]
    handles += [Patch(color=style.MODE_COLORS[m], label=f"forward ({m.lower()})") for m in sorted(modes)]
    handles += [
        Patch(color=PHASE_COLORS["sample"], label="sample"),
        Patch(color=BLOCKED, label="host inside forward + sample"),
        Patch(color=OTHER, label="rest of the step (commit, tracing)"),
        Patch(color=BETWEEN, label="between steps (stream, detokenize)"),
    ]
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    style.figure_title(fig, title or "Host and device work per step; arrows: sampled -> taken in")
    return fig


def _draw_step(ax: Any, label: str, s: StepRecord, drawn: list[StepRecord], following: float | None, t0: float) -> None:
    """One step's bars on both lanes (see draw_overlap_timeline), and the arrow into its process."""

    def bar(a: float, b: float, y: float, color: str, part: str) -> None:
        ax.broken_barh(
            [((a - t0) * 1e3, (b - a) * 1e3)], (y - BAR / 2, BAR), facecolors=color, gid=f"{label}|{s.step}|{part}"
        )

    if following is not None:
        bar(s.end, following, HOST_Y, BETWEEN, "between")
    bar(s.start, s.end, HOST_Y, OTHER, "other")
    device = [span for name, span in s.phases.items() if name in DEVICE_PHASES]
    if device:
        bar(min(a for a, _ in device), max(b for _, b in device), HOST_Y, BLOCKED, "blocked")
    for name, (a, b) in s.phases.items():
        if name == "forward":
            bar(a, b, DEVICE_Y, style.MODE_COLORS.get(s.forward_mode, "#777777"), name)
        else:
            bar(a, b, DEVICE_Y if name in DEVICE_PHASES else HOST_Y, PHASE_COLORS.get(name, "#777777"), name)
    x = (s.start - t0) * 1e3
    ax.axvline(x, color="#bbbbbb", lw=0.6, zorder=0)
    ax.annotate(f"step {s.step}", (x, HOST_Y - BAR / 2), xytext=(2, 2), textcoords="offset points", fontsize=7,
                color="#666666", va="bottom")  # fmt: skip
    came = next((r for r in drawn if r.step == s.processed_step), None)  # whose tokens it took in
    if "process" in s.phases and came is not None and "sample" in came.phases:
        x0, x1 = (came.phases["sample"][1] - t0) * 1e3, (s.phases["process"][0] - t0) * 1e3
        arrow = {"arrowstyle": "->", "color": ARROW, "lw": 0.9, "shrinkA": 0, "shrinkB": 0}
        ax.annotate("", (x1, HOST_Y + BAR / 2), (x0, DEVICE_Y - BAR / 2), arrowprops=arrow,
                    gid=f"{label}|{came.step}->{s.step}")  # fmt: skip


Resolver = Callable[[list[int], list[int]], list[int]]

# Hand-made cases first: a real id 0 (the first token id is a real token), the placeholder of slot
# 0 (-1), slots out of order, and a table longer than the slots used.
HAND_CASES: list[tuple[list[int], list[int], list[int]]] = [
    ([5, -1, 0, -3], [11, 12, 13, 14], [5, 11, 0, 13]),
    ([-2, -2, 7], [0, 42, 9], [42, 42, 7]),
    ([0, 1, 2], [8, 8, 8], [0, 1, 2]),
]


def placeholder_cases(source: Any) -> list[dict[str, Any]]:
    """The future tokens of a traced overlap run, step by step: for every step whose station-7 inputs
    hold future tokens, a dict with step, rids, input_ids (the rows recorded in full, in batch
    order), table (slot -> the token last sampled for that request slot before the step, as the
    ModelRunner's FutureMap holds it, 0 where nothing was sampled yet) and expected (the inputs with
    each future token replaced by the token its request sampled last: what the forward really read).
    The table is built per slot, the expected tokens per request: they agree only if the slots do."""
    by_step: dict[int, list] = {}
    for e in Run.of(source).tracer.events:  # in record order: a step's rows in batch order
        if e.station in (Station.FORWARD, Station.SAMPLE) and e.step is not None:
            by_step.setdefault(e.step, []).append(e)
    table: dict[int, int] = {}
    last: dict[str, int] = {}
    cases = []
    for step, evs in sorted(by_step.items()):
        rows = [
            e for e in evs if e.station == Station.FORWARD and all(isinstance(t, int) for t in e.detail["input_ids"])
        ]
        ids = [t for e in rows for t in e.detail["input_ids"]]
        if ids and FutureMap.has_future(ids):
            size = max([*table, *(-1 - t for t in ids if t < 0)]) + 1
            cases.append({
                "step": step,
                "rids": [e.rid for e in rows for _ in e.detail["input_ids"]],
                "input_ids": ids,
                "table": [table.get(slot, 0) for slot in range(size)],
                "expected": [
                    last[e.rid] if FutureMap.is_future(t) else t for e in rows for t in e.detail["input_ids"]
                ],
            })  # fmt: skip
        slots = {e.rid: e.detail["req_pool_idx"] for e in evs if e.station == Station.FORWARD}
        for e in evs:
            if e.station == Station.SAMPLE:  # every row's token goes into the table (FutureMap.store)
                table[slots[e.rid]] = last[e.rid] = e.detail["token"]
    return cases


def _labkit_resolve(input_ids: list[int], table: list[int]) -> list[int]:
    fmap = FutureMap(len(table), torch.device("cpu"))
    fmap.token_ids = torch.tensor(table, dtype=torch.int64)
    return fmap.resolve(torch.tensor(input_ids, dtype=torch.int64)).tolist()


def check_resolve(resolve: Resolver, source: Any) -> pd.DataFrame:
    """Assert that `resolve(input_ids, table)` turns future tokens into real ones as the ModelRunner
    does: a future token -1 - slot becomes table[slot], a real id (>= 0, 0 included) stays, and
    neither argument changes. Checked on HAND_CASES, then on every future token of the traced overlap
    run `source` (placeholder_cases), against the tokens the forward really read and against
    labkit's own FutureMap.resolve. Returns one row per future token of the run: step, rid,
    future_token, slot, resolved."""
    for ids, table, want in HAND_CASES:
        args = (list(ids), list(table))
        got = resolve(*args)
        assert list(got) == want, f"resolve({ids}, {table}) gave {got}, expected {want}"
        assert args == (ids, table), "resolve changed its arguments"
    cases = placeholder_cases(source)
    if not cases:
        raise ValueError("no future tokens in this run: trace an overlap run (overlap_schedule_on_cpu=True)")
    rows = []
    for case in cases:
        ids, table = case["input_ids"], case["table"]
        assert _labkit_resolve(ids, table) == case["expected"], f"step {case['step']}: the trace is inconsistent"
        got = list(resolve(list(ids), list(table)))
        assert got == case["expected"], (
            f"step {case['step']}: resolve({ids}, {table}) gave {got}, the forward read {case['expected']}"
        )
        rows += [
            (case["step"], rid, t, -1 - t, r) for rid, t, r in zip(case["rids"], ids, got) if FutureMap.is_future(t)
        ]
    print(f"resolve is right: {len(HAND_CASES)} hand-made cases and {len(rows)} future tokens of {len(cases)} steps")
    return pd.DataFrame(rows, columns=["step", "rid", "future_token", "slot", "resolved"])
