"""labkit.bench.kernels_report: the results file notebook 07 reads. On a CPU (--cpu) the same code
runs at tiny shapes in Triton's interpreter, without capture; this pins the file's shape."""

from __future__ import annotations

import json

import pytest
import torch

from labkit.bench import kernels_report
from labkit.model_executor.cuda_graph_runner import PAD_REQ_POOL_IDX, PAD_SLOT, capture_batch_sizes

# --cpu runs the kernels in Triton's interpreter, which tests/conftest.py turns on only without CUDA.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--cpu needs Triton's interpreter (no CUDA)")


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "kernels.json"
    report = kernels_report.main(["--cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == report  # what was written is what was returned
    return report


def test_cpu_report_has_every_section_and_its_provenance(cpu_report):
    meta = cpu_report["meta"]
    assert meta["schema"] == kernels_report.SCHEMA and meta["cuda"] is False
    assert meta["command"].startswith("python -m labkit.bench.kernels_report --cpu --out ")
    assert meta["device"].startswith("cpu") and meta["skipped"]
    assert set(cpu_report) == {
        "meta", "ceilings", "decode_attention", "decode_splits", "extend_attention", "norm_rotary", "cuda_graphs",
    }  # fmt: skip
    for section in ("decode_attention", "decode_splits", "extend_attention", "norm_rotary"):
        rows = cpu_report[section]
        assert rows and all(r["ms"] > 0 and 0 < r["fraction"] and r["floor_ms"] > 0 for r in rows), section
    assert {r["kernel"] for r in cpu_report["norm_rotary"]} == {"rmsnorm", "fused_add_rmsnorm", "rotary_embedding"}
    assert [r["max_kv_splits"] for r in cpu_report["decode_splits"]] == kernels_report.CPU_SPLITS[2]


def test_cpu_report_records_padded_steps_and_the_padding_rows(cpu_report):
    graphs = cpu_report["cuda_graphs"]
    assert graphs["capture_batch_sizes"] == capture_batch_sizes(graphs["max_bs"])
    steps = graphs["steps"]
    assert {s["mode"] for s in steps} == {"graph", "eager"}
    assert all(s["batch_size"] == 5 and s["padded_size"] == 8 and s["forward_ms"] > 0 for s in steps)
    example = graphs["padding_example"]
    assert example["batch_size"] == 5 and example["padded_size"] == 8
    real, pad = example["rows"][:5], example["rows"][5:]
    assert not any(r["padding"] for r in real) and all(r["padding"] for r in pad) and len(pad) == 3
    assert all(r["seq_len"] > 1 and r["out_cache_loc"] != PAD_SLOT for r in real)
    for r in pad:  # token 0 at position 0 of request slot 0, its KV written to the reserved slot
        assert (r["input_id"], r["position"], r["req_pool_idx"], r["seq_len"], r["out_cache_loc"]) == (
            0, 0, PAD_REQ_POOL_IDX, 1, PAD_SLOT,
        )  # fmt: skip


def test_without_cuda_the_gpu_run_refuses_and_says_why(tmp_path):
    if kernels_report.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="--cpu"):
        kernels_report.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
