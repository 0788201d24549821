"""The scheduler's own lifecycle: built from a config, its cache flushed and its state reset between
runs (refused while requests are in flight), and the order a policy would admit waiting requests in."""

from __future__ import annotations

import pytest

from labkit.config import EngineConfig
from labkit.io_struct import TokenizedGenerateReqInput
from labkit.scheduler.scheduler import INIT_NEW_TOKEN_RATIO, Scheduler


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler.from_config(EngineConfig(model_path="tiny-llama", load_format="dummy", max_total_tokens=512))


def add(sched: Scheduler, rid: str, ids: list[int], max_new_tokens: int = 3) -> None:
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    sched.add_request(TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=ids, sampling_params=params))


def run_until_done(sched: Scheduler) -> None:
    while sched.has_work():
        sched.step()


def test_from_config_builds_the_model_runner_and_pools(scheduler):
    assert scheduler.tokenizer is None  # dummy weights come without one
    assert scheduler.allocator.size == 512 and scheduler.model_runner.context_len == scheduler.max_req_len


def test_flush_cache_is_refused_while_requests_are_in_flight(scheduler):
    add(scheduler, "a", [5] * 40)
    scheduler.step()
    with pytest.raises(RuntimeError, match="waiting or running"):
        scheduler.flush_cache()
    run_until_done(scheduler)
    assert scheduler.tree_cache.total_size() > 0
    scheduler.flush_cache()
    assert scheduler.tree_cache.total_size() == 0
    assert scheduler.allocator.available_size() == scheduler.allocator.size


def test_reset_starts_over_as_a_new_scheduler(scheduler):
    fresh = (scheduler.new_token_ratio, scheduler.policy.name)
    add(scheduler, "a", [5] * 40, max_new_tokens=8)
    run_until_done(scheduler)
    assert scheduler.step_id > 0 and scheduler.new_token_ratio < fresh[0]
    scheduler.reset(policy="lpm")
    assert (scheduler.step_id, scheduler.new_token_ratio, scheduler.policy.name) == (0, fresh[0], "lpm")
    assert scheduler.tree_cache.total_size() == 0
    assert scheduler.new_token_ratio == INIT_NEW_TOKEN_RATIO * scheduler.config.schedule_conservativeness
    scheduler.reset()
    assert scheduler.policy.name == fresh[1]  # the configured policy again
    add(scheduler, "b", [6] * 10)
    assert scheduler.step().step == 1


def test_reset_is_refused_in_flight_and_for_an_unknown_policy_leaving_the_scheduler_as_it_was(scheduler):
    add(scheduler, "a", [5] * 40)
    scheduler.step()
    state = (scheduler.step_id, scheduler.policy, scheduler.tree_cache.total_size())
    with pytest.raises(RuntimeError, match="waiting or running"):
        scheduler.reset(policy="lpm")
    assert (scheduler.step_id, scheduler.policy, scheduler.tree_cache.total_size()) == state
    run_until_done(scheduler)
    state = (scheduler.step_id, scheduler.policy, scheduler.tree_cache.total_size())
    with pytest.raises(ValueError, match="unknown schedule policy"):
        scheduler.reset(policy="no-such-policy")
    assert (scheduler.step_id, scheduler.policy, scheduler.tree_cache.total_size()) == state


def test_waiting_order_sorts_a_copy_and_leaves_the_queue_alone(scheduler):
    shared = list(range(10, 42))
    add(scheduler, "warm", shared + [3])
    run_until_done(scheduler)  # the cache now holds `shared`
    add(scheduler, "cold", [7] * 33)
    add(scheduler, "hit", shared + [4])
    assert [r.rid for r in scheduler.waiting_order("lpm")] == ["hit", "cold"]
    assert [r.rid for r in scheduler.waiting_order("fcfs")] == ["cold", "hit"]
    assert [r.rid for r in scheduler.waiting_queue] == ["cold", "hit"]
    run_until_done(scheduler)  # and they still run
