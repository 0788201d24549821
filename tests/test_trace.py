"""Tracer recording, payload bounding and exports, on synthetic records."""

from __future__ import annotations

import json

import pytest

from labkit.trace import PoolUsage, Station, StepRecord, Tracer, TreeEvent, from_perfetto

T = 1000.0  # an arbitrary perf_counter origin


def make_tracer() -> Tracer:
    tr = Tracer(max_tokens=8)
    for i, rid in enumerate(["a", "b"]):
        base = T + i * 0.001
        tr.station(rid, Station.HTTP_RECEIVE, base, base + 0.0001, bytes=120)
        tr.station(rid, Station.TOKENIZE, base + 0.0002, base + 0.0003, input_ids=list(range(20)))
        tr.station(rid, Station.ENQUEUE, base + 0.0004, base + 0.0005, prefix_len=4 * i)
    tr.station("a", Station.FORWARD, T + 0.003, T + 0.004, step=0, num_tokens=40, shape=[2, 3])
    tr.station("a", Station.SAMPLE, T + 0.004, T + 0.004, step=0, token=7, top=[(7, 0.9), (3, 0.1)])
    for step, mode in enumerate(["EXTEND", "DECODE"]):
        tr.step(
            StepRecord(
                step=step, start=T + 0.003 + step * 0.002, end=T + 0.004 + step * 0.002,
                forward_mode=mode, rids=["a", "b"], extend_lens=[20, 16] if step == 0 else [1, 1],
                prefix_lens=[0, 4] if step == 0 else [20, 20], num_tokens=36 if step == 0 else 2,
                cache_hit_tokens=4 if step == 0 else 0,
                pool=PoolUsage(total=100, free=60 - step * 2, evictable=4, protected=4,
                               request_owned=32 + step * 2),
                running=2, waiting=1, blocked={"c": "token budget"},
            )
        )  # fmt: skip
    tr.tree(TreeEvent("insert", T + 0.0045, node_id=1, parent_id=0, num_tokens=20, tokens=list(range(20))))
    tr.tree(TreeEvent("split", T + 0.0046, node_id=2, parent_id=0, num_tokens=4, tokens=[0, 1, 2, 3]))
    tr.tree(TreeEvent("evict", T + 0.0070, node_id=1, parent_id=2, num_tokens=16))
    return tr


def test_records_and_for_request():
    tr = make_tracer()
    assert (len(tr.events), len(tr.steps), len(tr.tree_events)) == (8, 2, 3)
    # Recorded out of station order on purpose: for_request sorts by station then time.
    tr.station("a", Station.BATCH, T + 0.0029, T + 0.003, step=0)
    tr.station("a", Station.BATCH, T + 0.0010, T + 0.0011, step=0)
    evs = tr.for_request("a")
    assert [e.station for e in evs] == sorted(e.station for e in evs)
    batch = [e for e in evs if e.station == Station.BATCH]
    assert batch[0].start < batch[1].start
    assert all(e.rid == "a" for e in evs) and len(evs) == 7
    assert tr.t0 == T
    tr.clear()
    assert not tr.events and not tr.steps and not tr.tree_events and tr.t0 is None


def test_tree_method_is_an_on_event_callback():
    tr = Tracer()
    on_event = tr.tree  # what a RadixCache(on_event=...) would hold
    on_event(TreeEvent("insert", T, node_id=1, parent_id=0, num_tokens=3, tokens=[1, 2, 3]))
    assert tr.tree_events[0].tokens == [1, 2, 3]


def test_payload_shortening():
    tr = make_tracer()
    ids = tr.for_request("a")[1].detail["input_ids"]
    assert ids == [*range(8), "...<20 total>"]
    assert tr.tree_events[0].tokens == [*range(8), "...<20 total>"]
    assert tr.tree_events[1].tokens == [0, 1, 2, 3]  # short lists untouched
    # Nested lists are bounded too, and recorded lists are copies.
    src = list(range(5))
    tr.station("z", Station.DETOKENIZE, T, T, step=1, out={"ids": list(range(100))}, short=src)
    src.append(99)
    detail = tr.events[-1].detail
    assert detail["out"]["ids"][-1] == "...<100 total>" and len(detail["out"]["ids"]) == 9
    assert detail["short"] == [0, 1, 2, 3, 4]
    # The caller's TreeEvent is not mutated.
    ev = TreeEvent("insert", T, node_id=5, parent_id=0, num_tokens=30, tokens=list(range(30)))
    tr.tree(ev)
    assert len(ev.tokens) == 30 and len(tr.tree_events[-1].tokens) == 9


