"""Recorded runs of a real Engine on the tiny random-weight model, shared by the viz tests. One run
has it all: shared prefixes (hits, splits), a pool small enough for evictions and a retraction, a
running-request cap, chunked prefill."""

from __future__ import annotations

import pytest

from labkit import Engine
from labkit.bench.datasets import shared_prefix_workload
from labkit.bench.runner import run_requests

TINY = dict(model_path="tiny-llama", load_format="dummy")


def tiny_workload():
    reqs = shared_prefix_workload(
        num_groups=3, per_group=3, prefix_len=24, question_len=4, output_len=(16, 30), vocab_size=256
    )
    for i, r in enumerate(reqs):
        r.arrive_step = 2 * i
    return reqs


@pytest.fixture(scope="session")
def tiny():
    """Engine keyword arguments for the tiny random-weight model."""
    return dict(TINY)


@pytest.fixture(scope="session")
def tiny_engine():
    return Engine(enable_trace=True, max_total_tokens=128, chunked_prefill_size=16, max_running_requests=3, **TINY)


@pytest.fixture(scope="session")
def tiny_run(tiny_engine):
    run = run_requests(tiny_engine, tiny_workload(), label="tiny")
    kinds = {e.kind for e in run.tracer.tree_events}
    assert {"insert", "split", "evict"} <= kinds and any(s.retracted for s in run.steps), (
        "the fixture run must show splits, evictions and a retraction"
    )
    return run
