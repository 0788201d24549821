"""A traced run of the real engine yields per-request station records (3, 5-9), per-step records
whose pool categories add up, radix-tree events, and Perfetto JSON with the required fields."""

from __future__ import annotations

import json

import pytest

from labkit import Engine
from labkit.trace import Station

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}


@pytest.fixture(scope="module")
def traced():
    """The embedded model, traced (its tests are marked slow)."""
    engine = Engine(enable_trace=True, max_total_tokens=2048, chunked_prefill_size=32)
    questions = ["What is two plus two?", "Name a colour.", "What is the capital of Italy?"]
    outs = engine.generate(
        messages=[[SYSTEM, {"role": "user", "content": q}] for q in questions],
        sampling_params={"temperature": 0, "max_new_tokens": 8},
    )
    return engine, outs


@pytest.mark.slow
def test_every_request_passes_stations_3_and_5_to_9(traced):
    engine, outs = traced
    for out in outs:
        events = engine.tracer.for_request(out["meta_info"]["id"])
        seen = {e.station for e in events}
        assert {
            Station.TOKENIZE,
            Station.ENQUEUE,
            Station.BATCH,
            Station.FORWARD,
            Station.SAMPLE,
            Station.DETOKENIZE,
        } <= seen
        sampled = [e.detail["token"] for e in events if e.station == Station.SAMPLE and not e.detail["discarded"]]
        assert sampled == out["output_ids"]
        pieces = "".join(e.detail["piece"] for e in events if e.station == Station.DETOKENIZE)
        assert pieces == out["text"]
        forward = [e for e in events if e.station == Station.FORWARD]
        assert (
            sum(len(e.detail["input_ids"]) for e in forward)
            >= out["meta_info"]["prompt_tokens"] - out["meta_info"]["cached_tokens"]
        )
        assert all(e.end >= e.start for e in events)


@pytest.mark.slow
def test_step_records_account_for_the_whole_pool(traced):
    engine, _ = traced
    steps = engine.tracer.steps
    assert {s.forward_mode for s in steps} >= {"EXTEND", "DECODE"}
    for s in steps:
        p = s.pool
        assert p.free + p.evictable + p.protected + p.request_owned == p.total
        assert s.num_tokens == sum(s.extend_lens)
    # The shared system prompt is hit by the requests prefilled after the first.
    assert sum(s.cache_hit_tokens for s in steps) > 0
    df = engine.tracer.to_dataframe("steps")
    assert len(df) == len(steps)


@pytest.mark.slow
def test_tree_events_and_perfetto_json(traced, tmp_path):
    engine, _ = traced
    kinds = {e.kind for e in engine.tracer.tree_events}
    assert "insert" in kinds and "split" in kinds
    path = engine.tracer.save_perfetto(tmp_path / "trace.json")
    data = json.loads(path.read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert complete
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0 and e["ts"] >= 0
    stations = engine.tracer.to_dataframe("stations")
    assert set(stations["station"]) >= {3, 5, 6, 7, 8, 9}


def test_tracing_is_off_by_default():
    engine = Engine(model_path="tiny-llama", load_format="dummy", max_total_tokens=256)
    assert engine.tracer is None and engine.scheduler.tracer is None
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
