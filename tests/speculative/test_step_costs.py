"""The measured break-even of speculation: step times by kind and batch-size bucket, their medians,
and the scheduler drafting by them when no fixed gain is configured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from labkit.model_executor.forward_batch import ForwardMode
from labkit.speculative.step_costs import (
    DECODE_REFRESH,
    GAIN_MEMORY_STEPS,
    MAX_GAIN_MEMORY_STEPS,
    SAMPLES,
    RealizedGains,
    StepCosts,
    bucket,
    weigh,
)
from labkit.speculative.verify import SpecState

DECODE, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY


def test_batch_sizes_share_a_bucket_up_to_the_next_power_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 3, 3, 4, 4, 5]


def test_break_even_is_the_verify_to_decode_ratio_less_one_once_both_were_timed():
    costs = StepCosts()
    costs.record(DECODE, 16, 0.001)
    assert costs.break_even(16, default=1.0) == 1.0  # no verify step timed yet
    costs.record(VERIFY, 17, 0.0025)  # 17 is in 16's bucket
    assert abs(costs.break_even(16, default=1.0) - 1.5) < 1e-9
    assert costs.break_even(1, default=0.7) == 0.7  # another bucket: nothing timed there
    costs.record(ForwardMode.EXTEND, 16, 1.0)  # prefill steps do not count
    assert abs(costs.break_even(20, default=1.0) - 1.5) < 1e-9
    assert costs.summary() == ["batch 16-31: decode 1.00 ms (1), verify 2.50 ms (1), break-even 1.50 per request"]


def test_the_median_of_the_latest_steps_ignores_a_stall_and_old_steps():
    costs = StepCosts()
    for _ in range(SAMPLES):
        costs.record(VERIFY, 1, 0.002)
        costs.record(DECODE, 1, 0.004)
    assert costs.break_even(1, default=1.0) == 0.0  # a verify step cheaper than a decode one: floor 0
    costs.record(DECODE, 1, 5.0)  # one stall (a collection pause) moves nothing
    assert costs.break_even(1, default=1.0) == 0.0
    for _ in range(SAMPLES):  # the machine changed: only the latest SAMPLES steps count
        costs.record(DECODE, 1, 0.001)
    assert abs(costs.break_even(1, default=1.0) - 1.0) < 1e-9


def test_without_a_fixed_gain_the_scheduler_drafts_by_its_measured_break_even():
    from labkit import Engine

    engine = Engine(model_path="tiny-llama", load_format="dummy", speculative_algorithm="ngram")
    sched = engine.scheduler

    def reqs(*rates):
        return [SimpleNamespace(spec=SpecState(recent_rate=r)) for r in rates]

    assert sched.worth_drafting(reqs(0.5), [4])  # untimed: 1 token per request, 2 expected
    sched.step_costs.record(DECODE, 1, 0.001)
    sched.step_costs.record(VERIFY, 1, 0.004)  # a verify step costs 4 decode steps: break-even 3
    assert not sched.worth_drafting(reqs(0.5), [4])  # 2 < 3
    assert sched.worth_drafting(reqs(0.75), [4])  # 3 >= 3
    assert sched.worth_drafting(reqs(0.5, 0.5), [4, 4])  # batch 2: its own bucket, untimed


def test_realized_gains_are_per_request_of_batches_of_several_by_size_and_expire():
    gains = RealizedGains()
    assert gains.recent(0, 16) is None
    gains.record(10, 16, accepted=8, break_even=0.5)  # half a token per request
    gains.record(11, 20, accepted=30, break_even=0.5, least=0)  # 16-31: the same bucket; one kept none
    gains.record(12, 4, accepted=6, break_even=0.5)  # 4-7: another
    gains.record(12, 1, accepted=4, break_even=0.5)  # alone: not a batch's gain
    assert gains.recent(12, 16) == pytest.approx(((0.5 + 1.5) / 2, (0.5 + 0) / 2))  # the least: the mean if unknown
    assert gains.recent(12, 5) == pytest.approx((1.5, 1.5)) and gains.recent(12, 1) is None
    assert gains.recent(10 + GAIN_MEMORY_STEPS, 16) == pytest.approx((1.5, 0))  # the step-10 gain expired
    assert gains.recent(12 + GAIN_MEMORY_STEPS, 4) is None


def test_weigh_takes_the_mean_where_steps_grow_with_the_batch_and_the_least_where_they_do_not():
    assert weigh(3.0, 1.0, share=1.0) == 3.0
    assert weigh(3.0, 1.0, share=0.0) == 1.0
    assert weigh(3.0, 1.0, share=0.25) == 0.25 * 3 + 0.75 * 1
    assert weigh(1.0, 3.0, share=0.0) == 1.0  # a least above the mean (it left out finished requests) counts no more


def test_a_verify_step_whose_least_gain_falls_short_makes_the_next_probe_wait_where_the_least_counts():
    for share, memory in ((1.0, GAIN_MEMORY_STEPS), (0.0, 2 * GAIN_MEMORY_STEPS)):
        gains = RealizedGains()
        gains.record(0, 4, accepted=16, break_even=2.0, share=share, least=0)  # 4 each on average; one kept none
        assert gains.memory_of(4) == memory


def test_fruitless_verify_steps_in_a_row_make_the_next_probe_wait_longer():
    gains = RealizedGains()
    step = 0
    for memory in (2, 4, 8, 16):  # each probe short of the break-even doubles the wait
        gains.record(step, 8, accepted=0, break_even=1.0)
        assert gains.memory_of(8) == memory * GAIN_MEMORY_STEPS
        assert gains.recent(step + gains.memory_of(8) - 1, 8) == (0.0, 0.0)
        assert gains.recent(step + gains.memory_of(8), 8) is None
        step += gains.memory_of(8)
    assert gains.memory_of(2) == GAIN_MEMORY_STEPS  # other batch sizes probe as before
    for _ in range(10):
        gains.record(step, 8, accepted=0, break_even=1.0)
    assert gains.memory_of(8) == MAX_GAIN_MEMORY_STEPS
    gains.record(step, 8, accepted=8, break_even=1.0)  # one that pays resets it
    assert gains.memory_of(8) == GAIN_MEMORY_STEPS


def test_a_batch_whose_verify_steps_realized_little_stops_drafting_until_that_expires():
    from labkit import Engine

    engine = Engine(model_path="tiny-llama", load_format="dummy", speculative_algorithm="ngram")
    sched = engine.scheduler

    def reqs(n, rate):
        return [SimpleNamespace(spec=SpecState(recent_rate=rate)) for _ in range(n)]

    assert sched.worth_drafting(reqs(8, 1.0), [4] * 8)  # rates say 4 per request: drafts
    sched.realized_gains.record(sched.step_id, 8, accepted=4, break_even=1.0)  # but a verify step gave 0.5 each
    assert not sched.worth_drafting(reqs(8, 1.0), [4] * 8)
    assert sched.worth_drafting(reqs(1, 1.0), [4])  # alone, a request's own rate decides
    assert sched.worth_drafting(reqs(3, 1.0), [4] * 3)  # another batch size: its own history (none)
    sched.step_id += 2 * GAIN_MEMORY_STEPS - 1
    assert not sched.worth_drafting(reqs(8, 1.0), [4] * 8)  # it fell short: the wait doubled
    sched.step_id += 1
    assert sched.worth_drafting(reqs(8, 1.0), [4] * 8)  # expired: the batch tries again


@pytest.mark.parametrize("drafts_ahead", [False, True])
def test_drafting_for_nothing_is_a_fruitless_probe_timed_as_a_verify_step_only_if_it_waited(monkeypatch, drafts_ahead):
    import tests.speculative.conftest  # noqa: F401  (registers test-empty)
    from labkit import Engine
    from labkit.speculative.base import get_drafter

    monkeypatch.setattr(get_drafter("test-empty"), "drafts_ahead", drafts_ahead)
    engine = Engine(
        model_path="tiny-llama", load_format="dummy", overlap_schedule_on_cpu=True, speculative_algorithm="test-empty"
    )
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=params)
    sched = engine.scheduler
    assert sched.realized_gains.recent(sched.step_id, 2) == (0.0, 0.0)  # the attempts gained nothing
    if drafts_ahead:  # it looked for drafts behind the token in flight: no overlap was given up
        assert not sched.step_costs.verify
        return
    assert sched.step_costs.verify and sched.step_costs.decode.keys() <= {1, 2}


def test_decode_times_update_the_table_every_decode_refresh_steps_and_verify_times_at_once():
    costs = StepCosts()
    costs.record(DECODE, 16, 0.001)
    costs.record(VERIFY, 16, 0.004)
    assert costs.break_even(16, default=1.0) == 3.0  # timed both ways: at once
    for _ in range(DECODE_REFRESH - 1):  # the bucket's 2nd to 8th decode steps: the table waits
        costs.record(DECODE, 16, 0.002)
        assert costs.break_even(16, default=1.0) == 3.0
    costs.record(DECODE, 16, 0.002)  # the 9th: median 2 ms
    assert costs.break_even(16, default=1.0) == 1.0
    costs.record(VERIFY, 16, 0.008)  # verify steps update it every time: median 6 ms
    assert costs.break_even(16, default=1.0) == 2.0


def test_batch_share_is_the_part_of_a_decode_step_that_grows_with_its_batch():
    costs = StepCosts()
    costs.record(DECODE, 12, 0.002)
    assert costs.batch_share(12, default=1.0) == 1.0  # alone untimed: unknown
    costs.record(DECODE, 1, 0.001)  # bucket 8-15 (middle 12): 1 ms fixed + 1/11 ms per request
    assert abs(costs.batch_share(12, default=1.0) - (12 / 11 * 1e-3) / 0.002) < 1e-9
    costs.record(DECODE, 5, 0.0009)  # faster than alone (noise): a step of fixed cost, share 0
    assert costs.batch_share(5, default=1.0) == 0.0
    for _ in range(SAMPLES):
        costs.record(DECODE, 16, 0.024)  # 24 x the step alone at 24 requests: all of it grows
    assert costs.batch_share(20, default=1.0) == 1.0


def test_where_steps_cost_the_same_at_any_size_and_none_wait_the_batch_least_gain_decides():
    from labkit import Engine

    engine = Engine(model_path="tiny-llama", load_format="dummy", speculative_algorithm="ngram")
    sched = engine.scheduler

    def reqs(*rates):
        return [SimpleNamespace(spec=SpecState(recent_rate=r)) for r in rates]

    for size in (1, 4):  # host-bound: a decode step of 4 costs what one of 1 does; verify 2 x
        sched.step_costs.record(DECODE, size, 0.001)
        sched.step_costs.record(VERIFY, size, 0.002)
    copying, mixed = reqs(1.0, 1.0, 1.0, 1.0), reqs(1.0, 1.0, 1.0, 0.0)
    assert sched.worth_drafting(copying, [4] * 4)  # every request gains 4 >= 1: the batch ends sooner
    assert not sched.worth_drafting(mixed, [4] * 4)  # the fourth gains nothing: the batch lasts as long
    assert not sched.worth_drafting(copying, [4, 4, 4, 0])  # nothing drafted for it: the same
    sched.waiting_queue.append(SimpleNamespace())  # a request waits to take a finished one's place
    assert sched.worth_drafting(mixed, [4] * 4)  # mean gain 3 >= 1
    sched.waiting_queue.clear()
    for _ in range(DECODE_REFRESH):  # medians at 4-7 (middle 6): decode 4 ms, mostly per request; verify 8 ms
        sched.step_costs.record(DECODE, 4, 0.004)
        sched.step_costs.record(VERIFY, 4, 0.008)
    assert sched.break_even(4) == 1.0 and sched.worth_drafting(mixed, [4] * 4)  # 0.9 x 3 + 0.1 x 0


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_a_batch_whose_verify_steps_left_one_request_without_gain_drafts_again_only_where_the_mean_counts(share):
    from labkit import Engine

    engine = Engine(model_path="tiny-llama", load_format="dummy", speculative_algorithm="ngram")
    sched = engine.scheduler
    sched.batch_share = lambda batch_size: share  # type: ignore[method-assign]
    copying = [SimpleNamespace(spec=SpecState(recent_rate=1.0)) for _ in range(4)]
    assert sched.worth_drafting(copying, [4] * 4)  # every rate says 4 per request
    sched.record_gains(4, accepted=12, least=0)  # a verify step: 3 per request, but one request kept none
    assert sched.worth_drafting(copying, [4] * 4) == (share == 1.0)
    if share == 0.0:  # the early refusal agrees, without a pass over the requests
        assert sched.drafting_budgets(copying) is None  # type: ignore[arg-type]


def test_a_refusal_by_realized_gains_holds_for_refusal_hold_steps():
    from labkit import Engine
    from labkit.scheduler.speculation import REFUSAL_HOLD_STEPS

    engine = Engine(model_path="tiny-llama", load_format="dummy", speculative_algorithm="ngram")
    sched = engine.scheduler
    copying = [SimpleNamespace(spec=SpecState(recent_rate=1.0)) for _ in range(4)]
    asked = []
    sched.realized_gain = lambda batch_size: asked.append(batch_size) or (0.0, 0.0)  # type: ignore[method-assign]
    for _ in range(REFUSAL_HOLD_STEPS):
        assert sched.drafting_budgets(copying) is None  # type: ignore[arg-type]
        sched.step_id += 1
    assert asked == [4]  # refused once, then held without asking
    assert sched.drafting_budgets(copying) is None and asked == [4, 4]  # type: ignore[arg-type]


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_drafts_found_for_only_part_of_a_batch_verify_only_where_its_mean_gain_counts(monkeypatch, share):
    from labkit import Engine
    from labkit.speculative.base import DRAFTERS
    from tests.speculative.conftest import NoisyDrafter

    class HalfDrafter(NoisyDrafter):
        RIGHT = 1.0  # the last token again, for the prompts that start with 5; nothing for the others

        def propose(self, reqs, budgets):  # type: ignore[no-untyped-def]
            drafts = super().propose(reqs, budgets)
            return [d if r.origin_input_ids[0] == 5 else [] for r, d in zip(reqs, drafts)]

    monkeypatch.setitem(DRAFTERS, "test-half", HalfDrafter)
    engine = Engine(model_path="tiny-llama", load_format="dummy", speculative_algorithm="test-half")
    sched = engine.scheduler
    monkeypatch.setattr(sched, "batch_share", lambda batch_size: share)
    monkeypatch.setattr(sched, "break_even", lambda batch_size: 1.0)
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    outs = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=params)
    verify_steps = [o["meta_info"]["spec_verify_ct"] for o in outs]
    if share == 0.0:  # the batch lasts as long as its request without drafts: no verify step pays
        assert verify_steps == [0, 0]
        assert sched.realized_gains.recent(sched.step_id, 2) == (0.0, 0.0)  # the looks count as fruitless
    else:
        assert verify_steps[0] > 0 and verify_steps[1] == 0