def test_shortened_records_cross_the_server_processes():
    """Trace records travel between the server's processes inside msgspec messages: what the
    recorder shortened (a string marker in a token list) must decode as it was sent."""
    import msgspec

    from labkit.io_struct import BatchStrOutput, BatchTokenIDOutput, TraceChunk
    from labkit.server.ipc import ENCODER

    tr = make_tracer()
    for kind in (BatchTokenIDOutput, BatchStrOutput):
        sent = kind(outputs=[], trace=TraceChunk.drain(make_tracer()))
        got = msgspec.msgpack.Decoder(kind).decode(ENCODER.encode(sent))
        assert got.trace.tree_events == tr.tree_events and got.trace.tree_events[0].tokens[-1] == "...<20 total>"
        assert [e.detail for e in got.trace.events] == [e.detail for e in tr.events]


def test_dataframe_stations():
    df = make_tracer().to_dataframe("stations")
    assert len(df) == 8
    for col in ["rid", "station", "station_name", "start", "end", "duration", "step", "detail"]:
        assert col in df.columns
    # scalar details become columns, non-scalar ones stay in `detail` only
    assert {"bytes", "prefix_len", "num_tokens", "token"} <= set(df.columns)
    assert "input_ids" not in df.columns and "top" not in df.columns
    assert df["station"].tolist()[:3] == [1, 3, 5]
    assert df.loc[0, "station_name"] == "HTTP_RECEIVE"
    assert (df["duration"] >= 0).all()
    assert df["step"].isna().sum() == 6 and df["step"].dropna().tolist() == [0, 0]


def test_dataframe_detail_key_collision():
    tr = Tracer()
    tr.station("a", Station.RESPOND, T, T + 1, duration=5)  # clashes with the computed column
    df = tr.to_dataframe()
    assert df.loc[0, "duration"] == 1 and df.loc[0, "detail_duration"] == 5


def test_dataframe_steps_and_tree():
    tr = make_tracer()
    steps = tr.to_dataframe("steps")
    assert len(steps) == 2
    for col in ["pool_free", "pool_evictable", "pool_protected", "pool_request_owned", "pool_total",
                "batch_size", "forward_mode", "num_tokens", "cache_hit_tokens", "duration"]:  # fmt: skip
        assert col in steps.columns
    pool = steps[["pool_free", "pool_evictable", "pool_protected", "pool_request_owned"]].sum(axis=1)
    assert (pool == steps["pool_total"]).all()
    assert steps["batch_size"].tolist() == [2, 2]
    tree = tr.to_dataframe("tree")
    assert len(tree) == 3 and tree["kind"].tolist() == ["insert", "split", "evict"]
    assert list(tree.columns) == ["kind", "time", "node_id", "parent_id", "num_tokens", "tokens"]
    with pytest.raises(ValueError):
        tr.to_dataframe("nope")  # type: ignore[arg-type]


def test_dataframe_empty():
    tr = Tracer()
    for kind, col in (("stations", "station_name"), ("steps", "pool_free"), ("tree", "node_id")):
        df = tr.to_dataframe(kind)
        assert len(df) == 0 and col in df.columns
    assert tr.to_perfetto()["traceEvents"]  # metadata only, still valid


