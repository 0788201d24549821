"""Workload helpers: static-batching emulation, sequential arrival, policy runs and orders; the random
multi-turn conversations of the serving benchmark and the turn each request waits for."""

from __future__ import annotations

import pytest

from labkit import Engine
from labkit.bench.datasets import (
    BenchRequest,
    Request,
    multiturn_random_requests,
    previous_turns,
    random_workload,
    shared_prefix_workload,
)
from labkit.bench.policies import bench_policies, policy_orders, policy_summary, queue_table, run_policy
from labkit.bench.runner import latency_table, run_requests, token_times


@pytest.fixture(scope="module")
def tiny():
    """Engine keyword arguments for the tiny random-weight model."""
    return dict(model_path="tiny-llama", load_format="dummy")


def test_static_batching_admits_a_group_only_when_the_last_one_finished(tiny):
    engine = Engine(enable_trace=True, max_total_tokens=1024, **tiny)
    reqs = random_workload(num=7, input_len=(4, 12), output_len=(2, 9), vocab_size=256)
    run = run_requests(engine, reqs, static_batch_size=3)
    groups = [{r.rid for r in reqs[i : i + 3]} for i in range(0, 7, 3)]
    live: set[str] = set()
    for s in run.steps:
        live |= set(s.rids)
        assert any(live <= g for g in groups), (s.step, live)
        live -= set(s.finished)
    assert set(run.results) == {r.rid for r in reqs}
    assert run.steps[0].step == 1  # a fresh run numbers its steps from 1
    cont = run_requests(engine, reqs)
    assert len(cont.steps) < len(run.steps)
    assert set(cont.results) == set(run.results)


def test_static_batching_counts_the_time_a_group_waits_for_the_one_before(tiny):
    engine = Engine(enable_trace=True, max_total_tokens=1024, **tiny)
    reqs = random_workload(num=4, input_len=(4, 12), output_len=(2, 9), vocab_size=256)
    run = run_requests(engine, reqs, static_batch_size=2)
    meta = {rid: r["meta_info"] for rid, r in run.results.items()}
    first_done = max(meta[r.rid]["e2e_latency"] for r in reqs[:2])
    assert all(meta[r.rid]["ttft"] > first_done for r in reqs[2:])
    queued = {c.rid for c in run.cells if c.phase == "queued" and c.step == 1}
    assert queued == {r.rid for r in reqs[2:]}  # held back, but arrived with the others


