"""The speculative-decoding views (labkit.viz.speculative), checked against the step records and the
results of real traced runs on the tiny random-weight model: with ngram drafts (its greedy output
repeats its last token, so every draft is right) and with the NOISY test drafter (right or wrong at
random, so verification keeps runs of every length)."""

from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from labkit import Engine
from labkit.trace.recorder import Tracer
from labkit.viz import (
    Run,
    draft_runs,
    draw_accept_histogram,
    draw_accept_lengths,
    draw_drafts,
    draw_spec_kv,
    spec_frame,
)
from labkit.viz.speculative import no_draft_steps
from tests.speculative.conftest import NOISY

K = 5
PROMPTS = [[3 + i, 40 + i, 90, 7 * i % 256] * (3 + i) for i in range(3)]
PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def traced_run(algorithm: str, speculative_min_accept_rate: float = 0.0):
    # Without overlap (the CUDA default), so that every step a request runs in yields its token: with
    # it, the step launched while the request finished yields none, and the count below is one off.
    engine = Engine(
        model_path="tiny-llama", load_format="dummy", enable_trace=True, max_total_tokens=4096,
        speculative_algorithm=algorithm, speculative_num_draft_tokens=K,
        speculative_min_accept_rate=speculative_min_accept_rate, speculative_min_batch_gain=0,
        disable_overlap_schedule=True,
    )  # fmt: skip
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    return Run.of(engine), {o["meta_info"]["id"]: o for o in outs}


@pytest.fixture(scope="module")
def ngram():
    return traced_run("ngram")


@pytest.fixture(scope="module")
def noisy():
    return traced_run(NOISY)


@pytest.fixture(scope="module")
def wrong():
    """Drafts that (nearly) always fail, with pausing on (the default minimum acceptance rate)."""
    return traced_run("test-wrong", speculative_min_accept_rate=0.3)


def bars(fig, gid: str) -> list[float]:
    return [p.get_height() for p in fig.axes[0].patches if p.get_gid() == gid]


def cells(fig, gid: str) -> list[Rectangle]:
    return [p for p in fig.axes[0].patches if p.get_gid() == gid]


@pytest.mark.parametrize("which", ["ngram", "noisy"])
def test_the_frame_holds_every_drafting_request_of_every_verify_step(which, request):
    run, results = request.getfixturevalue(which)
    frame = spec_frame(run)
    verify = [s for s in run.steps if s.drafts]
    assert verify and all(s.forward_mode == "TARGET_VERIFY" for s in verify)
    assert len(frame) == sum(len(s.drafts) for s in verify)
    for s in verify:
        rows = frame[frame.step == s.step].set_index("rid")
        assert rows.drafted.to_dict() == {rid: len(d) for rid, d in s.drafts.items()}
        assert rows.accepted.to_dict() == s.accepted
        assert (rows.gained == rows.accepted + 1).all() and set(rows.rollback_slots) == {s.rollback_slots}
    per_rid = frame.groupby("rid")[["drafted", "accepted"]].sum()
    for rid, out in results.items():
        meta = out["meta_info"]
        assert per_rid.loc[rid].tolist() == [meta["spec_draft_tokens"], meta["spec_accepted_tokens"]]
        assert (frame.rid == rid).sum() == meta["spec_verify_ct"]
        # No stop falls inside a run here (drafts stop short of max_new_tokens): the prefill's token,
        # then accepted + 1 per verify step, plus one per step it ran in without drafting.
        plain = sum(1 for s in run.steps if rid in s.rids and s.forward_mode != "EXTEND" and rid not in s.drafts)
        assert 1 + frame[frame.rid == rid].gained.sum() + plain == len(out["output_ids"])


def test_every_ngram_draft_is_right_when_the_output_repeats(ngram):
    run, results = ngram
    frame = spec_frame(run)
    assert (frame.accepted == frame.drafted).all() and frame.drafted.max() == K
    assert sum(s.rollback_slots for s in run.steps) == 0  # nothing rejected, nothing given back


def test_rollback_gives_back_exactly_the_rejected_drafts_with_page_size_1(noisy):
    run, _ = noisy
    frame = spec_frame(run)
    assert 0 < frame.accepted.sum() < frame.drafted.sum() and {0, K} <= set(frame.accepted)
    for step, rows in frame.groupby("step"):
        assert rows.rollback_slots.iloc[0] == (rows.drafted - rows.accepted).sum(), step


