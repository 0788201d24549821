"""Notebook 05's Build-it: check_policy passes the notebook's least-prefill policy and rejects wrong
ones (each on a fresh tiny engine: a policy that breaks the contract leaves its engine unusable)."""

from __future__ import annotations

import pytest

from labkit import Engine
from labkit.bench.policies import check_policy
from labkit.scheduler.schedule_policy import POLICIES, SchedulePolicy, register_policy
from tests.notebook_cells import run_cells


def tiny_engine() -> Engine:
    return Engine(model_path="tiny-llama", load_format="dummy", max_total_tokens=1024)


def test_the_notebooks_answer_passes():
    names = {"SchedulePolicy": SchedulePolicy, "register_policy": register_policy}
    try:
        answer = run_cells("05_scheduling_policies", "build-policy-answer", **names)["LeastPrefillPolicy"]
        table = check_policy(answer, tiny_engine())
    finally:
        POLICIES.pop("least-prefill", None)  # the cell registers it; other tests list POLICIES
    assert (table["expected"] == table["yours"]).all()
    assert not any(name.startswith("check-") for name in POLICIES)  # the check unregisters its copy


class NoPrefixMatch(SchedulePolicy):
    """The right key, but the scheduler does not match the queue first: every extend_input_len is 0."""

    def sort(self, waiting, tree_cache):
        waiting.sort(key=lambda r: r.extend_input_len)


class ShortestPrompt(SchedulePolicy):
    needs_prefix_match = True

    def sort(self, waiting, tree_cache):
        waiting.sort(key=lambda r: len(r.origin_input_ids))  # ignores what is cached


class LongestPrefix(SchedulePolicy):
    needs_prefix_match = True

    def sort(self, waiting, tree_cache):
        waiting.sort(key=lambda r: -len(r.prefix_indices))  # lpm, not least-prefill


class LatestFirstOnTies(SchedulePolicy):
    needs_prefix_match = True

    def sort(self, waiting, tree_cache):
        waiting[:] = sorted(reversed(waiting), key=lambda r: r.extend_input_len)


class DropsOne(SchedulePolicy):
    needs_prefix_match = True

    def sort(self, waiting, tree_cache):
        waiting.sort(key=lambda r: r.extend_input_len)
        if len(waiting) > 1:
            waiting.pop()


class LocksItsFirst(SchedulePolicy):
    needs_prefix_match = True

    def sort(self, waiting, tree_cache):
        waiting.sort(key=lambda r: r.extend_input_len)
        tree_cache.inc_lock_ref(waiting[0].last_node)  # changes the cache


WRONG = [
    (NoPrefixMatch, "needs_prefix_match = True"),
    (ShortestPrompt, "fewest tokens to prefill first"),
    (LongestPrefix, "fewest tokens to prefill first"),
    (LatestFirstOnTies, "ties in arrival order"),
    (DropsOne, "only reorder the waiting list"),
    (LocksItsFirst, "sort changed the cache"),
]


@pytest.mark.parametrize("wrong, message", [pytest.param(w, m, id=w.__name__) for w, m in WRONG])
def test_check_policy_rejects_a_wrong_policy(wrong, message):
    with pytest.raises(AssertionError, match=message):
        check_policy(wrong, tiny_engine())
    assert not any(name.startswith("check-") for name in POLICIES)
