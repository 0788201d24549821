"""labkit.viz.overlap against the records of real runs of the tiny model, overlap off and on: the
one-step lag per token, the extra row, the timeline's bars and arrows, the time summary, and the
Build-it check of notebook 14 (it passes a right resolver and fails wrong ones)."""

from __future__ import annotations

import io

import pytest

from labkit import Engine
from labkit.viz.overlap import (
    HAND_CASES,
    check_resolve,
    draw_overlap_timeline,
    overlap_summary,
    placeholder_cases,
    step_phases,
    token_frame,
)

NEW_TOKENS = (3, 5, 8)


@pytest.fixture(scope="module")
def runs(tiny):
    out = {}
    for overlap in (False, True):
        engine = Engine(
            overlap_schedule_on_cpu=overlap, disable_overlap_schedule=not overlap, enable_trace=True, dtype="float32",
            **tiny,
        )  # fmt: skip
        engine.generate(
            input_ids=[[5 + i] * 10 for i in range(3)],
            sampling_params=[{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in NEW_TOKENS],
        )
        out["on" if overlap else "off"] = engine
    return out


def test_tokens_are_taken_in_by_the_step_that_sampled_them_or_the_next_with_overlap(runs):
    off, on = token_frame(runs["off"]), token_frame(runs["on"])
    assert off.kept.all() and (off.lag == 0).all()
    kept = on[on.kept]
    assert (kept.lag == 1).all()
    assert (
        kept.drop(columns=["sampled_step", "taken_step", "lag"])
        .reset_index(drop=True)
        .equals(off.drop(columns=["sampled_step", "taken_step", "lag"]).reset_index(drop=True))
    )
    dropped = on[~on.kept]  # one extra row per request, after its last token
    assert sorted(dropped.rid) == sorted(set(on.rid)) and dropped["index"].tolist() == list(NEW_TOKENS)
    assert dropped.taken_step.isna().all()


def test_step_phases_and_the_summary_cover_the_run(runs):
    frame = step_phases(runs["on"])
    assert set(frame.phase) == {"schedule", "prepare", "forward", "sample", "process"}
    assert set(frame[frame.lane == "device"].phase) == {"forward", "sample"}
    process = frame[frame.phase == "process"]
    assert (process.processed_step == process.step - 1).all()
    steps = runs["on"].tracer.steps
    summary = overlap_summary(runs["on"])
    total = (steps[-1].end - steps[0].start) * 1e3
    assert summary["steps"] == len(steps)
    assert summary["device_ms"] + summary["host_ms"] == pytest.approx(total)
    assert max(summary["device_ms"], summary["host_ms"]) <= summary["overlapped_ms"] + 1e-9 <= total + 1e-6
    assert overlap_summary(runs["on"], (2, 3))["steps"] == 2


def test_the_timeline_draws_every_phase_and_an_arrow_from_each_sample_to_its_take_in(runs):
    fig = draw_overlap_timeline({"off": runs["off"], "on": runs["on"]}, steps=(2, 5))
    gids = {a.get_gid() for ax in fig.axes for a in [*ax.collections, *ax.texts] if a.get_gid()}
    for label in ("off", "on"):
        for step in range(2, 6):
            for part in ("schedule", "prepare", "forward", "sample", "process", "blocked", "other"):
                assert f"{label}|{step}|{part}" in gids
    assert {g for g in gids if "->" in g} == {f"off|{k}->{k}" for k in range(2, 6)} | {
        f"on|{k}->{k + 1}" for k in range(2, 5)
    }
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        draw_overlap_timeline({"off": runs["off"]}, steps=(500, 600))


def resolve(input_ids, table):
    return [table[-1 - t] if t < 0 else t for t in input_ids]


def test_check_resolve_accepts_a_right_answer(runs):
    checked = check_resolve(resolve, runs["on"])
    assert len(checked) > 0 and (checked.future_token < 0).all()
    assert all(c["input_ids"] != c["expected"] for c in placeholder_cases(runs["on"]))


def _memorized(input_ids, table):
    # Right on the hand-made cases only; leaves every other future token in place.
    for ids, tab, want in HAND_CASES:
        if (input_ids, table) == (ids, tab):
            return want
    return list(input_ids)


def _in_place(input_ids, table):
    for i, t in enumerate(input_ids):
        if t < 0:
            input_ids[i] = table[-1 - t]
    return input_ids


@pytest.mark.parametrize(
    "wrong",
    [
        lambda ids, table: [table[-t] if t < 0 else t for t in ids],  # off by one slot
        lambda ids, table: [table[t] if t < 0 else t for t in ids],  # Python's negative indexing
        lambda ids, table: [table[-1 - t] if t <= 0 else t for t in ids],  # 0 is a real token
        _memorized,
        _in_place,
    ],
    ids=["off-by-one", "negative-index", "zero-as-placeholder", "memorized", "in-place"],
)
def test_check_resolve_fails_a_wrong_answer(runs, wrong):
    with pytest.raises(AssertionError):
        check_resolve(wrong, runs["on"])


def test_check_resolve_needs_an_overlap_run(runs):
    assert placeholder_cases(runs["off"]) == []
    with pytest.raises(ValueError):
        check_resolve(resolve, runs["off"])
