"""labkit.viz.batching: step costs, the BatchState each step saw, and check_batch_rule (notebook 03's
build-it) against real runs of the tiny random-weight model: labkit's own rule passes, wrong rules
fail at the step where they differ."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from labkit import Engine
from labkit.bench.datasets import random_workload
from labkit.bench.runner import run_requests
from labkit.viz.batching import (
    BatchState,
    batch_decisions,
    check_batch_rule,
    decisions_frame,
    draw_step_costs,
    fit_step_cost,
    step_costs,
)


def labkit_rule(state: BatchState) -> dict[str, int]:
    """The scheduler's rule, as notebook 03's working answer writes it."""
    batch: dict[str, int] = {}
    budget = state.chunked_prefill_size
    for p in state.pending:
        if len(state.decoding) + len(batch) >= state.max_running_requests:
            break
        if budget is not None and budget <= 0:
            break
        n = p.tokens_left if budget is None else min(p.tokens_left, budget)
        batch[p.rid] = n
        if budget is not None:
            budget -= n
        if n < p.tokens_left:
            break
    if not batch:
        return {rid: 1 for rid in state.decoding}
    if state.mixed:
        batch.update({rid: 1 for rid in state.decoding})
    return batch


def decode_first(state: BatchState) -> dict[str, int]:
    return {rid: 1 for rid in state.decoding} if state.decoding else labkit_rule(state)


def never_mixes(state: BatchState) -> dict[str, int]:
    return labkit_rule(BatchState(**{**state.__dict__, "mixed": False}))


def no_cap(state: BatchState) -> dict[str, int]:
    return labkit_rule(BatchState(**{**state.__dict__, "max_running_requests": 1 << 30}))


def whole_prompts(state: BatchState) -> dict[str, int]:
    return labkit_rule(BatchState(**{**state.__dict__, "chunked_prefill_size": None}))


def workload():
    reqs = random_workload(num=7, input_len=(6, 40), output_len=(3, 9), vocab_size=256, seed=3)
    for i, r in enumerate(reqs):
        r.arrive_step = 3 * i
    return reqs


@pytest.fixture(scope="module")
def runs(tiny):
    """The same requests three ways: no chunking, chunks of 16, chunks of 16 + mixed (cap 3)."""
    configs = {
        "whole": dict(chunked_prefill_size=-1),
        "chunked": dict(chunked_prefill_size=16),
        "mixed": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    }
    return {
        name: run_requests(Engine(enable_trace=True, max_running_requests=3, **cfg, **tiny), workload(), label=name)
        for name, cfg in configs.items()
    }


def test_the_schedulers_rule_matches_every_step(runs):
    table = check_batch_rule(labkit_rule, *runs.values())
    assert list(table.index) == ["whole", "chunked", "mixed"]
    assert (table["steps checked"] == table["of steps"]).all()  # plenty of memory: every step explained
    assert table.loc["mixed", "MIXED"] > 0 and table.loc["chunked", "MIXED"] == 0
    # some step was cut by the chunk budget, and some request was held back by the cap
    states = [d.state for run in runs.values() for d in batch_decisions(run)]
    assert any(p.started for s in states for p in s.pending)
    assert any(len(s.decoding) >= s.max_running_requests and s.pending for s in states)


@pytest.mark.parametrize(
    ("rule", "run", "expect"),
    [
        (decode_first, "whole", "EXTEND"),
        (never_mixes, "mixed", "MIXED"),
        (no_cap, "chunked", "labkit ran"),
        (whole_prompts, "chunked", "labkit ran"),
    ],
)
def test_a_wrong_rule_fails_at_the_step_where_it_differs(runs, rule, run, expect):
    with pytest.raises(AssertionError, match=expect) as err:
        check_batch_rule(rule, runs[run])
    assert "your rule picked" in str(err.value) and "pending" in str(err.value)


def test_a_rule_must_return_a_dict(runs):
    with pytest.raises(AssertionError, match="dict"):
        check_batch_rule(lambda state: list(state.decoding), runs["whole"])


def test_decisions_leave_out_steps_shaped_by_memory(tiny_run):
    """The shared fixture run is short of KV memory (retractions, requests held back): those steps are
    not explained by a BatchState and are skipped; the rule holds on the others."""
    decisions = batch_decisions(tiny_run)
    skipped = {s.step for s in tiny_run.steps} - {d.state.step for d in decisions}
    assert any(s.retracted for s in tiny_run.steps if s.step in skipped)
    assert all(not s.retracted for s in tiny_run.steps if s.step not in skipped)
    check_batch_rule(labkit_rule, tiny_run)


def test_decisions_frame_shows_the_chunked_request_first(runs):
    frame = decisions_frame(runs["mixed"])
    assert list(frame.columns) == ["decoding", "pending (tokens left)", "labkit ran", "forward_mode"]
    started = frame[frame["pending (tokens left)"].str.contains("started")]
    assert len(started) and all(", started)" in row.split("), ")[0] + ")" for row in started["pending (tokens left)"])


def test_step_costs_has_a_row_per_step_and_names_its_kind(runs):
    costs = step_costs(*runs.values())
    assert len(costs) == sum(len(r.steps) for r in runs.values())
    assert (costs["rows"] == costs["prefill_tokens"] + costs["decode_rows"]).all()
    mixed = costs[costs["forward_mode"] == "MIXED"]
    assert len(mixed) and all(
        k == f"MIXED {p}+{d}" for k, p, d in zip(mixed.kind, mixed.prefill_tokens, mixed.decode_rows)
    )
    decode = costs[costs["forward_mode"] == "DECODE"]
    assert (decode["prefill_tokens"] == 0).all() and (decode["ms"] > 0).all()


def test_fit_step_cost_recovers_a_line_and_the_figure_draws_it():
    frame = pd.DataFrame(
        {"forward_mode": ["DECODE", "EXTEND", "MIXED", "EXTEND"], "rows": [3, 128, 131, 454], "ms": 0.0}
    )
    frame["ms"] = 40 + 2.5 * frame["rows"]
    fixed, per_row = fit_step_cost(frame)
    assert fixed == pytest.approx(40) and per_row == pytest.approx(2.5)
    fig = draw_step_costs(frame)
    ax = fig.axes[0]
    assert {c.get_gid() for c in ax.collections} == {"steps-DECODE", "steps-EXTEND", "steps-MIXED"}
    assert "40 ms + 2.50 ms per row" in [t.get_text() for t in ax.get_legend().get_texts()][-1]
    fig.savefig(io.BytesIO(), format="png", dpi=40)
    with pytest.raises(ValueError, match="two sizes"):
        fit_step_cost(frame.iloc[:1])


def test_a_run_under_another_policy_is_refused(tiny):
    run = run_requests(Engine(enable_trace=True, schedule_policy="lpm", **tiny), workload()[:2], label="lpm")
    with pytest.raises(ValueError, match="fcfs"):
        batch_decisions(run)