def test_perfetto(tmp_path):
    tr = make_tracer()
    trace = json.loads(json.dumps(tr.to_perfetto()))
    assert trace["displayTimeUnit"] == "ms"
    evs = trace["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(tr.events) + len(tr.steps)
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
        assert e["dur"] >= 0 and e["ts"] >= 0
    assert min(e["ts"] for e in xs) == 0  # relative to the earliest record
    # one thread per request, named by rid
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    station_threads = {(e["pid"], e["tid"]) for e in xs if e["cat"] == "station"}
    assert sorted(names[k] for k in station_threads) == ["a", "b"]
    # steps named by forward mode, with rids and pool usage
    step_evs = [e for e in xs if e["cat"] == "step"]
    assert [e["name"] for e in step_evs] == ["EXTEND", "DECODE"]
    assert step_evs[0]["args"]["rids"] == ["a", "b"] and step_evs[0]["args"]["pool"]["free"] == 60
    counters = [e for e in evs if e["ph"] == "C" and e["name"] == "kv_pool"]
    assert len(counters) == 2
    assert set(counters[1]["args"]) == {"free", "evictable", "protected", "request_owned"}
    assert counters[1]["args"]["free"] == 58
    instants = [e for e in evs if e["ph"] == "i"]
    assert [e["name"] for e in instants] == ["tree insert", "tree split", "tree evict"]
    # tuples in details become lists; the file round-trips
    sample = next(e for e in xs if e["name"] == "8 sample")
    assert sample["args"]["top"] == [[7, 0.9], [3, 0.1]]
    path = tr.save_perfetto(tmp_path / "trace.json")
    assert json.loads(path.read_text()) == trace


def test_perfetto_coerces_non_json_details():
    np = pytest.importorskip("numpy")
    tr = Tracer()
    tr.station("a", Station.FORWARD, T, T + 1, step=0, arr=np.arange(3), mode=Station.FORWARD, obj=object())
    args = json.loads(json.dumps(tr.to_perfetto()))["traceEvents"][-1]["args"]
    assert args["arr"] == [0, 1, 2] and args["mode"] == "FORWARD" and args["obj"].startswith("<object")


def test_from_perfetto_reads_back_the_records(tmp_path):
    tr = make_tracer()
    back = from_perfetto(tr.save_perfetto(tmp_path / "trace.json"))  # from the file, as a server wrote it
    assert back.t0 == 0.0
    assert [(e.rid, e.station, e.step) for e in back.events] == [(e.rid, e.station, e.step) for e in tr.events]
    for a, b in zip(tr.events, back.events):
        assert b.start == pytest.approx(a.start - T, abs=1e-9) and b.end == pytest.approx(a.end - T, abs=1e-9)
    assert back.events[0].detail == {"bytes": 120}
    assert back.events[-1].detail["top"] == [[7, 0.9], [3, 0.1]]  # as JSON made it
    assert [s.pool for s in back.steps] == [s.pool for s in tr.steps]
    assert [s.blocked for s in back.steps] == [{"c": "token budget"}] * 2
    assert [(t.kind, t.node_id, t.parent_id, t.tokens) for t in back.tree_events] == [
        (t.kind, t.node_id, t.parent_id, t.tokens) for t in tr.tree_events
    ]
    # Exported again, it is the same trace (up to float noise in the microseconds).
    again, first = back.to_perfetto()["traceEvents"], json.loads(json.dumps(tr.to_perfetto()))["traceEvents"]
    assert [{k: v for k, v in e.items() if k not in ("ts", "dur")} for e in again] == [
        {k: v for k, v in e.items() if k not in ("ts", "dur")} for e in first
    ]
    assert [e.get("ts") for e in again] == pytest.approx([e.get("ts") for e in first], abs=1e-3)


def test_detach_moves_every_record_list_including_other_ranks_steps():
    t = Tracer()
    pool = PoolUsage(total=8, free=8, evictable=0, protected=0, request_owned=0)
    step = dict(start=0.0, end=1.0, forward_mode="DECODE", rids=["a"], extend_lens=[1], prefix_lens=[3])
    t.step(StepRecord(step=1, num_tokens=1, cache_hit_tokens=0, pool=pool, running=1, waiting=0, **step))
    t.rank_steps.append(
        StepRecord(step=1, num_tokens=1, cache_hit_tokens=0, pool=pool, running=1, waiting=0, rank=1, **step)
    )
    t.station("a", Station.FORWARD, 0.0, 1.0, step=1)
    copy = t.detach()
    assert (len(copy.steps), len(copy.rank_steps), len(copy.events)) == (1, 1, 1)
    assert copy.rank_steps[0].rank == 1
    assert not (t.steps or t.rank_steps or t.events or t.tree_events or t.snapshots)
