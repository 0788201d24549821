"""A recorded run, as the visualizers read it: the Tracer's records of a real engine run (station
events, step records, tree events, per-step snapshots) plus the tokenizer to turn token ids into
text. Everything here is derived from those records; nothing is simulated.

Per-request phases per step (used by the timeline, the replayer and the tests) follow from the step
records alone:

- a request is *queued* from its arrival until the step that first batches it, and again after a
  retraction;
- when batched while it has prompt left to compute it runs a *prefill* chunk; it stays in prefill
  while it is the step's `chunked_rid` (more chunks to come);
- afterwards each batch it is in is a *decode*; a step that runs while it is decoding but does not
  include it (a prefill batch of other requests, without mixed chunking) is a *stall* for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from labkit.trace.events import Station, StepRecord, TreeEvent
from labkit.trace.recorder import Tracer
from labkit.trace.snapshot import StepSnapshot, TreeSnapshot

PHASES = ("queued", "prefill", "decode", "stalled")


@dataclass
class Cell:
    """What one request did in one scheduler step."""

    rid: str
    step: int
    phase: str  # one of PHASES
    tokens: int = 0  # tokens it contributed to the batch (chunk length, or 1 for a decode)
    prefix: int = 0  # tokens already in its KV when the step began (cached or computed earlier)


@dataclass
class Run:
    """A recorded run: wrap an Engine(enable_trace=True) (or its Tracer) with `Run.of(...)`.

    Derived views (cells, arrivals, tree events by step) are computed once and cached: after stepping
    the engine further, take a new `Run.of(engine)`."""

    tracer: Tracer
    tokenizer: Any = None
    label: str = ""
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # rid -> Engine result, if kept
    config: Any = None
    wall_time: float | None = None  # seconds the run took (run_requests sets it)

    @classmethod
    def of(cls, source: Any, label: str = "") -> Run:
        """A Run from a Run, an Engine (with enable_trace=True) or a Tracer."""
        if isinstance(source, Run):
            return source
        if isinstance(source, Tracer):
            return cls(source, label=label)
        tracer = getattr(source, "tracer", None)
        if tracer is None:
            raise ValueError("no trace: build the engine with Engine(enable_trace=True)")
        return cls(
            tracer,
            getattr(source, "tokenizer", None),
            label,
            dict(getattr(source, "results", {}) or {}),
            getattr(source, "config", None),
        )

    # ---- records -----------------------------------------------------------------------------
    @property
    def steps(self) -> list[StepRecord]:
        return self.tracer.steps

    @property
    def t0(self) -> float:
        return self.tracer.t0 or 0.0

    def step_record(self, step: int) -> StepRecord:
        for s in self.steps:
            if s.step == step:
                return s
        raise KeyError(f"no step {step} in this run (steps {self.step_ids[:1]}..{self.step_ids[-1:]})")

    @property
    def step_ids(self) -> list[int]:
        return [s.step for s in self.steps]

    def snapshot(self, step: int) -> StepSnapshot | None:
        return self.tracer.snapshot_at(step)

    def tree_at(self, step: int) -> TreeSnapshot | None:
        snap = self.snapshot(step)
        return snap.tree if snap is not None else None

    @cached_property
    def tree_events_by_step(self) -> dict[int, list[TreeEvent]]:
        """TreeEvents grouped by the step whose [start, end] holds their time."""
        starts = [s.start for s in self.steps]
        out: dict[int, list[TreeEvent]] = {}
        for ev in self.tracer.tree_events:
            i = bisect.bisect_right(starts, ev.time) - 1
            if i >= 0:
                out.setdefault(self.steps[i].step, []).append(ev)
        return out

    def tree_events(self, step: int) -> list[TreeEvent]:
        return self.tree_events_by_step.get(step, [])

    # ---- requests ----------------------------------------------------------------------------
    @cached_property
    def arrivals(self) -> dict[str, float]:
        """rid -> arrival time at the scheduler (station 5's start; else its first record)."""
        first: dict[str, float] = {}
        enqueue: dict[str, float] = {}
        for e in self.tracer.events:
            if e.station == Station.ENQUEUE:
                enqueue.setdefault(e.rid, e.start)
            if e.station >= Station.ENQUEUE or e.station == Station.TOKENIZE:
                first[e.rid] = min(first.get(e.rid, e.start), e.start)
        for s in self.steps:  # requests only seen as blocked (never scheduled, no station 5 yet)
            for rid in [*s.rids, *s.blocked]:
                first.setdefault(rid, s.start)
        return {rid: enqueue.get(rid, t) for rid, t in first.items()}

    @cached_property
    def rids(self) -> list[str]:
        """Every request of the run, in arrival order."""
        return sorted(self.arrivals, key=lambda r: (self.arrivals[r], r))

    @cached_property
    def cells(self) -> list[Cell]:
        """One Cell per (request, step) from its arrival to its finish (see module docstring)."""
        starts = [s.start for s in self.steps]
        arrive_idx = {rid: bisect.bisect_left(starts, t) for rid, t in self.arrivals.items()}
        in_prefill: dict[str, bool] = {}
        done: set[str] = set()
        out: list[Cell] = []
        for i, s in enumerate(self.steps):
            batch = {rid: (e, p) for rid, e, p in zip(s.rids, s.extend_lens, s.prefix_lens)}
            for rid in s.retracted:
                in_prefill[rid] = True
            for rid in self.rids:
                if rid in done or arrive_idx[rid] > i:
                    continue
                if rid in batch:
                    e, p = batch[rid]
                    phase = "prefill" if in_prefill.get(rid, True) else "decode"
                    out.append(Cell(rid, s.step, phase, e, p))
                    in_prefill[rid] = rid == s.chunked_rid
                else:
                    running = rid in in_prefill and not in_prefill[rid]
                    out.append(Cell(rid, s.step, "stalled" if running else "queued"))
            done.update(s.finished)
        return out

    def cells_of(self, rid: str) -> list[Cell]:
        return [c for c in self.cells if c.rid == rid]

    def finish_step(self, rid: str) -> int | None:
        return next((s.step for s in self.steps if rid in s.finished), None)

    # ---- text --------------------------------------------------------------------------------
    def text(self, tokens: list | tuple, limit: int | None = None) -> str:
        """Token ids as text (ids themselves without a tokenizer); newlines shown as the ↵ sign."""
        return token_text(self.tokenizer, tokens, limit)


def token_text(tokenizer: Any, tokens: list | tuple, limit: int | None = None, compact: bool = True) -> str:
    """Decode for labels: newlines as ↵; with `compact` the chat markers <|im_start|>/<|im_end|> as « »."""
    ids = [t for t in tokens if isinstance(t, int)]
    more = len(ids) < len(tokens)  # the recorder cut the list
    if tokenizer is None:
        text = " ".join(map(str, ids))
    else:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if compact:
            text = text.replace("<|im_start|>", "«").replace("<|im_end|>", "»")
    text = text.replace("\n", "↵").replace("\t", "→")
    if more:
        text += "…"
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return text
