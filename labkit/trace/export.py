"""Exports of a Tracer's records: pandas DataFrames (for tables and labkit.viz) and Chrome/Perfetto
trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from labkit.trace.events import PoolUsage, Station, StationEvent, StepRecord, TierUsage, TreeEvent

if TYPE_CHECKING:
    import pandas as pd

    from labkit.trace.recorder import Tracer

Kind = Literal["stations", "steps", "tree", "ranks"]

STATION_COLUMNS = ["rid", "station", "station_name", "start", "end", "duration", "step", "detail"]
STEP_COLUMNS = [
    "step", "start", "end", "duration", "forward_mode", "batch_size", "rids", "extend_lens",
    "prefix_lens", "num_tokens", "cache_hit_tokens", "pool_total", "pool_free", "pool_evictable",
    "pool_protected", "pool_request_owned", "running", "waiting", "chunked_rid", "finished",
    "retracted", "blocked", "expert_tokens", "drafts", "accepted", "rollback_slots", "host_total", "host_free",
    "host_host_only", "host_backed_up",
]  # fmt: skip
TREE_COLUMNS = ["kind", "time", "node_id", "parent_id", "num_tokens", "tokens"]
RANK_COLUMNS = [
    "step", "rank", "start", "end", "duration", "forward_mode", "num_tokens", "comm_calls", "comm_bytes",
    "comm_seconds", "sampled_digest",
]  # fmt: skip
POOL_FIELDS = ("free", "evictable", "protected", "request_owned")
HOST_FIELDS = ("total", "free", "host_only", "backed_up")  # TierUsage

# Perfetto process ids: one track group per record type.
PID_REQUESTS, PID_SCHEDULER = 1, 2
TID_STEPS, TID_TREE = 1, 2
TID_RANK0 = 100  # tensor parallelism: rank r's steps on thread TID_RANK0 + r (rank 0's are TID_STEPS)


def to_dataframe(tracer: Tracer, kind: Kind = "stations") -> pd.DataFrame:
    """One row per record of `kind`. Times stay absolute perf_counter seconds (subtract tracer.t0).

    stations: rid, station (int), station_name, start, end, duration, step, detail (the dict), plus one
        column per scalar detail key (named `detail_<key>` if it collides with a fixed column).
    steps: StepRecord fields with duration, batch_size and the pool flattened into pool_<field>
        (expert_tokens: None for dense models).
    tree: TreeEvent fields.
    ranks: every tensor-parallel rank's steps (rank 0's and tracer.rank_steps), one row per rank and
        step, with the time in collectives (comm_seconds, where they block) and the sampled-token digest.
    """
    import pandas as pd  # lazy: processes that only record never pay for pandas

    if kind == "stations":
        rows = []
        for e in tracer.events:
            row: dict[str, Any] = {
                "rid": e.rid, "station": int(e.station), "station_name": e.station.name,
                "start": e.start, "end": e.end, "duration": e.end - e.start, "step": e.step,
                "detail": e.detail,
            }  # fmt: skip
            for k, v in e.detail.items():
                if v is None or isinstance(v, (str, int, float, bool)):
                    row[f"detail_{k}" if k in STATION_COLUMNS else k] = v
            rows.append(row)
        df = pd.DataFrame(rows, columns=_with_extra(STATION_COLUMNS, rows))
        df["step"] = df["step"].astype("Int64")  # nullable: stations 1-5 and 10 have no step
        return df
    if kind == "steps":
        rows = [
            {
                "step": s.step,
                "start": s.start,
                "end": s.end,
                "duration": s.end - s.start,
                "forward_mode": s.forward_mode,
                "batch_size": len(s.rids),
                "rids": s.rids,
                "extend_lens": s.extend_lens,
                "prefix_lens": s.prefix_lens,
                "num_tokens": s.num_tokens,
                "cache_hit_tokens": s.cache_hit_tokens,
                "pool_total": s.pool.total,
                **{f"pool_{f}": getattr(s.pool, f) for f in POOL_FIELDS},
                "running": s.running,
                "waiting": s.waiting,
                "chunked_rid": s.chunked_rid,
                "finished": s.finished,
                "retracted": s.retracted,
                "blocked": s.blocked,
                "expert_tokens": s.expert_tokens,
                "drafts": s.drafts,
                "accepted": s.accepted,
                "rollback_slots": s.rollback_slots,
                **{f"host_{f}": getattr(s.host_pool, f) if s.host_pool else None for f in HOST_FIELDS},
            }  # fmt: skip
            for s in tracer.steps
        ]
        return pd.DataFrame(rows, columns=STEP_COLUMNS)
    if kind == "tree":
        rows = [{c: getattr(t, c) for c in TREE_COLUMNS} for t in tracer.tree_events]
        df = pd.DataFrame(rows, columns=TREE_COLUMNS)
        df["parent_id"] = df["parent_id"].astype("Int64")  # the root has no parent
        return df
    if kind == "ranks":
        rows = [
            {**{c: getattr(s, c) for c in RANK_COLUMNS if hasattr(s, c)}, "duration": s.end - s.start}
            for s in [*tracer.steps, *tracer.rank_steps]
        ]
        return pd.DataFrame(rows, columns=RANK_COLUMNS).sort_values(["step", "rank"], ignore_index=True)
    raise ValueError(f"kind must be 'stations', 'steps', 'tree' or 'ranks', not {kind!r}")


def _with_extra(columns: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """`columns` followed by any other keys of `rows`, in first-seen order."""
    extra = dict.fromkeys(k for r in rows for k in r if k not in columns)
    return columns + list(extra)


def to_perfetto(tracer: Tracer) -> dict[str, Any]:
    """Chrome trace-event JSON of the run, times in microseconds from tracer.t0.

    Process "requests": one thread per rid, a complete ("X") event per station visit.
    Process "scheduler": thread "steps" with an "X" event per step (named by forward mode), thread
    "radix tree" with instant ("i") events for insert/split/evict, a traced step's phases (schedule,
    prepare, forward, sample, process) as "X" events nested in its step, and counters ("C") "kv_pool"
    (free/evictable/protected/request_owned) and "queue" (running/waiting) per step. With tensor
    parallelism, thread "steps, rank r" holds rank r's steps (rank 0's are "steps").
    """
    t0 = tracer.t0 or 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    def meta(name: str, pid: int, tid: int | None, value: str) -> dict[str, Any]:
        ev = {"name": name, "ph": "M", "pid": pid, "args": {"name": value}}
        return ev if tid is None else {**ev, "tid": tid}

    out = [
        meta("process_name", PID_REQUESTS, None, "requests"),
        meta("process_name", PID_SCHEDULER, None, "scheduler"),
        meta("thread_name", PID_SCHEDULER, TID_STEPS, "steps"),
        meta("thread_name", PID_SCHEDULER, TID_TREE, "radix tree"),
    ]
    tids: dict[str, int] = {}
    for e in tracer.events:
        if e.rid not in tids:
            tids[e.rid] = len(tids) + 1
            out.append(meta("thread_name", PID_REQUESTS, tids[e.rid], e.rid))
        args = {"rid": e.rid, "step": e.step, **e.detail}
        out.append({
            "name": f"{int(e.station)} {e.station.name.lower()}", "cat": "station", "ph": "X",
            "ts": us(e.start), "dur": max(0.0, us(e.end) - us(e.start)),
            "pid": PID_REQUESTS, "tid": tids[e.rid], "args": _jsonable(args),
        })  # fmt: skip
    ranks = sorted({s.rank for s in tracer.rank_steps})
    out += [meta("thread_name", PID_SCHEDULER, TID_RANK0 + r, f"steps, rank {r}") for r in ranks]
    for s in [*tracer.steps, *tracer.rank_steps]:
        pool = {f: getattr(s.pool, f) for f in POOL_FIELDS}
        args = {
            "step": s.step, "rids": s.rids, "extend_lens": s.extend_lens, "prefix_lens": s.prefix_lens,
            "num_tokens": s.num_tokens, "cache_hit_tokens": s.cache_hit_tokens,
            "pool": {"total": s.pool.total, **pool}, "running": s.running, "waiting": s.waiting,
            "chunked_rid": s.chunked_rid, "finished": s.finished, "retracted": s.retracted,
            "blocked": s.blocked, "rank": s.rank, "comm_calls": s.comm_calls,
            "comm_bytes": s.comm_bytes, "comm_seconds": s.comm_seconds,
            "sampled_digest": s.sampled_digest, "expert_tokens": s.expert_tokens,
            "drafts": s.drafts, "accepted": s.accepted, "rollback_slots": s.rollback_slots,
            "phases": s.phases, "processed_step": s.processed_step,
            "host_pool": asdict(s.host_pool) if s.host_pool else None,
        }  # fmt: skip
        out.append({
            "name": s.forward_mode, "cat": "step", "ph": "X", "ts": us(s.start),
            "dur": max(0.0, us(s.end) - us(s.start)), "pid": PID_SCHEDULER,
            "tid": TID_RANK0 + s.rank if s.rank else TID_STEPS, "args": _jsonable(args),
        })  # fmt: skip
        for phase, (a, b) in s.phases.items():  # nested under the step's slice on its thread
            out.append({
                "name": phase, "cat": "phase", "ph": "X", "ts": us(a), "dur": max(0.0, us(b) - us(a)),
                "pid": PID_SCHEDULER, "tid": TID_RANK0 + s.rank if s.rank else TID_STEPS, "args": {"step": s.step},
            })  # fmt: skip
        if s.rank:
            continue  # the pool and queue counters are rank 0's (every rank has the same)
        # Counters at the step's end: the pool as the step left it.
        counters = [("kv_pool", pool), ("queue", {"running": s.running, "waiting": s.waiting})]
        if s.host_pool:
            counters.append(("host_kv_pool", {f: getattr(s.host_pool, f) for f in HOST_FIELDS[1:]}))
        for name, values in counters:
            out.append({"name": name, "ph": "C", "ts": us(s.end), "pid": PID_SCHEDULER, "args": values})
    for t in tracer.tree_events:
        out.append({
            "name": f"tree {t.kind}", "cat": "tree", "ph": "i", "s": "t", "ts": us(t.time),
            "pid": PID_SCHEDULER, "tid": TID_TREE,
            "args": _jsonable({"node_id": t.node_id, "parent_id": t.parent_id,
                               "num_tokens": t.num_tokens, "tokens": t.tokens}),
        })  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def save_perfetto(tracer: Tracer, path: str | Path) -> Path:
    """Write to_perfetto(tracer) as JSON to `path`; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_perfetto(tracer)))
    return path