def test_sequential_and_timed_arrivals(tiny):
    engine = Engine(enable_trace=True, max_total_tokens=1024, **tiny)
    reqs = [
        Request(f"s{i}", input_ids=[5 + i] * 6, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        for i in range(3)
    ]
    run = run_requests(engine, reqs, sequential=True)
    assert all(len(s.rids) <= 1 for s in run.steps)
    times = token_times(run)
    assert len(times) == 9 and times.groupby("rid")["gap_ms"].count().tolist() == [2, 2, 2]
    table = latency_table(run)
    assert list(table.index) == ["s0", "s1", "s2"] and (table["completion_tokens"] == 3).all()


def test_policy_runs_are_repeatable_and_lpm_groups_prefixes(tiny):
    engine = Engine(max_total_tokens=80, max_running_requests=2, **tiny)
    reqs = shared_prefix_workload(
        num_groups=4, per_group=3, prefix_len=24, question_len=4, output_len=(2, 6), vocab_size=256
    )
    a, b = run_policy(engine, "fcfs", reqs), run_policy(engine, "fcfs", reqs)
    assert (a["cache_hit_rate"], a["prefill_tokens"]) == (b["cache_hit_rate"], b["prefill_tokens"])
    lpm = run_policy(engine, "lpm", reqs)
    assert lpm["cache_hit_rate"] > a["cache_hit_rate"]
    table = bench_policies(engine, {"shared": reqs}, ["fcfs", "lpm"])
    assert list(table["policy"]) == ["fcfs", "lpm"] and {"total_tok_s", "ttft_mean_s"} <= set(table.columns)
    # orders from a cache that holds group 0's prefix
    run_requests(engine, reqs[:1])
    order = policy_orders(engine, [r for r in reqs if r.rid.endswith("-q1")], ["fcfs", "lpm"])
    assert order["lpm"].iloc[0].startswith("g0-q1 (24)")
    assert not engine.scheduler.has_work() and not engine.results


def test_bench_policies_repeats_round_robin_and_the_summary_keeps_counts_beside_timings(tiny):
    engine = Engine(max_total_tokens=80, max_running_requests=2, **tiny)
    reqs = shared_prefix_workload(
        num_groups=3, per_group=2, prefix_len=24, question_len=4, output_len=(2, 4), vocab_size=256
    )
    runs = bench_policies(engine, {"shared": reqs, "again": reqs[:3]}, ["lpm", "fcfs"], repeats=3)
    assert list(zip(runs["workload"], runs["policy"], runs["repeat"]))[:4] == [
        ("shared", "lpm", 0), ("shared", "lpm", 1), ("shared", "lpm", 2), ("shared", "fcfs", 0),
    ]  # fmt: skip
    summary = policy_summary(runs)
    assert list(zip(summary["workload"], summary["policy"])) == [
        ("shared", "lpm"), ("shared", "fcfs"), ("again", "lpm"), ("again", "fcfs"),
    ]  # fmt: skip
    assert (summary["repeats"] == 3).all()
    one = run_policy(engine, "lpm", reqs)
    row = summary.iloc[0]
    for col in ("prefill_tokens", "cache_hit_rate", "forward_passes", "retractions"):
        assert row[col] == one[col], col
    assert row["wall_s_min"] <= row["wall_s"] <= row["wall_s_max"]
    assert row["wall_s"] == runs[(runs["workload"] == "shared") & (runs["policy"] == "lpm")]["wall_s"].median()
    # Scheduling is deterministic: counts that differ between repeats point at a bug, not at noise.
    broken = runs.copy()
    broken.loc[0, "prefill_tokens"] += 1
    with pytest.raises(ValueError, match="prefill_tokens differs between repeats"):
        policy_summary(broken)


def test_queue_table_shows_what_each_policy_sorts_by_and_leaves_the_queue_empty(tiny):
    engine = Engine(max_total_tokens=256, **tiny)
    reqs = shared_prefix_workload(
        num_groups=2, per_group=3, prefix_len=24, question_len=4, output_len=(2, 6), vocab_size=256
    )
    run_requests(engine, reqs[:1])  # g0-q0: group 0's prefix is cached now
    table = queue_table(engine, reqs[1:])
    assert list(table.index) == [r.rid for r in reqs[1:]]  # arrival order
    assert table.loc["g0-q1", "cached"] == 24 and table.loc["g1-q1", "cached"] == 0
    assert (table["to_prefill"] == table["prompt_tokens"] - table["cached"]).all()
    assert list(table["max_new_tokens"]) == [r.sampling_params["max_new_tokens"] for r in reqs[1:]]
    assert list(table["group"]) == [r.group for r in reqs[1:]]
    assert not engine.scheduler.has_work() and not engine.results


def test_multiturn_random_turns_extend_the_last_prompt_by_reply_and_user_tokens():
    reqs = multiturn_random_requests(5, 3, 20, 4, 6, 7, vocab_size=300, seed=1)
    assert len(reqs) == 15 and all(r.output_len == 7 and r.ignore_eos and not r.is_chat for r in reqs)
    assert [(r.turn, r.conversation) for r in reqs] == [(k, c) for k in range(3) for c in range(5)]  # by round
    assert all(r.prompt_len == len(r.prompt) == 20 + 4 * (r.turn + 1) + 6 * r.turn for r in reqs)
    assert all(100 <= t < 300 for r in reqs for t in r.prompt)
    by_turn = {(r.conversation, r.turn): r.prompt for r in reqs}
    for (c, k), prompt in by_turn.items():
        if k:
            assert prompt[: len(by_turn[c, k - 1])] == by_turn[c, k - 1]  # the previous turn's whole prompt
    systems = {tuple(by_turn[c, 0][:20]) for c in range(5)}
    assert len(systems) == 5  # a system prompt per conversation, shared with no other
    replies = {tuple(by_turn[c, 2][24:30]) for c in range(5)} | {tuple(by_turn[c, 2][34:40]) for c in range(5)}
    assert len(replies) == 10  # every recorded reply is its own
    assert reqs == multiturn_random_requests(5, 3, 20, 4, 6, 7, vocab_size=300, seed=1)
    assert reqs != multiturn_random_requests(5, 3, 20, 4, 6, 7, vocab_size=300, seed=2)
    no_system = multiturn_random_requests(2, 2, 0, 3, 0, 1, vocab_size=300)
    assert [r.prompt_len for r in no_system] == [3, 3, 6, 6]


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_conversations=0),
        dict(turns=0),
        dict(user_len=0),
        dict(output_len=0),
        dict(system_len=-1),
        dict(assistant_len=-1),
    ],
)
def test_multiturn_random_refuses_empty_or_negative_sizes(bad):
    sizes = dict(num_conversations=2, turns=2, system_len=8, user_len=4, assistant_len=4, output_len=2)
    with pytest.raises(ValueError, match="multi-turn"):
        multiturn_random_requests(**(sizes | bad), vocab_size=300)


def test_each_turn_waits_for_the_latest_earlier_previous_turn_of_its_conversation():
    reqs = multiturn_random_requests(3, 3, 4, 2, 2, 1, vocab_size=300)
    assert previous_turns(reqs) == [None, None, None, 0, 1, 2, 3, 4, 5]
    plain = BenchRequest([101], 1, 1)
    assert previous_turns([plain, plain]) == [None, None]  # not part of a conversation: no wait
    first, second = reqs[0], reqs[3]
    assert previous_turns([second, first, first, second]) == [None, None, None, 2]  # never a later one
