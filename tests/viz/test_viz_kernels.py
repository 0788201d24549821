"""labkit.viz.kernels: the split-KV partials and merge check of notebook 07, and its figures (the GPU
ones drawn from a results file shaped as labkit.bench.kernels_report writes it)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from matplotlib.figure import Figure

from labkit.viz import kernels as vk


def right_merge(m, sumexp, o):
    w = sumexp * torch.exp(m - m.max(dim=0).values)
    return (w[:, :, None] * o).sum(0) / w.sum(0)[:, None]


def qkv(seed: int, heads: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode query of `heads` heads over `tokens` tokens of KV in 2 KV heads, head dim 8."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, 8, generator=gen),
        torch.randn(tokens, 2, 8, generator=gen),
        torch.randn(tokens, 2, 8, generator=gen),
    )


def test_split_bounds_follow_the_kernels_rule():
    assert vk.split_bounds(200, 4) == [(0, 50), (50, 100), (100, 150), (150, 200)]
    assert vk.split_bounds(101, 3) == [(0, 34), (34, 68), (68, 101)]
    assert vk.split_bounds(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]  # the last split is empty


def test_split_partials_merge_back_to_softmax_attention():
    q, k, v = qkv(seed=0, heads=6, tokens=40)
    parts = vk.split_partials(q, k, v, 3, 8**-0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[None, :, None].double(),
        k.transpose(0, 1)[None].double(),
        v.transpose(0, 1)[None].double(),
        scale=8**-0.5,
        enable_gqa=True,
    )[0, :, 0]
    torch.testing.assert_close(parts.reference, dense)
    torch.testing.assert_close(right_merge(parts.m, parts.sumexp, parts.o), dense)
    lse = parts.m + parts.sumexp.log()  # what the kernel stores (in base 2), per split
    assert torch.isfinite(lse).all()


def test_check_merge_accepts_the_right_merge():
    table = vk.check_merge(right_merge)
    assert len(table) == len(vk.MERGE_CASES) and (table.iloc[:, 1] < 1e-5).all()


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda m, z, o: o.mean(0), "differs from softmax attention"),  # the plain mean of the partials
        (lambda m, z, o: (z[:, :, None] * o).sum(0) / z.sum(0)[:, None], "differs"),  # no exp(m - M)
        (lambda m, z, o: ((z * m.exp())[:, :, None] * o).sum(0) / (z * m.exp()).sum(0)[:, None], "inf or NaN"),
        (lambda m, z, o: o.sum(0), "differs"),
        (lambda m, z, o: right_merge(m, z, o)[:, :-1], "shape"),
        (lambda m, z, o: right_merge(m, z, o).tolist(), "not a tensor"),
    ],
    ids=["mean", "no-max-weight", "overflow", "sum", "shape", "list"],
)
def test_check_merge_fails_a_wrong_merge(wrong, message):
    with pytest.raises(AssertionError, match=message):
        vk.check_merge(wrong, seed=1)


def test_draw_split_kv_and_paged_addressing():
    q, k, v = qkv(seed=1, heads=4, tokens=30)
    parts = vk.split_partials(q, k, v, 4, 8**-0.5)
    assert isinstance(vk.draw_split_kv(parts, parts.reference.float(), head=1, dims=4), Figure)
    r2t = torch.zeros(3, 16, dtype=torch.int64)
    r2t[0, :6] = torch.tensor([4, 5, 6, 7, 20, 21])
    r2t[2, :3] = torch.tensor([8, 9, 10])
    fig = vk.draw_paged_addressing(r2t, [0, 2], [6, 3], page_size=4, labels=["a", "b"])
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"page 1", "page 5", "page 2"} <= texts  # the pages of each run of positions


def gpu_like_results() -> dict:
    """A results file of the benchmark's shape with GPU-like sizes (two models, many batch sizes);
    the numbers are made up for the test and drawn nowhere else."""
    from labkit.model_executor.cuda_graph_runner import capture_batch_sizes

    sizes = capture_batch_sizes(160)
    padded = {n: min(s for s in sizes if s >= n) for n in range(1, 161)}
    steps = []
    for n in [1, 2, 3, 5, 8, 17, 24, 64, 160, 192]:
        for mode in ("graph", "eager"):
            run = "graph" if mode == "graph" and n <= 160 else "eager"
            ms = (1.0 + 0.01 * padded.get(n, n)) if run == "graph" else 6.0 + 0.01 * n
            steps += [
                {"batch_size": n, "padded_size": padded.get(n), "mode": run, "forward_ms": ms, "step_ms": ms + 1}
            ] * 2
    models = [("SmolLM2-135M-Instruct", 9, 3, 64), ("llama-3-8b", 32, 8, 128)]
    decode, splits, extend, norms = [], [], [], []
    for model, h, hkv, d in models:
        head = {"model": model, "num_heads": h, "num_kv_heads": hkv, "head_dim": d}
        for b, n in [(1, 32768), (8, 4096), (64, 2048), (160, 1024)]:
            floor = 2 * b * n * hkv * d * 2 / 3e12 * 1e3
            decode.append(
                {
                    **head,
                    "batch": b,
                    "seq_len": n,
                    "page_size": 16,
                    "max_kv_splits": 4,
                    "ms": floor * 1.5,
                    "floor_ms": floor,
                    "kv_bytes": 1,
                    "bytes_per_s": 1.0,
                    "fraction": 1 / 1.5,
                }
            )
        for s in [1, 2, 4, 8, 16, 32]:
            splits.append(
                {
                    **head,
                    "batch": 1,
                    "seq_len": 32768,
                    "page_size": 16,
                    "max_kv_splits": s,
                    "ms": 0.5 / s + 0.02,
                    "floor_ms": 0.015,
                    "kv_bytes": 1,
                    "bytes_per_s": 1.0,
                    "fraction": 0.5,
                }
            )
        extend.append(
            {
                **head,
                "batch": 1,
                "new_tokens": 4096,
                "ms": 1.0,
                "floor_ms": 0.5,
                "flops": 1e12,
                "flops_per_s": 1e15,
                "fraction": 0.5,
            }
        )
        for t in [1, 64, 4096]:
            for kernel in ("rmsnorm", "fused_add_rmsnorm", "rotary_embedding"):
                norms.append(
                    {
                        "kernel": kernel,
                        "model": model,
                        "tokens": t,
                        "shape": "x",
                        "ms": 0.003 + t * 1e-5,
                        "torch_ms": 0.01 + t * 4e-5,
                        "floor_ms": t * 5e-6,
                        "bytes": 1,
                        "fraction": 0.4,
                    }
                )
    return {
        "meta": {
            "schema": 1,
            "device": "NVIDIA H100 80GB HBM3",
            "cuda": True,
            "created": "2026-01-01T00:00:00+00:00",
            "command": "python -m labkit.bench.kernels_report --out data/results/kernels_gpu.json",
            "engine_model": "SmolLM2-135M-Instruct",
        },
        "ceilings": {"copy_bytes_per_s": 3e12, "matmul_flops_per_s": 7e14, "matmul_dtype": "bfloat16"},
        "decode_attention": decode,
        "decode_splits": splits,
        "extend_attention": extend,
        "norm_rotary": norms,
        "cuda_graphs": {
            "max_bs": 160,
            "capture_batch_sizes": sizes,
            "capture_seconds": 3.0,
            "replay": "CUDA graph replay",
            "prompt_len": 128,
            "steps": steps,
            "padding_example": None,
        },
    }


def test_gpu_figures_are_titled_with_the_files_device_and_command(tmp_path, monkeypatch):
    results = gpu_like_results()
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(results))
    monkeypatch.setenv(vk.RESULTS_ENV, str(path))
    assert vk.load_gpu_results() == results
    assert vk.load_gpu_results(tmp_path / "missing.json") is None
    command = "python -m labkit.bench.kernels_report --out data/results/kernels_gpu.json"
    label = f"recorded on NVIDIA H100 80GB HBM3 by `{command}`"
    assert vk.recorded_by(results) == label
    for draw in (vk.draw_graph_steps, vk.draw_decode_roofline, vk.draw_fused_kernels):
        fig = draw(results)
        titles = [ax.get_title(loc="left") for ax in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""]
        assert any(label in t for t in titles), draw.__name__
    frame = vk.graph_steps_frame(results)
    row = frame[(frame.batch_size == 5) & (frame["mode"] == "graph")].iloc[0]
    assert row.padded_size == 8 and row.steps == 2 and math.isclose(row.forward_ms, 1.08)
    assert set(frame[frame.batch_size == 192]["mode"]) == {"eager"}  # above max_bs: eager in both rounds


def test_the_notebook_reads_where_the_benchmark_writes():
    from labkit.bench import kernels_report

    assert vk.RESULTS_FILE == kernels_report.RESULTS_FILE
