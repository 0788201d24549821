"""offline_gpu's step breakdown and options, which the parallel benchmark reuses (no GPU needed)."""

from __future__ import annotations

import pytest

from labkit.bench.offline_gpu import StepStats, arg_parser


def test_per_step_ms_splits_a_step_into_host_calls_rest_and_gpu_idle():
    stats = StepStats(steps=4, wall=0.040, forward_gpu=0.024, sample_gpu=0.004, forward_call=0.008, sample_call=0.002)
    ms = stats.per_step_ms()
    assert ms["wall"] == pytest.approx(10.0)
    assert ms["fwd_gpu"] == pytest.approx(6.0) and ms["smpl_gpu"] == pytest.approx(1.0)
    assert ms["rest_cpu"] == pytest.approx(10.0 - 2.0 - 0.5)  # wall less the forward and sampling calls
    assert ms["gpu_idle"] == pytest.approx(10.0 - 7.0)  # wall less the GPU's forward and sampling time


def test_the_parser_defaults_carry_every_engine_option_build_engine_reads():
    args = arg_parser().parse_args(["--num-seqs", "8"])
    assert args.num_seqs == 8 and args.model == "qwen3-0.6b"
    for name in ("page_size", "kv_memory_gb", "kv_cache_dtype", "attention_backend", "chunked_prefill_size"):
        assert hasattr(args, name), name
