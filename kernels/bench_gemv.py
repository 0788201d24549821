"""One-row linear layers on a GPU: cuBLAS (F.linear) against labkit's gemv kernel.

    python -m labkit.kernels.bench_gemv

The projections of a batch-1 decode step of Qwen3-0.6B and Qwen2.5-0.5B, bf16. Each is timed as
replays of a CUDA graph of 16 calls on 16 different weight copies (more bytes than the L2 holds, so
every call reads its weight from HBM, as in a real step): microseconds per call and the bandwidth it
reaches. The last column is what the linear layers use (labkit.layers.linear: gemv unless K > 4N)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from labkit.kernels.gemv import gemv
from labkit.layers.linear import GEMV_MAX_K_PER_N

SHAPES = {  # name: (out_features N, in_features K)
    "qwen3-0.6b qkv_proj": (4096, 1024),
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b gate_up_proj": (6144, 1024),
    "qwen3-0.6b down_proj": (1024, 3072),
    "qwen2.5-0.5b qkv_proj": (1152, 896),
    "qwen2.5-0.5b o_proj": (896, 896),
    "qwen2.5-0.5b gate_up_proj": (9728, 896),
    "qwen2.5-0.5b down_proj": (896, 4864),
}
COPIES = 16


def replayed_us(calls: list[Callable[[], torch.Tensor]]) -> float:
    """Median microseconds per call of `calls` captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) off the capture stream
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / len(calls)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, bf16, one row, {COPIES} weight copies per graph")
    header = f"{'layer':28} {'N':>6} {'K':>6} {'MB':>6} {'cuBLAS us':>10} {'TB/s':>5} {'gemv us':>8} {'TB/s':>5}"
    print(header + "  layers use")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cublas = replayed_us([lambda w=w, x=x: F.linear(x, w) for w in weights])
        ours = replayed_us([lambda w=w, x=x: gemv(x, w) for w in weights])
        mb = n * k * 2 / 1e6
        used = "gemv" if k <= GEMV_MAX_K_PER_N * n else "cuBLAS"
        print(f"{name:28} {n:6} {k:6} {mb:6.1f} {cublas:10.2f} {mb / cublas:5.2f} {ours:8.2f} {mb / ours:5.2f}  {used}")


if __name__ == "__main__":
    main()