def from_perfetto(trace: dict[str, Any] | str | Path) -> Tracer:
    """The Tracer a to_perfetto trace was made from (a dict, or the path of a saved one), so a trace
    file (`python -m labkit.server --trace-file`) can be read back into tables and labkit.viz.

    Times come back in seconds from the trace's zero (tracer.t0 of the run), details as JSON made
    them (tuples as lists, enums by name); the counters are derived data and are skipped. Per-step
    tree snapshots are not in a trace: views that need them (the radix tree per step) cannot be drawn.
    """
    from labkit.trace.recorder import Tracer  # the recorder imports this module

    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    tracer = Tracer()
    for ev in trace["traceEvents"]:
        args, start = dict(ev.get("args", {})), ev.get("ts", 0.0) / 1e6
        end = start + ev.get("dur", 0.0) / 1e6
        if ev.get("cat") == "station":
            station = Station(int(ev["name"].split()[0]))
            tracer.events.append(StationEvent(args.pop("rid"), station, start, end, args.pop("step"), args))
        elif ev.get("cat") == "step":
            pool = PoolUsage(**args.pop("pool"))
            host = args.pop("host_pool", None)
            host_pool = TierUsage(**host) if host else None
            record = StepRecord(start=start, end=end, forward_mode=ev["name"], pool=pool, host_pool=host_pool, **args)
            (tracer.rank_steps if record.rank else tracer.steps).append(record)
        elif ev.get("cat") == "tree":
            tracer.tree_events.append(TreeEvent(kind=ev["name"].removeprefix("tree "), time=start, **args))
    return tracer


def _jsonable(value: Any) -> Any:
    """Details are meant to be JSON-able; coerce stragglers (enums, numpy, torch) so export never fails."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.name
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist"):  # numpy arrays/scalars, torch tensors
        return _jsonable(value.tolist())
    return str(value)
