"""One-row linear layers on a GPU: cuBLAS (F.linear) against labkit's gemv kernel.

    python -m labkit.kernels.bench_gemv [--sweep]

The projections of a batch-1 decode step of Qwen3-0.6B and Qwen2.5-0.5B, bf16. Each is timed as
replays of a CUDA graph of 16 calls on 16 different weight copies (more bytes than the L2 holds, so
every call reads its weight from HBM, as in a real step): microseconds per call and the bandwidth it
reaches; the gemv with the split of K it picks (gemv_split_k) and with each power-of-two split (the
linear layers take the gemv for every single 16-bit row on CUDA: labkit.layers.linear)."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from labkit.kernels.decode import num_sms
from labkit.kernels.gemv import MAX_SPLIT_K, Split, Tiles, default_tiles, gemv, gemv_split_k, semaphore_count

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
SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS = (4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8)


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


def gemv_us(x: torch.Tensor, weights: list[torch.Tensor], split: Split) -> float:
    return replayed_us([lambda w=w: gemv(x, w, None, split) for w in weights])


def sweep(n: int, k: int, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Every tile shape at the chosen split, fastest first (what default_tiles was picked from)."""
    split_k = gemv_split_k(n, k, num_sms(x.device))
    semaphores = torch.zeros(triton.cdiv(n, min(SWEEP_BLOCK_N)), dtype=torch.int32, device="cuda")
    k_split = triton.cdiv(k, split_k)
    times = {}
    for bn, bk, warps in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS):
        if bk > 2 * triton.next_power_of_2(k_split) or bn * bk > 16384:
            continue
        times[(bn, bk, warps)] = gemv_us(x, weights, Split(split_k, semaphores, Tiles(bn, bk, warps)))
    default = default_tiles(n, k_split)
    best = sorted(times.items(), key=lambda kv: kv[1])[:5]
    print(f"    default {default}: {times[(default.block_n, default.block_k, default.num_warps)]:.2f} us; best:")
    print("    " + ", ".join(f"(block_n {bn}, block_k {bk}, warps {w}) {t:.2f}" for (bn, bk, w), t in best))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA device")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time every tile shape of each layer")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, bf16, one row, {COPIES} weight copies per graph")
    splits = [1 << i for i in range(MAX_SPLIT_K.bit_length())]
    header = f"{'layer':28} {'N':>6} {'K':>6} {'MB':>6} {'cuBLAS us':>10} {'TB/s':>5}"
    header += f" {'split':>5} {'gemv us':>8} {'TB/s':>5}"
    print(header + "".join(f" {f'split {s}':>8}" for s in splits))
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        semaphores = torch.zeros(semaphore_count(n), dtype=torch.int32, device="cuda")
        cublas = replayed_us([lambda w=w, x=x: F.linear(x, w) for w in weights])
        ours = gemv_us(x, weights, Split(None, semaphores))
        each = "".join(f" {gemv_us(x, weights, Split(s, semaphores)):8.2f}" for s in splits)
        mb = n * k * 2 / 1e6
        chosen = gemv_split_k(n, k, num_sms(x.device))
        print(
            f"{name:28} {n:6} {k:6} {mb:6.1f} {cublas:10.2f} {mb / cublas:5.2f} {chosen:5} {ours:8.2f} {mb / ours:5.2f}"
            f"{each}"
        )
        if args.sweep:
            sweep(n, k, x, weights)


if __name__ == "__main__":
    main()
