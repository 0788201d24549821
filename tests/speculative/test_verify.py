"""Verification's pure parts: which drafts survive, the sampler's view of each verify row, a request
pausing when its drafts keep failing, the drafts a batch may take, and bad settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from labkit.sampling.sampling_params import SamplingParams
from labkit.speculative.verify import PAUSE_STEPS, RATE_WEIGHT, RESUME_RATE, SpecState, accept, verify_rows


def test_accept_keeps_drafts_up_to_the_first_mismatch_then_the_targets_token():
    drafts = [[5, 6, 7], [1, 2], [], [9]]
    # Rows per request: 4, 3, 1 and 2. Request 0: 5 and 6 agree, 8 replaces 7 (its last row's 0 is
    # never used); request 1: 3 replaces 1 at once; request 2 has no drafts: its row's token;
    # request 3: 7 replaces 9.
    targets = [5, 6, 8, 0] + [3, 1, 2] + [4] + [7, 9]
    assert accept(drafts, targets) == [[5, 6, 8], [3], [4], [7]]
    assert accept([[1, 2]], [1, 2, 3]) == [[1, 2, 3]]  # all accepted: the bonus token too


def test_each_verify_row_sees_the_output_with_the_drafts_before_it():
    req = SimpleNamespace(sampling_params=SamplingParams(), origin_input_ids=[1, 2], output_ids=[3])
    rows = verify_rows([req], [[4, 5]])
    assert rows[0] is req
    assert [r.output_ids for r in rows[1:]] == [[3, 4], [3, 4, 5]]
    assert all(r.origin_input_ids == [1, 2] for r in rows[1:])


def fail_until_paused(spec: SpecState, step: int) -> int:
    """Record failed verify steps from `step` on until the request pauses; the step it paused at."""
    spec.record(4, 0, step=step, min_rate=0.3)
    while spec.drafting(step + 1):
        step += 1
        spec.record(4, 0, step=step, min_rate=0.3)
    return step


def test_a_request_whose_drafts_fail_pauses_for_longer_each_time_and_resumes():
    spec = SpecState()
    spec.record(4, 0, step=10, min_rate=0.3)
    assert spec.recent_rate == 1 - RATE_WEIGHT and spec.drafting(11)  # one bad step is not enough
    paused_at = fail_until_paused(spec, 11)
    assert paused_at - 10 + 1 == 5  # 0.75 ** 5 < 0.3: five failures in a row after a fresh start
    assert not spec.drafting(paused_at + PAUSE_STEPS) and spec.drafting(paused_at + 1 + PAUSE_STEPS)
    assert spec.recent_rate == RESUME_RATE  # a second chance after the pause
    spec.miss(40, min_rate=0.3)
    assert spec.drafting(41)
    paused_at = fail_until_paused(spec, 41)
    assert spec.paused_until == paused_at + 1 + 2 * PAUSE_STEPS  # no success in between: twice as long
    spec.record(4, 4, step=80, min_rate=0.3)  # a success resets the pause length
    assert spec.pause == PAUSE_STEPS and spec.drafting(81)


def test_a_long_copy_survives_a_few_failed_steps_at_an_edit():
    spec = SpecState()
    for step in range(20):
        spec.record(8, 8, step=step, min_rate=0.3)
    spec.record(8, 1, step=20, min_rate=0.3)  # the copy inserted a comma: one draft kept
    spec.record(8, 0, step=21, min_rate=0.3)  # and the next draft missed its place
    assert spec.drafting(22)
    assert spec.meta_info() == {"spec_verify_ct": 22, "spec_draft_tokens": 176, "spec_accepted_tokens": 161}


def test_steps_with_nothing_to_draft_count_half_and_are_not_drafts():
    spec = SpecState()
    misses = next(n for n in range(1, 100) if (1 - RATE_WEIGHT / 2) ** n < 0.3)
    for step in range(misses - 1):
        spec.miss(step, min_rate=0.3)
        assert spec.drafting(step + 1)
    spec.miss(misses - 1, min_rate=0.3)
    assert not spec.drafting(misses)
    assert spec.meta_info() == {"spec_verify_ct": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}


def test_min_rate_zero_never_pauses():
    spec = SpecState()
    for step in range(5):
        spec.record(3, 0, step, min_rate=0.0)
    assert spec.drafting(5)


def test_a_batch_drafts_only_when_its_expected_gain_pays_for_the_lost_overlap():
    from types import SimpleNamespace

    from labkit import Engine

    engine = Engine(
        model_path="tiny-llama", load_format="dummy", speculative_algorithm="ngram", speculative_min_batch_gain=0.25
    )
    sched = engine.scheduler

    def reqs(*rates):
        return [SimpleNamespace(spec=SpecState(recent_rate=r)) for r in rates]

    batch = reqs(1.0, *[0.0] * 7)  # one eager request in a batch of 8: expected 4 >= 0.25 x 8
    assert sched.worth_drafting(batch, [4, 0, 0, 0, 0, 0, 0, 0])
    assert not sched.worth_drafting(reqs(0.3, *[0.0] * 7), [4, 0, 0, 0, 0, 0, 0, 0])  # 1.2 < 2
    assert sched.worth_drafting(reqs(0.3), [4])  # alone, 1.2 >= 0.25
    assert not sched.worth_drafting(reqs(1.0, 1.0), [0, 0])  # nothing to draft


def test_drafts_are_cut_so_that_a_verify_step_fits_the_largest_cuda_graph():
    from labkit import Engine

    engine = Engine(model_path="tiny-llama", load_format="dummy", device="cpu", speculative_algorithm="ngram")
    sched = engine.scheduler
    reqs = [SimpleNamespace(sampling_params=SamplingParams(max_new_tokens=100), output_ids=[], seqlen=10,
                            grammar=None, spec=SpecState()) for _ in range(3)]  # fmt: skip
    assert sched.model_runner.cuda_graph_runner is None  # a CPU engine: only the budget counts
    assert sched.draft_budgets(reqs) == [4, 4, 4]
    sched.model_runner.cuda_graph_runner = SimpleNamespace(max_bs=12)  # a GPU engine's largest graph
    assert sched.draft_budgets(reqs) == [4, 4, 1]  # 3 + 9 drafts: 12 rows
    reqs[2].spec.recent_rate = 2.0  # the most promising request drafts first
    assert sched.draft_budgets(reqs) == [4, 1, 4]
    sched.model_runner.cuda_graph_runner = SimpleNamespace(max_bs=2)  # even the decode step is eager:
    assert sched.draft_budgets(reqs) == [4, 4, 4]  # drafts do not change that


def test_a_paused_request_drafts_again_early_when_the_drafter_sees_it_copying_in_a_small_batch(monkeypatch):
    from labkit import Engine
    from labkit.scheduler.speculation import EARLY_RESUME_MAX_BATCH

    engine = Engine(model_path="tiny-llama", load_format="dummy", device="cpu", speculative_algorithm="ngram")
    sched = engine.scheduler

    def reqs(n):
        return [SimpleNamespace(rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=[], seqlen=10, grammar=None,
                                sampling_params=SamplingParams(max_new_tokens=100),
                                spec=SpecState(paused_until=sched.step_id + 100)) for i in range(n)]  # fmt: skip

    assert sched.draft_budgets(reqs(1)) == [0]  # paused, and the drafter sees no copy
    monkeypatch.setattr(sched.drafter, "copying_again", lambda req: True)
    small = reqs(EARLY_RESUME_MAX_BATCH)
    assert sched.draft_budgets(small) == [4] * EARLY_RESUME_MAX_BATCH
    assert all(r.spec.drafting(sched.step_id) for r in small)  # the pauses ended
    large = reqs(EARLY_RESUME_MAX_BATCH + 1)  # one request's drafts rarely pay for a larger batch
    assert sched.draft_budgets(large) == [0] * (EARLY_RESUME_MAX_BATCH + 1)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be >= 1"),
        ({"speculative_min_accept_rate": 1.5}, r"speculative_min_accept_rate must be in \[0, 1\]"),
        ({"speculative_min_batch_gain": -1.0}, "speculative_min_batch_gain must be >= 0"),
        ({"speculative_ngram_min_n": 0}, "need 1 <= speculative_ngram_min_n"),
        ({"speculative_algorithm": "no-such-drafter"}, "unknown speculative algorithm"),
    ],
)
def test_bad_speculative_settings_are_clear_errors(setting, message):
    from labkit import Engine

    kw = {"model_path": "tiny-llama", "load_format": "dummy", "device": "cpu", "speculative_algorithm": "ngram"}
    with pytest.raises(ValueError, match=message):
        Engine(**kw | setting)
