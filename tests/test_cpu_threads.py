"""On CPU a rank's torch thread count leaves a core free by default (spin-waiting OpenMP threads on a
busy machine made a notebook 8x slower), and an explicit setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from labkit import Engine
from labkit.model_executor.model_runner import available_cores, cpu_thread_count


def test_auto_leaves_one_core_free_and_splits_the_rest_among_the_ranks():
    assert cpu_thread_count(0, ranks=1, cores=2, default=2, env_set=False) == 1
    assert cpu_thread_count(0, ranks=1, cores=16, default=8, env_set=False) == 8  # torch's default is the cap
    assert cpu_thread_count(0, ranks=2, cores=16, default=16, env_set=False) == 7
    assert cpu_thread_count(0, ranks=3, cores=2, default=2, env_set=False) == 1  # never below one
    assert cpu_thread_count(0, ranks=1, cores=1, default=1, env_set=False) == 1


def test_omp_num_threads_and_an_explicit_count_win_over_auto():
    assert cpu_thread_count(0, ranks=1, cores=16, default=4, env_set=True) is None
    assert cpu_thread_count(3, ranks=4, cores=2, default=2, env_set=True) == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        cpu_thread_count(-1, ranks=1, cores=2, default=2, env_set=False)


def test_an_engine_on_cpu_sets_torchs_threads(tmp_path):
    # A fresh interpreter: torch's thread count is process-wide.
    code = (
        "import torch; from labkit import Engine; "
        "Engine(model_path='tiny-llama', load_format='dummy', device='cpu', cpu_threads=2, max_total_tokens=256); "
        "print(torch.get_num_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "2"


def test_xdist_workers_share_the_machines_cores_and_engines_keep_the_share():
    # tests/conftest.py, where OMP_NUM_THREADS was unset: each of N workers runs cores // N threads, and
    # an engine built in the worker keeps that count instead of taking the cores less one.
    share = os.environ.get("LABKIT_TEST_SHARED_THREADS")
    if share is None:
        pytest.skip("not under xdist, or OMP_NUM_THREADS was set")
    assert int(share) == max(1, available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    Engine(model_path="tiny-llama", load_format="dummy", device="cpu", max_total_tokens=256)
    assert torch.get_num_threads() == int(share)