def test_accept_lengths_draw_a_line_per_request_the_mean_and_the_budget(noisy):
    run, results = noisy
    frame = spec_frame(run)
    fig = draw_accept_lengths(run)
    lines = {line.get_gid(): line for line in fig.axes[0].lines if line.get_gid()}
    assert {f"accepted:{rid}" for rid in results} | {"mean", "budget"} <= set(lines)
    for rid in results:
        ys = [y for y in lines[f"accepted:{rid}"].get_ydata() if y == y]  # NaN: a break in the line
        assert ys == frame[frame.rid == rid].accepted.tolist()
    assert list(lines["budget"].get_ydata()) == [K, K]


def test_paused_requests_break_their_line_and_show_the_steps_without_drafts(wrong):
    run, results = wrong
    fig = draw_accept_lengths(run)
    lines = {line.get_gid(): line for line in fig.axes[0].lines if line.get_gid()}
    assert "mean" in lines  # the requests drafted in the same steps
    for rid in results:
        verify = {s.step for s in run.steps if rid in s.drafts}
        decoded = {c.step for c in run.cells_of(rid) if c.phase == "decode"}
        idle = no_draft_steps(run, rid)
        assert idle and set(idle) == decoded - verify  # failed drafts paused it
        assert list(lines[f"no-drafts:{rid}"].get_xdata()) == idle
        xs = list(lines[f"accepted:{rid}"].get_xdata())
        assert any(x != x for x in xs) and {x for x in xs if x == x} == verify


@pytest.mark.parametrize("which", ["ngram", "noisy"])
def test_the_histogram_has_k_plus_1_bars_counting_the_frame(which, request):
    run, _ = request.getfixturevalue(which)
    counts = spec_frame(run).accepted.value_counts()
    assert bars(draw_accept_histogram(run), "accepted") == [counts.get(a, 0) for a in range(K + 1)]


def test_the_kv_view_puts_drafted_slots_next_to_the_rollback(noisy):
    run, _ = noisy
    verify = [s for s in run.steps if s.drafts]
    fig = draw_spec_kv(run)
    assert bars(fig, "drafted") == [sum(map(len, s.drafts.values())) for s in verify]
    assert bars(fig, "rolled-back") == [s.rollback_slots for s in verify]


def test_drafts_view_colours_each_draft_as_verification_found_it(noisy):
    run, results = noisy
    for rid in results:
        mine = [s for s in run.steps if rid in s.drafts]
        runs = draft_runs(run, rid)
        assert [r.step for r in runs] == [s.step for s in mine]
        assert [r.draft for r in runs] == [s.drafts[rid] for s in mine]
        assert [r.accepted for r in runs] == [s.accepted[rid] for s in mine]  # no stop inside a run here
        assert all(len(r.target) == len(r.draft) + 1 for r in runs)
        fig = draw_drafts(run, rid)
        accepted = sum(s.accepted[rid] for s in mine)
        rejected = sum(s.accepted[rid] < len(s.drafts[rid]) for s in mine)
        drafted = sum(len(s.drafts[rid]) for s in mine)
        assert len(cells(fig, "accepted")) == accepted and len(cells(fig, "rejected")) == rejected
        assert len(cells(fig, "not-reached")) == drafted - accepted - rejected
        assert len(cells(fig, "target")) == len(mine)


def test_drafts_view_labels_cells_with_the_tokenizers_text_and_takes_a_step_range(noisy):
    run, results = noisy
    rid = next(iter(results))
    first = draft_runs(run, rid)[0]

    class Letters:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(f" t{i}$" for i in ids)  # a space (shown as ·) and a $ (no mathtext)

    fig = draw_drafts(run, rid, tokenizer=Letters(), steps=(first.step, first.step))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert f"·t{first.draft[0]}$" in texts and f"·t{first.target[first.accepted]}$" in texts
    assert len(cells(fig, "target")) == 1
    fig.canvas.draw()  # renders: the $ signs are not parsed as math


def test_views_refuse_runs_without_drafts():
    with pytest.raises(ValueError, match="no verify steps"):
        spec_frame(Tracer())
    with pytest.raises(ValueError, match="drafted in no recorded verify step"):
        draft_runs(Tracer(), "req-0")
