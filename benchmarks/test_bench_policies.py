"""Scheduling policies end to end: every registered policy on a shared-prefix and a random workload,
each round one full run from an empty prefix cache through the real Engine (real forward passes of
a small random-weight Llama, see labkit.bench.policies.MINI_LLAMA). The time is the run's wall time;
cache hit rate, TTFT, end-to-end latency and prefill tokens go into `extra_info`, so
--benchmark-compare shows them next to the timings.

    .venv/bin/python -m pytest benchmarks/test_bench_policies.py -m microbench --benchmark-enable \\
        --benchmark-save=policies
    .venv/bin/python -m pytest benchmarks/test_bench_policies.py -m microbench --benchmark-enable \\
        --benchmark-compare

The notebook notebooks/05_scheduling_policies.ipynb runs the same comparison (same engine settings
and workloads) and draws it. LABKIT_BENCH_POLICY_MODEL=<config or model dir> swaps the model
(with LABKIT_BENCH_POLICY_LOAD=auto for real weights).
"""

from __future__ import annotations

import os

import pytest

from labkit import Engine
from labkit.bench.datasets import random_workload, shared_prefix_workload
from labkit.bench.policies import mini_model_path, run_policy
from labkit.scheduler.schedule_policy import POLICIES

pytestmark = pytest.mark.microbench

ENGINE = dict(max_total_tokens=768, max_running_requests=8)  # room for about 3 of the 6 prefixes
WORKLOADS = {
    "shared-prefix": lambda: shared_prefix_workload(num_groups=6, per_group=4, prefix_len=192, question_len=16),
    "random": lambda: random_workload(num=24, input_len=(32, 256)),
}


@pytest.fixture(scope="module")
def engine():
    model = os.environ.get("LABKIT_BENCH_POLICY_MODEL") or mini_model_path()
    load = os.environ.get("LABKIT_BENCH_POLICY_LOAD", "dummy")
    eng = Engine(model_path=model, load_format=load, **ENGINE)
    run_policy(eng, "fcfs", WORKLOADS["random"]()[:4])  # warm-up: first forward passes are slow
    return eng


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy(benchmark, engine, policy, workload):
    requests = WORKLOADS[workload]()
    results = []

    def run():
        results.append(run_policy(engine, policy, requests))

    benchmark.pedantic(run, rounds=3, iterations=1)
    last = results[-1]
    benchmark.extra_info.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items()})
    assert last["requests"] == len(requests)
    # Scheduling is deterministic: every round makes the same decisions, only the clock differs.
    assert len({r["cache_hit_rate"] for r in results}) == 1
    assert len({r["prefill_tokens"] for r in results}) == 1
