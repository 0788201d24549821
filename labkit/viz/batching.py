"""Station 6 read back from a recorded run: what each step cost, and what the scheduler saw and chose.

    step_costs(run_a, run_b)             # one row per step: forward mode, rows, prefill/decode, ms
    fit_step_cost(step_costs(...))       # ms = fixed + per_row * rows, least squares over the steps
    draw_step_costs(step_costs(...))     # the steps' time against their rows, and that line
    batch_decisions(run)                 # per step: the BatchState the scheduler saw, what it ran
    decisions_frame(run)                 # the same as a table
    check_batch_rule(my_rule, run, ...)  # your rule against every step of real runs

A BatchState is the part of the scheduler's state that decides the next batch when memory is
plentiful (`Scheduler.get_next_batch_to_run`, `PrefillAdder`): the requests decoding, the requests
with prompt tokens still to compute (the one being prefilled in chunks first, then the waiting queue
in fcfs order), the chunk budget, the running-request cap and whether decodes may join a prefill
(MIXED). Everything is read from the run's step records (`Run.cells`); nothing is simulated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from labkit.model_executor.model_runner import resolve_device
from labkit.scheduler.scheduler import default_chunked_prefill_size
from labkit.viz import style
from labkit.viz.run import Cell, Run

COMPUTING = ("EXTEND", "DECODE", "MIXED")  # the forward modes a BatchState explains
# PrefillAdder's reasons (StepRecord.blocked) for limits a BatchState leaves out: memory, token budget.
UNMODELLED = ("kv memory", "prefill token budget")


# ---- what a step cost -----------------------------------------------------------------------------
def step_costs(*sources: Any) -> pd.DataFrame:
    """One row per step of the runs: run label, step, forward mode, prefill tokens, decode rows,
    rows (all tokens of the forward), kind ("DECODE 3", "EXTEND 128", "MIXED 128+3") and its wall
    time in ms (StepRecord end - start: scheduling, the forward, sampling and the finish checks)."""
    rows = []
    for source in sources:
        run = Run.of(source)
        decodes: dict[int, int] = {}
        for c in run.cells:
            decodes[c.step] = decodes.get(c.step, 0) + (c.phase == "decode")
        for s in run.steps:
            computed = dict(zip(s.rids, s.extend_lens))
            decode = decodes.get(s.step, 0)
            prefill = sum(computed.values()) - decode
            kind = {
                "EXTEND": f"EXTEND {prefill}",
                "DECODE": f"DECODE {decode}",
                "MIXED": f"MIXED {prefill}+{decode}",
            }.get(s.forward_mode, s.forward_mode)
            rows.append(
                {
                    "run": run.label,
                    "step": s.step,
                    "forward_mode": s.forward_mode,
                    "prefill_tokens": prefill,
                    "decode_rows": decode,
                    "rows": s.num_tokens,
                    "kind": kind,
                    "ms": (s.end - s.start) * 1e3,
                }
            )
    return pd.DataFrame(rows)


def fit_step_cost(frame: pd.DataFrame) -> tuple[float, float]:
    """(fixed_ms, ms_per_row): the least-squares line ms = fixed + per_row * rows through the steps
    of a step_costs frame (EXTEND, DECODE and MIXED steps)."""
    df = frame[frame["forward_mode"].isin(COMPUTING)]
    if df["rows"].nunique() < 2:
        raise ValueError("fitting a line needs steps of at least two sizes")
    per_row, fixed = np.polyfit(df["rows"].to_numpy(float), df["ms"].to_numpy(float), 1)
    return float(fixed), float(per_row)


def draw_step_costs(frame: pd.DataFrame, title: str | None = None) -> Figure:
    """Each step's wall time against the rows (tokens) it computed, coloured by forward mode, with the
    fitted line ms = fixed + per_row * rows. Returns the Figure."""
    fixed, per_row = fit_step_cost(frame)
    fig = style.new_figure(9, 3.6)
    ax = fig.subplots()
    handles = []
    for mode in COMPUTING:
        df = frame[frame["forward_mode"] == mode]
        if len(df):
            ax.scatter(df["rows"], df["ms"], s=22, color=style.MODE_COLORS[mode], alpha=0.8, lw=0, gid=f"steps-{mode}")
            handles.append(Line2D([], [], marker="o", ls="none", color=style.MODE_COLORS[mode], label=f"{mode} steps"))
    xs = np.array([0, frame["rows"].max() * 1.04])
    ax.plot(xs, fixed + per_row * xs, color="#333333", lw=1, ls="--", gid="fit")
    handles.append(
        Line2D([], [], color="#333333", lw=1, ls="--", label=f"fit: {fixed:.0f} ms + {per_row:.2f} ms per row")
    )
    ax.set_xlim(0, xs[1])
    ax.set_ylim(0, frame["ms"].max() * 1.08)
    ax.set_xlabel("rows in the forward (prefill tokens + decode rows)")
    ax.set_ylabel("step time (ms)")
    ax.grid(color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False)
    ax.set_title(title or "What a step costs on this machine", loc="left", fontsize=11, weight="bold")
    return fig


# ---- what the scheduler saw and chose -------------------------------------------------------------
@dataclass(frozen=True)
class Pending:
    """A request with prompt tokens still to compute (not yet decoding)."""

    rid: str
    tokens_left: int  # prompt tokens still to compute (the prompt less its cached prefix and chunks done)
    started: bool  # some of its prompt is computed already (it is being prefilled in chunks)


@dataclass(frozen=True)
class BatchState:
    """What the scheduler knows before a step, as far as choosing the batch goes (memory aside)."""

    step: int
    decoding: tuple[str, ...]  # running requests with their prompt done: each can decode one token
    pending: tuple[Pending, ...]  # the request being chunk-prefilled first, then the waiting queue
    chunked_prefill_size: int | None  # most prompt tokens in one step (None: no chunking)
    max_running_requests: int  # most requests running (decoding or prefilling) at once
    mixed: bool  # enable_mixed_chunk: running decodes join a step that prefills


@dataclass(frozen=True)
class Decision:
    """One recorded step: the state before it and the batch labkit ran (rid -> tokens computed)."""

    state: BatchState
    chosen: dict[str, int]
    forward_mode: str


def _settings(run: Run) -> tuple[int | None, int, bool]:
    cfg = run.config
    if cfg is None:
        raise ValueError("the run has no config: record it with run_requests or Run.of(engine)")
    if cfg.schedule_policy != "fcfs" or cfg.page_size != 1:
        raise ValueError("a BatchState explains fcfs runs with page_size 1")
    chunk = cfg.chunked_prefill_size
    if chunk is None:
        chunk = default_chunked_prefill_size(resolve_device(cfg.device))
    return (chunk if chunk > 0 else None), cfg.max_running_requests, cfg.enable_mixed_chunk


def batch_decisions(source: Any) -> list[Decision]:
    """The BatchState before each step of a recorded fcfs run and the batch labkit chose, for the
    EXTEND, DECODE and MIXED steps that no unmodelled limit shaped (no retraction, no request held
    back for KV memory or the prefill token budget: see StepRecord.blocked)."""
    run = Run.of(source)
    chunk, cap, mixed = _settings(run)
    by_rid: dict[str, list[Cell]] = {}
    by_step: dict[int, list[Cell]] = {}
    for c in run.cells:
        by_rid.setdefault(c.rid, []).append(c)
        by_step.setdefault(c.step, []).append(c)

    def tokens_left(rid: str, step: int) -> int:
        # The prefill tokens it computes from `step` until it first decodes (or stalls, or ends).
        left = 0
        for c in by_rid[rid]:
            if c.step < step:
                continue
            if c.phase in ("decode", "stalled"):
                break
            left += c.tokens
        return left

    out = []
    chunked: str | None = None  # the previous step's chunked_rid: continues first
    for s in run.steps:
        cells = by_step.get(s.step, [])
        unmodelled = s.retracted or any(r.startswith(UNMODELLED) for r in s.blocked.values())
        if s.forward_mode in COMPUTING and not unmodelled:
            # Arrival order after the chunked request (a stable sort). Retracted requests go back to
            # the head of the queue, but under fcfs everyone still waiting arrived after them.
            pending = sorted((c for c in cells if c.phase in ("queued", "prefill")), key=lambda c: c.rid != chunked)
            state = BatchState(
                step=s.step,
                decoding=tuple(c.rid for c in cells if c.phase in ("decode", "stalled")),
                pending=tuple(Pending(c.rid, tokens_left(c.rid, s.step), c.rid == chunked) for c in pending),
                chunked_prefill_size=chunk,
                max_running_requests=cap,
                mixed=mixed,
            )
            out.append(Decision(state, dict(zip(s.rids, s.extend_lens)), s.forward_mode))
        chunked = s.chunked_rid
    return out


def decisions_frame(source: Any) -> pd.DataFrame:
    """batch_decisions as a table: per step, who was decoding, who had prompt left (tokens left),
    and what labkit ran."""
    rows = [
        {
            "step": d.state.step,
            "decoding": ", ".join(d.state.decoding),
            "pending (tokens left)": ", ".join(
                f"{p.rid} ({p.tokens_left}{', started' if p.started else ''})" for p in d.state.pending
            ),
            "labkit ran": ", ".join(f"{rid}: {n}" for rid, n in d.chosen.items()),
            "forward_mode": d.forward_mode,
        }
        for d in batch_decisions(source)
    ]
    return pd.DataFrame(rows).set_index("step")


BatchRule = Callable[[BatchState], dict[str, int]]


def check_batch_rule(rule: BatchRule, *sources: Any) -> pd.DataFrame:
    """Assert that `rule(state)` (rid -> tokens to compute this step: a prefill chunk's length, or 1
    for a decode) picks exactly the batch labkit ran, at every step batch_decisions explains, in
    every run given. Raises AssertionError at the first step where it differs, naming the state, the
    batch labkit ran and the rule's; returns a table of the steps checked per run."""
    rows = []
    for source in sources:
        run = Run.of(source)
        decisions = batch_decisions(run)
        assert decisions, f"run {run.label!r}: no step to check"
        for d in decisions:
            got = rule(d.state)  # frozen, of tuples: a rule cannot change what it is shown
            assert isinstance(got, dict), f"the rule must return a dict rid -> tokens, got {type(got).__name__}"
            got = {rid: n for rid, n in got.items() if n}
            if got != d.chosen:
                lines = [
                    f"run {run.label!r}, step {d.state.step} ({d.forward_mode}): your rule picked {got}",
                    f"  labkit ran {d.chosen}",
                    f"  decoding: {list(d.state.decoding)}",
                    "  pending: " + ", ".join(f"{p.rid} ({p.tokens_left} left)" for p in d.state.pending),
                    f"  chunked_prefill_size={d.state.chunked_prefill_size}, "
                    f"max_running_requests={d.state.max_running_requests}, mixed={d.state.mixed}",
                ]
                raise AssertionError("\n".join(lines))
        modes = pd.Series([d.forward_mode for d in decisions]).value_counts()
        rows.append(
            {
                "run": run.label,
                "steps checked": len(decisions),
                "of steps": len(run.steps),
                **{mode: int(modes.get(mode, 0)) for mode in COMPUTING},
            }
        )
    return pd.DataFrame(rows).set_index("run")
