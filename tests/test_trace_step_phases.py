"""A traced scheduler step records when it ran each phase (StepRecord.phases: schedule, prepare,
forward, sample, process) and whose tokens it took in (processed_step): its own batch's without
overlap, the step before's with it. Untraced steps record nothing."""

from __future__ import annotations

import functools

import pytest

from labkit import Engine
from labkit.trace.events import StepRecord

TINY = dict(model_path="tiny-llama", load_format="dummy", dtype="float32")
PROMPTS = [[5 + i] * 12 for i in range(3)]
PARAMS = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (3, 5, 8)]


@functools.cache
def traced_steps(overlap: bool, frequency_penalty: float = 0.0) -> list[StepRecord]:
    engine = Engine(overlap_schedule_on_cpu=overlap, disable_overlap_schedule=not overlap, enable_trace=True, **TINY)
    params = [{**p, "frequency_penalty": frequency_penalty} for p in PARAMS]
    engine.generate(input_ids=PROMPTS, sampling_params=params)
    return engine.tracer.steps


@pytest.mark.parametrize("overlap", [False, True])
def test_each_step_records_its_phases_in_order_within_the_step(overlap):
    for s in traced_steps(overlap):
        names = sorted(s.phases, key=lambda n: s.phases[n][0])
        expected = ["schedule", "prepare", "forward", "sample", "process"]
        if s.step == 1 and overlap:
            expected.remove("process")  # nothing was in flight before the first batch
        assert names == expected, (s.step, names)
        spans = [s.phases[n] for n in names]
        assert s.start <= spans[0][0] and spans[-1][1] <= s.end, s.step
        assert all(a <= b <= c <= d for (a, b), (c, d) in zip(spans, spans[1:])), s.step


def test_without_overlap_a_step_takes_its_own_batch_in_and_with_overlap_the_one_before():
    assert [s.processed_step for s in traced_steps(False)] == [s.step for s in traced_steps(False)]
    first, *rest = traced_steps(True)
    assert first.processed_step is None
    assert [s.processed_step for s in rest] == [s.step - 1 for s in rest]


def test_a_batch_that_needs_the_token_history_takes_the_step_in_flight_in_before_its_launch():
    for s in traced_steps(True, frequency_penalty=0.5)[1:]:
        assert s.phases["process"][1] <= s.phases["prepare"][0], s.step
        assert s.processed_step == s.step - 1


def test_an_untraced_step_records_no_phases():
    engine = Engine(overlap_schedule_on_cpu=True, **TINY)
    engine.add_request(input_ids=PROMPTS[0], sampling_params=PARAMS[0])
    outs = [engine.scheduler.step() for _ in range(3)]
    assert all(out.phases == {} and out.processed_step is None for out in outs)


def test_the_phases_go_to_perfetto_nested_in_their_step_and_come_back(tmp_path):
    from labkit.trace import Tracer, from_perfetto

    steps = traced_steps(True)
    tracer = Tracer()
    tracer.steps = list(steps)
    events = tracer.to_perfetto()["traceEvents"]
    slices = {e["args"]["step"]: e for e in events if e.get("cat") == "step"}
    phases = [e for e in events if e.get("cat") == "phase"]
    assert len(phases) == sum(len(s.phases) for s in steps)
    for e in phases:  # Perfetto nests a slice inside the one on its thread that contains it
        step = slices[e["args"]["step"]]
        assert (
            e["tid"] == step["tid"] and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3
        )
    back = from_perfetto(tracer.save_perfetto(tmp_path / "trace.json")).steps
    assert [s.processed_step for s in back] == [s.processed_step for s in steps]
    for b, s in zip(back, steps):  # JSON keeps a float's every digit; tuples come back as lists
        assert {k: tuple(v) for k, v in b.phases.items()} == s.phases
