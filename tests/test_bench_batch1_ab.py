"""batch1_ab's variants, constants, rotation and A/B driver, which offline_ab shares (no GPU needed)."""

from __future__ import annotations

import pytest

import labkit.kernels.decode
from labkit.bench.batch1_ab import Variant, alternate, applied, main, parse_variant, summary


def test_a_variant_is_a_name_and_module_constants_as_literals():
    v = parse_variant("fast:labkit.kernels.decode.PREFETCH_MAX_BATCH=0,labkit.kernels.gemv.MAX_SPLIT_K=4")
    assert v == Variant(
        "fast", (("labkit.kernels.decode", "PREFETCH_MAX_BATCH", 0), ("labkit.kernels.gemv", "MAX_SPLIT_K", 4))
    )
    assert parse_variant("base") == Variant("base")


def test_a_variant_value_may_be_a_dict_or_tuple_with_commas_of_its_own():
    v = parse_variant(
        "w:labkit.kernels.decode.FP8_ONE_WARP={'BLOCK_N': 16, 'num_warps': 1},"
        "labkit.kernels.gemv.TALL_TILE=(4, 1024, 8),labkit.kernels.decode.FP8_PROGRAMS_PER_SM=8"
    )
    assert v.knobs == (
        ("labkit.kernels.decode", "FP8_ONE_WARP", {"BLOCK_N": 16, "num_warps": 1}),
        ("labkit.kernels.gemv", "TALL_TILE", (4, 1024, 8)),
        ("labkit.kernels.decode", "FP8_PROGRAMS_PER_SM", 8),
    )
    assert parse_variant("s:a.B='x,y'").knobs == (("a", "B", "x,y"),)


@pytest.mark.parametrize("spec", [":a.B=1", "x:NOMODULE=1", "x:a.B", "x:a.B=not a literal", "x:a.B={'k': 1"])
def test_a_malformed_variant_is_refused(spec):
    with pytest.raises(ValueError):
        parse_variant(spec)


def test_constants_are_set_inside_the_block_and_restored_after_it():
    before = labkit.kernels.decode.PREFETCH_MAX_BATCH
    with applied(parse_variant("on:labkit.kernels.decode.PREFETCH_MAX_BATCH=3")):
        assert labkit.kernels.decode.PREFETCH_MAX_BATCH == 3
    assert labkit.kernels.decode.PREFETCH_MAX_BATCH == before
    with pytest.raises(ValueError, match="no NO_SUCH"):  # a typo is an error, not a silent no-op
        with applied(parse_variant("x:labkit.kernels.decode.PREFETCH_MAX_BATCH=3,labkit.kernels.decode.NO_SUCH=1")):
            pass
    assert labkit.kernels.decode.PREFETCH_MAX_BATCH == before  # restored on the error too


def test_rounds_rotate_the_order_and_keep_results_in_round_order():
    order = []
    results = alternate(lambda name: order.append(name) or float(len(order)), ["a", "b", "c"], 3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert results == {"a": [1.0, 6.0, 8.0], "b": [2.0, 4.0, 9.0], "c": [3.0, 5.0, 7.0]}


def test_the_summary_gives_medians_and_paired_differences_from_the_first():
    lines = summary({"base": [1.0, 1.2, 1.1], "new": [0.9, 1.15, 1.0]})
    assert lines[0].startswith("base: 1.100 ms/token (1.000-1.200, 3 rounds)")
    assert lines[1].endswith("-0.100 against base (median per round)")


def test_duplicate_or_malformed_variants_are_usage_errors():
    with pytest.raises(SystemExit):
        main(["--variant", "a", "--variant", "a"])
    with pytest.raises(SystemExit):
        main(["--variant", "x:oops"])


def test_compare_builds_and_measures_each_engine_under_its_own_constants(monkeypatch, capsys):
    import torch

    from labkit.bench import batch1_ab
    from labkit.bench.batch1_ab import compare

    monkeypatch.setattr(batch1_ab, "machine_state", lambda: "GPU state")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    variants = {v.name: v for v in map(parse_variant, ["off", "on:labkit.kernels.decode.PREFETCH_MAX_BATCH=5"])}
    built = []

    def build():
        built.append(labkit.kernels.decode.PREFETCH_MAX_BATCH)
        return len(built)  # the "engine"

    def measure(engine):  # the engine built under a setting runs under that setting
        assert labkit.kernels.decode.PREFETCH_MAX_BATCH == built[engine - 1]
        return 10.0 * engine

    results = compare(variants, build, measure, 2, "test", "tok/s", 0)
    assert built == [labkit.kernels.decode.PREFETCH_MAX_BATCH, 5]
    assert results == {"off": [10.0, 10.0], "on": [20.0, 20.0]}
    out = capsys.readouterr().out
    assert "  on: 20 tok/s  [GPU state]" in out
    assert "on: 20 tok/s (20-20, 2 rounds), +10 against off" in out


def test_offline_ab_refuses_repeated_variants():
    from labkit.bench import offline_ab

    with pytest.raises(SystemExit):
        offline_ab.main(["--variant", "a", "--variant", "a"])


def test_machine_state_reads_nvidia_smi_and_the_load(monkeypatch):
    import subprocess

    import torch

    from labkit.bench import batch1_ab

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(batch1_ab.os, "getloadavg", lambda: (2.25, 0.0, 0.0))
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="1755, 2619, 412.5, 51\n")

    monkeypatch.setattr(batch1_ab.subprocess, "run", fake_run)
    assert batch1_ab.machine_state() == "SM 1755 MHz, mem 2619 MHz, 412.5 W, 51 C; load 2.2"
    assert calls[0][:3] == ["nvidia-smi", "-i", "0"]

    def missing(cmd, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(batch1_ab.subprocess, "run", missing)
    assert batch1_ab.machine_state() == "load 2.2"
