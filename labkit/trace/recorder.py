"""The Tracer: one recorder per run, shared by the engine, scheduler, radix cache and server parts.

Convention (why tracing off costs nothing): a component holds `tracer: Tracer | None` and guards every
record with `if self.tracer is not None:` *before* building it, so with tracing off no timestamps,
dicts or dataclasses are made; there is no "enabled" flag to consult on a hot path.

    if self.tracer is not None:
        self.tracer.station(req.rid, Station.ENQUEUE, t0, time.perf_counter(), prefix_len=n)

The recorder keeps payloads bounded so callers need not: token-id lists longer than `max_tokens`
(in station details, at any depth, and in TreeEvent.tokens) are cut to their first `max_tokens`
items followed by one marker string giving the full length, e.g. `[1, 2, ..., "...<300 total>"]`.
Lists are copied on record, so later mutation by the caller (e.g. `req.output_ids`) does not leak in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from labkit.trace import export
from labkit.trace.events import Station, StationEvent, StepRecord, TreeEvent
from labkit.trace.snapshot import StepSnapshot, snapshot_tree, snapshot_waiting

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_MAX_TOKENS = 64


def shorten(seq: list | tuple, limit: int) -> list:
    """Copy of `seq`; if longer than `limit`, its first `limit` items plus a full-length marker."""
    if len(seq) <= limit:
        return list(seq)
    return [*seq[:limit], f"...<{len(seq)} total>"]


def _bound(value: Any, limit: int) -> Any:
    """Recursively copy containers in a detail value, shortening long lists."""
    if isinstance(value, dict):
        return {k: _bound(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bound(v, limit) for v in shorten(value, limit)]
    return value


class Tracer:
    """Collects StationEvents, StepRecords and TreeEvents of one run; exports them.

    `max_tokens` bounds every recorded list (see module docstring). With `record_snapshots` (the
    default) the scheduler also leaves one StepSnapshot per step in `snapshots` (the radix tree with
    its locks and the waiting queue with its prefix matches; see labkit.trace.snapshot), which is
    what labkit.viz replays a run from.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, record_snapshots: bool = True) -> None:
        self.max_tokens = max_tokens
        self.events: list[StationEvent] = []
        self.steps: list[StepRecord] = []
        # Tensor parallelism: the step records of ranks 1.. (rank 0's are `steps`), gathered to rank 0.
        self.rank_steps: list[StepRecord] = []
        self.tree_events: list[TreeEvent] = []
        self.record_snapshots = record_snapshots
        self.snapshots: list[StepSnapshot] = []
        self._last_nodes: dict = {}  # node id -> NodeState of the last snapshot (shared if unchanged)

    def station(
        self, rid: str, station: Station, start: float, end: float, step: int | None = None, **detail: Any
    ) -> None:
        """Record that request `rid` spent [start, end] (perf_counter seconds) at `station`."""
        self.events.append(StationEvent(rid, Station(station), start, end, step, _bound(detail, self.max_tokens)))

    def step(self, record: StepRecord) -> None:
        """Record one scheduler step."""
        self.steps.append(record)

    def tree(self, event: TreeEvent) -> None:
        """Record one radix-tree change; usable directly as RadixCache's `on_event` callback."""
        if len(event.tokens) > self.max_tokens:
            event = dataclasses.replace(event, tokens=shorten(event.tokens, self.max_tokens))
        self.tree_events.append(event)

    def snapshot(self, step: int, tree_cache, waiting_queue: list) -> None:
        """Record the tree (with lock refs) and the waiting queue as step `step` left them. Called by
        the scheduler's trace hook at the end of every step; a no-op when record_snapshots is off."""
        if not self.record_snapshots:
            return
        tree = snapshot_tree(tree_cache, step, previous=self._last_nodes)
        if tree is not None:
            self._last_nodes = tree.by_id()
        self.snapshots.append(StepSnapshot(step, tree, snapshot_waiting(waiting_queue)))

    def snapshot_at(self, step: int) -> StepSnapshot | None:
        """The snapshot recorded at the end of scheduler step `step` (None if there is none)."""
        for snap in reversed(self.snapshots):
            if snap.step == step:
                return snap
        return None

    def detach(self) -> Tracer:
        """A new tracer holding every record made so far (every rank's steps included); this one is
        emptied and stays attached to its components for the next run."""
        copy = Tracer(self.max_tokens, self.record_snapshots)
        copy.events, copy.steps, copy.rank_steps = list(self.events), list(self.steps), list(self.rank_steps)
        copy.tree_events, copy.snapshots = list(self.tree_events), list(self.snapshots)
        self.clear()
        return copy

    def clear(self) -> None:
        """Drop all records (keeps the tracer attached to its components)."""
        self.events.clear()
        self.steps.clear()
        self.rank_steps.clear()
        self.tree_events.clear()
        self.snapshots.clear()
        self._last_nodes = {}

    def for_request(self, rid: str) -> list[StationEvent]:
        """Station events of `rid`, ordered by station then start time."""
        return sorted((e for e in self.events if e.rid == rid), key=lambda e: (e.station, e.start))

    @property
    def t0(self) -> float | None:
        """Earliest time in any record (the zero of exported timelines), or None when empty."""
        times = [e.start for e in self.events] + [s.start for s in self.steps]
        times += [t.time for t in self.tree_events]
        return min(times, default=None)

    # Exports: thin wrappers so notebooks can write tracer.to_dataframe("steps").
    def to_dataframe(self, kind: Literal["stations", "steps", "tree"] = "stations") -> pd.DataFrame:
        """See labkit.trace.export.to_dataframe."""
        return export.to_dataframe(self, kind)

    def to_perfetto(self) -> dict[str, Any]:
        """See labkit.trace.export.to_perfetto."""
        return export.to_perfetto(self)

    def save_perfetto(self, path: str | Path) -> Path:
        """See labkit.trace.export.save_perfetto."""
        return export.save_perfetto(self, path)
