"""Verification's pure parts: which drafts survive, the sampler's view of each verify row, and a
request pausing when its drafts keep failing."""

from __future__ import annotations

from types import SimpleNamespace

from labkit.sampling.sampling_params import SamplingParams
from labkit.speculative.verify import PAUSE_STEPS, RESUME_RATE, SpecState, accept, verify_rows


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


def test_a_request_whose_drafts_fail_pauses_for_longer_each_time_and_resumes():
    spec = SpecState()
    spec.record(4, 0, step=10, min_rate=0.3)
    assert spec.recent_rate == 0.5 and spec.drafting(11)  # one bad step is not enough
    spec.record(4, 0, step=11, min_rate=0.3)
    assert not spec.drafting(11 + PAUSE_STEPS) and spec.drafting(12 + PAUSE_STEPS)
    assert spec.recent_rate == RESUME_RATE  # a second chance after the pause
    spec.miss(30, min_rate=0.3)  # 0.375
    assert spec.drafting(31)
    spec.record(4, 0, step=31, min_rate=0.3)
    assert spec.paused_until == 32 + 2 * PAUSE_STEPS  # no success in between: twice as long
    spec.record(4, 4, step=60, min_rate=0.3)  # a success resets the pause length
    assert spec.pause == PAUSE_STEPS and spec.drafting(61)
    assert spec.meta_info() == {"spec_verify_ct": 4, "spec_draft_tokens": 16, "spec_accepted_tokens": 4}


def test_steps_with_nothing_to_draft_count_half_and_are_not_drafts():
    spec = SpecState()
    for step in range(4):
        spec.miss(step, min_rate=0.3)
        assert spec.drafting(step + 1)
    spec.miss(4, min_rate=0.3)  # 0.75 ** 5 < 0.3
    assert not spec.drafting(5)
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
